"""The comparison of the suite's step metadata with what vLLM's V2 runner hands the builders
(``backends.vllm.v2_runner.field_differences``), on hand-made steps: no vLLM needed."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from backends.vllm.v2_runner import COMPARED_FIELDS, RunnerStep, field_differences


def runner_step(**changed) -> RunnerStep:
    fields = dict(mode="FULL", num_reqs=4, num_actual_tokens=4,
                  query_start_loc_cpu=torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32),
                  seq_lens=torch.tensor([2048, 2051, 300, 0], dtype=torch.int32),
                  seq_lens_cpu_upper_bound=torch.tensor([2048, 2051, 300, 0], dtype=torch.int32),
                  positions=torch.tensor([2047, 2050, 299, 0]), max_query_len=1, max_seq_len=2051)
    fields.update(changed)
    return RunnerStep(**fields)


def model_of(step: RunnerStep, **changed):
    """The suite's metadata as the runner's, int64 where the runner holds int32, with ``changed``."""
    fields = {name: getattr(step, name) for name in COMPARED_FIELDS}
    fields = {k: v.to(torch.int64) if isinstance(v, torch.Tensor) else v for k, v in fields.items()}
    fields.update(changed)
    return SimpleNamespace(**fields)


def test_equal_values_in_other_integer_dtypes_are_the_same():
    step = runner_step()
    assert field_differences(model_of(step), step) == []


def test_one_value_off_in_a_tensor_of_the_same_shape_is_named_with_both():
    step = runner_step()
    model = model_of(step, seq_lens=torch.tensor([2048, 2051, 301, 0]))
    assert field_differences(model, step) == [
        "seq_lens: the suite's model [2048, 2051, 301, 0], vLLM's FULL runner [2048, 2051, 300, 0]"]


def test_a_field_one_side_lacks_is_named_and_one_both_lack_is_not():
    step = runner_step()
    assert field_differences(model_of(step, seq_lens_cpu_upper_bound=None), step) == [
        "seq_lens_cpu_upper_bound: the suite's model None, vLLM's FULL runner [2048, 2051, 300, 0]"]
    both = runner_step(seq_lens_cpu_upper_bound=None)
    assert field_differences(model_of(both), both) == []
    assert field_differences(model_of(both, seq_lens_cpu_upper_bound=torch.tensor([1, 2, 3, 0])), both) == [
        "seq_lens_cpu_upper_bound: the suite's model [1, 2, 3, 0], vLLM's FULL runner None"]


def test_counts_and_tensor_lengths_are_compared():
    step = runner_step()
    lines = field_differences(model_of(step, num_reqs=3, query_start_loc_cpu=torch.tensor([0, 1, 2, 3])), step)
    assert lines == ["num_reqs: the suite's model 3, vLLM's FULL runner 4",
                     "query_start_loc_cpu: the suite's model [0, 1, 2, 3], vLLM's FULL runner [0, 1, 2, 3, 3]"]
