"""MTP with shared top-k indices (docs/input-space.md#mtp-with-shared-top-k-indices,
docs/findings.md#mtp-shared-top-k-rows-executed-by-the-drafts-context): the scenario transform
(``harness.builder.with_shared_mtp_indices``), the finding's row helper, a case file that keeps
the draft step, and the CPU twin of ``tests/gpu/test_shared_mtp_rows.py``: the same cases at
topk 128 through the port (planned only, on the reference stand-in), vLLM's SM90 backend on the
fa3 stand-in and FlashMLA's on its stand-in kernels (``--vllm``)."""

from __future__ import annotations

import pytest
import torch

import backends.flashinfer.sm90_state as sm90
from backends.seam import StepOutcome
from harness.builder import build_scenario, with_shared_mtp_indices
from harness.case_runner import run_case, scenario_of_step
from harness.findings import rows_by_rule_and_off, valid_and_rule_counts
from harness.hashed_values import component_seed
from harness.indexer_fill import indexer_rows_fast
from harness.spec import batch
from pytest_sparse_mla.backend import open_run_backend
from tests.shared_mtp_cases import shared_mtp_params
from tests.support.reference_wrapper import ReferenceWrapper

TOPK_SMALL = 128
SEED = 3


def test_a_draft_step_hands_each_decode_the_row_step_0_kept_at_its_earlier_context():
    spec = batch((7, 1), (TOPK_SMALL + 2, 1), (300, 1), topk=TOPK_SMALL, kpool=4)
    built = build_scenario(spec, SEED)
    drafted = with_shared_mtp_indices(built, 2)
    assert torch.equal(drafted.row_ctx, built.row_ctx) and drafted.meta is built.meta
    kept = indexer_rows_fast(built.row_ctx - 2, torch.zeros(3, dtype=torch.bool), TOPK_SMALL, 4,
                             spec.resolved_width, component_seed(SEED, "mtp-step0-2"))
    assert torch.equal(drafted.topk_indices, kept)
    valid, rule = valid_and_rule_counts(drafted, 3)
    assert valid.tolist() == [5, TOPK_SMALL, TOPK_SMALL + 2] and rule.tolist() == [7, TOPK_SMALL + 2, TOPK_SMALL]
    assert drafted.extra["mtp_draft_step"] == 2 and scenario_of_step(spec, SEED, mtp_draft_step=2).topk_indices.equal(
        drafted.topk_indices)


@pytest.mark.parametrize(("step", "requests", "error"), [
    (4, [(7, 1)], "draft_step must be one of"),
    (2, [(2, 1)], "needs every decode's context past 2"),
    (1, [(40, 8)], "has no single-token decode"),
])
def test_a_draft_step_it_cannot_be_is_refused_naming_why(step, requests, error):
    with pytest.raises(ValueError, match=error):
        with_shared_mtp_indices(build_scenario(batch(*requests, topk=TOPK_SMALL, kpool=4, decode_threshold=8), 0),
                                step)


def test_rows_run_by_the_rule_are_told_from_rows_run_by_neither_count():
    """valid 5 / 128 / 130 against the rule's 7 / 130 / 128: a row that runs the rule's count is the
    finding's, one that runs a third length is no one's."""
    scenario = with_shared_mtp_indices(build_scenario(batch((7, 1), (TOPK_SMALL + 2, 1), (300, 1), topk=TOPK_SMALL,
                                                            kpool=4), SEED), 2)
    by = StepOutcome("b", 3, executed_lengths=torch.tensor([7, TOPK_SMALL + 2, TOPK_SMALL]))
    assert rows_by_rule_and_off(by, scenario) == ([0, 1, 2], [])
    mixed = StepOutcome("b", 3, executed_lengths=torch.tensor([5, TOPK_SMALL + 1, TOPK_SMALL]))
    assert rows_by_rule_and_off(mixed, scenario) == ([2], [1])


def test_a_case_file_keeps_the_draft_step_and_rebuilds_its_rows(tmp_path):
    from recording.backend_case import load_backend_case, write_backend_case
    from tests.support.backend_cases import port_case

    spec = batch((7, 1), (TOPK_SMALL + 2, 1), topk=TOPK_SMALL, kpool=4)
    case = {**port_case(None), "kind": "step", "mtp_draft_step": 3, "steps": [{"spec": spec, "seed": SEED,
                                                                             "holes": None}]}
    record = load_backend_case(write_backend_case(tmp_path, "drafted", case))
    assert record["mtp_draft_step"] == 3
    plain = {**case, "mtp_draft_step": 0}
    assert load_backend_case(write_backend_case(tmp_path, "plain", plain))["steps"][0]["scenario_digest"] != \
        record["steps"][0]["scenario_digest"]


@pytest.fixture
def reference_wrapper(monkeypatch):
    monkeypatch.setattr(sm90, "MLAWrapper", ReferenceWrapper)
    monkeypatch.setattr(sm90, "WORKSPACE_BYTES", 1024)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


@pytest.mark.parametrize(("case", "step"), shared_mtp_params(TOPK_SMALL))
def test_port_plans_the_rule_for_shared_rows(reference_wrapper, case, step, device, judge, pytestconfig):
    """The port with the run's host stages (``--impl``)."""
    run_case(judge, open_run_backend(pytestconfig, "port-fa3"), case.spec, device, seed=SEED, mtp_draft_step=step)


@pytest.mark.vllm
@pytest.mark.parametrize(("case", "step"), shared_mtp_params(TOPK_SMALL))
def test_vllm_executes_the_rule_for_shared_rows(vllm_on_stand_in, case, step, device, judge):
    run_case(judge, vllm_on_stand_in, case.spec, device, seed=SEED, mtp_draft_step=step)


@pytest.mark.vllm
@pytest.mark.flashmla
@pytest.mark.parametrize(("case", "step"), shared_mtp_params(TOPK_SMALL))
def test_flashmla_executes_each_shared_rows_valid_count(flashmla_on_stand_in, case, step, device, judge):
    run_case(judge, flashmla_on_stand_in, case.spec, device, seed=SEED, mtp_draft_step=step)
