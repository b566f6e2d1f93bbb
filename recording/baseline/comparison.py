"""The upgrade check's comparison: each test of a baseline against the same test now. Every
test's outcome is compared (``outcomes.json`` of each records folder); a test that recorded
outputs (a GPU-tier case, a fixture re-run) is compared further: behaviour changes, output
drift, integer results and the judged times.

The check fails when a test that passed (or xfailed) now fails, errors, xpasses or becomes a
known finding (xfails where it passed); when a call that ran now raises (even where the suite
expects the error, as for the strided layout on FlashInfer >= 0.7: the upgrade still breaks
it), fixtures included; when an integer result (an executed length, a packed index) is not
equal; when a test that ran in the baseline did not run now (unless the user's own -k/-m/path
selection left it out); or when a judged time regressed (:mod:`recording.baseline.timing`).
Float outputs that are no longer bitwise equal, worse error-budget ratios (still within
budget: past it the test fails) and new or gone warnings are changes, not regressions. A
fixture the baseline has no record of is compared with the output the fixture file itself
holds for the baseline's FlashInfer version, where it holds one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from harness.bits import same_bits

from ..fixture import FixtureError, load_fixture
from .records import CaseRecord, Outcome, read_outcomes, read_outputs, read_records
from .timing import TimeJudgement, judge_kernel_time, judge_plan_time

WORST_ROWS = 3


def drift(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Max abs difference, relative L2 (finite elements) and the fraction of bitwise-equal
    elements (an empty output is equal); the rows (dim 0) that differ and the worst of them by
    max abs. An element non-finite on one side and not bitwise equal differs by infinity."""
    if a.numel() == 0:
        return {"max_abs": 0.0, "rel_l2": 0.0, "bitwise_equal": 1.0, "rows": a.shape[0] if a.dim() else 0,
                "rows_differing": 0, "worst_rows": []}
    a64, b64 = a.double(), b.double()
    finite = torch.isfinite(a64) & torch.isfinite(b64)
    equal = same_bits(a, b)
    finite_diff = torch.where(finite, a64 - b64, torch.zeros_like(a64))
    diff = torch.where(finite | equal, finite_diff.abs(), torch.full_like(a64, math.inf))
    norm = float(torch.where(finite, a64, torch.zeros_like(a64)).norm())
    rows_diff = (~equal).reshape(a.shape[0], -1).any(1) if a.dim() else (~equal).reshape(1)
    row_max = diff.reshape(rows_diff.shape[0], -1).amax(1)
    differing = rows_diff.nonzero().flatten().tolist()
    worst = sorted(differing, key=lambda r: -float(row_max[r]))[:WORST_ROWS]
    return {
        "max_abs": float(diff.max()),
        "rel_l2": float(finite_diff.norm()) / norm if norm > 0 else float(finite_diff.norm()),
        "bitwise_equal": float(equal.sum()) / max(equal.numel(), 1),
        "rows": rows_diff.shape[0],
        "rows_differing": len(differing),
        "worst_rows": [[r, float(row_max[r])] for r in worst],
    }


@dataclass
class CaseComparison:
    case: str
    before: CaseRecord | None
    after: CaseRecord | None
    status: str = "compared"  # compared / new / not run / deselected / skipped (in both runs)
    why: str = ""  # why a baseline case has no record now, or why a new fixture is not compared
    measured: bool = True  # a record of outputs on either side (False: the test's outcome alone)
    against: str = ""  # a fixture without a baseline record: the fixture file's output it was compared with
    changes: list[str] = field(default_factory=list)
    regressions: list[str] = field(default_factory=list)
    drift: dict[str, dict] = field(default_factory=dict)
    integers: dict[str, str] = field(default_factory=dict)  # integer output -> "" (equal) or how it differs
    kernel_time: TimeJudgement = field(default_factory=TimeJudgement)
    plan_time: TimeJudgement = field(default_factory=TimeJudgement)

    @property
    def is_fixture(self) -> bool:
        """A fixture replay re-run on the installed FlashInfer, not a GPU-tier case."""
        return bool((self.after and self.after.fixture) or (self.before and self.before.fixture))

    @property
    def refusal(self) -> str:
        """"new" / "gone" when FlashInfer newly raises / no longer raises, else ""."""
        if self.before is None or self.after is None:
            return ""
        if self.after.error and not self.before.error:
            return "new"
        return "gone" if self.before.error and not self.after.error else ""

    @property
    def outputs_compared(self) -> bool:
        """A fixture re-run compared with a record of the old release's outputs or refusal (its
        baseline record or its file's): not only with the outcome of its test."""
        return self.status == "compared" and self.before is not None and bool(self.before.fixture)

    @property
    def bitwise_equal(self) -> bool:
        return all(d["bitwise_equal"] == 1.0 for d in self.drift.values())

    @property
    def worse_ratios(self) -> dict[str, tuple[float, float]]:
        """Error-budget ratios that grew: name -> (before, after)."""
        if self.before is None or self.after is None:
            return {}
        b, a = self.before.ratios, self.after.ratios
        return {k: (b[k], a[k]) for k in sorted(set(b) & set(a)) if a[k] > b[k]}


@dataclass
class RunFacts:
    """What the plugin knows of this run beyond its records."""

    deselected: frozenset[str] = frozenset()  # node ids the user's -k/-m/--deselect left out
    selected_paths: tuple[str, ...] = ()  # the run's path arguments, relative to the rootdir
    outcomes: dict[str, str] = field(default_factory=dict)  # node id -> outcome ("skipped: why")
    gpu_skip_reason: str = ""  # why the GPU tier was skipped, where it was
    timing: str = ""  # why times were not taken now ("" when the timing pass ran)
    timing_failed: bool = False  # the timing pass was due and could not run
    not_rerun: dict[str, str] = field(default_factory=dict)  # fixture replay node id -> why it was not re-run
    collect_errors: dict[str, str] = field(default_factory=dict)  # collector node id -> its error line
    stopped: str = ""  # why the run stopped before running every test it collected (-x, collection errors)


RECORDED_ONLY = "--replay-recorded-only"  # the not-re-run reason that is the user's own choice


def under_paths(case: str, paths: tuple[str, ...]) -> bool:
    """Whether node id ``case`` lies under one of the run's path arguments (all when none)."""
    if not paths:
        return True
    for p in paths:
        p = p.rstrip("/")
        if p in ("", ".") or case == p or case.startswith((p + "/", p + "::", p + "[")):
            return True
    return False


def collection_error(case: str, errors: dict[str, str]) -> str:
    """The error of the collector (module, class, folder) that holds node id ``case``, "" if none."""
    for node, line in sorted(errors.items()):
        if node in ("", ".") or case.startswith((node + "::", node.rstrip("/") + "/")):
            return f"{node or 'the session'}: {line}"
    return ""


def missing_case_status(case: str, run: RunFacts, before: CaseRecord | None = None) -> tuple[str, str]:
    """(status, why) of a baseline case that left no record now. A fixture replayed on its
    recorded outputs only is left out where the user asked for that (--replay-recorded-only),
    else not run; a fixture not replayed at all is not run (its folder not named now)."""
    if case in run.deselected:
        return "deselected", "deselected by -k/-m"
    if not under_paths(case, run.selected_paths):
        return "deselected", "outside the paths given"
    if case in run.not_rerun:
        why = run.not_rerun[case]
        if why == RECORDED_ONLY:
            return "deselected", f"{RECORDED_ONLY}: recorded outputs judged only"
        return "not run", f"not re-run: {why}"
    if case in run.outcomes:
        outcome = run.outcomes[case]
        return "not run", outcome if outcome.startswith("skipped") else f"ran without recording its outputs ({outcome})"
    if collection_error(case, run.collect_errors):
        return "not run", f"collection error in {collection_error(case, run.collect_errors)}"
    if run.stopped:
        return "not run", f"the run stopped early ({run.stopped})"
    if before is not None and before.fixture:
        return "not run", f"fixture not replayed now (name its folder with --baseline-fixtures: {before.fixture})"
    return "not run", "not collected (renamed or removed?)"


OK_OUTCOMES = ("passed", "xfailed")  # passed, or failed as the suite expects (a known finding)
REGRESSED_OUTCOMES = ("failed", "error", "xpassed", "xfailed")


def ok_outcome(record: CaseRecord | None) -> bool:
    """Passed, or failed as the suite expects (a strict xfail)."""
    return record is not None and record.outcome in OK_OUTCOMES


def has_run(record: CaseRecord | None) -> bool:
    return record is not None and record.outcome != "skipped"


def outcome_regressed(before: CaseRecord | None, after: CaseRecord | None) -> bool:
    """Passed or xfailed before, and now failed, errored, xpassed, or xfailed where it passed
    (a known finding now)."""
    return (ok_outcome(before) and after is not None and after.outcome != before.outcome
            and after.outcome in REGRESSED_OUTCOMES)


def outcome_regression(before: CaseRecord, after: CaseRecord) -> str:
    """``was passed, now failed: <the error line>``."""
    line = after.outcome_line or after.error
    return f"was {before.outcome}, now {after.outcome}" + (f": {line}" if line else "")


def is_integer(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex())


def entry_name(name: str, index: tuple[int, ...]) -> str:
    return f"{name}[{', '.join(map(str, index))}]"


def integer_difference(name: str, before: torch.Tensor, after: torch.Tensor) -> str:
    """How an integer result (an executed length, a packed index) differs between releases, naming
    the first entry that differs and how many do; "" when it is equal entry for entry."""
    if not (is_integer(before) and is_integer(after)):
        return f"{name} dtype {before.dtype} -> {after.dtype}"
    if before.shape != after.shape:
        return f"{name} shape {tuple(before.shape)} -> {tuple(after.shape)}"
    differ = before.long() != after.long()
    if not bool(differ.any()):
        return ""
    index = tuple(int(i) for i in differ.nonzero()[0])
    return (f"{entry_name(name, index)} is {int(after[index])} now, was {int(before[index])} "
            f"({int(differ.sum())} of {differ.numel()} entries differ)")


def integers_missing_now(before_out: dict, after_out: dict) -> list[str]:
    """The integer results recorded before that are not recorded now."""
    return [key for key in sorted(set(before_out) - set(after_out)) if is_integer(before_out[key])]


def not_run_comparison(cmp: CaseComparison, run: RunFacts | None) -> CaseComparison:
    """A baseline test that did not run now: missing, or skipped where it ran (status and why);
    not run fails the check, where the test ran in the baseline. A test skipped in the baseline
    and not run now is ``skipped``, not judged."""
    before, after, case = cmp.before, cmp.after, cmp.case
    if after is None:
        cmp.status, cmp.why = missing_case_status(case, run or RunFacts(), before)
    else:
        skipped = Outcome("skipped", after.outcome_line or "").text
        cmp.status, cmp.why = "not run", (run.outcomes.get(case) if run else None) or skipped
    if cmp.status == "not run" and not has_run(before):
        cmp.status, cmp.why = "skipped", f"skipped in the baseline ({before.outcome_line or 'no reason'})"
    if cmp.status == "not run":
        cmp.regressions.append(f"not run: {cmp.why}")
    return cmp


def compare_case(case: str, before: CaseRecord | None, after: CaseRecord | None, before_out, after_out,
                 run: RunFacts | None = None) -> CaseComparison:
    cmp = CaseComparison(case, before, after)
    if before is None:
        cmp.status = "new"
        return cmp
    if not has_run(after):
        return not_run_comparison(cmp, run)
    if before.outcome != after.outcome:
        cmp.changes.append(f"outcome {before.outcome} -> {after.outcome}")
    if cmp.refusal == "gone":
        cmp.changes.append(f"no longer raising (was: {before.error})")
    new_warnings = sorted(set(after.warnings) - set(before.warnings))
    gone_warnings = sorted(set(before.warnings) - set(after.warnings))
    if new_warnings:
        cmp.changes.append("new warnings: " + " | ".join(new_warnings))
    if gone_warnings:
        cmp.changes.append("warnings gone: " + " | ".join(gone_warnings))
    if cmp.refusal == "new":
        cmp.changes.append(f"newly raising: {after.error}")
        cmp.regressions.append(f"newly raising: {after.error}")
    elif outcome_regressed(before, after):
        cmp.regressions.append(outcome_regression(before, after))
    if not (before.error or after.error or cmp.is_fixture):  # a refused plan() has nothing to time; nor a fixture
        cmp.kernel_time = judge_kernel_time(before.kernel_us_repeats, after.kernel_us_repeats)
        cmp.plan_time = judge_plan_time(before.plan_us_repeats, after.plan_us_repeats)
        cmp.regressions += [t.why for t in (cmp.kernel_time, cmp.plan_time) if t.regressed]
    compare_outputs(cmp, before_out, after_out)
    return cmp


def compare_outputs(cmp: CaseComparison, before_out: dict, after_out: dict) -> None:
    """Float outputs by their drift (a change), integer results entry for entry (a regression
    where they differ, or where one recorded before is missing from a run that passed now)."""
    for key in sorted(set(before_out) & set(after_out)):
        b, a = before_out[key], after_out[key]
        if is_integer(b) or is_integer(a):
            cmp.integers[key] = integer_difference(key, b, a)
            if cmp.integers[key]:
                cmp.regressions.append(cmp.integers[key])
        elif b.shape == a.shape:
            cmp.drift[key] = drift(b, a)
        else:
            cmp.changes.append(f"{key} shape {tuple(b.shape)} -> {tuple(a.shape)}")
    for key in integers_missing_now(before_out, after_out) if ok_outcome(cmp.after) else ():
        cmp.integers[key] = f"{key} recorded before, not now"
        cmp.regressions.append(cmp.integers[key])


def baseline_version(records: dict[str, CaseRecord]) -> str | None:
    """The one FlashInfer version a baseline was recorded on (None where it names none or several)."""
    versions = {r.flashinfer for r in records.values()} - {None}
    return versions.pop() if len(versions) == 1 else None


def record_from_fixture_file(after: CaseRecord, version: str | None) -> tuple[CaseRecord | None, dict, str]:
    """What the fixture file of ``after`` holds for ``version``, as a baseline record and its
    outputs (its recorded out and lse, or the exception that version raised), or (None, {}, why
    not). The outcome is taken from ``after``: the file does not say how its replay ended."""
    if version is None:
        return None, {}, "the baseline names no single FlashInfer version"
    try:
        fx = load_fixture(after.fixture)
    except (FixtureError, OSError) as e:
        return None, {}, f"fixture file unreadable now: {e}"
    base = dict(case=after.case, outcome=after.outcome, flashinfer=version, fixture=after.fixture)
    if version in fx.outputs:
        out, lse = fx.outputs[version]
        return CaseRecord(**base), ({"out": out, "lse": lse} if fx.meta.get("lse_recorded", True) else {"out": out}), ""
    refused = (fx.meta.get("refused") or {}).get(version)
    if refused:
        return CaseRecord(**base, error=refused), {}, ""
    return None, {}, f"no record of {version}, neither in the baseline nor in the fixture file"


def with_outcome(case: str, record: CaseRecord | None, outcome: Outcome | None,
                 version: str | None) -> CaseRecord | None:
    """A test's record with the outcome its run's outcomes file gives (a teardown's error
    included); for a test that recorded nothing, a record of its outcome alone."""
    if outcome is None:
        return record
    if record is None:
        return CaseRecord(case=case, outcome=outcome.outcome, flashinfer=version, outcome_line=outcome.line or None)
    return replace(record, outcome=outcome.outcome, outcome_line=outcome.line or None)


def recorded_before_only(before_record: CaseRecord | None, after_record: CaseRecord | None,
                         before: CaseRecord | None, after: CaseRecord | None) -> bool:
    """A test that recorded outputs before and passes (or xfails) now without recording them (a
    fixture not re-run, a case that did not reach its launch): it counts as not run. Where its
    outcome regressed, the outcome is what the check reports."""
    return (before_record is not None and after_record is None and ok_outcome(after)
            and not outcome_regressed(before, after))


def compare_directories(before_dir: Path, after_dir: Path, run: RunFacts | None = None) -> list[CaseComparison]:
    """Every test of either folder compared: its outcome (``outcomes.json``), and where it
    recorded outputs, those; a fixture the baseline has no record of is compared with what its
    own file holds for the baseline's version (``record_from_fixture_file``)."""
    before = read_records(before_dir)
    after = read_records(after_dir) if Path(after_dir).exists() else {}
    before_tests_version, before_tests = read_outcomes(before_dir)
    after_tests_version, after_tests = read_outcomes(after_dir) if Path(after_dir).exists() else (None, {})
    version = baseline_version(before) or before_tests_version
    after_version = baseline_version(after) or after_tests_version
    comparisons = []
    for case in sorted(set(before) | set(after) | set(before_tests) | set(after_tests)):
        b, a = before.get(case), after.get(case)
        b_out, a_out = read_outputs(before_dir, case) if b else {}, read_outputs(after_dir, case) if a else {}
        why, against = "", ""
        if b is None and a is not None and a.fixture:
            b, b_out, why = record_from_fixture_file(a, version)
            against = f"the fixture file's {version} record" if b is not None else ""
        measured = b is not None or a is not None
        b_test = with_outcome(case, b, before_tests.get(case), version)
        a_test = with_outcome(case, a, after_tests.get(case), after_version)
        if recorded_before_only(b, a, b_test, a_test):
            a_test = None  # its outputs were not compared: missing_case_status says why
        cmp = compare_case(case, b_test, a_test, b_out, a_out, run)
        cmp.why, cmp.against, cmp.measured = cmp.why or why, against, measured
        comparisons.append(cmp)
    return comparisons
