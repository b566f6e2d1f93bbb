"""A row's output bits against the batch it is planned in (docs/edges.md#invariance).

A target row (its q, its selected slots, the KV values of those slots) is planned alone, first
and last in a mixed batch, among long rows (2048 slots each) and among short rows (1 to 16
slots), always through the production attention state (convert, compacted layout, plan, run)
with the same reserved size. Every row of every batch is drawn from a key alone: q by
:func:`harness.scenario.query_rows`, its slots from a pool by a generator seeded with the key,
the pool's values by the scenario builder's per-slot hash. So the target's inputs are bitwise
the same in every batch, and any change in its output comes from the batch around it (the
plan's cluster size and KV splits follow the batch).

To hand the production state explicit slot lists, each row is its own request with block size
1: its block-table row is its slot list and its indexer row is ``0..len-1``, so the convert
kernel maps token j to slot j of the list.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mla_constants import INVALID, TOPK
from reference.budget import finite_mismatch

from .bits import same_bits
from .cases import KernelConfig
from .scenario import component_seed, nan_kv_buffer, query_rows, slot_values_on

POOL_SLOTS = 1 << 16
FILLERS = 255
PLACEMENTS = ("alone", "first", "last", "among-long", "among-short")


@dataclass(frozen=True)
class Row:
    key: int
    length: int


#: The target rows: a full top-k row, a row of a few slots, one in between.
TARGETS = {"long": Row(1, TOPK), "short": Row(2, 7), "mid": Row(3, 700)}


def long_fillers(count: int, topk: int = TOPK) -> list[Row]:
    return [Row(1000 + i, topk) for i in range(count)]


def short_fillers(count: int) -> list[Row]:
    return [Row(5000 + i, 1 + i % 16) for i in range(count)]


def placement_rows(target: Row, placement: str, fillers: int = FILLERS, topk: int = TOPK) -> tuple[list[Row], int]:
    """The batch of one placement and the target's index in it; the long fillers are full rows
    of ``topk`` slots."""
    longs = long_fillers(fillers, topk)
    mixed = [row for pair in zip(longs, short_fillers(fillers), strict=True) for row in pair][:fillers]
    half = fillers // 2
    if placement == "alone":
        return [target], 0
    if placement == "first":
        return [target] + mixed, 0
    if placement == "last":
        return mixed + [target], fillers
    if placement == "among-long":
        return longs[:half] + [target] + longs[half:], half
    if placement == "among-short":
        rows = short_fillers(fillers)
        return rows[:half] + [target] + rows[half:], half
    raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")


def row_slots(seed: int, row: Row, pool: int = POOL_SLOTS) -> np.ndarray:
    """The row's distinct slots (int64), a function of ``(seed, key, length)`` alone."""
    rng = np.random.default_rng(component_seed(seed, f"invariance-row-{row.key}"))
    return rng.choice(pool, size=row.length, replace=False)


@dataclass
class Batch:
    """One placement's step inputs for the production state (block size 1, one request per row)."""

    rows: list[Row]
    target: int
    topk_indices: torch.Tensor  # int32 [max_rows, W]: 0..len-1 then -1
    block_table: torch.Tensor  # int32 [max_rows, W]: each row's slot list
    req_id: torch.Tensor  # int32 [max_rows]
    lens: torch.Tensor  # int32 [rows], host
    slots: torch.Tensor  # int64 [rows, W] slot lists, -1 past each length
    q: torch.Tensor  # bf16 [max_rows, H, 512 + R]


def build_batch(rows: list[Row], target: int, config: KernelConfig, seed: int, max_rows: int, device,
                width: int = TOPK) -> Batch:
    if len(rows) > max_rows:
        raise ValueError(f"{len(rows)} rows > max_rows {max_rows}")
    slots = torch.full((len(rows), width), INVALID, dtype=torch.int64)
    for i, row in enumerate(rows):
        slots[i, : row.length] = torch.from_numpy(row_slots(seed, row))
    lens = torch.tensor([row.length for row in rows], dtype=torch.int32)
    cols = torch.arange(width)
    topk = torch.full((max_rows, width), INVALID, dtype=torch.int32)
    topk[: len(rows)] = torch.where(cols < lens[:, None], cols, INVALID).to(torch.int32)
    table = torch.zeros((max_rows, width), dtype=torch.int32)
    table[: len(rows)] = slots.clamp(min=0).to(torch.int32)
    keys = torch.tensor([row.key for row in rows] + [0] * (max_rows - len(rows)), dtype=torch.int64)
    q = query_rows(component_seed(seed, "invariance-q"), keys, config.num_heads, config.head_dim, device)
    return Batch(
        rows,
        target,
        topk.to(device),
        table.to(device),
        torch.arange(max_rows, dtype=torch.int32, device=device),
        lens,
        slots,
        q,
    )


def pool_cache(batches: list[Batch], config: KernelConfig, seed: int, device) -> torch.Tensor:
    """``[POOL_SLOTS, 1, 512 + R]`` in the variant's KV dtype: the slots some row reads hold the
    per-slot hash values, every other slot NaN (a read outside a selection shows)."""
    cache = nan_kv_buffer((POOL_SLOTS, 1, config.head_dim), config.kv_dtype, device)
    used = torch.unique(torch.cat([b.slots[b.slots != INVALID] for b in batches])).to(device)
    cache[used, 0] = slot_values_on(component_seed(seed, "invariance-kv"), used, config.head_dim).to(
        config.torch_kv_dtype
    )
    return cache


def bits_equal_share(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of elements whose bits are equal (NaN with the same bits counts as equal)."""
    if a.numel() == 0:
        return 1.0
    return float(same_bits(a, b).double().mean())


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| where both are finite; inf where they disagree on NaN or on an infinity."""
    a, b = a.double(), b.double()
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    inf_mismatch = finite_mismatch(a, b) & ~nan_a & ~nan_b
    if bool((nan_a != nan_b).any() or inf_mismatch.any()):
        return float("inf")
    both = torch.isfinite(a) & torch.isfinite(b)
    return float((a - b).abs()[both].max()) if bool(both.any()) else 0.0
