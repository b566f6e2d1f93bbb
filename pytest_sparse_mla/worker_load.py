"""Where an xdist run's wall time goes: per worker, the seconds its tests took, when its last
test ended, and its longest tests. The worker whose last test ends last is the run's critical
path; a run is as fast as that worker, not as the sum of all tests divided by the workers.

Printed as the "xdist workers" section at the end of every run with two or more workers, the
busiest first.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

#: Longest tests named per worker.
LONGEST_PER_WORKER = 3


@dataclass
class WorkerLoad:
    """One worker's share of a run."""

    worker: str
    tests: int = 0
    busy_s: float = 0.0
    #: Seconds from the session's start to this worker's first test's start and last test's end.
    starts_at_s: float = 0.0
    ends_at_s: float = 0.0
    longest: list[tuple[float, str]] = field(default_factory=list)


def worker_loads(phases: list[tuple[str, str, float, float, float]], session_start: float) -> list[WorkerLoad]:
    """``phases``: (worker, nodeid, start, stop, duration) of every setup, call and teardown;
    ``session_start``: when the session began, on the same clock. Per worker: its tests, the
    seconds they took, when its first one started and its last one ended, and its longest
    tests; the worker that ends last first."""
    per_test: dict[tuple[str, str], float] = defaultdict(float)
    starts: dict[str, float] = {}
    ends: dict[str, float] = defaultdict(float)
    for worker, nodeid, start, stop, duration in phases:
        per_test[(worker, nodeid)] += duration
        starts[worker] = min(starts.get(worker, start - session_start), start - session_start)
        ends[worker] = max(ends[worker], stop - session_start)
    loads: dict[str, WorkerLoad] = {}
    for (worker, nodeid), seconds in per_test.items():
        load = loads.setdefault(worker, WorkerLoad(worker, starts_at_s=starts[worker], ends_at_s=ends[worker]))
        load.tests += 1
        load.busy_s += seconds
        load.longest.append((seconds, nodeid))
    for load in loads.values():
        load.longest = sorted(load.longest, reverse=True)[:LONGEST_PER_WORKER]
    return sorted(loads.values(), key=lambda w: (-w.ends_at_s, w.worker))


def short_name(nodeid: str) -> str:
    """``tests/cpu/test_x.py::test_y[p]`` as ``test_x::test_y[p]``."""
    path, _, rest = nodeid.partition("::")
    stem = path.rsplit("/", 1)[-1].removesuffix(".py")
    return f"{stem}::{rest}" if rest else stem


def load_lines(loads: list[WorkerLoad]) -> list[str]:
    """One line per worker (seconds counted from the session's start), then one for the run:
    when the first test started (what starting the workers and collecting cost), the sum of
    all tests' seconds over the workers (the wall a perfect split would add) and when the last
    worker ended."""
    lines = []
    for w in loads:
        longest = ", ".join(f"{short_name(n)} {s:.1f} s" for s, n in w.longest)
        lines.append(f"{w.worker}: {w.tests} tests, {w.busy_s:.1f} s busy from {w.starts_at_s:.1f} s to"
                     f" {w.ends_at_s:.1f} s; longest: {longest}")
    total = sum(w.busy_s for w in loads)
    first = min(w.starts_at_s for w in loads)
    lines.append(f"all workers: first test at {first:.1f} s; {total:.1f} test-seconds,"
                 f" {total / len(loads):.1f} s each if split evenly; the last worker ended at"
                 f" {loads[0].ends_at_s:.1f} s ({loads[0].worker})")
    return lines


class WorkerLoadReport:
    """Registered on the controlling process of an xdist run."""

    def __init__(self, session_start: float):
        self.session_start = session_start
        self.phases: list[tuple[str, str, float, float, float]] = []

    def pytest_runtest_logreport(self, report):
        node = getattr(report, "node", None)
        worker = getattr(getattr(node, "gateway", None), "id", None)
        start, stop = getattr(report, "start", None), getattr(report, "stop", None)
        if worker is not None and start is not None and stop is not None:
            self.phases.append((worker, report.nodeid, start, stop, report.duration))

    def pytest_terminal_summary(self, terminalreporter, exitstatus, config):
        loads = worker_loads(self.phases, self.session_start)
        if len(loads) >= 2:
            terminalreporter.section("xdist workers (the first ends the run)")
            for line in load_lines(loads):
                terminalreporter.write_line(line)


def pytest_configure(config):
    if not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None):
        config.pluginmanager.register(WorkerLoadReport(time.time()), "sparse-mla-worker-load")
