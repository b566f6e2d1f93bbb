"""The largest plan a FlashInfer release accepts, and whether the rows of plans at that size are
right (docs/edges.md#plan-limits). One module per job:

- :mod:`.scheduler`: the fa3 scheduler's work items and its capacity;
- :mod:`.search`: the plans searched and the grow-then-bisect search (pure);
- :mod:`harness.port.plan_limits_child`: what runs in a child process (plan attempts, a rows
  attempt, the environment), so a crash, an abort or a hang stays there and the search goes on;
  it drives the port's API, so it lives among the port's state studies (``harness/port/``);
- :mod:`.children`: the parent side (a plan worker, rows attempts, how a child died);
- :mod:`.study`: the whole study per head count; :mod:`.report`: its tables.

Every plan is the production shape at its simplest: N query rows, each its own request (page
size 1), each reading ``width`` slots (2048: a full top-k row), H heads, bf16 q and KV, rope 64,
through the compatibility layer's ``MLAWrapper`` with reserved buffers sized for N. A refusal is
an outcome; a plan that is accepted and then gives a wrong row without an error is a finding.
"""

from mla_constants import FA3_WORK_CAPACITY

from .children import (
    PLAN_TIMEOUT_S,
    REPO_ROOT,
    ROWS_TIMEOUT_S,
    PlanWorker,
    WarmRowsChildren,
    child_env,
    run_rows_attempt,
)
from .report import BAD_ROWS_OUTCOMES, entry_finding, report_markdown, write_report
from .scheduler import exceeds_work_capacity, fa3_work_items
from .search import INT32_ROWS_BOUND, PLAN_WIDTH, Attempt, Search, checked_sizes, search_largest, search_near
from .study import DEFAULT_HEADS, StudyUnavailable, environment_info, study, study_heads

__all__ = [
    "BAD_ROWS_OUTCOMES", "DEFAULT_HEADS", "FA3_WORK_CAPACITY", "INT32_ROWS_BOUND", "PLAN_TIMEOUT_S", "PLAN_WIDTH",
    "REPO_ROOT", "ROWS_TIMEOUT_S", "Attempt", "PlanWorker", "Search", "StudyUnavailable", "WarmRowsChildren",
    "checked_sizes", "child_env", "entry_finding", "environment_info", "exceeds_work_capacity", "fa3_work_items",
    "report_markdown", "run_rows_attempt", "search_largest", "search_near", "study", "study_heads", "write_report",
]
