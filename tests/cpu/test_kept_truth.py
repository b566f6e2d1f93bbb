"""The float64 truth a case judged on several backends computes once (``harness.backend_step``):
served to the next backend judged on the same inputs object and selection, and recomputed where
anything it was computed from changed."""

from __future__ import annotations

import gc

import pytest
import torch

import harness.backend_step as backend_step
from backends.seam import StepOutcome
from harness.backend_step import intended_references
from harness.builder import build_scenario
from harness.device_inputs import build_attention_inputs
from harness.spec import batch


@pytest.fixture
def float64_calls(monkeypatch):
    """The float64 oracle calls made (the lowp yardstick's are not counted), on a fresh kept truth."""
    calls = []
    real = backend_step.sparse_mla_reference

    def counted(*args, mode="float64", **kwargs):
        if mode == "float64":
            calls.append(args[4].shape)
        return real(*args, mode=mode, **kwargs)

    monkeypatch.setattr(backend_step, "sparse_mla_reference", counted)
    monkeypatch.setattr(backend_step, "_KEPT_TRUTH", backend_step.KeptTruth())
    return calls


def judged(scenario, inputs):
    outcome = StepOutcome("any", scenario.planned_rows)
    return intended_references(outcome, scenario, inputs)


def case(seed=0):
    scenario = build_scenario(batch((300, 1), (2100, 1), (40, 3), kpool=4), seed)
    return scenario, build_attention_inputs(scenario, torch.device("cpu"))


def test_a_second_backend_on_the_same_inputs_gets_the_truth_computed_once(float64_calls):
    scenario, inputs = case()
    (first, _), (second, _) = judged(scenario, inputs), judged(scenario, inputs)
    assert len(float64_calls) == 1
    assert first[0] is second[0] and first[1] is second[1]


def test_equal_inputs_of_another_object_compute_it_again(float64_calls):
    scenario, inputs = case()
    _, again = case()
    (first, _), (second, _) = judged(scenario, inputs), judged(scenario, again)
    assert len(float64_calls) == 2
    assert torch.equal(first[0], second[0])


def test_a_cache_or_query_changed_in_place_computes_it_again(float64_calls):
    scenario, inputs = case()
    (before, _) = judged(scenario, inputs)
    inputs.kv_cache[0, 0, 0] = 3.0  # one value of one slot, in place
    (after_cache, _) = judged(scenario, inputs)
    inputs.q_nope[0, 0, 0] = -2.0
    judged(scenario, inputs)
    assert len(float64_calls) == 3
    assert after_cache[0] is not before[0]


def test_a_truth_changed_in_place_by_its_first_reader_computes_it_again(float64_calls):
    scenario, inputs = case()
    (first, _) = judged(scenario, inputs)
    held = float(first[0][0, 0, 0])
    first[0][0, 0, 0] += 1.0  # a reader that writes into the truth it was handed
    (second, _) = judged(scenario, inputs)
    assert len(float64_calls) == 2
    assert second[0] is not first[0] and float(second[0][0, 0, 0]) == held


def test_another_selection_or_scale_computes_it_again(float64_calls):
    scenario, inputs = case()
    judged(scenario, inputs)
    other = build_scenario(batch((300, 1), (2100, 1), (40, 3), kpool=4), 5)  # other indexer rows, same shapes
    judged(other, inputs)
    scaled = build_scenario(batch((300, 1), (2100, 1), (40, 3), kpool=4, k_scale=0.5), 0)
    judged(scaled, inputs)
    assert len(float64_calls) == 3


def test_the_truth_is_let_go_with_its_inputs_and_a_large_one_is_not_kept(float64_calls, monkeypatch):
    scenario, inputs = case()
    judged(scenario, inputs)
    assert backend_step._KEPT_TRUTH._kept is not None
    del inputs
    gc.collect()
    assert backend_step._KEPT_TRUTH._kept is None
    monkeypatch.setattr(backend_step, "_KEPT_TRUTH", backend_step.KeptTruth(max_bytes=1024))
    scenario, inputs = case()
    judged(scenario, inputs)
    judged(scenario, inputs)
    assert backend_step._KEPT_TRUTH._kept is None and len(float64_calls) == 3
