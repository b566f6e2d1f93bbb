"""The FA3 production path against the references in every context regime and batch situation
(docs/regimes.md#batch-situations), for every kv_indices layout.

Each case: invariants and (b) == (a) before launch (a violation fails without launching),
then plan + convert + layout + run on NaN-filled outputs, a bitwise rerun, and the kernel
against the as-implemented reference (b) within the error budget. Where the installed FlashInfer
refuses the plan as it is expected to (strided rows shorter than W on a release that checks page
counts), the case ends at that refusal, counted as refused in the regime table, not as passed. Kernel configurations
(kv dtype x rope x heads) follow a covering design (harness.cases.covering_config): every
regime meets each kernel variant, and the whole set meets every variant x heads pair.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from fast.layouts import LAYOUTS
from harness import build_scenario
from harness.cases import case_layout_index, covering_config, large_batch_cases, situation_cases
from harness.launch import (
    Launched,
    assert_within_budget,
    check_launched,
    compare_with_references,
    failure_context,
    launch_step,
    prepared,
)
from harness.pipeline import describe_rows
from pytest_sparse_mla.port_reports import note_baseline, record_errors
from reference import check_plan_invariants
from reference.rules import valid_counts, valid_first
from tests.regime_c import REGIME_CASES, raise_regime_c_finding, regime_c_marks

pytestmark = pytest.mark.gpu


def params(cases, offset: int = 0):
    out = []
    for i, case in enumerate(cases):
        for j, layout in enumerate(LAYOUTS):
            config = covering_config(case_layout_index(offset + i, j))
            out.append(pytest.param(case, layout, config, id=f"{case.id}-{layout}-{config.id}",
                                    marks=regime_c_marks(case, layout)))
    return out


def run_case(gpu, case, layout, config, seed: int, *, scenario=None, label="") -> Launched:
    """The whole check of one case on the GPU test's ``gpu`` (impl, features, request,
    regime_log): what was launched, or the plan the installed FlashInfer refused as expected."""
    impl, features, regime_log = gpu.impl, gpu.features, gpu.regime_log
    scenario = scenario or build_scenario(config.apply(case.spec), seed)
    step = prepared(impl, scenario, layout)
    regime_log.record(step.regimes(), focus=case.focus or None)
    regime_log.blame(
        step.regimes(sorted({v.row for v in step.violations if v.row is not None and v.row < step.num_planned}))
    )
    assert step.num_planned == scenario.planned_rows, (
        f"{step.num_planned} rows planned but q has {scenario.planned_rows}; {failure_context(step, features.version)}"
    )
    raise_regime_c_finding(step, regime_log, "\n(kernel not launched)")

    launched = launch_step(impl, features, step, log=regime_log)
    if not launched.ran:
        note_baseline(gpu.request, launched)
        return launched
    check_launched(launched)
    n, out, lse = launched.rows, launched.out, launched.lse
    out2, lse2 = launched.rerun()
    assert torch.equal(out[:n], out2[:n]) and torch.equal(lse[:n], lse2[:n]), (
        f"rerun not bitwise equal; {launched.context()}")

    comparisons = compare_with_references(step, launched.inputs, out, lse, launched.state)
    record_errors(gpu.request.node, step, comparisons, label)
    note_baseline(gpu.request, launched, comparisons)
    regime_log.blame(step.regimes(sorted({r for c in comparisons if not c.ok for r, _, _ in c.worst if r < n})))
    assert_within_budget(step, comparisons, features.version)
    return launched


@pytest.mark.parametrize(("case", "layout", "config"), params(REGIME_CASES))
def test_kernel_matches_as_implemented_reference(gpu, case, layout, config):
    """Every regime and batch situation, every layout: kernel == (b) within budget, (b) == (a)."""
    run_case(gpu, case, layout, config, seed=11)


@pytest.mark.parametrize(("case", "layout", "config"), params(large_batch_cases(), offset=3))
def test_large_batches(gpu, case, layout, config):
    """About 66 and 132 rows, contexts up to 128k, slot ids >= 2**23."""
    run_case(gpu, case, layout, config, seed=12)


def test_mha_routing_plans_only_the_decode_prefix(gpu):
    """Prefills routed to dense MHA: only the decode rows are planned and written; planning
    every row instead (docs/findings.md#prefills-to-mha-still-planned) is caught before launch."""
    impl = gpu.impl
    case = next(c for c in situation_cases(4) if c.name.startswith("decode+prefill-to-mha"))
    step = run_case(gpu, case, "compacted", covering_config(0), seed=13).step
    scenario = step.scenario
    assert scenario.prefills_to_mha and step.num_planned == scenario.meta.num_decode_tokens < scenario.num_rows
    all_rows = impl.kv_lens(scenario.meta, topk=scenario.spec.topk, kpool=scenario.spec.kpool, async_scheduling=False)
    violations = check_plan_invariants(
        converted=step.slots, lens=all_rows, q_rows=scenario.planned_rows, num_slots=scenario.num_slots,
        max_tokens=step.max_rows, width=scenario.spec.resolved_width,
    )
    assert any(v.rule == "rows" for v in violations), f"planning prefill rows too was not caught; {step.context()}"


def test_async_optimistic_host_bound_is_caught(gpu):
    """Async spec decode: lens from positions run right; the optimistic host bound used as
    exact lengths (docs/findings.md#optimistic-async-bounds) violates the invariants, so it never launches."""
    impl = gpu.impl
    case = next(c for c in situation_cases(4) if c.name.startswith("async-spec-decode"))
    step = run_case(gpu, case, "compacted", covering_config(1), seed=14).step
    scenario = step.scenario
    optimistic = impl.kv_lens(scenario.meta, topk=scenario.spec.topk, kpool=scenario.spec.kpool, async_scheduling=False)
    assert not torch.equal(optimistic, step.planned_lens), "the host bound was not optimistic in this scenario"
    violations = check_plan_invariants(
        converted=valid_first(scenario.intended_slots()), lens=optimistic, q_rows=scenario.planned_rows,
        num_slots=scenario.num_slots, max_tokens=step.max_rows, width=scenario.spec.resolved_width,
    )
    assert any(v.rule == "len==valid" for v in violations), (
        f"optimistic host bounds used as exact lengths were not caught; {step.context()}"
    )
    counts = valid_counts(scenario.intended_slots())[: scenario.planned_rows]
    wrong = (optimistic != step.planned_lens).nonzero().flatten().tolist()
    escaped = [r for r in wrong if int(optimistic[r]) == int(counts[r])]
    assert not escaped, "rows with optimistic lengths escaped the len == valid invariant:\n" + describe_rows(
        step, escaped
    )


def permute_valid_entries(topk_indices: torch.Tensor, seed: int) -> torch.Tensor:
    """Each row's valid entries shuffled among the columns they occupy (-1 pattern kept)."""
    rng = np.random.default_rng(seed)
    rows = topk_indices.clone()
    for r in range(rows.shape[0]):
        cols = (rows[r] != -1).nonzero().flatten()
        rows[r, cols] = rows[r, cols[torch.from_numpy(rng.permutation(cols.numel()))]]
    return rows


@pytest.mark.parametrize("kpool", [1, 4])
def test_topk_order_permutation_within_budget(gpu, kpool):
    """The indexer's top-k order is unspecified: a permuted row attends the same set, so the
    kernel stays within the budget of the same truth."""
    case = next(c for c in situation_cases(kpool) if c.name.startswith("decode-mixed-lengths"))
    config = covering_config(6 + kpool)
    scenario = build_scenario(config.apply(case.spec), seed=15)
    run_case(gpu, case, "compacted", config, seed=15, scenario=scenario)
    permuted = dataclasses.replace(scenario, topk_indices=permute_valid_entries(scenario.topk_indices, seed=16))
    run_case(gpu, case, "compacted", config, seed=15, scenario=permuted, label="permuted")
