"""The FA3 production path against the references in every context regime and batch situation
(docs/regimes.md#batch-situations), for every kv_indices layout.

Each case runs through the one judge (``harness.case_runner.run_case``, the ``judge`` fixture) on the
port under that layout (``backends.flashinfer.port.PortBackend("fa3", impl, layout)``): invariants and (b) ==
(a) before launch (a violation fails without launching), then plan + convert + layout + run on
NaN-filled outputs, the state's buffers against the rehearsed layout, a bitwise rerun, and the
kernel against the oracle within the error budget. Where the installed FlashInfer refuses the plan
as it is expected to (strided rows shorter than W on a release that checks page counts), the case
ends at that refusal, counted as refused in the regime table, not as passed. Kernel configurations
(kv dtype x rope x heads) follow a covering design (harness.cases.covering_config): every
regime meets each kernel variant, and the whole set meets every variant x heads pair.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from backends.flashinfer.port import PortBackend
from fast.layouts import LAYOUTS
from harness import build_scenario
from harness.backend_step import laid_out_step
from harness.case_runner import run_case
from harness.cases import case_layout_index, covering_config, large_batch_cases, situation_cases
from harness.pipeline import describe_rows
from harness.port.launch import DEVICE
from reference import check_plan_invariants
from reference.rules import valid_counts, valid_first
from tests.regime_c import REGIME_CASES, regime_c_marks

pytestmark = pytest.mark.gpu


def params(cases, offset: int = 0):
    out = []
    for i, case in enumerate(cases):
        for j, layout in enumerate(LAYOUTS):
            config = covering_config(case_layout_index(offset + i, j))
            out.append(pytest.param(case, layout, config, id=f"{case.id}-{layout}-{config.id}",
                                    marks=regime_c_marks(case, layout)))
    return out


def judged(gpu, judge, case, layout, config, seed: int, *, scenario=None, label=""):
    """One case (its spec under ``config`` built with ``seed``, or ``scenario`` where the test
    changed it) through the judge on the port under ``layout``: the outcome, its ``refusal`` set
    where the installed FlashInfer refused the plan as expected."""
    backend = PortBackend("fa3", gpu.impl, layout)
    return run_case(judge, backend, config.apply(case.spec), DEVICE, seed=seed, scenario=scenario, label=label)


@pytest.mark.parametrize(("case", "layout", "config"), params(REGIME_CASES))
def test_kernel_matches_as_implemented_reference(gpu, judge, case, layout, config):
    """Every regime and batch situation, every layout: (b) == (a) before launch, kernel == the
    oracle within budget."""
    judged(gpu, judge, case, layout, config, seed=11)


@pytest.mark.gpu_large
@pytest.mark.parametrize(("case", "layout", "config"), params(large_batch_cases(), offset=3))
def test_large_batches(gpu, judge, case, layout, config):
    """About 66 and 132 rows, contexts up to 128k, slot ids >= 2**23."""
    judged(gpu, judge, case, layout, config, seed=12)


def test_mha_routing_plans_only_the_decode_prefix(gpu, judge):
    """Prefills routed to dense MHA: only the decode rows are planned and written; planning
    every row instead (docs/findings.md#prefills-to-mha-still-planned) is caught before launch."""
    impl = gpu.impl
    case = next(c for c in situation_cases(4) if c.name.startswith("decode+prefill-to-mha"))
    config = covering_config(0)
    outcome = judged(gpu, judge, case, "compacted", config, seed=13)
    scenario = build_scenario(config.apply(case.spec), seed=13)
    step = laid_out_step(scenario, outcome)
    assert scenario.prefills_to_mha and step.num_planned == scenario.meta.num_decode_tokens < scenario.num_rows
    all_rows = impl.kv_lens(scenario.meta, topk=scenario.spec.topk, kpool=scenario.spec.kpool, async_scheduling=False)
    violations = check_plan_invariants(
        converted=step.slots, lens=all_rows, q_rows=scenario.planned_rows, num_slots=scenario.num_slots,
        max_tokens=step.max_rows, width=scenario.spec.resolved_width,
    )
    assert any(v.rule == "rows" for v in violations), f"planning prefill rows too was not caught; {step.context()}"


def test_async_optimistic_host_bound_is_caught(gpu, judge):
    """Async spec decode: lens from positions run right; the optimistic host bound used as
    exact lengths (docs/findings.md#optimistic-async-bounds) violates the invariants, so it never launches."""
    impl = gpu.impl
    case = next(c for c in situation_cases(4) if c.name.startswith("async-spec-decode"))
    config = covering_config(1)
    outcome = judged(gpu, judge, case, "compacted", config, seed=14)
    scenario = build_scenario(config.apply(case.spec), seed=14)
    step = laid_out_step(scenario, outcome)
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
def test_topk_order_permutation_within_budget(gpu, judge, kpool):
    """The indexer's top-k order is unspecified: a permuted row attends the same set, so the
    kernel stays within the budget of the same truth."""
    case = next(c for c in situation_cases(kpool) if c.name.startswith("decode-mixed-lengths"))
    config = covering_config(6 + kpool)
    scenario = build_scenario(config.apply(case.spec), seed=15)
    judged(gpu, judge, case, "compacted", config, seed=15)
    permuted = dataclasses.replace(scenario, topk_indices=permute_valid_entries(scenario.topk_indices, seed=16))
    judged(gpu, judge, case, "compacted", config, seed=15, scenario=permuted, label="permuted")
