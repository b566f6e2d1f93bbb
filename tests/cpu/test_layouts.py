"""The three kv_indices layouts on hand-made rows: indptr, what each row's span holds, the
dump entry, padded rows, and the reference view (b) read back from the buffers, through the
implementation under test (``impl.kv_indptr`` on the host, ``impl.write_kv_indices`` on the
test device)."""

from __future__ import annotations

import pytest
import torch

from fast.layouts import LAYOUTS, indices_capacity
from reference import planned_selection
from tests.cpu.host_stages import host_stages_apart

impl = pytest.fixture(scope="module", name="impl")(host_stages_apart)

W = 128
# Row 0: a prefix of 3; row 1: a hole then a tail (regime C shape); row 2: empty.
ROWS = torch.full((3, W), -1, dtype=torch.int32)
ROWS[0, :3] = torch.tensor([10, 11, 12])
ROWS[1, :2] = torch.tensor([20, 21])
ROWS[1, 5:7] = torch.tensor([30, 31])
LENS = torch.tensor([3, 4, 0], dtype=torch.int32)
MAX_ROWS = 5


def lay_out(impl, device, layout: str, lens: torch.Tensor = LENS) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kv_indptr, kv_indices)`` of ROWS planned with ``lens``: the host indptr, then the
    indices written on ``device`` into a reserved buffer of -1 (as the SM90 state does)."""
    indptr = impl.kv_indptr(layout, lens, MAX_ROWS, W)
    out = torch.full((indices_capacity(MAX_ROWS, W),), -1, dtype=torch.int32, device=device)
    impl.write_kv_indices(layout, ROWS.to(device), lens.to(device), indptr[: ROWS.shape[0] + 1].to(device), out)
    return indptr, out.cpu()


def spans(impl, device, layout: str, lens: torch.Tensor = LENS) -> list[list[int]]:
    indptr, indices = lay_out(impl, device, layout, lens)
    slots, read = planned_selection(indptr, indices, lens, 3)
    return [slots[r, : int(read[r])].tolist() for r in range(3)]


def test_strided_reads_the_first_len_columns_in_place(impl, device):
    indptr, _ = lay_out(impl, device, "strided")
    assert indptr.tolist() == [0, W, 2 * W, 3 * W, 3 * W, 3 * W]
    assert spans(impl, device, "strided") == [[10, 11, 12], [20, 21, -1, -1], []]


def test_packed_clamps_minus_one_to_slot_zero(impl, device):
    indptr, _ = lay_out(impl, device, "packed")
    assert indptr.tolist() == [0, 3, 7, 7, 7, 7]
    assert spans(impl, device, "packed") == [[10, 11, 12], [20, 21, 0, 0], []]


def test_compacted_reads_the_valid_entries(impl, device):
    assert spans(impl, device, "compacted") == [[10, 11, 12], [20, 21, 30, 31], []]


def test_compacted_leaves_minus_one_when_len_exceeds_valid_count(impl, device):
    lens = torch.tensor([5, 4, 0], dtype=torch.int32)
    assert spans(impl, device, "compacted", lens)[0] == [10, 11, 12, -1, -1]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_buffer_has_one_dump_entry_and_nothing_past_the_plan_is_written(impl, device, layout):
    indptr, indices = lay_out(impl, device, layout)
    assert indices.numel() == indices_capacity(MAX_ROWS, W) == MAX_ROWS * W + 1
    used = int(indptr[3]) if layout != "strided" else 3 * W
    assert (indices[used:-1] == -1).all(), f"{layout}: entries past the planned rows were written"


@pytest.mark.input_rules
def test_unknown_layout_is_rejected(impl):
    with pytest.raises(ValueError, match="layout"):
        impl.kv_indptr("dense", LENS, MAX_ROWS, W)


#: What a reused kv_indices buffer holds before a step: slot ids an earlier step wrote.
STALE = 777


def batch_rows(valid_per_row: list[list[tuple[int, int]]]) -> torch.Tensor:
    """Convert output rows of width W: ``(column, slot)`` pairs per row, -1 elsewhere."""
    rows = torch.full((len(valid_per_row), W), -1, dtype=torch.int32)
    for r, entries in enumerate(valid_per_row):
        for col, slot in entries:
            rows[r, col] = slot
    return rows


# Each batch ends with the row that matters: one with more valid entries than its length (the
# entry of rank len must not be written) or one with fewer (its leftover span holds -1, whatever
# the buffer held there).
BATCHES = {
    "longer-last": ([[(c, 10 + c) for c in range(5)], [(0, 20), (1, 21), (5, 30)], [(c, 40 + c) for c in range(2, 6)]],
                    [3, 5, 2],
                    {"compacted": [[10, 11, 12], [20, 21, 30, -1, -1], [42, 43]],
                     "packed": [[10, 11, 12], [20, 21, 0, 0, 0], [0, 0]]}),
    "shorter-last": ([[(c, 10 + c) for c in range(5)], [(c, 40 + c) for c in range(2, 6)], [(0, 20), (1, 21), (5, 30)]],
                     [3, 2, 5],
                     {"compacted": [[10, 11, 12], [42, 43], [20, 21, 30, -1, -1]],
                      "packed": [[10, 11, 12], [0, 0], [20, 21, 0, 0, 0]]}),
}


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("layout", ["packed", "compacted"])
def test_a_reused_buffer_holds_the_spans_and_keeps_what_it_held_elsewhere(impl, device, layout, batch):
    """Into a buffer that holds an earlier step's slots, the layout writes each planned span
    whole (a compacted row short of valid entries gets -1 for the rest of its span) and nothing
    else but the dump entry."""
    entries, lens, expected = BATCHES[batch]
    rows, lens = batch_rows(entries), torch.tensor(lens, dtype=torch.int32)
    indptr = impl.kv_indptr(layout, lens, MAX_ROWS, W)
    out = torch.full((indices_capacity(MAX_ROWS, W),), STALE, dtype=torch.int32, device=device)
    impl.write_kv_indices(layout, rows.to(device), lens.to(device), indptr[: rows.shape[0] + 1].to(device), out)
    out = out.cpu()
    starts = indptr[:3].tolist()
    assert [out[s: s + n].tolist() for s, n in zip(starts, lens.tolist(), strict=True)] == expected[layout]
    untouched = torch.ones(out.numel(), dtype=torch.bool)
    for s, n in zip(starts, lens.tolist(), strict=True):
        untouched[s: s + n] = False
    untouched[-1] = False  # the dump entry
    outside = ((out != STALE) & untouched).nonzero().flatten().tolist()
    assert not outside, f"{layout}: written outside the planned spans at entries {outside[:8]}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kv_indptr_is_host_int32_for_every_layout(impl, layout):
    indptr = impl.kv_indptr(layout, LENS, MAX_ROWS, W)
    assert indptr.dtype == torch.int32 and indptr.device.type == "cpu" and indptr.shape == (MAX_ROWS + 1,)


@pytest.mark.input_rules
def test_more_rows_than_the_capacity_are_refused_naming_both(impl):
    with pytest.raises(ValueError, match=r"^3 rows > max_rows 2$"):
        impl.kv_indptr("packed", LENS, 2, W)


@pytest.mark.input_rules
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_buffer_without_its_dump_entry_is_refused(impl, device, layout):
    """The buffer needs every row full plus the dump entry: one entry short is refused."""
    rows = batch_rows([[(0, 5)], [(1, 6)]])
    lens = torch.tensor([1, 1], dtype=torch.int32)
    indptr = impl.kv_indptr(layout, lens, 2, W)
    out = torch.full((2 * W,), -1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=rf"^kv_indices buffer of {2 * W} < {2 * W + 1} entries$"):
        impl.write_kv_indices(layout, rows.to(device), lens.to(device), indptr.to(device), out)
