"""The upgrade check's times: repeated medians, their spread, and whether a time regressed.

Times come only from the timing pass, which re-runs each case with a GPU to itself: each time
is ``TIME_REPEATS`` medians of ``TIME_REPS`` calls. A time whose medians spread more than the
spread limit in either run is unstable and not judged.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

KERNEL_TIME_LIMIT = 1.15
KERNEL_TIME_FLOOR_US = 2.0
PLAN_TIME_LIMIT = 2.0
TIME_REPEATS = 3  # medians per time
TIME_REPS = 15  # calls per median
KERNEL_SPREAD_LIMIT = 0.10  # (max - min) / median of the repeats' medians
PLAN_SPREAD_LIMIT = 0.25


def repeated_medians(measure, repeats: int = TIME_REPEATS) -> list[float]:
    """``repeats`` medians, in microseconds, of the samples (seconds) each ``measure()`` returns."""
    return [statistics.median(measure()) * 1e6 for _ in range(repeats)]


def spread(medians: list[float]) -> float:
    """(max - min) / median of repeated medians: how far repeats of one time disagree."""
    mid = statistics.median(medians)
    return (max(medians) - min(medians)) / mid if mid > 0 else math.inf


@dataclass
class TimeJudgement:
    before_us: float | None = None
    after_us: float | None = None
    judged: bool = False
    regressed: bool = False
    why: str = ""  # why not judged, or how it regressed

    @property
    def ratio(self) -> float | None:
        return self.after_us / self.before_us if self.before_us and self.after_us else None


def judge_time(what: str, before: list[float], after: list[float], limit: float, spread_limit: float,
               floor_us: float = 0.0) -> TimeJudgement:
    """Judged only with repeated medians on both sides that agree within ``spread_limit``; a
    regression when the median of medians grew past ``limit`` x and by more than ``floor_us``."""
    j = TimeJudgement(statistics.median(before) if before else None, statistics.median(after) if after else None)
    if not before or not after:
        j.why = f"{what} not timed " + ("in the baseline" if not before else "now")
        return j
    for side, medians in (("in the baseline", before), ("now", after)):
        if spread(medians) > spread_limit:
            j.why = f"{what} unstable {side} (spread {spread(medians):.0%} > {spread_limit:.0%})"
            return j
    j.judged = True
    if j.ratio > limit and j.after_us - j.before_us > floor_us:
        j.regressed = True
        j.why = f"{what} time x{j.ratio:.2f} ({j.before_us:.1f} -> {j.after_us:.1f} us)"
    return j


def judge_kernel_time(before: list[float], after: list[float]) -> TimeJudgement:
    return judge_time("kernel", before, after, KERNEL_TIME_LIMIT, KERNEL_SPREAD_LIMIT, KERNEL_TIME_FLOOR_US)


def judge_plan_time(before: list[float], after: list[float]) -> TimeJudgement:
    return judge_time("plan()", before, after, PLAN_TIME_LIMIT, PLAN_SPREAD_LIMIT)


def thresholds() -> dict:
    """The limits times are judged by, as the report's JSON states them."""
    return {"kernel_time": KERNEL_TIME_LIMIT, "kernel_time_floor_us": KERNEL_TIME_FLOOR_US,
            "plan_time": PLAN_TIME_LIMIT,
            "kernel_spread": KERNEL_SPREAD_LIMIT, "plan_spread": PLAN_SPREAD_LIMIT, "time_repeats": TIME_REPEATS,
            "time_reps": TIME_REPS}
