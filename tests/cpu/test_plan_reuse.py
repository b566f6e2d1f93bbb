"""The plan-reuse option of the SM90 state (``AttentionConfig.reuse_plan``), against a recording
stand-in for FlashInfer's wrapper: FlashInfer is planned again exactly when num_rows or a
len changed, after a failed plan, and always with the option off (the default). The state
plans through the implementation under test (``impl.kv_indptr``) with its buffers on the test
device."""

from __future__ import annotations

import pytest
import torch

import backends.flashinfer.sm90_state as sm90
from backends.flashinfer.sm90_state import AttentionConfig, SM90AttentionState
from mla_constants import DEEPSEEK_V32_SM_SCALE


class RecordingWrapper:
    """Stands in for backends.flashinfer.compat.MLAWrapper: records what each plan was given."""

    def __init__(self, workspace, *, features=None, **buffers):
        self.features = features
        self.plans: list[tuple[list[int], list[int]]] = []
        self.fail_next = False

    def plan(self, *, qo_indptr, kv_len_arr, **kwargs):
        if self.fail_next:
            self.fail_next = False
            raise ValueError("refused")
        self.plans.append((qo_indptr.tolist(), kv_len_arr.tolist()))


@pytest.fixture
def make_state(monkeypatch, impl, device):
    monkeypatch.setattr(sm90, "MLAWrapper", RecordingWrapper)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # CPU-only torch

    def make(reuse: bool, layout: str = "packed") -> SM90AttentionState:
        config = AttentionConfig(num_heads=16, max_rows=4, width=128, layout=layout, block_size=64,
                                 sm_scale=DEEPSEEK_V32_SM_SCALE, reuse_plan=reuse)
        return SM90AttentionState(impl, config, device=device)

    return make


def lens(*values):
    return torch.tensor(values, dtype=torch.int32)


def test_reuse_is_off_by_default():
    assert AttentionConfig(num_heads=16, max_rows=4, width=128, layout="packed", block_size=64,
                           sm_scale=0.1).reuse_plan is False


def test_without_reuse_every_plan_reaches_flashinfer(make_state):
    state = make_state(reuse=False)
    for _ in range(3):
        state.plan(2, lens(100, 128))
    assert len(state.wrapper.plans) == 3 and state.plans == 3 and state.reused_plans == 0


@pytest.mark.parametrize("layout", ["strided", "packed", "compacted"])
def test_reuse_keeps_the_plan_only_while_rows_and_lens_are_unchanged(make_state, layout):
    state = make_state(reuse=True, layout=layout)
    sequence = [
        (2, lens(100, 128), True),
        (2, lens(100, 128), False),  # same: kept
        (2, lens(100, 127), True),  # one len changed
        (3, lens(100, 127, 0), True),  # one more row
        (3, lens(100, 127, 0), False),
        (2, lens(100, 127), True),  # fewer rows, same leading lens
        (0, lens(), True),
        (0, lens(), False),
    ]
    for step, (rows, row_lens, planned) in enumerate(sequence):
        before = len(state.wrapper.plans)
        state.plan(rows, row_lens)
        assert (len(state.wrapper.plans) > before) == planned, f"step {step}"
        assert state.num_rows == rows
        assert state.planned_kv_len[:rows].tolist() == row_lens.tolist()
        assert not state.planned_kv_len[rows:].any(), f"step {step}: stale lens past the planned rows"
    assert state.plans == len(sequence)
    assert state.reused_plans == sum(not planned for _, _, planned in sequence)
    qo, kv_len = state.wrapper.plans[-2]
    assert qo == [0, 1, 2, 2, 2] and kv_len == [100, 127, 0, 0]


def test_a_failed_plan_is_never_kept(make_state):
    state = make_state(reuse=True)
    state.plan(2, lens(5, 6))
    state.wrapper.fail_next = True
    with pytest.raises(ValueError, match="refused"):
        state.plan(2, lens(5, 7))
    state.plan(2, lens(5, 7))
    state.plan(2, lens(5, 6))
    assert [kv[:2] for _, kv in state.wrapper.plans] == [[5, 6], [5, 7], [5, 6]]
    assert state.reused_plans == 0


def test_lens_of_another_dtype_compare_by_value(make_state):
    state = make_state(reuse=True)
    state.plan(2, lens(5, 6))
    state.plan(2, torch.tensor([5, 6], dtype=torch.int64))
    assert len(state.wrapper.plans) == 1 and state.reused_plans == 1
