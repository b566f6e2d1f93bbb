"""The judge's check behind vLLM 0.31.0's finding "slot 0 loaded past a row's length"
(docs/findings.md#vllm-slot-0-loaded-past-a-rows-length): rows that are NaN because FlashInfer's
fa3 kernel loads a non-finite slot 0 past their executed length, with weight 0, are the finding
only where the same plan, run again with slot 0 finite, is within the budget on every row.

The finding needs FlashInfer's own kernel (only it loads past a row's length); here a layer
stand-in plays the kernel: its output is the working-precision reference of the step, NaN on the
rows it loads slot 0 for where the cache's slot 0 is not finite, and off where a bug is planted.
The verdicts asserted are the judge's, as on the GPU.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from backends.seam import StepInput, StepOutcome
from harness.backend_step import intended_references
from harness.builder import build_scenario
from harness.case_runner import Reporter, run_sequence
from harness.device_inputs import build_attention_inputs
from harness.findings import for_backend
from harness.findings.vllm import SLOT_ZERO, SlotZeroLoaded
from harness.judge import judge_step
from harness.spec import batch
from mla_constants import FIRST_SLOT
from mla_constants import SLOT_ZERO as SLOT_ZERO_FILLER

#: A vLLM backend as the judge sees one (a vLLM family name and 0.31.0's facts: slot 0 packed past a
#: row's length); plans bf16, no finding of its own here.
BACKEND = SimpleNamespace(name="vllm-stand-in", design="exact", kernel=None, version="0.31.0",
                          plans_fp8_as_storage_dtype=False, minus_one_filler=SLOT_ZERO_FILLER,
                          describe=lambda: "vLLM stand-in on fa3's loads")


class LoadsSlotZero:
    """FlashInfer's fa3 kernel as vLLM 0.31.0 drives it, for the step of ``scenario``: the
    working-precision reference, each row of ``loads`` reading slot 0 past its length (NaN where
    slot 0 is not finite), each row of ``off`` scaled by 1.5 (a bug of the backend's own)."""

    on_flashinfer = True

    def __init__(self, scenario, loads: list[int], off: list[int] = ()):
        self.scenario, self.loads, self.off = scenario, loads, list(off)
        self.runs = 0

    def output(self, step: StepInput, rows: int) -> torch.Tensor:
        self.runs += 1
        outcome = StepOutcome(BACKEND.name, rows)
        _, (out, _) = intended_references(outcome, self.scenario, SimpleNamespace(
            q_nope=step.q_nope, q_pe=step.q_pe, ckv=step.kv_cache.reshape(-1, 1, step.kv_cache.shape[-1])[..., :512],
            kpe=step.kv_cache.reshape(-1, 1, step.kv_cache.shape[-1])[..., 512:]))
        out = out.clone()
        out[self.off] *= 1.5
        if not bool(torch.isfinite(step.kv_cache[0, 0].float()).all()):
            out[self.loads] = float("nan")
        return out

    def step(self, step: StepInput) -> StepOutcome:
        rows = self.scenario.planned_rows
        return StepOutcome(BACKEND.name, rows, out=self.output(step, rows))

    def forward_again(self, step: StepInput, outcome: StepOutcome) -> torch.Tensor:
        return self.output(step, outcome.planned_rows)

    def slots_loaded_past_length(self, outcome: StepOutcome) -> dict[int, list[int]]:
        return {row: [0] for row in self.loads}


class CannotRunAgain(LoadsSlotZero):
    forward_again = None


@pytest.fixture(scope="module")
def step():
    scenario = build_scenario(batch((5, 1), (3000, 1), (3001, 2), topk=2048, kpool=4, num_heads=16), 0)
    inputs = build_attention_inputs(scenario, "cpu")
    assert not bool(torch.isfinite(inputs.kv_cache[0, 0].float()).all()), "slot 0 holds NaN in these inputs"
    return scenario, inputs


def test_rows_nan_only_through_slot_zero_are_the_finding(step):
    scenario, inputs = step
    layer = LoadsSlotZero(scenario, loads=[1, 2])
    verdict = judge_step(BACKEND, layer, scenario, inputs)
    assert isinstance(verdict.failure, SlotZeroLoaded), verdict.failure
    assert SLOT_ZERO in verdict.expected
    assert "with slot 0 finite the same plan is within the budget" in str(verdict.failure)
    assert layer.runs == 2
    assert not bool(torch.isfinite(inputs.kv_cache[0, 0].float()).all()), "slot 0 is restored after the run again"


def test_a_bug_on_the_rows_that_load_slot_zero_is_not_absorbed(step):
    scenario, inputs = step
    verdict = judge_step(BACKEND, LoadsSlotZero(scenario, loads=[1, 2], off=[2]), scenario, inputs)
    assert type(verdict.failure) is AssertionError, verdict.failure
    assert SLOT_ZERO not in verdict.expected
    assert "with slot 0 finite the same plan is still off" in str(verdict.failure)


def test_a_bug_on_another_row_is_not_absorbed(step):
    scenario, inputs = step
    verdict = judge_step(BACKEND, LoadsSlotZero(scenario, loads=[1], off=[3]), scenario, inputs)
    assert type(verdict.failure) is AssertionError and SLOT_ZERO not in verdict.expected, verdict.failure
    assert "still off" in str(verdict.failure)


def test_predicted_loads_that_leave_the_output_right_pass(step):
    """The kernel's loads predicted, the output finite and right: no finding expected, so no
    strict xfail to pass unexpectedly."""
    scenario, inputs = step
    layer = LoadsSlotZero(scenario, loads=[])
    layer.slots_loaded_past_length = lambda outcome: {1: [0]}
    verdict = judge_step(BACKEND, layer, scenario, inputs)
    assert verdict.failure is None and verdict.expected == []


def test_a_layer_that_cannot_run_its_plan_again_fails_rather_than_claims_the_finding(step):
    scenario, inputs = step
    verdict = judge_step(BACKEND, CannotRunAgain(scenario, loads=[1]), scenario, inputs)
    assert type(verdict.failure) is AssertionError and SLOT_ZERO not in verdict.expected
    assert "cannot run its plan again" in str(verdict.failure)


def test_the_run_again_sees_the_step_inputs_with_slot_zero_finite(step):
    scenario, inputs = step
    seen = []
    layer = LoadsSlotZero(scenario, loads=[1])

    def forward_again(s, outcome):
        seen.append(s.kv_cache[0, 0].clone())
        return layer.output(s, outcome.planned_rows)

    layer.forward_again = forward_again
    judge_step(BACKEND, layer, scenario, inputs)
    assert len(seen) == 1 and bool((seen[0].float() == 0).all())


class StepsOfASequence(LoadsSlotZero):
    """The stand-in through the steps of a sequence: step ``i`` is ``scenarios[i]``, its rows
    ``loads[i]`` loading slot 0, ``off[i]`` off."""

    def __init__(self, scenarios, loads, off):
        super().__init__(scenarios[0], loads[0], off[0])
        self.scenarios, self.all_loads, self.all_off, self.index = scenarios, loads, off, -1

    def step(self, step: StepInput) -> StepOutcome:
        self.index += 1
        self.scenario = self.scenarios[self.index]
        self.loads, self.off = self.all_loads[self.index], self.all_off[self.index]
        return super().step(step)


def sequence_backend(loads, off):
    specs = [batch((5, 1), (3000, 1), (3001, 2), topk=2048, kpool=4, num_heads=16),
             batch((6, 1), (3001, 1), (3003, 2), topk=2048, kpool=4, num_heads=16)]
    scenarios = [build_scenario(spec, 0) for spec in specs]
    return SimpleNamespace(**vars(BACKEND), unsupported=lambda config: None,
                           open_layer=lambda config, device: StepsOfASequence(scenarios, loads, off)), specs


@pytest.mark.parametrize(("loads", "off", "raised"), [
    ([[1], []], [[], []], SlotZeroLoaded),            # the finding at step 0, step 1 right: the finding
    ([[1], []], [[], [2]], AssertionError),           # step 1 off behind the finding of step 0: its failure
    ([[1], [1]], [[], []], SlotZeroLoaded),           # the finding at both steps
], ids=["finding-then-right", "finding-then-a-bug", "finding-twice"])
def test_a_finding_of_an_early_step_does_not_hide_a_later_failure(loads, off, raised):
    backend, specs = sequence_backend(loads, off)
    with pytest.raises(AssertionError) as caught:
        run_sequence(Reporter(), backend, [(spec, 0) for spec in specs], "cpu")
    assert type(caught.value) is raised, caught.value
    if raised is AssertionError:
        assert "step 1 of the sequence's 2" in str(caught.value)


def bad_slot_rows(loaded: dict, nan_at: int | None, *, on_flashinfer=True, filler=SLOT_ZERO_FILLER) -> list[int]:
    """The rows vLLM's findings name as loading a non-finite slot 0, for a layer that loaded
    ``loaded`` (row -> slots past its executed length) from a cache of 3 blocks of 4 slots, 8
    values each, whose slot 0 holds a NaN at ``nan_at`` (none: finite)."""
    outcome = object()
    cache = torch.zeros(3, 4, 8)
    if nan_at is not None:
        cache[0, 0, nan_at] = float("nan")
    backend = SimpleNamespace(name="vllm-0.31.0", version="0.31.0", minus_one_filler=filler)
    layer = SimpleNamespace(on_flashinfer=on_flashinfer,
                            slots_loaded_past_length=lambda o: loaded if o is outcome else {})
    return for_backend(backend).rows_loading_a_bad_slot(backend, layer, outcome, SimpleNamespace(kv_cache=cache))


def test_the_rows_named_are_those_that_loaded_slot_0_where_it_is_not_finite():
    loaded = {0: (0,), 1: (5,), 2: (7, 0)}
    assert bad_slot_rows(loaded, nan_at=6) == [0, 2], "a NaN anywhere in slot 0's row (past the block size too)"
    assert bad_slot_rows(loaded, nan_at=None) == [], "slot 0 finite: loading it changes nothing"
    assert bad_slot_rows({1: (5,)}, nan_at=6) == [], "no row loaded slot 0"
    assert bad_slot_rows(loaded, nan_at=6, on_flashinfer=False) == [], "not FlashInfer's kernel"
    assert bad_slot_rows(loaded, nan_at=6, filler=FIRST_SLOT) == [], "a release that packs the first slot there"
