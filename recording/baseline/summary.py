"""The upgrade check's summary: one line per class of change, each with its status computed
once, as data (:class:`SummaryLine`), and rendered from it. FAIL fails the check, note is a
change that does not, ok is no change; the verdict line heads them and is FAIL exactly when
another line is, and :func:`passed` reads the verdict.

Outcomes and not run are about every test the runs ran; refusals, numerics, integers, errors
and time about the GPU-tier cases; the fixtures line about the fixture replays re-run on the
installed FlashInfer; warnings about both. Below the lines, :func:`regression_lines` names each
test with a regression and why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from .comparison import CaseComparison, RunFacts, ok_outcome, outcome_regressed
from .records import RunCode
from .timing import TIME_REPEATS, TIME_REPS

FAIL, PASS, NOTE, OK = "FAIL", "PASS", "note", "ok"
REGRESSIONS_SHOWN = 30  # tests named below the summary; report.md names them all


@dataclass(frozen=True)
class SummaryLine:
    status: str  # FAIL / note / ok; the verdict line PASS or FAIL
    name: str  # the class of change: refusals, outcomes, numerics, ...
    text: str

    def render(self) -> str:
        return f"{self.status:<5} {self.name:<10} {self.text}"


def status_of(fail: bool, note: bool = False) -> str:
    return FAIL if fail else (NOTE if note else OK)


def fmt(x, spec=".2f", none="–") -> str:
    return none if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def short_id(case: str) -> str:
    return case.split("::", 1)[-1]


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def first(items: list[str], n: int = 1) -> str:
    return "; ".join(items[:n]) + (f"; and {len(items) - n} more" if len(items) > n else "")


def clip(text: str, width: int = 100) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 3] + "..."


def display_name(c: CaseComparison) -> str:
    """A fixture by its file's stem, a case by its test id."""
    record = c.after or c.before
    return Path(record.fixture).stem if record and record.fixture else short_id(c.case)


def ran(c: CaseComparison) -> bool:
    return c.after is not None and c.after.outcome != "skipped"


def newly_failing(compared: list[CaseComparison]) -> list[CaseComparison]:
    """Tests that passed (or failed as expected) before and now fail, error, xpass or xfail where
    they passed, refusals apart (their own line counts them)."""
    return [c for c in compared if outcome_regressed(c.before, c.after) and c.refusal != "new"]


def transition(c: CaseComparison) -> str:
    """``passed -> failed: <the error line>`` of a compared test."""
    line = c.after.outcome_line or c.after.error
    return f"{c.before.outcome} -> {c.after.outcome}" + (f": {clip(line, 80)}" if line else "")


def worst_drift(drifted: list[CaseComparison]) -> str:
    """The output that moved most: which case or fixture, which output, its rows."""
    worst = max(drifted, key=lambda c: max(d["max_abs"] for d in c.drift.values()))
    key, d = max(((k, d) for k, d in worst.drift.items() if d["bitwise_equal"] < 1.0), key=lambda kv: kv[1]["max_abs"])
    rows = ", ".join(f"{r} ({m:.3g})" for r, m in d["worst_rows"])
    return (f"worst `{display_name(worst)}` {key} max abs {d['max_abs']:.3g}, {d['rows_differing']}/{d['rows']} rows "
            f"differ, worst rows {rows}")


def refusals_text(compared: list[CaseComparison]) -> tuple[str, list, list]:
    """"N new, M gone" with the first new refusal; the new and the gone."""
    new = [c for c in compared if c.refusal == "new"]
    gone = [c for c in compared if c.refusal == "gone"]
    text = f"{len(new)} new, {len(gone)} gone"
    if new:
        text += f" (now raising: {clip(new[0].after.error, 60)} in `{display_name(new[0])}`" + (
            f" and {len(new) - 1} more)" if len(new) > 1 else ")")
    return text, new, gone


def refusals_line(compared: list[CaseComparison]) -> SummaryLine:
    text, new, gone = refusals_text(compared)
    return SummaryLine(status_of(bool(new), bool(gone)), "refusals", text)


def outcomes_line(tests: list[CaseComparison]) -> SummaryLine:
    """Every compared test that is not a fixture re-run (the fixtures line counts those): how
    many passed (or xfailed) before and now fail, error, xpass or xfail, the first with its line."""
    ok_before = [c for c in tests if ok_outcome(c.before)]
    failing = newly_failing(tests)
    if not failing:
        return SummaryLine(OK, "outcomes", f"none of {plural(len(ok_before), 'test')} that passed (or xfailed) before "
                                           "fails, errors, xpasses or xfails now")
    first_failing = f"`{display_name(failing[0])}`: {transition(failing[0])}"
    return SummaryLine(FAIL, "outcomes", f"{len(failing)} of {plural(len(ok_before), 'test')} that passed (or "
                                         f"xfailed) before fail, error, xpass or xfail now ({first_failing})")


def integers_line(compared: list[CaseComparison]) -> SummaryLine:
    """Integer results (executed lengths, packed indices): equal entry for entry, or the first
    case that differs with its first differing entry."""
    with_integers = [c for c in compared if c.integers]
    differ = [c for c in with_integers if any(c.integers.values())]
    if not differ:
        return SummaryLine(OK, "integers", f"all {plural(len(with_integers), 'case')} with integer results equal"
                           if with_integers else "no integer result recorded")
    first_line = next(d for d in differ[0].integers.values() if d)
    return SummaryLine(FAIL, "integers", f"{len(differ)} of {plural(len(with_integers), 'case')} with integer results "
                                         f"differ (`{display_name(differ[0])}`: {clip(first_line, 80)})")


def numerics_line(compared: list[CaseComparison]) -> SummaryLine:
    with_outputs = [c for c in compared if c.drift]
    drifted = [c for c in with_outputs if not c.bitwise_equal]
    text = (f"{len(drifted)} of {plural(len(with_outputs), 'case')} no longer bitwise equal; {worst_drift(drifted)}"
            if drifted else f"all {plural(len(with_outputs), 'case')} with outputs bitwise equal")
    return SummaryLine(status_of(False, bool(drifted)), "numerics", text)


def errors_line(compared: list[CaseComparison]) -> SummaryLine:
    worse = [(c, k, b, a) for c in compared for k, (b, a) in c.worse_ratios.items()]
    if not worse:
        return SummaryLine(OK, "errors", "no error-budget ratio worse")
    c, k, b, a = max(worse, key=lambda w: w[3] - w[2])
    cases = len({w[0].case for w in worse})
    return SummaryLine(NOTE, "errors", f"{plural(cases, 'case')} with a worse error-budget ratio; worst "
                                       f"`{display_name(c)}` {k} {b:.3g} -> {a:.3g}")


def time_line(compared: list[CaseComparison], run: RunFacts) -> SummaryLine:
    if run.timing:
        return SummaryLine(status_of(run.timing_failed, True), "time", f"not judged: {run.timing}")
    times = [t for c in compared for t in (c.kernel_time, c.plan_time)]
    judged = [t for t in times if t.judged]
    slower = sorted((t for t in judged if t.regressed), key=lambda t: -(t.ratio or 0))
    unjudged = sorted({t.why for t in times if not t.judged and t.why})
    if not judged:
        return SummaryLine(NOTE, "time", "not judged: " + (first(unjudged) if unjudged else "no case timed"))
    how = f"one process per GPU, {TIME_REPEATS} medians of {TIME_REPS}"
    text = f"{plural(len(judged), 'time')} judged ({how}): " + (
        f"{len(slower)} slower past the limits, worst {slower[0].why}" if slower else "none slower past the limits")
    not_judged = [t for t in times if not t.judged and t.why]
    if not_judged:
        text += f"; {len(not_judged)} not judged ({clip(unjudged[0], 50)}" + (", ...)" if len(unjudged) > 1 else ")")
    return SummaryLine(status_of(bool(slower)), "time", text)


def warnings_line(both: list[CaseComparison]) -> SummaryLine:
    new_w = sorted({w for c in both for w in set(c.after.warnings) - set(c.before.warnings)})
    gone_w = sorted({w for c in both for w in set(c.before.warnings) - set(c.after.warnings)})
    text = f"{len(new_w)} new, {len(gone_w)} gone" + (f" (new: {clip(new_w[0])})" if new_w else "")
    return SummaryLine(status_of(False, bool(new_w or gone_w)), "warnings", text)


def fixtures_line(fixtures: list[CaseComparison], run: RunFacts, before_version: str) -> SummaryLine:
    """Fixture replays across releases: how many re-ran now, how many outputs are bitwise equal
    to the old release's (from its baseline record or the fixture file's), the worst that is
    not, refusals, and the fixtures compared with nothing or not re-run."""
    not_rerun = sorted(run.not_rerun.items())
    reasons = sorted({why for _, why in not_rerun})
    not_rerun_text = f"{len(not_rerun)} not re-run ({clip(first(reasons), 80)}): judged on their recorded outputs only"
    rerun = [c for c in fixtures if c.after is not None]
    if not rerun:
        return SummaryLine(NOTE, "fixtures",
                           not_rerun_text + ", nothing compared" if not_rerun else "no fixture replay re-ran")
    compared = [c for c in rerun if c.outputs_compared]
    with_outputs = [c for c in compared if c.drift]
    drifted = [c for c in with_outputs if not c.bitwise_equal]
    from_files = [c for c in compared if c.against]
    uncompared = [c for c in rerun if not c.outputs_compared]
    failing = newly_failing([c for c in rerun if c.status == "compared"])
    text = (f"{len(rerun)} re-run: {len(with_outputs) - len(drifted)} of {len(with_outputs)} with outputs bitwise "
            f"equal to {before_version}")
    if from_files:
        text += f" ({len(from_files)} compared with the fixture file's record)"
    if drifted:
        text += f"; {worst_drift(drifted)}"
    refusals, new_ref, gone_ref = refusals_text(compared)
    text += f"; refusals {refusals}"
    if failing:
        text += f"; {len(failing)} that passed fail now (`{display_name(failing[0])}`: {failing[0].after.outcome})"
    if uncompared:
        text += f"; {len(uncompared)} not compared ({clip(first(sorted({c.why for c in uncompared})), 80)})"
    if not_rerun:
        text += "; " + not_rerun_text
    return SummaryLine(status_of(bool(new_ref or failing), bool(drifted or gone_ref or uncompared or not_rerun)),
                       "fixtures", text)


def not_run_line(comparisons: list[CaseComparison]) -> SummaryLine:
    """Tests of the baseline that ran then and not now: skipped, not collected, fixtures not
    re-run (failing unless the run's own selection left them out); tests new in this run (GPU-tier
    cases and tests that record nothing, not fixture re-runs: the fixtures line has those); tests
    skipped in both runs."""
    not_run = [c for c in comparisons if c.status == "not run"]
    deselected = [c for c in comparisons if c.status == "deselected"]
    new = [c for c in comparisons if c.status == "new" and not c.is_fixture]
    skipped = [c for c in comparisons if c.status == "skipped"]
    text = f"{plural(len(not_run), 'test')} of the baseline did not run" + (
        f" (`{display_name(not_run[0])}`: {clip(not_run[0].why)})" if not_run else "")
    if deselected:
        whys = sorted({c.why for c in deselected})
        text += f"; {len(deselected)} left out by this run's selection ({', '.join(whys)}), not judged"
    if new:
        text += f"; {plural(len(new), 'new test')} not in the baseline (`{display_name(new[0])}`), not judged"
    if skipped:
        text += f"; {len(skipped)} skipped in the baseline and not run now, not judged"
    return SummaryLine(status_of(bool(not_run), bool(deselected or new)), "not run", text)


def nothing_ran_summary(measured: list[CaseComparison], run: RunFacts, before_version: str) -> list[SummaryLine]:
    reason = run.gpu_skip_reason or "no GPU-tier case recorded anything"
    lines = [SummaryLine(FAIL, "GPU tier", f"did not run ({reason}): nothing was compared")]
    if run.not_rerun:
        lines.append(fixtures_line([], run, before_version))
    return lines + [SummaryLine(FAIL, "not run", f"all {plural(len(measured), 'case')} of the baseline")]


def compared_labels(before: RunCode, after: RunCode) -> tuple[str, str]:
    """The two runs of a check named by what differs between them (FlashInfer, vLLM, machine:
    :class:`RunCode`), what both ran alike after the new one's, in parentheses; both named by
    FlashInfer where nothing differs. The machine is compared only where both records name it."""
    # a machine one record does not name (an older record, or no GPU found) is not called a change
    pairs = [(b, a) for b, a in zip(before.named(), after.named(), strict=True)
             if b[0] != "machine" or (b[1] is not None and a[1] is not None)]
    shown = [(b, a) for b, a in pairs if b != a] or pairs[:1]
    alike = [f"{name} {value}" for (name, value), a in pairs if (name, value) == a and value is not None
             and ((name, value), a) not in shown]
    before_label = ", ".join(f"{name} {value or 'none'}" for (name, value), _ in shown)
    after_label = ", ".join(f"{name} {value or 'none'}" for _, (name, value) in shown)
    return before_label, after_label + (f" (both: {'; '.join(alike)})" if alike else "")


def summary(comparisons: list[CaseComparison], run: RunFacts, before_version: str,
            after_version: str) -> list[SummaryLine]:
    """One line per class of change, the verdict first: FAIL where any line below is FAIL, and
    counting the tests compared, the cases and fixtures among them compared on their records,
    and the tests with a regression."""
    measured = [c for c in comparisons if c.measured]
    if not any(ran(c) for c in measured):
        return nothing_ran_summary(measured, run, before_version)
    fixtures = [c for c in measured if c.is_fixture]
    compared = [c for c in measured if not c.is_fixture and c.status == "compared"]
    fixtures_compared = [c for c in fixtures if c.outputs_compared]
    tests = [c for c in comparisons if c.status == "compared"]
    lines = [refusals_line(compared), outcomes_line([c for c in tests if not c.is_fixture]), numerics_line(compared),
             integers_line(compared), errors_line(compared), time_line(compared, run),
             warnings_line(compared + fixtures_compared), fixtures_line(fixtures, run, before_version),
             not_run_line(comparisons)]
    regressed = sum(1 for c in comparisons if c.regressions)
    head = (f"{before_version} -> {after_version}: {plural(len(tests), 'test')} compared, "
            f"{plural(len(compared), 'case')}" + (f" and {plural(len(fixtures_compared), 'fixture')}"
                                                   if fixtures_compared else "") + " of them on their records")
    head += f", {plural(regressed, 'regression')}" if regressed else ", no regression"
    verdict = FAIL if any(line.status == FAIL for line in lines) else PASS
    return [SummaryLine(verdict, "verdict", head), *lines]


def summary_lines(comparisons: list[CaseComparison], run: RunFacts, before_version: str,
                  after_version: str) -> list[str]:
    return [line.render() for line in summary(comparisons, run, before_version, after_version)]


def regression_lines(comparisons: list[CaseComparison], shown: int = REGRESSIONS_SHOWN) -> list[str]:
    """One line per test with a regression, naming its test id and every regression with its
    error line; the first ``shown`` of them, then how many more report.md names."""
    regressed = [c for c in comparisons if c.regressions]
    lines = [f"FAIL  {c.case}: {clip('; '.join(c.regressions), 240)}" for c in regressed[:shown]]
    if len(regressed) > shown:
        lines.append(f"FAIL  and {len(regressed) - shown} more tests with a regression: report.md names them all")
    return lines


def passed(lines: list[SummaryLine]) -> bool:
    """The check's verdict, read from the summary: a verdict line that says PASS."""
    return bool(lines) and lines[0].name == "verdict" and lines[0].status == PASS
