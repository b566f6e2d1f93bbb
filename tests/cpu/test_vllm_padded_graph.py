"""vLLM's padded FULL graph step against a FlashInfer that checks the query shape at run
(docs/findings.md#vllm-padded-graph-rows-unplanned), on the CPU stand-in that makes 0.7.4's check:
vLLM's build() plans the step's query rows, its forward_mqa hands run() the padded token rows, and
the refusal is the finding's own exception, whose strict xfail the test carries (a release that
plans the padded rows, or any other error, fails it)."""

from __future__ import annotations

import pytest

from harness.builder import build_scenario
from harness.case_runner import run_case
from harness.cases import KernelConfig
from harness.findings.vllm import PaddedGraphRowsUnplanned, padded_graph_step
from harness.spec import batch, graph_padded
from mla_constants import TOPK
from pytest_sparse_mla.judge import flashinfer_checks_query_shape
from tests import fa3_stand_in

pytestmark = pytest.mark.vllm

BF16 = KernelConfig("bfloat16", True, 16)


def padded_decode_step():
    """Three decodes around topk in the FULL graph of 4 tokens: one padded row and request."""
    return graph_padded(BF16.apply(batch((TOPK - 1, 1), (TOPK + 6, 1), (300, 1), kpool=4)), 4)


def test_the_step_is_a_padded_full_graph_step():
    spec = padded_decode_step()
    scenario = build_scenario(spec, 3)
    assert padded_graph_step(spec) and not padded_graph_step(BF16.apply(batch((5, 1))))
    assert (scenario.num_rows, scenario.meta.num_actual_tokens, scenario.meta.num_reqs) == (3, 4, 4)


@pytest.mark.parametrize("checks", [False, True], ids=["0.7.2-style", "0.7.4-style"])
def test_the_stand_in_declares_whether_it_checks_the_query_shape(checks, monkeypatch):
    wrapper = fa3_stand_in.StandInQueryShapeWrapper if checks else fa3_stand_in.StandInWrapper
    fa3_stand_in.install(monkeypatch, wrapper)
    assert flashinfer_checks_query_shape() is checks


def test_padded_full_graph_step_on_a_flashinfer_that_checks_the_query_shape(vllm_backend, device, monkeypatch,
                                                                           judge):
    if vllm_backend.design != "bounded":
        pytest.skip(f"vLLM {vllm_backend.version} ({vllm_backend.design} design) plans the strided layout, which "
                    "every FlashInfer that checks the query shape (0.7.4) refuses at plan: the pairing cannot run")
    fa3_stand_in.install(monkeypatch, fa3_stand_in.StandInQueryShapeWrapper)
    try:
        run_case(judge, vllm_backend, padded_decode_step(), device, seed=3)
    except PaddedGraphRowsUnplanned as exc:
        assert "planned the 3 query rows" in str(exc) and "ran 4 rows" in str(exc), str(exc)
        raise
