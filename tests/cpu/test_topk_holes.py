"""Holes in the top-k (docs/input-space.md#holes-in-the-top-k, docs/findings.md#top-k-holes-attended):
the indexer model that writes -1 inside a row's valid prefix from tied, infinite or NaN scores
(``reference.indexer``), the scenario transform that applies it (``harness.topk_holes``), the
finding's helpers (``harness.findings``), and the CPU twin of ``tests/gpu/test_topk_holes.py``:
the same cases at topk 128 through the port (planned only, on the reference stand-in), vLLM's SM90
backend on the fa3 stand-in and FlashMLA's on its stand-in kernels (``--vllm``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import backends.flashinfer.sm90_state as sm90
from backends.seam import StepOutcome
from harness.backend_step import executed_length_problems, selection_problems
from harness.builder import build_scenario
from harness.case_runner import run_case
from harness.cases import LONG_CTX, case_scenario, regime_contexts
from harness.findings import rows_past_valid, topk_hole_rows, topk_holes_finding
from harness.spec import batch
from harness.topk_holes import TopkHoles, with_topk_holes
from mla_constants import INVALID
from pytest_sparse_mla.backend import open_run_backend
from reference.indexer import HOLE_KINDS, row_with_holes, selection_order, tie_capacity, topk_with_holes
from reference.rules import kv_len_rule, valid_counts
from tests.support.reference_wrapper import ReferenceWrapper
from tests.topk_hole_cases import hole_params

TOPK_SMALL = 128

# --- the indexer model ---------------------------------------------------------------------------


def test_ties_at_the_threshold_leave_the_holes_sglang_30645_reports():
    """seq 8320, topk 2048: 100 winners and 8220 equal zeros give 924 invalid entries; the
    winners are all written, and the tied entries written are the first by id."""
    scores = torch.zeros(8320, dtype=torch.float64)
    winners = torch.arange(3000, 3100)
    scores[winners] = 1.0 + torch.arange(100, dtype=torch.float64)
    row = topk_with_holes(scores, 2048)
    assert row.numel() == 2048 and int((row == INVALID).sum()) == 924
    written = set(row[row >= 0].tolist())
    assert set(winners.tolist()) <= written
    assert written - set(winners.tolist()) == set(range(tie_capacity(2048)))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("n", [5, 40])
def test_a_non_finite_score_is_a_hole_where_it_is_selected(value, n):
    """NaN ranks first and +inf before any finite score, so either is selected and written -1 at
    any n; -inf ranks last, so it is selected, and a hole, only where every candidate is (n <= k)."""
    k = 16
    scores = torch.from_numpy(np.random.default_rng(1).standard_normal(n))
    scores[2] = value
    row = topk_with_holes(scores, k)
    selected = n <= k or value != float("-inf")
    assert row.numel() == min(n, k)
    assert int((row == INVALID).sum()) == int(selected)
    assert 2 not in row.tolist()
    assert row[row >= 0].tolist() == sorted(r for r in selection_order(scores)[: min(n, k)].tolist() if r != 2)


def test_distinct_finite_scores_select_the_top_k_without_holes():
    scores = torch.from_numpy(np.random.default_rng(2).standard_normal(300))
    row = topk_with_holes(scores, 64)
    assert row.tolist() == sorted(torch.topk(scores, 64).indices.tolist())


@pytest.mark.parametrize("kind", HOLE_KINDS)
@pytest.mark.parametrize("kpool", [1, 4])
def test_rows_with_holes_at_every_context_keep_the_rows_shape(kind, kpool):
    """At each regime context: distinct tokens of [0, ctx) in the top-k columns, a pool written
    whole or as kpool -1, the trailing incomplete pool at column topk, and holes inside the first
    min(ctx, topk) columns: the valid count falls short of the length rule by the holes. NaN and
    +inf leave a hole in every row with a complete pool; ties in every row past topk."""
    width = -(-(TOPK_SMALL + kpool - 1) // 128) * 128
    rng = np.random.default_rng(3)
    for ctx in regime_contexts(TOPK_SMALL, kpool):
        row = torch.from_numpy(row_with_holes(ctx, TOPK_SMALL, kpool, width, kind, 2, rng))
        complete, tail = divmod(ctx, kpool)
        head = row[: min(complete, TOPK_SMALL // kpool) * kpool]
        tokens = head[head >= 0]
        assert tokens.unique().numel() == tokens.numel() and bool((tokens < complete * kpool).all()), (ctx, row)
        assert bool((row[head.numel(): TOPK_SMALL] == INVALID).all()), ctx
        pools = head.view(-1, kpool)
        assert bool(((pools >= 0).all(1) | (pools < 0).all(1)).all()), ctx
        assert row[TOPK_SMALL: TOPK_SMALL + tail].tolist() == list(range(complete * kpool, ctx)), ctx
        holes = int(kv_len_rule(torch.tensor([ctx]), TOPK_SMALL, kpool)) - int((row >= 0).sum())
        assert holes == int((head < 0).sum()), ctx
        if complete and (kind != "ties" or ctx > TOPK_SMALL):
            assert holes > 0, (kind, ctx)


NAN = TopkHoles("nan")


def holed(spec, seed=5, holes=NAN):
    scenario = build_scenario(spec, seed)
    return scenario, with_topk_holes(scenario, holes)


def test_holes_rewrite_the_indexers_top_k_rows_only():
    """The identity fill and CUDA-graph padding rows stay as built; the top-k rows take holes,
    the same for the same seed and pattern, others for another."""
    spec = batch((40, 1), (LONG_CTX, 1), (TOPK_SMALL - 3, 8), topk=TOPK_SMALL, kpool=4, padded_rows=2,
                 decode_threshold=1)
    plain, scenario = holed(spec)
    n = scenario.num_rows
    assert torch.equal(scenario.topk_indices[n:], plain.topk_indices[n:])
    identity = scenario.row_identity
    assert bool(identity.any()) and torch.equal(scenario.topk_indices[:n][identity], plain.topk_indices[:n][identity])
    assert set(topk_hole_rows(scenario, n)) == set((~identity).nonzero().flatten().tolist())
    assert torch.equal(holed(spec)[1].topk_indices, scenario.topk_indices)
    assert not torch.equal(holed(spec, seed=6)[1].topk_indices, scenario.topk_indices)
    assert not torch.equal(holed(spec, holes=TopkHoles("inf"))[1].topk_indices, scenario.topk_indices)
    assert topk_hole_rows(plain, n) == []


# --- the finding's helpers -----------------------------------------------------------------------


def outcome_executing(scenario, lengths) -> StepOutcome:
    n = scenario.planned_rows
    return StepOutcome(backend="test", planned_rows=n, executed_lengths=torch.as_tensor(lengths, dtype=torch.int64),
                       planned_lengths=kv_len_rule(scenario.row_ctx[:n], scenario.spec.topk, scenario.spec.kpool))


def test_the_finding_is_exactly_the_rows_with_holes_reading_past_their_valid_count():
    spec = batch((3, 1), (TOPK_SMALL + 5, 1), (LONG_CTX, 1), topk=TOPK_SMALL, kpool=1)
    _, scenario = holed(spec)
    formula = kv_len_rule(scenario.row_ctx, TOPK_SMALL, 1)
    valid = valid_counts(scenario.intended_slots()[: scenario.num_rows]).to(torch.int64)
    holes = topk_hole_rows(scenario)
    assert holes == [0, 1, 2] and rows_past_valid(outcome_executing(scenario, formula), scenario) == holes

    at_formula = outcome_executing(scenario, formula)
    problems = executed_length_problems(at_formula, scenario)
    assert topk_holes_finding(at_formula, scenario, problems) is not None
    assert topk_holes_finding(at_formula, scenario, problems + ["the backend serves 2 rows"]) is None
    assert topk_holes_finding(at_formula, scenario, problems[1:]) is None  # a row past its count unnamed

    at_valid = outcome_executing(scenario, valid)
    assert executed_length_problems(at_valid, scenario) == [] and rows_past_valid(at_valid, scenario) == []
    assert topk_holes_finding(at_valid, scenario, []) is None

    _, short = holed(batch((3, 1), (4, 1), topk=TOPK_SMALL, kpool=1))  # the identity fill: no top-k
    assert topk_hole_rows(short) == [] and topk_holes_finding(outcome_executing(short, [3, 4]), short, []) is None


# --- the backends (the CPU twin of tests/gpu/test_topk_holes.py) ---------------------------------

SEED = 3


@pytest.fixture
def reference_wrapper(monkeypatch):
    monkeypatch.setattr(sm90, "MLAWrapper", ReferenceWrapper)
    monkeypatch.setattr(sm90, "WORKSPACE_BYTES", 1024)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


@pytest.mark.parametrize("case", hole_params(TOPK_SMALL))
def test_port_plans_the_length_rule_over_holes(reference_wrapper, case, device, judge, pytestconfig):
    """The port with the run's host stages (``--impl``)."""
    run_case(judge, open_run_backend(pytestconfig, "port-fa3"), case.spec, device, seed=SEED, holes=case.holes)


@pytest.mark.vllm
@pytest.mark.parametrize("case", hole_params(TOPK_SMALL))
def test_vllm_executes_the_length_rule_over_holes(vllm_on_stand_in, case, device, judge):
    run_case(judge, vllm_on_stand_in, case.spec, device, seed=SEED, holes=case.holes)


@pytest.mark.vllm
@pytest.mark.flashmla
@pytest.mark.parametrize("case", hole_params(TOPK_SMALL))
def test_flashmla_executes_each_rows_valid_count(flashmla_on_stand_in, case, device, judge):
    outcome = run_case(judge, flashmla_on_stand_in, case.spec, device, seed=SEED, holes=case.holes)
    scenario = case_scenario(case, SEED)
    assert topk_hole_rows(scenario) and selection_problems(outcome, scenario) == []
