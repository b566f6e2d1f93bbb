"""Upgrade validation: record what every GPU-tier case did on the installed FlashInfer, and
compare another version against such a record (the options, hooks and the timing pass are
``pytest_sparse_mla.baselines``). One module per job:

- :mod:`.records`: ``--record-baseline DIR`` writes, per case, a JSON record (outcome, error
  FlashInfer raised, its warnings, error-budget ratios, kernel and plan() times) and a
  safetensors file of the outputs; fixture replays re-run on the installed FlashInfer are
  recorded too (``CaseRecord.fixture`` names the file); and ``outcomes.json``, the outcome of
  every test the run ran with its error line. A baseline is checked file by file before any
  test runs.
- :mod:`.timing`: repeated medians and whether a time regressed.
- :mod:`.comparison`: each test of the baseline against the same test now: its outcome, and its
  record where it has one (what fails the check).
- :mod:`.summary`: one line per class of change, its status (FAIL / note / ok) as data.
- :mod:`.report`: ``report.md`` and ``report.json`` in ``--baseline-out``.
"""

from .comparison import (
    RECORDED_ONLY,
    CaseComparison,
    RunFacts,
    compare_case,
    compare_directories,
    drift,
    integer_difference,
    missing_case_status,
)
from .records import (
    OUTCOMES_FILE,
    SCHEMA,
    TIMING_DIR,
    BaselineError,
    CaseRecord,
    Outcome,
    RunCode,
    check_baseline,
    merge_timings,
    read_outcomes,
    read_outputs,
    read_records,
    read_run_code,
    safe_name,
    timed_cases,
    write_outcomes,
    write_record,
    write_timing,
)
from .report import write_report
from .summary import SummaryLine, compared_labels, passed, regression_lines, summary, summary_lines
from .timing import TIME_REPS, judge_time, repeated_medians, spread

__all__ = [
    "BaselineError", "CaseComparison", "CaseRecord", "OUTCOMES_FILE", "Outcome", "RECORDED_ONLY", "RunCode",
    "RunFacts", "SCHEMA", "SummaryLine", "TIME_REPS", "TIMING_DIR", "check_baseline", "compare_case",
    "compare_directories", "compared_labels", "drift", "integer_difference", "judge_time", "merge_timings",
    "missing_case_status", "passed", "read_outcomes", "read_outputs", "read_records", "read_run_code",
    "regression_lines", "repeated_medians", "safe_name", "spread", "summary", "summary_lines", "timed_cases",
    "write_outcomes", "write_record", "write_report", "write_timing",
]
