"""Reading FlashInfer's fa3 MLA schedule back (``backends.flashinfer.fa3_schedule``), on workspaces laid out
by hand as FlashInfer's ``MLAPlanInfo`` describes them (field numbers written out here, not
taken from the module: the CPU stand-in of FlashInfer writes its schedule with the module's own
constants, so only these tests hold the constants to FlashInfer's layout), and the per-row
coverage the vLLM backend's checks read from it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from backends.flashinfer.fa3_schedule import (
    PLAN_INFO_LEN,
    RowExtent,
    ScheduleUnreadable,
    int_workspace,
    plan_info,
    read_schedule,
    row_extents,
    schedule_from_workspace,
    stray_works,
)

CAPACITY = 6


def planned_wrapper(works: list[tuple[int, int, int]], clusters: list[int], *, seventeen: bool = False,
                    on_planned_backend: bool = True):
    """A wrapper as plan() leaves it: the works' (row, kv_start, kv_end) laid out back to back at
    CAPACITY entries per array in the int workspace, ``clusters`` works per cluster, and the
    byte offsets in an 18-long plan info (field 1 clusters, 2 q_indptr, 3 kv_indptr, 13 kv_start,
    14 kv_end, 15 work_indptr)."""
    ws = torch.full((64,), -7, dtype=torch.int32)
    base = 8  # entries before the first array: offsets are not from 0
    offsets = {2: base, 3: base + CAPACITY, 13: base + 2 * CAPACITY, 14: base + 3 * CAPACITY,
               15: base + 4 * CAPACITY}
    for field, column in ((2, 0), (13, 1), (14, 2)):
        ws[offsets[field]: offsets[field] + len(works)] = torch.tensor([w[column] for w in works], dtype=torch.int32)
    ws[offsets[3]: offsets[3] + len(works)] = 0
    indptr = [0]
    for n in clusters:
        indptr.append(indptr[-1] + n)
    ws[offsets[15]: offsets[15] + len(indptr)] = torch.tensor(indptr, dtype=torch.int32)
    info = [0] * (17 if seventeen else 18)
    info[1] = len(clusters)
    for field, entry in offsets.items():
        info[field] = 4 * entry
    buffer = ws.view(torch.uint8)
    if on_planned_backend:
        return SimpleNamespace(_plan_info=info, _planned_backend=SimpleNamespace(_int_workspace_buffer=buffer))
    return SimpleNamespace(_plan_info=info, _int_workspace_buffer=buffer)


def test_the_works_are_read_at_the_offsets_mlaplaninfo_names():
    works = [(0, 0, 100), (1, 0, 40), (0, 100, 130), (2, 0, 0)]
    schedule = read_schedule(planned_wrapper(works, clusters=[3, 1]))
    assert PLAN_INFO_LEN == 18 and schedule.capacity == CAPACITY and type(schedule.capacity) is int
    assert schedule.num_works == 4
    assert schedule.row.tolist() == [0, 1, 0, 2]
    assert schedule.kv_start.tolist() == [0, 0, 100, 0] and schedule.kv_end.tolist() == [100, 40, 130, 0]
    assert schedule.row.dtype == torch.int64


def test_0_6_keeps_the_workspace_on_the_wrapper_itself():
    schedule = read_schedule(planned_wrapper([(0, 0, 9)], clusters=[1], on_planned_backend=False))
    assert schedule.kv_end.tolist() == [9]


def test_no_work_planned_reads_an_empty_schedule():
    schedule = read_schedule(planned_wrapper([], clusters=[0, 0]))
    assert schedule.num_works == 0 and row_extents(schedule, 2) == [RowExtent(0, 0), RowExtent(0, 0)]


@pytest.mark.parametrize(("wrapper", "message"), [
    (SimpleNamespace(), "^SimpleNamespace keeps no _int_workspace_buffer$"),
    (SimpleNamespace(_planned_backend=None), "^SimpleNamespace keeps no _int_workspace_buffer$"),
])
def test_a_wrapper_without_a_workspace_is_unreadable(wrapper, message):
    with pytest.raises(ScheduleUnreadable, match=message):
        int_workspace(wrapper)


def test_the_planned_backends_workspace_is_read_as_int32():
    wrapper = planned_wrapper([(0, 0, 9)], clusters=[1])
    assert int_workspace(wrapper).dtype == torch.int32 and int_workspace(wrapper).numel() == 64


def test_a_plan_info_that_is_not_mlaplaninfo_is_unreadable():
    with pytest.raises(ScheduleUnreadable, match=r"^SimpleNamespace has no _plan_info \(planned\?\)$"):
        plan_info(SimpleNamespace())
    with pytest.raises(ScheduleUnreadable, match="17 fields, expected 18"):
        read_schedule(planned_wrapper([(0, 0, 9)], clusters=[1], seventeen=True))


@pytest.mark.parametrize("total", [CAPACITY + 1, -1])
def test_a_work_count_past_the_capacity_is_unreadable(total):
    wrapper = planned_wrapper([(0, 0, 9)], clusters=[1])
    ws = int_workspace(wrapper)
    info = plan_info(wrapper)
    ws[info[15] // 4 + 1] = total
    with pytest.raises(ScheduleUnreadable, match=f"claims {total} works for a capacity of {CAPACITY}"):
        schedule_from_workspace(ws, info)


def test_a_work_count_at_the_capacity_is_read():
    works = [(r, 0, 10 + r) for r in range(CAPACITY)]
    assert read_schedule(planned_wrapper(works, clusters=[CAPACITY])).num_works == CAPACITY


def extents(works, rows):
    schedule = read_schedule(planned_wrapper(works, clusters=[len(works)]))
    return row_extents(schedule, rows)


def test_a_row_is_executed_with_the_end_of_its_chain_of_works_from_0():
    got = extents([(0, 0, 64), (0, 64, 100), (1, 0, 7)], rows=3)
    assert got == [RowExtent(100, 2), RowExtent(7, 1), RowExtent(0, 0)]


def test_query_tiles_of_one_row_each_cover_it_from_0():
    assert extents([(0, 0, 50), (0, 50, 90), (0, 0, 90)], rows=1) == [RowExtent(90, 3)]


def test_query_tiles_that_cover_different_lengths_are_a_problem():
    (got,) = extents([(0, 0, 90), (0, 0, 70)], rows=1)
    assert got == RowExtent(90, 2, ("query tiles cover different lengths [70, 90]",))


@pytest.mark.parametrize(("works", "problem"), [
    ([(0, 0, 40), (0, 41, 60)], "work [41, 60) leaves a gap or overlaps"),
    ([(0, 0, 40), (0, 30, 60)], "work [30, 60) leaves a gap or overlaps"),
    ([(0, 0, 40), (0, 50, 45)], "work [50, 45) ends before it starts"),
])
def test_gaps_overlaps_and_backward_works_are_problems(works, problem):
    (got,) = extents(works, rows=1)
    assert got.problems == (problem,) and got.length == 40 and got.works == 2


def test_a_work_clamped_to_nothing_reads_no_kv_and_is_no_problem():
    assert extents([(0, 0, 40), (0, 40, 40), (0, 77, 77), (0, 1, 1)], rows=1) == [RowExtent(40, 4)]
    assert extents([(0, 0, 0)], rows=1) == [RowExtent(0, 1)]
    assert extents([(0, 0, 40), (0, 40, 40), (0, 40, 60)], rows=1) == [RowExtent(60, 3)]
    assert extents([(0, 5, 5)], rows=1) == [RowExtent(0, 1)]  # clamped away whole: reads nothing


def test_a_query_tile_clamped_to_nothing_beside_one_that_reads_is_a_problem():
    (got,) = extents([(0, 0, 0), (0, 0, 40)], rows=1)
    assert got == RowExtent(40, 2, ("query tiles cover different lengths [0, 40]",))


def test_the_works_after_a_backward_one_are_still_read():
    (got,) = extents([(0, 0, 40), (0, 20, 10), (0, 40, 60)], rows=1)
    assert got == RowExtent(60, 3, ("work [20, 10) ends before it starts",))


def test_works_naming_rows_that_are_not_planned_are_stray():
    schedule = read_schedule(planned_wrapper([(0, 0, 5), (3, 0, 5), (-1, 0, 5), (3, 5, 9), (2, 0, 1)],
                                             clusters=[5]))
    assert stray_works(schedule, 2) == [-1, 2, 3]
    assert stray_works(schedule, 4) == [-1]
    assert [e.length for e in row_extents(schedule, 4)] == [5, 0, 1, 9]


def test_column_parts_number_each_rows_works_in_kv_order():
    """Row 0 read by works [0,3) [3,6) [6,7) (listed out of order), row 1 by one work, row 2 by
    none, an empty work and a stray row ignored: the part of each KV column."""
    from backends.flashinfer.fa3_schedule import Schedule, column_parts

    schedule = Schedule(row=torch.tensor([0, 1, 0, 0, 0, 5]), kv_start=torch.tensor([6, 0, 0, 3, 7, 0]),
                        kv_end=torch.tensor([7, 4, 3, 6, 7, 9]), capacity=8)
    parts = column_parts(schedule, 3, 8)
    assert parts.dtype == torch.int64
    assert parts.tolist() == [[0, 0, 0, 1, 1, 1, 2, 2], [0] * 8, [0] * 8]


def test_column_parts_leave_out_works_of_rows_outside_the_planned_ones():
    """A work naming the first row past the planned ones, or a negative row, splits no row."""
    from backends.flashinfer.fa3_schedule import Schedule, column_parts

    schedule = Schedule(row=torch.tensor([0, 2, -1, 1]), kv_start=torch.tensor([0, 2, 3, 0]),
                        kv_end=torch.tensor([4, 4, 4, 4]), capacity=4)
    assert column_parts(schedule, 2, 4).tolist() == [[0] * 4, [0] * 4]


def test_parts_follow_the_slots_into_the_selections_order():
    """The kernel's parts are aligned with its executed columns; the oracle over (a) takes them
    slot by slot in (a)'s column order; a slot the kernel did not execute gets part 0."""
    from harness.backend_step import parts_in_selection_order

    slots, mask = torch.tensor([[5, 9, 2, 7, 4, -1]]), torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    executed = torch.tensor([[2, 5, 7, 9, 3, 0]])
    executed_mask = torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    parts = torch.tensor([[0, 0, 1, 1, 2, 2]])
    assert parts_in_selection_order(slots, mask, executed, executed_mask, parts).tolist() == [[0, 1, 0, 1, 0, 0]]
