"""The upgrade check's records: one JSON record and one safetensors file of outputs per case,
the outcome of every test the run ran (``outcomes.json``, the tests that record nothing
included), the timing pass's medians beside them, and the start-up check of a baseline folder."""

from __future__ import annotations

import hashlib
import json
import math
import re
import statistics
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from .. import checks
from ..fixture import is_case_file

SCHEMA = 3
TIMING_DIR = "timing"  # inside a records folder: the timing pass's per-case times and logs
OUTCOMES_FILE = "outcomes.json"  # inside a records folder: every test's outcome and its line
RERECORD = "record it again with --record-baseline on the old FlashInfer"
NAME_LIMIT = 180


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
    outcome_line: str | None = None  # Outcome.line: why the test did not pass

    @property
    def kernel_us(self) -> float | None:
        return statistics.median(self.kernel_us_repeats) if self.kernel_us_repeats else None

    @property
    def plan_us(self) -> float | None:
        return statistics.median(self.plan_us_repeats) if self.plan_us_repeats else None


@dataclass(frozen=True)
class Outcome:
    """How one test ended: pytest's outcome (``error``: its setup or teardown failed;
    ``xpassed``: a test expected to fail passed, strict or not) and the line that says why it did
    not pass: the error line of a failure, an error or an xpass, the exception of a known finding
    (xfailed), the reason of a skip; "" for a pass."""

    outcome: str
    line: str = ""

    @property
    def text(self) -> str:
        """``outcome: line``, or the outcome alone."""
        return f"{self.outcome}: {self.line}" if self.line else self.outcome


class BaselineError(ValueError):
    """A baseline folder that cannot be compared against; the message names the path."""


#: The outcomes a record holds (pytest's, and xfailed / xpassed / error).
OUTCOMES = ("passed", "failed", "skipped", "xfailed", "xpassed", "error")
#: Timing medians and output tensors one record may hold; tests one outcomes file may hold.
MAX_REPEATS = 1000
MAX_OUTPUTS = 256
MAX_TESTS = 1 << 20


def _optional_text(value) -> str | None:
    return None if value is None or isinstance(value, str) else "expected null or a string"


def _ratio(value) -> bool:
    return (checks.is_int(value) or isinstance(value, float)) and not math.isnan(value) and value >= 0


def _ratios(value) -> str | None:
    ok = isinstance(value, dict) and all(isinstance(k, str) and _ratio(v) for k, v in value.items())
    return None if ok else "expected an object of error-budget ratios, numbers >= 0 (inf where the yardstick has " \
                           "no error)"


def _medians(value) -> str | None:
    ok = isinstance(value, list) and len(value) <= MAX_REPEATS and all(
        checks.is_number(v) and v > 0 for v in value)
    return None if ok else f"expected a list of at most {MAX_REPEATS} finite times > 0 (us)"


#: Each field of a record with its check.
RECORD_FIELDS = {
    "case": lambda v: None if isinstance(v, str) and v else "expected a test id",
    "outcome": checks.one_of(*OUTCOMES), "flashinfer": _optional_text, "error": _optional_text,
    "warnings": checks.list_of(checks.text, "strings", most=10_000), "ratios": _ratios,
    "kernel_us_repeats": _medians, "plan_us_repeats": _medians, "fixture": _optional_text,
    "outcome_line": _optional_text,
}
#: Each field of a timing file (the timing pass's medians of one case) with its check.
TIMING_FIELDS = {"case": RECORD_FIELDS["case"], "kernel_us_repeats": _medians, "plan_us_repeats": _medians}


def safe_name(case: str) -> str:
    """The file name of a case's record: its test id (after the file) with other characters
    than letters, digits, ``_.-`` replaced; a longer one (a fixture under a deep absolute path)
    is cut and ends with a hash of the whole id, so two long ids never share a file."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", case.split("::", 1)[-1])
    if len(name) <= NAME_LIMIT:
        return name
    return name[: NAME_LIMIT - 17] + "-" + hashlib.sha256(case.encode()).hexdigest()[:16]


def record_json(record: CaseRecord) -> str:
    return json.dumps(dict(asdict(record), schema=SCHEMA), indent=1, sort_keys=True)


def write_record(directory: Path, record: CaseRecord, outputs: dict[str, torch.Tensor] | None) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    name = safe_name(record.case)
    (directory / f"{name}.json").write_text(record_json(record))
    if outputs:
        save_file({k: v.detach().contiguous().cpu() for k, v in outputs.items()},
                  str(directory / f"{name}.safetensors"))


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
    for name, value in data.items():
        problem = checks.field_problem(name, value, RECORD_FIELDS[name], "record")
        if problem:
            raise BaselineError(f"{path}: {problem}; {RERECORD}")
    return CaseRecord(**data)


def read_records(directory: Path) -> dict[str, CaseRecord]:
    paths = sorted(p for p in Path(directory).glob("*.json") if p.name != OUTCOMES_FILE)
    return {r.case: r for r in map(read_record, paths)}


@dataclass(frozen=True)
class RunCode:
    """What a recorded run judged besides the suite, each None where the run had none: the
    FlashInfer version, the vLLM under test (its release, the sha256 of its SM90 module, the
    files that differ from the release's) and what stood in for the SM90 machine or the GPU it
    ran on."""

    flashinfer: str | None = None
    vllm: str | None = None
    machine: str | None = None

    def named(self) -> list[tuple[str, str | None]]:
        return [("FlashInfer", self.flashinfer), ("vLLM", self.vllm), ("machine", self.machine)]


def write_outcomes(directory: Path, outcomes: dict[str, Outcome], flashinfer: str | None, *, vllm: str | None = None,
                   machine: str | None = None) -> None:
    """Every test's outcome in ``directory/outcomes.json``, with the FlashInfer version of the
    run, the vLLM it judged and its machine (:class:`RunCode`)."""
    directory.mkdir(parents=True, exist_ok=True)
    tests = {case: {"outcome": o.outcome, "line": o.line} for case, o in sorted(outcomes.items())}
    payload = {"schema": SCHEMA, "flashinfer": flashinfer, "vllm": vllm, "machine": machine, "tests": tests}
    (directory / OUTCOMES_FILE).write_text(json.dumps(payload, indent=1, sort_keys=True))


#: Each field of an outcomes file, and of each test in it, with its check.
OUTCOMES_FIELDS = {"schema": checks.one_of(SCHEMA), "flashinfer": _optional_text,
                   "tests": lambda v: None if isinstance(v, dict) and len(v) <= MAX_TESTS else
                   f"expected an object of at most {MAX_TESTS} test ids"}
#: Fields an outcomes file may leave out (written by a run that judged no vLLM, or before they were).
OPTIONAL_OUTCOMES_FIELDS = {"vllm": _optional_text, "machine": _optional_text}
TEST_OUTCOME_FIELDS = {"outcome": RECORD_FIELDS["outcome"], "line": checks.text}


def outcomes_file_problem(data) -> str | None:
    """What is wrong with an outcomes file's JSON, naming the field (and the test); None when good."""
    if not isinstance(data, dict):
        return f"not an outcomes file (a JSON {type(data).__name__})"
    if data.get("schema") != SCHEMA and "schema" in data:
        return f"schema {data['schema']!r}, this tool reads schema {SCHEMA}"
    problem = checks.fields_problem(data, OUTCOMES_FIELDS, OPTIONAL_OUTCOMES_FIELDS, "outcomes")
    if problem:
        return problem
    for case, entry in data["tests"].items():
        if not isinstance(entry, dict):
            return f"outcomes field 'tests' holds {checks.shown(entry)} for {case}, expected an object"
        problem = checks.fields_problem(entry, TEST_OUTCOME_FIELDS, {}, "outcomes", prefix=f"tests[{case}].")
        if problem:
            return problem
    return None


def outcomes_data(directory: Path) -> dict:
    """A records folder's outcomes file, checked ({} where it has none); BaselineError naming the
    file and the field when it cannot be read."""
    path = Path(directory) / OUTCOMES_FILE
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BaselineError(f"{path}: not a readable JSON outcomes file ({e}); {RERECORD}") from None
    problem = outcomes_file_problem(data)
    if problem:
        raise BaselineError(f"{path}: {problem}; {RERECORD}")
    return data


def read_outcomes(directory: Path) -> tuple[str | None, dict[str, Outcome]]:
    """The FlashInfer version and every test's outcome of a records folder ((None, {}) where it
    has no outcomes file)."""
    data = outcomes_data(directory)
    return data.get("flashinfer"), {case: Outcome(**entry) for case, entry in data.get("tests", {}).items()}


def read_run_code(directory: Path) -> RunCode:
    """What the run that wrote a records folder judged (:class:`RunCode`): the FlashInfer
    versions of its records and of its outcomes file (joined where they differ), the vLLM and
    the machine its outcomes file names."""
    data = outcomes_data(directory)
    versions = {r.flashinfer for r in read_records(directory).values()} | {data.get("flashinfer")}
    return RunCode(",".join(sorted(versions - {None})) or None, data.get("vllm"), data.get("machine"))


def outputs_problem(path: Path) -> str:
    """Why a record's outputs file cannot be read back ("" when it can): its header, tensor
    names, dtypes and shapes are read and its size checked against them, without loading the
    tensors."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
            for key in keys:
                f.get_slice(key).get_shape()
    except Exception as e:  # safetensors raises its own error types, and OSError
        return f"{path}: not a readable safetensors file of outputs ({type(e).__name__}: {e})"
    if len(keys) > MAX_OUTPUTS:
        return f"{path}: {len(keys)} output tensors, expected at most {MAX_OUTPUTS}"
    return ""


def check_baseline(directory: Path) -> dict[str, CaseRecord]:
    """The records of a baseline folder, every file of it checked (the records, their outputs,
    the outcomes file); BaselineError naming the folder or the first file that is wrong with it."""
    directory = Path(directory)
    if not directory.exists():
        raise BaselineError(f"baseline {directory} does not exist; {RERECORD}")
    if is_case_file(directory):
        raise BaselineError(f"baseline {directory} is a written case (a file --dump-failures writes), not a baseline: "
                            f"run it with --replay={directory}; --compare-baseline takes the folder "
                            "--record-baseline wrote")
    if not directory.is_dir():
        raise BaselineError(f"baseline {directory} is not a folder; {RERECORD}")
    records = read_records(directory)
    if not records:
        raise BaselineError(f"baseline {directory} holds no case records (*.json); {RERECORD}")
    for path in sorted(directory.glob("*.safetensors")):
        if not path.with_suffix(".json").exists():
            raise BaselineError(f"{path}: outputs with no record beside them ({path.stem}.json); {RERECORD}")
        problem = outputs_problem(path)
        if problem:
            raise BaselineError(f"{problem}; {RERECORD}")
    if not (directory / OUTCOMES_FILE).exists():
        raise BaselineError(f"baseline {directory} holds no {OUTCOMES_FILE} (the outcome of every test the run ran); "
                            f"{RERECORD}")
    read_outcomes(directory)
    return records


def read_outputs(directory: Path, case: str) -> dict[str, torch.Tensor]:
    """A case's recorded outputs ({} when it has none); BaselineError naming an unreadable file."""
    from safetensors.torch import load_file

    path = Path(directory) / f"{safe_name(case)}.safetensors"
    if not path.exists():
        return {}
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error types, and OSError
        raise BaselineError(f"{path}: not a readable safetensors file of outputs ({type(e).__name__}: {e})") from None


def write_timing(directory: Path, case: str, kernel_us_repeats: list[float], plan_us_repeats: list[float]) -> None:
    """The timing pass's medians of one case, kept beside the records until merged."""
    directory.mkdir(parents=True, exist_ok=True)
    payload = {"case": case, "kernel_us_repeats": kernel_us_repeats, "plan_us_repeats": plan_us_repeats}
    (directory / f"{safe_name(case)}.json").write_text(json.dumps(payload, indent=1))


def read_timing(path: Path) -> dict:
    """One timing file, every field checked; BaselineError naming the file and the field."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BaselineError(f"{path}: not a readable JSON timing file ({e})") from None
    if not isinstance(data, dict):
        raise BaselineError(f"{path}: not a timing file (a JSON {type(data).__name__})")
    problem = checks.fields_problem(data, {"case": TIMING_FIELDS["case"]},
                                    {k: v for k, v in TIMING_FIELDS.items() if k != "case"}, "timing")
    if problem:
        raise BaselineError(f"{path}: {problem}")
    return data


def merge_timings(records_dir: Path, timing_dir: Path) -> int:
    """Write the timing pass's medians into the matching records; the number of records timed."""
    timed = 0
    for path in sorted(Path(timing_dir).glob("*.json")):
        times = read_timing(path)
        record_path = Path(records_dir) / path.name
        if not record_path.exists():
            continue
        record = read_record(record_path)
        record.kernel_us_repeats = times.get("kernel_us_repeats") or []
        record.plan_us_repeats = times.get("plan_us_repeats") or []
        record_path.write_text(record_json(record))
        timed += 1
    return timed


def timed_cases(records: dict[str, CaseRecord]) -> list[str]:
    """The cases the timing pass re-runs: GPU-tier cases that ran to a launch (not skipped, no
    refusal); fixture re-runs are compared, never timed."""
    return sorted(case for case, r in records.items() if r.outcome != "skipped" and not r.error and not r.fixture)
