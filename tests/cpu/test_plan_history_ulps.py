"""The measurement behind the plan-history bound (``scripts/plan_history_ulps.py``), run on CPU:
its cases are seeded and in range, and each runs the target step after a kept plan and on a
fresh one through vLLM's bounded design (on the fa3 stand-in, which attends a row unsplit, so
the two outputs are bit for bit equal here; the GPU gives the numbers)."""

from __future__ import annotations

import pytest

from scripts.plan_history_ulps import MAX_REQUESTS, TOPK, drawn_case, measured, steps_of, summary_lines
from tests import fa3_stand_in
from tests.support.vllm_planting import stand_in_for


def test_a_case_is_the_same_on_every_draw_and_keeps_its_rows_below_topk():
    cases = [drawn_case(7, i) for i in range(200)]
    assert cases == [drawn_case(7, i) for i in range(200)]
    assert cases != [drawn_case(8, i) for i in range(200)]
    assert all(1 <= len(c["contexts"]) <= MAX_REQUESTS and 2 <= min(c["contexts"]) and max(c["contexts"]) < TOPK
               for c in cases)
    assert {c["heads"] for c in cases} == {16, 32, 64, 128} and {c["kv_dtype"] for c in cases} == {
        "bfloat16", "float8_e4m3fn"}
    history, fresh = steps_of(cases[0])
    assert history[1] == fresh[0] and [r.seq_len + 1 for r in history[0][0].requests] == cases[0]["contexts"]


@pytest.mark.vllm
def test_each_case_runs_after_a_kept_plan_and_on_a_fresh_one(vllm_backend, device, monkeypatch):
    if vllm_backend.design != "bounded":
        pytest.skip(f"vLLM {vllm_backend.version} plans every step afresh: no kept plan to measure")
    fa3_stand_in.install(monkeypatch, stand_in_for(vllm_backend))
    # bf16 cases: vLLM 0.31.0 plans fp8 as uint8, which the stand-in refuses as FlashInfer does (a finding)
    cases = [c for c in (drawn_case(0, i) for i in range(20)) if c["kv_dtype"] == "bfloat16"][:4]
    results = [measured(vllm_backend, case, device) for case in cases]
    assert [r["error"] for r in results] == [None] * 4
    assert all(r["plan_kept"] and not r["same_planned_lengths"] for r in results), results
    assert [r["max_ulps"] for r in results] == [0] * 4  # the stand-in attends each row in one softmax
    text = "\n".join(summary_lines(results))
    assert "### planned lengths differ (the bound applies): 4 cases, 4 on a kept plan" in text
    assert "| 0 | 4 | 0.00% |" in text, text
