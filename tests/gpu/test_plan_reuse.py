"""Plan reuse (``AttentionConfig(reuse_plan=True)``): a replan with the same rows and lens keeps
the last FlashInfer plan instead of planning again. Every step after a kept plan must equal,
bitwise, the same step of a state that planned (eagerly, and replayed from a CUDA graph
captured once), and the references within the budget; a replan with other lens plans again.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from backends.flashinfer.port import make_attention_state
from harness import batch, build_attention_inputs, build_scenario
from harness.cases import covering_config
from harness.port.launch import (
    DEVICE,
    StaticStep,
    assert_launchable,
    assert_within_budget,
    attention_config,
    compare_with_references,
    failure_context,
    prepared,
    state_matches_step,
    sync,
)
from mla_constants import TOPK
from pytest_sparse_mla.port_reports import record_errors

pytestmark = pytest.mark.gpu

#: Long-context decode rows (kpool 1, ctx > topk: every len is topk) under three seeds: the
#: same lens with other slots and q; between them a batch with other lens.
SAME_LENS = [(TOPK + 64 + 7 * i, 1) for i in range(6)]
OTHER_LENS = [(5, 1), (TOPK + 1, 1), (700, 1)]
SEQUENCE = [(SAME_LENS, 61), (SAME_LENS, 62), (OTHER_LENS, 63), (SAME_LENS, 64), (SAME_LENS, 65)]
KEPT = [False, True, False, False, True]


def scenarios_for(config):
    return [build_scenario(config.apply(batch(*requests, topk=TOPK, kpool=1)), seed) for requests, seed in SEQUENCE]


def run_planned(state, static, step, regime_log):
    """Plan and run one eager step of ``state`` on the static buffers; the output rows."""
    n = step.num_planned
    static.out.fill_(float("nan"))
    static.lse.fill_(float("nan"))
    state.plan(n, step.planned_lens)
    state.step(*static.args())
    sync()
    regime_log.kernel_ran()
    return static.out[:n].clone(), static.lse[:n].clone()


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize(("layout", "config_index"), [("packed", 0), ("compacted", 1)])
def test_kept_plan_equals_a_fresh_plan(impl, features, request, regime_log, mode, layout, config_index):
    config = covering_config(config_index)
    scenarios = scenarios_for(config)
    static = StaticStep(scenarios, impl)
    steps = [prepared(impl, s, layout, max_rows=static.max_rows) for s in scenarios]
    for step in steps:
        regime_log.record(step.regimes())
        assert_launchable(step, features.version)
    assert torch.equal(steps[0].planned_lens, steps[1].planned_lens), "test setup: the same lens twice"
    assert not torch.equal(steps[0].planned_lens[:3], steps[2].planned_lens), "test setup: other lens"
    base = attention_config(scenarios[0], layout, static.max_rows)
    kept = make_attention_state(impl, dataclasses.replace(base, reuse_plan=True), DEVICE)
    fresh = make_attention_state(impl, base, DEVICE)
    inputs = [build_attention_inputs(s, DEVICE) for s in scenarios]

    order = list(range(len(scenarios)))
    graph = None
    if mode == "graph":
        static.load(scenarios[0], inputs[0])
        kept.plan(steps[0].num_planned, steps[0].planned_lens)
        kept.step(*static.args())  # warm-up outside capture
        sync()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            kept.step(*static.args())
        sync()
        order = order[1:]

    for index in order:
        scenario, step = scenarios[index], steps[index]
        n = step.num_planned
        ctx = f"{mode} step {index}; {failure_context(step, features.version)}"
        static.load(scenario, inputs[index])
        reused_before = kept.reused_plans
        if graph is None:
            out, lse = run_planned(kept, static, step, regime_log)
        else:
            kept.plan(n, step.planned_lens)
            graph.replay()
            sync()
            regime_log.kernel_ran()
            out, lse = static.out[:n].clone(), static.lse[:n].clone()
        assert (kept.reused_plans > reused_before) == KEPT[index], (
            f"plan kept: {kept.reused_plans > reused_before}, expected {KEPT[index]}; {ctx}"
        )
        problems = state_matches_step(kept, step)
        assert not problems, f"buffers after a kept plan; {ctx}\n" + "\n".join(problems)
        expected_out, expected_lse = run_planned(fresh, static, step, regime_log)
        assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse), (
            f"a kept plan gives other results than a fresh plan; {ctx}"
        )
        comparisons = compare_with_references(step, inputs[index], out, lse, kept)
        record_errors(request.node, step, comparisons, label=f"plan-reuse-{mode}-{index}")
        assert_within_budget(step, comparisons, features.version, what=f"kept plan, step {index}, vs (b)")
    assert kept.reused_plans == sum(KEPT)
    assert fresh.reused_plans == 0
