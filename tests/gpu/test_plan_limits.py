"""The largest accepted plan (docs/edges.md#plan-limits), in the main job: for H 16 and 128,
the plan search up to twice the fa3 scheduler's work capacity (32768 rows), starting at the
capacity (16384 and 16385 settle a release that refuses plans past it; 32768 one that accepts
them; a bisection anything else), then every row of the plans just below and at the limit (and
the outcome just above it). Every attempt runs in a child process (the rows children start
while the plan search runs and wait for their sizes); ``python3 -m scripts.plan_limits`` is the
full study (from 1 row up to 1048575, the largest all-right plan searched too).

A release that accepts plans beyond the work capacity (measured here, by the search) is held
to the finding WorkCapacityExceeded, a strict xfail applied when the search finds it: the rows of those
plans must be wrong, or the run crash. A release that refuses them must give right rows at the
limit.
"""

from __future__ import annotations

import pytest

from harness.findings import WORK_CAPACITY_FINDING, WorkCapacityExceeded
from harness.plan_limits import (
    BAD_ROWS_OUTCOMES,
    DEFAULT_HEADS,
    PlanWorker,
    WarmRowsChildren,
    entry_finding,
    study_heads,
)
from mla_constants import FA3_WORK_CAPACITY

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_large, pytest.mark.edge("scale")]

TEST_BOUND = 2 * FA3_WORK_CAPACITY
ROWS_TIMEOUT_S = 120.0


def attempts_text(entry: dict) -> str:
    plans = entry["plan_search"]
    lines = ["plan attempts: " + ", ".join(f"{a['rows']} {a['outcome']}" for a in plans["attempts"])]
    lines += [f"N={c['rows']} ({c['kind']}): {c['outcome']} {c.get('detail', '')}" for c in entry["row_checks"]]
    return "\n".join(lines)


@pytest.mark.parametrize("heads", DEFAULT_HEADS)
def test_largest_accepted_plan_and_the_rows_around_it(features, request, record_property, heads):
    with PlanWorker() as worker, WarmRowsChildren(2) as rows:  # the rows children start during the search
        entry = study_heads(heads, bound=TEST_BOUND, plan_attempt_fn=worker.attempt, expected=FA3_WORK_CAPACITY,
                            rows_attempt_fn=lambda n, h: rows.attempt(n, h, timeout=ROWS_TIMEOUT_S), rows_workers=2)
    record_property("plan_limits", entry)
    finding = entry_finding(entry)
    context = f"flashinfer {features.version}, H {heads}: {finding}\n{attempts_text(entry)}"
    print(context)
    plans = entry["plan_search"]
    limit = plans["largest_ok"]
    assert plans["attempts"] and limit >= 1, f"plan() accepted no plan, not even of one row; {context}"
    if not plans["reached_bound"]:
        first = plans["first_failing"]
        assert first["rows"] == limit + 1 and first["outcome"] in ("refused", "crashed", "timeout"), context
    checks = [c for c in entry["row_checks"] if c["kind"] == "rows"]
    assert checks and any(c["outcome"] != "not-run" for c in checks), f"no rows check ran; {context}"
    if limit > FA3_WORK_CAPACITY:
        request.applymarker(pytest.mark.xfail(reason=WORK_CAPACITY_FINDING, raises=WorkCapacityExceeded, strict=True))
        if any(c["outcome"] in BAD_ROWS_OUTCOMES for c in checks):
            raise WorkCapacityExceeded(f"plans beyond {FA3_WORK_CAPACITY} work items accepted; {context}")
    wrong = [c for c in checks if c["outcome"] not in ("right", "not-run")]
    assert not wrong, f"rows of plans plan() accepted are not right; {context}"
