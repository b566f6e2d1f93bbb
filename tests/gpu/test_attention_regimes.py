"""The FA3 production path against the references in every context regime and batch situation
(docs/regimes.md#batch-situations), for every kv_indices layout.

Each case: invariants and (b) == (a) before launch (a violation fails without launching),
then plan + convert + layout + run on NaN-filled outputs, a bitwise rerun, and the kernel
against the as-implemented reference (b) within the error budget. Kernel configurations
(kv dtype x rope x heads) follow a covering design (harness.cases.covering_config): every
regime meets each kernel variant, and the whole set meets every variant x heads pair.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from fast.flashinfer_compat import PAGE_COUNT_REFUSAL
from fast.layouts import LAYOUTS
from harness import build_attention_inputs, build_scenario
from harness.cases import (
    all_regime_cases,
    case_layout_index,
    covering_config,
    has_regime_c,
    large_batch_cases,
    situation_cases,
)
from harness.findings import REGIME_C_FINDING, RegimeCPlannedAsPrefix, regime_c_finding
from harness.launch import (
    DEVICE,
    assert_launchable,
    assert_within_budget,
    attention_config,
    compare_with_references,
    eager_step,
    failure_context,
    launch_inputs,
    nan_buffers,
    prepared,
    state_matches_step,
    strided_plan_refused,
    sync,
    untouched_rows,
)
from harness.pipeline import describe_rows
from reference import check_plan_invariants
from reference.rules import valid_counts, valid_first
from tests.gpu.notes import note_baseline, record_errors

pytestmark = pytest.mark.gpu

CASES = all_regime_cases() + situation_cases(1) + situation_cases(4)
def params(cases, offset: int = 0):
    out = []
    for i, case in enumerate(cases):
        c_rows = has_regime_c(case)
        for j, layout in enumerate(LAYOUTS):
            config = covering_config(case_layout_index(offset + i, j))
            marks = []
            if c_rows and layout != "compacted":
                marks.append(pytest.mark.xfail(reason=REGIME_C_FINDING.format(layout=layout),
                                               raises=RegimeCPlannedAsPrefix, strict=True))
            out.append(pytest.param(case, layout, config, id=f"{case.id}-{layout}-{config.id}", marks=marks))
    return out


def run_case(impl, features, request, regime_log, case, layout, config, seed: int, *, scenario=None, label=""):
    """The whole check of one case; returns (step, out, lse) or None when nothing ran."""
    spec = config.apply(case.spec)
    scenario = scenario or build_scenario(spec, seed)
    step = prepared(impl, scenario, layout)
    regime_log.record(step.regimes(), focus=case.focus or None)
    regime_log.blame(step.regimes(sorted({v.row for v in step.violations if v.row is not None and v.row < step.num_planned})))
    assert step.num_planned == scenario.planned_rows, (
        f"{step.num_planned} rows planned but q has {scenario.planned_rows}; {failure_context(step, features.version)}"
    )
    finding = regime_c_finding(step)
    if finding:
        regime_log.blame(["C"])
        raise RegimeCPlannedAsPrefix(f"{finding}\n(kernel not launched)")
    assert_launchable(step, features.version)

    inputs = build_attention_inputs(scenario, DEVICE)
    max_rows = step.max_rows
    state = impl.make_attention_state(attention_config(scenario, layout, max_rows), DEVICE)
    launch = launch_inputs(impl, scenario, inputs, max_rows)
    out, lse = nan_buffers(max_rows, spec.num_heads)
    if strided_plan_refused(features, step):
        with pytest.raises(ValueError, match=PAGE_COUNT_REFUSAL) as rejected:
            state.plan(step.num_planned, step.planned_lens)
        request.getfixturevalue("baseline").note(error=f"ValueError at plan: {rejected.value}"[:300])
        return None
    eager_step(state, launch, step, out, lse)
    sync()
    ctx = failure_context(step, features.version)
    problems = state_matches_step(state, step)
    assert not problems, f"the state hands the kernel something else than (b) describes; {ctx}\n" + "\n".join(problems)
    n = step.num_planned
    assert untouched_rows(out, n), f"the kernel wrote rows past the {n} planned rows; {ctx}"

    out2, lse2 = nan_buffers(max_rows, spec.num_heads)
    state.step(*launch.step_args(out2, lse2))
    sync()
    assert torch.equal(out[:n], out2[:n]) and torch.equal(lse[:n], lse2[:n]), f"rerun not bitwise equal; {ctx}"

    comparisons = compare_with_references(step, inputs, out, lse)
    record_errors(request.node, step, comparisons, label)
    note_baseline(request, state, launch, step, out, lse, comparisons)
    regime_log.blame(step.regimes(sorted({r for c in comparisons if not c.ok for r, _, _ in c.worst if r < n})))
    assert_within_budget(step, comparisons, features.version)
    return step, out, lse


@pytest.mark.parametrize(("case", "layout", "config"), params(CASES))
def test_kernel_matches_as_implemented_reference(impl, features, request, regime_log, case, layout, config):
    """Every regime and batch situation, every layout: kernel == (b) within budget, (b) == (a)."""
    run_case(impl, features, request, regime_log, case, layout, config, seed=11)


@pytest.mark.parametrize(("case", "layout", "config"), params(large_batch_cases(), offset=3))
def test_large_batches(impl, features, request, regime_log, case, layout, config):
    """About 66 and 132 rows, contexts up to 128k, slot ids >= 2**23."""
    run_case(impl, features, request, regime_log, case, layout, config, seed=12)


def test_mha_routing_plans_only_the_decode_prefix(impl, features, request, regime_log):
    """Prefills routed to dense MHA: only the decode rows are planned and written; planning
    every row instead (docs/findings.md#prefills-to-mha-still-planned) is caught before launch."""
    case = next(c for c in situation_cases(4) if c.name.startswith("decode+prefill-to-mha"))
    config = covering_config(0)
    result = run_case(impl, features, request, regime_log, case, "compacted", config, seed=13)
    step, out, _ = result
    scenario = step.scenario
    assert scenario.prefills_to_mha and step.num_planned == scenario.meta.num_decode_tokens < scenario.num_rows
    all_rows = impl.kv_lens(scenario.meta, topk=scenario.spec.topk, kpool=scenario.spec.kpool, async_scheduling=False)
    violations = check_plan_invariants(
        converted=step.slots, lens=all_rows, q_rows=scenario.planned_rows, num_slots=scenario.num_slots,
        max_tokens=step.max_rows, width=scenario.spec.resolved_width,
    )
    assert any(v.rule == "rows" for v in violations), f"planning prefill rows too was not caught; {step.context()}"


def test_async_optimistic_host_bound_is_caught(impl, features, request, regime_log):
    """Async spec decode: lens from positions run right; the optimistic host bound used as
    exact lengths (docs/findings.md#optimistic-async-bounds) violates the invariants, so it never launches."""
    case = next(c for c in situation_cases(4) if c.name.startswith("async-spec-decode"))
    step, _, _ = run_case(impl, features, request, regime_log, case, "compacted", covering_config(1), seed=14)
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
    assert not escaped, "rows with optimistic lengths escaped the len == valid invariant:\n" + describe_rows(step, escaped)


def permute_valid_entries(topk_indices: torch.Tensor, seed: int) -> torch.Tensor:
    """Each row's valid entries shuffled among the columns they occupy (-1 pattern kept)."""
    rng = np.random.default_rng(seed)
    rows = topk_indices.clone()
    for r in range(rows.shape[0]):
        cols = (rows[r] != -1).nonzero().flatten()
        rows[r, cols] = rows[r, cols[torch.from_numpy(rng.permutation(cols.numel()))]]
    return rows


@pytest.mark.parametrize("kpool", [1, 4])
def test_topk_order_permutation_within_budget(impl, features, request, regime_log, kpool):
    """The indexer's top-k order is unspecified: a permuted row attends the same set, so the
    kernel stays within the budget of the same truth."""
    case = next(c for c in situation_cases(kpool) if c.name.startswith("decode-mixed-lengths"))
    config = covering_config(6 + kpool)
    scenario = build_scenario(config.apply(case.spec), seed=15)
    run_case(impl, features, request, regime_log, case, "compacted", config, seed=15, scenario=scenario)
    permuted = dataclasses.replace(scenario, topk_indices=permute_valid_entries(scenario.topk_indices, seed=16))
    run_case(impl, features, request, regime_log, case, "compacted", config, seed=15, scenario=permuted, label="permuted")
