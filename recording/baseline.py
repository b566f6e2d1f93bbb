"""Upgrade validation: record what every GPU-tier case did on the installed FlashInfer, and
compare another version against such a record (the record format, the comparison and the
report; the options, hooks and the timing pass are ``pytest_sparse_mla.baselines``).

``--record-baseline DIR`` writes, per case, a JSON record (outcome, error FlashInfer raised,
its warnings, error-budget ratios, kernel and plan() times) and a safetensors file of the
outputs. ``--compare-baseline DIR`` records the installed version the same way (into
``--baseline-out``) and writes ``report.md`` and ``report.json`` there: a summary of one line
per class of change, then the details.

Fixture replays re-run on the installed FlashInfer are recorded too (``CaseRecord.fixture``
names the file): their new out and lse, or their refusal as the case's error. A fixture the
baseline has no record of is compared with the output the fixture file itself holds for the
baseline's FlashInfer version, where it holds one, and is otherwise reported as not compared.
The check fails when

- a case that passed now fails, or a call that ran now raises (even where the suite expects
  the error, as for the strided layout on FlashInfer >= 0.7: the upgrade still breaks it);
  fixtures included;
- a case of the baseline did not run now (unless the user's own -k/-m/path selection left it
  out), or no GPU-tier case ran at all;
- a judged kernel time is more than ``KERNEL_TIME_LIMIT`` x the baseline (and more than
  ``KERNEL_TIME_FLOOR_US`` slower, so launch noise on tiny cases does not count), or a judged
  plan() host time more than ``PLAN_TIME_LIMIT`` x; or the timing pass could not run.

Times come only from the timing pass, which re-runs each case with a GPU to itself: each time
is ``TIME_REPEATS`` medians of ``TIME_REPS`` calls. A time whose medians spread more than the
spread limit in either run is reported as unstable and not judged. Outputs that are no longer
bitwise equal, worse error-budget ratios (still within budget: past it the test fails) and
new or gone warnings are reported; they do not fail the check.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import statistics
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from .fixture import same_bits

SCHEMA = 2
KERNEL_TIME_LIMIT = 1.15
KERNEL_TIME_FLOOR_US = 2.0
PLAN_TIME_LIMIT = 2.0
TIME_REPEATS = 3  # medians per time
TIME_REPS = 15  # calls per median
KERNEL_SPREAD_LIMIT = 0.10  # (max - min) / median of the repeats' medians
PLAN_SPREAD_LIMIT = 0.25
TIMING_DIR = "timing"  # inside a records folder: the timing pass's per-case times and logs


@dataclass
class CaseRecord:
    case: str
    outcome: str = "passed"  # pytest outcome: passed / failed / xfailed / skipped / error
    flashinfer: str | None = None
    error: str | None = None  # what FlashInfer raised, if it did
    warnings: list[str] = field(default_factory=list)
    ratios: dict[str, float] = field(default_factory=dict)  # e.g. out_max_ratio, lse_mean_ratio
    kernel_us_repeats: list[float] = field(default_factory=list)  # the timing pass's medians (us)
    plan_us_repeats: list[float] = field(default_factory=list)
    fixture: str | None = None  # a fixture replay's re-run: the fixture file (absolute path)

    @property
    def kernel_us(self) -> float | None:
        return statistics.median(self.kernel_us_repeats) if self.kernel_us_repeats else None

    @property
    def plan_us(self) -> float | None:
        return statistics.median(self.plan_us_repeats) if self.plan_us_repeats else None


class BaselineError(ValueError):
    """A baseline folder that cannot be compared against; the message names the path."""


RERECORD = "record it again with --record-baseline on the old FlashInfer"


NAME_LIMIT = 180


def safe_name(case: str) -> str:
    """The file name of a case's record: its test id (after the file) with other characters
    than letters, digits, ``_.-`` replaced; a longer one (a fixture under a deep absolute path)
    is cut and ends with a hash of the whole id, so two long ids never share a file."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", case.split("::", 1)[-1])
    if len(name) <= NAME_LIMIT:
        return name
    return name[: NAME_LIMIT - 17] + "-" + hashlib.sha256(case.encode()).hexdigest()[:16]


def write_record(directory: Path, record: CaseRecord, outputs: dict[str, torch.Tensor] | None) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    name = safe_name(record.case)
    (directory / f"{name}.json").write_text(json.dumps(dict(asdict(record), schema=SCHEMA), indent=1, sort_keys=True))
    if outputs:
        save_file({k: v.detach().contiguous().cpu() for k, v in outputs.items()}, str(directory / f"{name}.safetensors"))


def read_record(path: Path) -> CaseRecord:
    """One record; BaselineError naming the file when it is not a record of this schema."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BaselineError(f"{path}: not a readable JSON record ({e}); {RERECORD}") from None
    if not isinstance(data, dict):
        raise BaselineError(f"{path}: not a case record (a JSON {type(data).__name__}); {RERECORD}")
    schema = data.pop("schema", None)
    if schema != SCHEMA:
        found = "no schema field" if schema is None else f"schema {schema!r}"
        raise BaselineError(f"{path}: {found}, this tool reads schema {SCHEMA}; {RERECORD}")
    unknown = sorted(set(data) - {f.name for f in fields(CaseRecord)})
    if unknown or "case" not in data:
        raise BaselineError(f"{path}: fields {unknown or ['case' + ' missing']} do not fit schema {SCHEMA}; {RERECORD}")
    return CaseRecord(**data)


def read_records(directory: Path) -> dict[str, CaseRecord]:
    return {r.case: r for r in (read_record(p) for p in sorted(Path(directory).glob("*.json")))}


def check_baseline(directory: Path) -> dict[str, CaseRecord]:
    """The records of a baseline folder; BaselineError saying what is wrong with it."""
    directory = Path(directory)
    if not directory.exists():
        raise BaselineError(f"baseline {directory} does not exist; {RERECORD}")
    if not directory.is_dir():
        raise BaselineError(f"baseline {directory} is not a folder; {RERECORD}")
    records = read_records(directory)
    if not records:
        raise BaselineError(f"baseline {directory} holds no case records (*.json); {RERECORD}")
    return records


def write_timing(directory: Path, case: str, kernel_us_repeats: list[float], plan_us_repeats: list[float]) -> None:
    """The timing pass's medians of one case, kept beside the records until merged."""
    directory.mkdir(parents=True, exist_ok=True)
    payload = {"case": case, "kernel_us_repeats": kernel_us_repeats, "plan_us_repeats": plan_us_repeats}
    (directory / f"{safe_name(case)}.json").write_text(json.dumps(payload, indent=1))


def merge_timings(records_dir: Path, timing_dir: Path) -> int:
    """Write the timing pass's medians into the matching records; the number of records timed."""
    timed = 0
    for path in sorted(Path(timing_dir).glob("*.json")):
        times = json.loads(path.read_text())
        record_path = Path(records_dir) / path.name
        if not record_path.exists():
            continue
        record = read_record(record_path)
        record.kernel_us_repeats = times.get("kernel_us_repeats") or []
        record.plan_us_repeats = times.get("plan_us_repeats") or []
        record_path.write_text(json.dumps(dict(asdict(record), schema=SCHEMA), indent=1, sort_keys=True))
        timed += 1
    return timed


def timed_cases(records: dict[str, CaseRecord]) -> list[str]:
    """The cases the timing pass re-runs: GPU-tier cases that ran to a launch (not skipped, no
    refusal); fixture re-runs are compared, never timed."""
    return sorted(case for case, r in records.items() if r.outcome != "skipped" and not r.error and not r.fixture)


def read_outputs(directory: Path, case: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = Path(directory) / f"{safe_name(case)}.safetensors"
    return load_file(str(path)) if path.exists() else {}


# --- times ------------------------------------------------------------------------------------


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


# --- outputs ----------------------------------------------------------------------------------

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


# --- the comparison ---------------------------------------------------------------------------


@dataclass
class CaseComparison:
    case: str
    before: CaseRecord | None
    after: CaseRecord | None
    status: str = "compared"  # compared / new / not run / deselected
    why: str = ""  # why a baseline case has no record now, or why a new fixture is not compared
    against: str = ""  # a fixture without a baseline record: the fixture file's output it was compared with
    changes: list[str] = field(default_factory=list)
    regressions: list[str] = field(default_factory=list)
    drift: dict[str, dict] = field(default_factory=dict)
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
        return "not run", run.outcomes[case]
    if before is not None and before.fixture:
        return "not run", f"fixture not replayed now (name its folder with --baseline-fixtures: {before.fixture})"
    return "not run", "not collected (renamed or removed?)"


def _ok(record: CaseRecord | None) -> bool:
    return record is not None and record.outcome in ("passed", "xfailed")


def compare_case(case: str, before: CaseRecord | None, after: CaseRecord | None, before_out, after_out,
                 run: RunFacts | None = None) -> CaseComparison:
    cmp = CaseComparison(case, before, after)
    if before is None:
        cmp.status = "new"
        return cmp
    if after is None or (after.outcome == "skipped" and before.outcome != "skipped"):
        cmp.status, cmp.why = missing_case_status(case, run or RunFacts(), before) if after is None else ("not run", "skipped")
        if after is not None and run is not None:
            cmp.why = run.outcomes.get(case, cmp.why)
        if cmp.status == "not run":
            cmp.regressions.append(f"not run: {cmp.why}")
        return cmp
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
    elif _ok(before) and not _ok(after):
        cmp.regressions.append(f"was {before.outcome}, now {after.outcome}" + (f" ({after.error})" if after.error else ""))
    if not (before.error or after.error or cmp.is_fixture):  # a refused plan() has nothing to time; fixtures are not timed
        cmp.kernel_time = judge_time("kernel", before.kernel_us_repeats, after.kernel_us_repeats, KERNEL_TIME_LIMIT,
                                     KERNEL_SPREAD_LIMIT, KERNEL_TIME_FLOOR_US)
        cmp.plan_time = judge_time("plan()", before.plan_us_repeats, after.plan_us_repeats, PLAN_TIME_LIMIT,
                                   PLAN_SPREAD_LIMIT)
        cmp.regressions += [t.why for t in (cmp.kernel_time, cmp.plan_time) if t.regressed]
    for key in sorted(set(before_out) & set(after_out)):
        if before_out[key].shape == after_out[key].shape:
            cmp.drift[key] = drift(before_out[key], after_out[key])
        else:
            cmp.changes.append(f"{key} shape {tuple(before_out[key].shape)} -> {tuple(after_out[key].shape)}")
    return cmp


def baseline_version(records: dict[str, CaseRecord]) -> str | None:
    """The one FlashInfer version a baseline was recorded on (None where it names none or several)."""
    versions = {r.flashinfer for r in records.values()} - {None}
    return versions.pop() if len(versions) == 1 else None


def record_from_fixture_file(after: CaseRecord, version: str | None) -> tuple[CaseRecord | None, dict, str]:
    """What the fixture file of ``after`` holds for ``version``, as a baseline record and its
    outputs (its recorded out and lse, or the exception that version raised), or (None, {}, why
    not). The outcome is taken from ``after``: the file does not say how its replay ended."""
    from .fixture import FixtureError, load_fixture

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


def compare_directories(before_dir: Path, after_dir: Path, run: RunFacts | None = None) -> list[CaseComparison]:
    """Every case of either folder compared; a fixture the baseline has no record of is
    compared with what its own file holds for the baseline's version (``record_from_fixture_file``)."""
    before = read_records(before_dir)
    after = read_records(after_dir) if Path(after_dir).exists() else {}
    version = baseline_version(before)
    comparisons = []
    for case in sorted(set(before) | set(after)):
        b, a = before.get(case), after.get(case)
        b_out, a_out = read_outputs(before_dir, case) if b else {}, read_outputs(after_dir, case) if a else {}
        why, against = "", ""
        if b is None and a is not None and a.fixture:
            b, b_out, why = record_from_fixture_file(a, version)
            against = f"the fixture file's {version} record" if b is not None else ""
        cmp = compare_case(case, b, a, b_out, a_out, run)
        cmp.why, cmp.against = cmp.why or why, against
        comparisons.append(cmp)
    return comparisons


# --- the report -------------------------------------------------------------------------------


def _fmt(x, spec=".2f", none="–") -> str:
    return none if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _short(case: str) -> str:
    return case.split("::", 1)[-1]


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _line(status: str, name: str, text: str) -> str:
    return f"{status:<5} {name:<10} {text}"


def _first(items: list[str], n: int = 1) -> str:
    return "; ".join(items[:n]) + (f"; and {len(items) - n} more" if len(items) > n else "")


def timing_line(compared: list[CaseComparison], run: RunFacts) -> str:
    how = f"one process per GPU, {TIME_REPEATS} medians of {TIME_REPS}"
    if run.timing:
        return _line("FAIL" if run.timing_failed else "note", "time", f"not judged: {run.timing}")
    times = [t for c in compared for t in (c.kernel_time, c.plan_time)]
    judged = [t for t in times if t.judged]
    slower = sorted((t for t in judged if t.regressed), key=lambda t: -(t.ratio or 0))
    unjudged = sorted({t.why for t in times if not t.judged and t.why})
    if not judged:
        return _line("note", "time", "not judged: " + (_first(unjudged) if unjudged else "no case timed"))
    text = f"{_n(len(judged), 'time')} judged ({how}): " + (
        f"{len(slower)} slower past the limits, worst {slower[0].why}" if slower else "none slower past the limits")
    not_judged = [t for t in times if not t.judged and t.why]
    if not_judged:
        text += f"; {len(not_judged)} not judged ({_clip(unjudged[0], 50)}" + (", ...)" if len(unjudged) > 1 else ")")
    return _line("FAIL" if slower else "ok", "time", text)


def _clip(text: str, width: int = 100) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _name(c: CaseComparison) -> str:
    """A fixture by its file's stem, a case by its test id."""
    record = c.after or c.before
    return Path(record.fixture).stem if record and record.fixture else _short(c.case)


def worst_drift(drifted: list[CaseComparison]) -> str:
    """The output that moved most: which case or fixture, which output, its rows."""
    worst = max(drifted, key=lambda c: max(d["max_abs"] for d in c.drift.values()))
    key, d = max(((k, d) for k, d in worst.drift.items() if d["bitwise_equal"] < 1.0), key=lambda kv: kv[1]["max_abs"])
    rows = ", ".join(f"{r} ({m:.3g})" for r, m in d["worst_rows"])
    return (f"worst `{_name(worst)}` {key} max abs {d['max_abs']:.3g}, {d['rows_differing']}/{d['rows']} rows differ, "
            f"worst rows {rows}")


def refusals_text(compared: list[CaseComparison]) -> tuple[str, list, list]:
    """"N new, M gone" with the first new refusal; the new and the gone."""
    new = [c for c in compared if c.refusal == "new"]
    gone = [c for c in compared if c.refusal == "gone"]
    text = f"{len(new)} new, {len(gone)} gone"
    if new:
        text += f" (now raising: {_clip(new[0].after.error, 60)} in `{_name(new[0])}`" + (
            f" and {len(new) - 1} more)" if len(new) > 1 else ")")
    return text, new, gone


def fixtures_line(fixtures: list[CaseComparison], run: RunFacts, before_version: str) -> str:
    """Fixture replays across releases: how many re-ran now, how many outputs are bitwise equal
    to the old release's (from its baseline record or the fixture file's), the worst that is
    not, refusals, and the fixtures compared with nothing or not re-run."""
    not_rerun = sorted(run.not_rerun.items())
    reasons = sorted({why for _, why in not_rerun})
    not_rerun_text = f"{len(not_rerun)} not re-run ({_clip(_first(reasons), 80)}): judged on their recorded outputs only"
    rerun = [c for c in fixtures if c.after is not None]
    if not rerun:
        return _line("note", "fixtures", not_rerun_text + ", nothing compared" if not_rerun else "no fixture replay re-ran")
    compared = [c for c in rerun if c.status == "compared"]
    with_outputs = [c for c in compared if c.drift]
    drifted = [c for c in with_outputs if not c.bitwise_equal]
    from_files = [c for c in compared if c.against]
    uncompared = [c for c in rerun if c.status == "new"]
    failing = [c for c in compared if _ok(c.before) and not _ok(c.after) and c.refusal != "new"]
    text = f"{len(rerun)} re-run: {len(with_outputs) - len(drifted)} of {len(with_outputs)} with outputs bitwise equal to {before_version}"
    if from_files:
        text += f" ({len(from_files)} compared with the fixture file's record)"
    if drifted:
        text += f"; {worst_drift(drifted)}"
    refusals, new_ref, gone_ref = refusals_text(compared)
    text += f"; refusals {refusals}"
    if failing:
        text += f"; {len(failing)} that passed fail now (`{_name(failing[0])}`: {failing[0].after.outcome})"
    if uncompared:
        text += f"; {len(uncompared)} not compared ({_clip(_first(sorted({c.why for c in uncompared})), 80)})"
    if not_rerun:
        text += "; " + not_rerun_text
    status = "FAIL" if new_ref or failing else ("note" if drifted or gone_ref or uncompared or not_rerun else "ok")
    return _line(status, "fixtures", text)


def not_run_line(comparisons: list[CaseComparison]) -> str:
    """Baseline cases and fixtures with no record now (failing unless the run's own selection
    left them out), and the GPU-tier cases new in this run."""
    not_run = [c for c in comparisons if c.status == "not run"]
    deselected = [c for c in comparisons if c.status == "deselected"]
    new = [c for c in comparisons if c.status == "new" and not c.is_fixture]
    text = f"{_n(len(not_run), 'case')} of the baseline did not run" + (
        f" (`{_name(not_run[0])}`: {_clip(not_run[0].why)})" if not_run else "")
    if deselected:
        whys = sorted({c.why for c in deselected})
        text += f"; {len(deselected)} left out by this run's selection ({', '.join(whys)}), not judged"
    if new:
        text += f"; {_n(len(new), 'new case')} not in the baseline, not judged"
    return _line("FAIL" if not_run else ("note" if deselected or new else "ok"), "not run", text)


def summary_lines(comparisons: list[CaseComparison], run: RunFacts, before_version: str, after_version: str) -> list[str]:
    """One line per class of change, the verdict first; FAIL lines fail the check, note lines
    report a change that does not. Refusals, outcomes, numerics, errors and time are about the
    GPU-tier cases; the fixtures line about the fixture replays; warnings and not run about both."""
    fixtures = [c for c in comparisons if c.is_fixture]
    cases = [c for c in comparisons if not c.is_fixture]
    compared = [c for c in cases if c.status == "compared"]
    fixtures_compared = [c for c in fixtures if c.status == "compared"]
    regressed = [c for c in comparisons if c.regressions]
    if not any(ran(c) for c in comparisons):
        reason = run.gpu_skip_reason or "no GPU-tier case recorded anything"
        lines = [_line("FAIL", "GPU tier", f"did not run ({reason}): nothing was compared")]
        if run.not_rerun:
            lines.append(fixtures_line([], run, before_version))
        return lines + [_line("FAIL", "not run", f"all {_n(len(comparisons), 'case')} of the baseline")]
    head = f"FlashInfer {before_version} -> {after_version}: {_n(len(compared), 'case')}" + (
        f" and {_n(len(fixtures_compared), 'fixture')}" if fixtures_compared else "") + " compared"
    failed = bool(regressed) or run.timing_failed
    lines = [_line("FAIL" if failed else "PASS", "verdict",
                   head + (f", {_n(len(regressed), 'regression')}" if regressed else ", no regression"))]

    text, new_ref, gone_ref = refusals_text(compared)
    lines.append(_line("FAIL" if new_ref else ("note" if gone_ref else "ok"), "refusals", text))

    failing = [c for c in compared if _ok(c.before) and not _ok(c.after) and c.refusal != "new"]
    lines.append(_line("FAIL" if failing else "ok", "outcomes",
                       f"{_n(len(failing), 'case')} that passed fail now" + (f" (`{_name(failing[0])}`: "
                                                                        f"{failing[0].after.outcome})" if failing else "")))

    with_outputs = [c for c in compared if c.drift]
    drifted = [c for c in with_outputs if not c.bitwise_equal]
    text = (f"{len(drifted)} of {_n(len(with_outputs), 'case')} no longer bitwise equal; {worst_drift(drifted)}" if drifted
            else f"all {_n(len(with_outputs), 'case')} with outputs bitwise equal")
    lines.append(_line("note" if drifted else "ok", "numerics", text))

    worse = [(c, k, b, a) for c in compared for k, (b, a) in c.worse_ratios.items()]
    if worse:
        c, k, b, a = max(worse, key=lambda w: w[3] - w[2])
        text = f"{_n(len({w[0].case for w in worse}), 'case')} with a worse error-budget ratio; worst `{_name(c)}` {k} {b:.3g} -> {a:.3g}"
    else:
        text = "no error-budget ratio worse"
    lines.append(_line("note" if worse else "ok", "errors", text))

    lines.append(timing_line(compared, run))

    both = compared + fixtures_compared
    new_w = sorted({w for c in both for w in set(c.after.warnings) - set(c.before.warnings)})
    gone_w = sorted({w for c in both for w in set(c.before.warnings) - set(c.after.warnings)})
    text = f"{len(new_w)} new, {len(gone_w)} gone" + (f" (new: {_clip(new_w[0])})" if new_w else "")
    lines.append(_line("note" if new_w or gone_w else "ok", "warnings", text))

    lines.append(fixtures_line(fixtures, run, before_version))
    lines.append(not_run_line(comparisons))
    return lines


def ran(c: CaseComparison) -> bool:
    return c.after is not None and c.after.outcome != "skipped"


def passed(comparisons: list[CaseComparison], run: RunFacts) -> bool:
    """The check's verdict: a GPU-tier case ran, nothing regressed, the due timing pass ran."""
    return any(ran(c) for c in comparisons) and not any(c.regressions for c in comparisons) and not run.timing_failed


def render_markdown(comparisons: list[CaseComparison], run: RunFacts, before_version: str, after_version: str) -> str:
    lines = [f"# FlashInfer upgrade check: {before_version} -> {after_version}", "", "```"]
    lines += summary_lines(comparisons, run, before_version, after_version)
    lines += ["```", "",
              f"FAIL fails the check, note is a change that does not. Rules: passed/xfailed -> failed, or newly "
              f"raising; a baseline case not run (unless the run's own -k/-m/paths left it out); kernel time > "
              f"x{KERNEL_TIME_LIMIT} and > {KERNEL_TIME_FLOOR_US} us slower; plan() time > x{PLAN_TIME_LIMIT}. Times come "
              f"from a pass with one process per GPU, {TIME_REPEATS} medians of {TIME_REPS} calls; a time whose medians "
              f"spread more than {KERNEL_SPREAD_LIMIT:.0%} (kernel) or {PLAN_SPREAD_LIMIT:.0%} (plan()) is not judged. "
              f"Fixtures re-run on the new release are compared with the old release's record of them, or, where the "
              f"baseline has none, with the output the fixture file holds for the old release; a new refusal fails.",
              "", "## Regressions", ""]
    lines += [f"- `{c.case}`: " + "; ".join(c.regressions) for c in comparisons if c.regressions] or ["none"]
    lines += ["", "## Behaviour changes", ""]
    lines += [f"- `{c.case}`: " + "; ".join(c.changes) for c in comparisons if c.changes] or ["none"]
    drifted = [c for c in comparisons if c.drift and not c.bitwise_equal and not c.is_fixture]
    lines += ["", "## Outputs no longer bitwise equal", ""]
    lines += [f"- `{c.case}`: " + "; ".join(
        f"{k} max abs {d['max_abs']:.3g}, rel L2 {d['rel_l2']:.3g}, {d['bitwise_equal']:.1%} bitwise equal, "
        f"{d['rows_differing']}/{d['rows']} rows differ (worst: " + ", ".join(f"row {r} {m:.3g}" for r, m in d["worst_rows"]) + ")"
        for k, d in c.drift.items() if d["bitwise_equal"] < 1.0) for c in drifted] or ["none"]
    lines += ["", "## Fixtures", ""]
    lines += fixture_lines([c for c in comparisons if c.is_fixture], run, before_version)
    skipped = [c for c in comparisons if c.status in ("not run", "deselected", "new")]
    lines += ["", "## Not run, left out, new", ""]
    lines += [f"- `{c.case}`: {c.status}" + (f" ({c.why})" if c.why else "") for c in skipped] or ["none"]
    lines += ["", "## Per case", "",
              "| case | before | after | out max ratio before/after | out bitwise equal | rows differing | "
              "kernel us before/after | plan us before/after | time not judged |",
              "|---|---|---|---|---|---|---|---|---|"]
    for c in (c for c in comparisons if not c.is_fixture):
        b, a = c.before, c.after
        d = c.drift.get("out", {})
        unjudged = "; ".join(t.why for t in (c.kernel_time, c.plan_time) if not t.judged and t.why)
        lines.append(
            f"| `{c.case}` | {b.outcome if b else '–'} | {a.outcome if a else c.status} | "
            f"{_fmt(b.ratios.get('out_max_ratio') if b else None)}/{_fmt(a.ratios.get('out_max_ratio') if a else None)} | "
            f"{_fmt(d.get('bitwise_equal'), '.1%')} | {d.get('rows_differing', '–')} | "
            f"{_fmt(b.kernel_us if b else None, '.1f')}/{_fmt(a.kernel_us if a else None, '.1f')} | "
            f"{_fmt(b.plan_us if b else None, '.0f')}/{_fmt(a.plan_us if a else None, '.0f')} | {unjudged} |"
        )
    return "\n".join(lines) + "\n"


def drift_text(d: dict) -> str:
    if d["bitwise_equal"] == 1.0:
        return "bitwise equal"
    worst = ", ".join(f"row {r} {m:.3g}" for r, m in d["worst_rows"])
    return (f"max abs {d['max_abs']:.3g}, rel L2 {d['rel_l2']:.3g}, {d['bitwise_equal']:.1%} bitwise equal, "
            f"{d['rows_differing']}/{d['rows']} rows differ (worst: {worst})")


def fixture_lines(fixtures: list[CaseComparison], run: RunFacts, before_version: str) -> list[str]:
    """One item per fixture: what it was compared with and how its outputs moved; then the
    fixtures not re-run now."""
    lines = []
    for c in fixtures:
        record = c.after or c.before
        if c.after is None:
            what = f"{c.status}: {c.why}"
        elif c.status == "new":
            what = f"re-run, not compared: {c.why}"
        else:
            against = c.against or f"the baseline's record ({before_version})"
            parts = [f"against {against}"]
            if c.after.error or (c.before and c.before.error):
                parts.append(f"refused before: {c.before.error or 'no'}; now: {c.after.error or 'no'}")
            parts += [f"{k} {drift_text(d)}" for k, d in c.drift.items()]
            parts += c.regressions
            what = "; ".join(parts)
        lines.append(f"- `{_name(c)}` ({record.fixture}): {what}")
    lines += [f"- `{case}`: not re-run ({why}); judged on its recorded outputs only" for case, why in sorted(run.not_rerun.items())]
    return lines or ["none replayed"]


def write_report(comparisons: list[CaseComparison], out_dir: Path, before_version: str, after_version: str,
                 run: RunFacts | None = None) -> bool:
    """Write report.md and report.json; True when the check passes."""
    run = run or RunFacts()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.md").write_text(render_markdown(comparisons, run, before_version, after_version))
    ok = passed(comparisons, run)
    payload = {
        "before": before_version,
        "after": after_version,
        "passed": ok,
        "summary": summary_lines(comparisons, run, before_version, after_version),
        "thresholds": {"kernel_time": KERNEL_TIME_LIMIT, "kernel_time_floor_us": KERNEL_TIME_FLOOR_US,
                       "plan_time": PLAN_TIME_LIMIT, "kernel_spread": KERNEL_SPREAD_LIMIT,
                       "plan_spread": PLAN_SPREAD_LIMIT, "time_repeats": TIME_REPEATS, "time_reps": TIME_REPS},
        "timing": run.timing or "timing pass ran",
        "fixtures_not_rerun": run.not_rerun,
        "cases": [
            {"case": c.case, "status": c.status, "why": c.why, "fixture": c.is_fixture, "against": c.against or None,
             "before": asdict(c.before) if c.before else None, "after": asdict(c.after) if c.after else None,
             "changes": c.changes, "regressions": c.regressions, "drift": c.drift,
             "kernel_time": dict(asdict(c.kernel_time), ratio=c.kernel_time.ratio),
             "plan_time": dict(asdict(c.plan_time), ratio=c.plan_time.ratio)}
            for c in comparisons
        ],
    }
    (out_dir / "report.json").write_text(json.dumps(payload, indent=1, sort_keys=True))
    return ok
