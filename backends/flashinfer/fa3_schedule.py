"""FlashInfer's fa3 MLA schedule, read back from the wrapper after a plan: what the kernel will
execute, work item by work item.

``plan()`` writes the schedule into the wrapper's int workspace and keeps the byte offsets of
its arrays in ``_plan_info``, an 18-long array that mirrors ``MLAPlanInfo`` in FlashInfer's
``scheduler.cuh`` (0.6.x and 0.7.x alike): field 1 is the number of clusters, 2 the per-work
q_indptr array (the query row of the work: one query row per request here), 3 kv_indptr,
13 kv_start, 14 kv_end (each work reads the row's kv range ``[kv_start, kv_end)``), 15
work_indptr (``num_clusters + 1`` entries: the works of cluster c are ``work_indptr[c] ..
work_indptr[c + 1]``, so its last entry is the number of works). The per-work arrays are laid
out back to back at the scheduler's capacity.

vLLM 0.32 and later rewrite kv_end in place after every plan (a device clamp to each row's
valid count), so reading the schedule back is the only way to see the KV length a row is
executed with. 0.7.x keeps the workspace on ``wrapper._planned_backend``; 0.6.x on the
wrapper itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PLAN_INFO_LEN = 18
NUM_CLUSTERS, Q_INDPTR, KV_INDPTR, KV_START, KV_END, WORK_INDPTR = 1, 2, 3, 13, 14, 15


class ScheduleUnreadable(RuntimeError):
    """The installed FlashInfer's wrapper does not keep the schedule where this module reads it."""


def int_workspace(wrapper) -> torch.Tensor:
    """The wrapper's int workspace as int32 (the planned backend's on 0.7.x)."""
    holder = getattr(wrapper, "_planned_backend", None) or wrapper
    buffer = getattr(holder, "_int_workspace_buffer", None)
    if buffer is None:
        raise ScheduleUnreadable(f"{type(wrapper).__name__} keeps no _int_workspace_buffer")
    return buffer.view(torch.int32)


def plan_info(wrapper) -> list[int]:
    info = getattr(wrapper, "_plan_info", None)
    if info is None:
        raise ScheduleUnreadable(f"{type(wrapper).__name__} has no _plan_info (planned?)")
    values = [int(x) for x in info]
    if len(values) != PLAN_INFO_LEN:
        raise ScheduleUnreadable(f"_plan_info has {len(values)} fields, expected {PLAN_INFO_LEN} (MLAPlanInfo)")
    return values


@dataclass(frozen=True)
class Schedule:
    """The planned work items: int64 host tensors, one entry per work."""

    row: torch.Tensor
    kv_start: torch.Tensor
    kv_end: torch.Tensor
    capacity: int  # per-work slots the arrays are laid out for

    @property
    def num_works(self) -> int:
        return int(self.row.numel())


def schedule_from_workspace(int_ws: torch.Tensor, info: list[int]) -> Schedule:
    """Decode a schedule from an int32 workspace and its plan info (any device)."""
    capacity = (info[KV_INDPTR] - info[Q_INDPTR]) // 4
    ws = int_ws.detach().to("cpu")
    total = int(ws[info[WORK_INDPTR] // 4 + info[NUM_CLUSTERS]])
    if not 0 <= total <= capacity:
        raise ScheduleUnreadable(f"the schedule claims {total} works for a capacity of {capacity}")

    def array(field: int) -> torch.Tensor:
        start = info[field] // 4
        return ws[start : start + total].to(torch.int64)

    return Schedule(array(Q_INDPTR), array(KV_START), array(KV_END), capacity)


def read_schedule(wrapper) -> Schedule:
    """The schedule the last plan (and anything that rewrote it since) left in ``wrapper``."""
    return schedule_from_workspace(int_workspace(wrapper), plan_info(wrapper))


@dataclass(frozen=True)
class RowExtent:
    """What a row is executed with: ``length`` is the end of its contiguous KV coverage from 0
    (the KV length the kernel reads); ``problems`` lists a gap, an overlap or query tiles that
    disagree."""

    length: int
    works: int
    problems: tuple[str, ...] = ()


def row_extents(schedule: Schedule, num_rows: int) -> list[RowExtent]:
    """Per query row ``0 .. num_rows - 1``: the KV range its work items cover. A row with no
    work has length 0; work items naming rows past ``num_rows`` are :func:`stray_works`."""
    by_row: dict[int, list[tuple[int, int]]] = {}
    for r, s, e in zip(schedule.row.tolist(), schedule.kv_start.tolist(), schedule.kv_end.tolist(), strict=True):
        by_row.setdefault(r, []).append((s, e))
    extents = []
    for row in range(num_rows):
        ranges = by_row.get(row, [])
        extents.append(_extent(ranges))
    return extents


def _extent(ranges: list[tuple[int, int]]) -> RowExtent:
    """Coverage of one row's work items. Several query tiles of one row each cover the row's
    KV from 0: the ranges are grouped into chains that each start at 0."""
    problems = []
    if not ranges:
        return RowExtent(0, 0)
    chains: list[int] = []  # the end reached by each chain
    for start, end in sorted(ranges):
        if end < start:
            problems.append(f"work [{start}, {end}) ends before it starts")
            continue
        if end == start and start > 0:
            continue  # an empty work (a clamp cut it to nothing) reads no KV
        if start == 0:
            chains.append(end)
            continue
        extended = False
        for i, reached in enumerate(chains):
            if reached == start:
                chains[i] = max(reached, end)
                extended = True
                break
        if not extended:
            problems.append(f"work [{start}, {end}) leaves a gap or overlaps")
    lengths = sorted(set(chains)) or [0]
    if len(lengths) > 1:
        problems.append(f"query tiles cover different lengths {lengths}")
    return RowExtent(lengths[-1], len(ranges), tuple(problems))


def stray_works(schedule: Schedule, num_rows: int) -> list[int]:
    """Rows named by work items that are not planned rows (padding rows must have none)."""
    rows = schedule.row
    return sorted({int(r) for r in rows[(rows < 0) | (rows >= num_rows)].tolist()})


def column_parts(schedule: Schedule, num_rows: int, width: int) -> torch.Tensor:
    """``[num_rows, width]`` int64: for each query row, which of its KV parts reads each column
    (KV position): the row's works split its KV range at their distinct ``kv_start`` values, and
    the parts are numbered from 0 in KV order. A row read by one work, or by none, is all 0.
    Query tiles of one row that cover the same range split it alike; where they do not, the
    parts are the union of their split points."""
    parts = torch.zeros((num_rows, width), dtype=torch.int64)
    starts: dict[int, set[int]] = {}
    for r, s, e in zip(schedule.row.tolist(), schedule.kv_start.tolist(), schedule.kv_end.tolist(), strict=True):
        if 0 <= r < num_rows and e > s:
            starts.setdefault(r, set()).add(s)
    columns = torch.arange(width)
    for r, row_starts in starts.items():
        bounds = torch.tensor(sorted(row_starts - {0}), dtype=torch.int64)
        if bounds.numel():
            parts[r] = torch.searchsorted(bounds, columns, right=True)
    return parts
