"""The production input space (docs/input-space.md) on the GPU tier: a bounded, seeded draw of
combined cases (the strength-1 covering design: every value class of every dimension, in
combination; and the strength-2 design's cases with slot ids below 2^23, whose KV caches stay
small: most feasible pairs) run through the kernel of the implementation under test and compared with the
references; and a batch evolving over a few steps in one attention state (the real FlashInfer
wrapper and its reserved buffers, replanned every step, never rebuilt)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, settings

from backends.flashinfer.port import make_attention_state
from harness import build_attention_inputs
from harness.case_log import note_sequence_step
from harness.cases import case_scenario, input_space_cases
from harness.findings import topk_hole_rows
from harness.input_space import classify
from harness.pipeline import selection_mismatches
from harness.port.launch import (
    DEVICE,
    assert_launchable,
    assert_within_budget,
    attention_config,
    compare_with_references,
    launch_inputs,
    nan_buffers,
    plan_or_refusal,
    prepared,
    state_matches_step,
    sync,
)
from pytest_sparse_mla.coverage import record_input
from pytest_sparse_mla.port_reports import record_errors
from tests.support.evolving_batch import MAX_ROWS, SCRIPTED_TRANSITIONS, EvolvingBatch, run_scripted

pytestmark = pytest.mark.gpu

GPU_CASES = [pytest.param(c, lay, id=f"s1-{c.id}") for c, lay in input_space_cases(1, seed=20)] + [
    pytest.param(c, lay, id=f"s2-{c.id}") for c, lay in input_space_cases(2, seed=20) if "below-2^23" in c.id
]


def c_rows_planned(step) -> set[int]:
    return {r for r, g in enumerate(step.regimes()) if g == "C"}


def run_on_gpu(impl, features, scenario, layout, log, state=None, max_rows=None, node=None):
    """One step through the kernel: the known findings asserted as themselves (regime C under
    strided/packed and rows with top-k holes are not launched; a strided plan a
    page-count-checking FlashInfer refuses),
    otherwise launch and compare with the references. ``log`` (the ``regime_log`` fixture)
    hears of each launch and each expected refusal; ``node``'s report gets the measured error
    ratios (the run's table of them, fp8 NoPE included: only the drawn inputs reach it)."""
    max_rows = max(scenario.topk_indices.shape[0], 1) if max_rows is None else max_rows
    step = prepared(impl, scenario, layout, max_rows=max_rows)
    c_rows = c_rows_planned(step) if layout != "compacted" else set()
    holes = set(topk_hole_rows(scenario))
    if c_rows or holes:
        # docs/findings.md#regime-c-planned-as-a-prefix and #top-k-holes-attended: exactly those
        # rows planned wrong (a row with holes: -1 inside its planned span).
        assert set(selection_mismatches(step)) == c_rows | holes, step.context()
        return state
    assert_launchable(step, features.version)
    if state is None:
        state = make_attention_state(impl, attention_config(scenario, layout, max_rows), DEVICE)
    if plan_or_refusal(features, state, step, log) is not None:
        return state
    inputs = build_attention_inputs(scenario, DEVICE)
    launch = launch_inputs(impl, scenario, inputs, max_rows)
    out, lse = nan_buffers(max_rows, scenario.spec.num_heads)
    state.step(*launch.step_args(out, lse))
    sync()
    log.kernel_ran()
    problems = state_matches_step(state, step)
    assert not problems, f"{step.context()}: " + "; ".join(problems)
    comparisons = compare_with_references(step, inputs, out, lse, state)
    if node is not None:
        record_errors(node, step, comparisons, label="input space")
    assert_within_budget(step, comparisons, features.version)
    del inputs
    return state


@pytest.mark.parametrize(("case", "layout"), GPU_CASES)
def test_drawn_production_inputs_through_the_kernel(impl, features, regime_log, case, layout, request):
    """A combined case of the production input space: the kernel's output within the error
    budget of the references over the planned selection."""
    record_input(classify(case.spec, layout, case.holes))
    run_on_gpu(impl, features, case_scenario(case, seed=20), layout, regime_log, node=request.node)


class EvolvingBatchOnGPU(EvolvingBatch):
    """The CPU machine's batch, each step planned and run in one FlashInfer attention state
    sized once for MAX_ROWS rows (reused buffers, replans smaller after larger)."""

    SEQUENCE_KIND = "attention-state"

    def check_scenario(self, scenario):
        note_sequence_step(scenario)
        self.gpu_state = run_on_gpu(self.impl, self.features, scenario, self.layout, self.log,
                                    state=getattr(self, "gpu_state", None), max_rows=MAX_ROWS)


EvolvingBatchOnGPU.TestCase.settings = settings(max_examples=3, stateful_step_count=4,
                                                phases=(Phase.explicit, Phase.reuse, Phase.generate))


def test_evolving_batch_in_one_attention_state(impl, features, regime_log):
    """A few steps of an evolving batch in one attention state: each within the budget."""
    EvolvingBatchOnGPU.impl, EvolvingBatchOnGPU.features, EvolvingBatchOnGPU.device = impl, features, DEVICE
    EvolvingBatchOnGPU.log = regime_log
    EvolvingBatchOnGPU.TestCase().runTest()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("name", sorted(SCRIPTED_TRANSITIONS))
def test_each_scripted_transition_in_one_attention_state(impl, features, regime_log, name):
    """The scripted run of each transition a few drawn sequences may miss, in one attention
    state: it makes its transition, and each step is within the budget."""
    machine = EvolvingBatchOnGPU()
    machine.impl, machine.features, machine.device, machine.log = impl, features, DEVICE, regime_log
    assert name in run_scripted(machine, name)
    torch.cuda.empty_cache()
