"""The three kv_indices layouts on hand-made rows: indptr, what each row's span holds, the
dump entry, padded rows, and the reference view (b) read back from the buffers."""

from __future__ import annotations

import pytest
import torch

from fast.layouts import LAYOUTS, indices_capacity, lay_out
from reference import planned_selection

W = 128
# Row 0: a prefix of 3; row 1: a hole then a tail (regime C shape); row 2: empty.
ROWS = torch.full((3, W), -1, dtype=torch.int32)
ROWS[0, :3] = torch.tensor([10, 11, 12])
ROWS[1, :2] = torch.tensor([20, 21])
ROWS[1, 5:7] = torch.tensor([30, 31])
LENS = torch.tensor([3, 4, 0], dtype=torch.int32)


def spans(layout: str) -> list[list[int]]:
    planned = lay_out(layout, ROWS, LENS, max_rows=5)
    slots, lens = planned_selection(planned.kv_indptr, planned.kv_indices, planned.kv_len, 3)
    return [slots[r, : int(lens[r])].tolist() for r in range(3)]


def test_strided_reads_the_first_len_columns_in_place():
    planned = lay_out("strided", ROWS, LENS, max_rows=5)
    assert planned.kv_indptr.tolist() == [0, W, 2 * W, 3 * W, 3 * W, 3 * W]
    assert spans("strided") == [[10, 11, 12], [20, 21, -1, -1], []]


def test_packed_clamps_minus_one_to_slot_zero():
    planned = lay_out("packed", ROWS, LENS, max_rows=5)
    assert planned.kv_indptr.tolist() == [0, 3, 7, 7, 7, 7]
    assert spans("packed") == [[10, 11, 12], [20, 21, 0, 0], []]


def test_compacted_reads_the_valid_entries():
    assert spans("compacted") == [[10, 11, 12], [20, 21, 30, 31], []]


def test_compacted_leaves_minus_one_when_len_exceeds_valid_count():
    planned = lay_out("compacted", ROWS, torch.tensor([5, 4, 0], dtype=torch.int32), max_rows=5)
    slots, lens = planned_selection(planned.kv_indptr, planned.kv_indices, planned.kv_len, 3)
    assert slots[0, :5].tolist() == [10, 11, 12, -1, -1]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_buffer_has_one_dump_entry_and_nothing_past_the_plan_is_written(layout):
    planned = lay_out(layout, ROWS, LENS, max_rows=5)
    assert planned.kv_indices.numel() == indices_capacity(5, W) == 5 * W + 1
    used = int(planned.kv_indptr[3]) if layout != "strided" else 3 * W
    assert (planned.kv_indices[used:-1] == -1).all(), "entries past the planned rows were written"


def test_unknown_layout_is_rejected():
    with pytest.raises(ValueError, match="layout"):
        lay_out("dense", ROWS, LENS)
