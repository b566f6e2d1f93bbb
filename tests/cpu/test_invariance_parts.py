"""The batches of the invariance edge (harness.invariance): the target row has bitwise the same
inputs in every placement, sits where the placement says, and the pool holds data exactly where
some row reads; the bit and difference measures."""

from __future__ import annotations

import pytest
import torch

from harness.cases import KernelConfig
from harness.invariance import (
    FILLERS,
    PLACEMENTS,
    POOL_SLOTS,
    TARGETS,
    bits_equal_share,
    build_batch,
    max_abs_diff,
    placement_rows,
    pool_cache,
)
from mla_constants import INVALID, TOPK
from reference.rules import convert_rule

CONFIG = KernelConfig("bfloat16", True, 4)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_target_inputs_are_the_same_in_every_placement(name):
    target = TARGETS[name]
    batches = {p: build_batch(*placement_rows(target, p, fillers=9), CONFIG, 3, 10, "cpu") for p in PLACEMENTS}
    alone = batches["alone"]
    assert alone.target == 0 and len(alone.rows) == 1
    for placement, batch in batches.items():
        t = batch.target
        assert batch.rows[t] == target, placement
        assert torch.equal(batch.q[t].view(torch.int16), alone.q[0].view(torch.int16)), placement
        assert torch.equal(batch.slots[t], alone.slots[0]) and int(batch.lens[t]) == target.length
        # what the production convert rule reads for the row: its slot list, in order
        converted = convert_rule(batch.topk_indices, batch.block_table, batch.req_id, 1)[t]
        assert torch.equal(converted.to(torch.int64), batch.slots[t]), placement


def test_placements_put_the_target_where_they_say():
    target = TARGETS["mid"]
    rows, at = placement_rows(target, "last", fillers=FILLERS)
    assert at == FILLERS == len(rows) - 1 and rows[-1] == target
    rows, at = placement_rows(target, "among-long")
    assert rows[at] == target and all(r.length == TOPK for i, r in enumerate(rows) if i != at)
    rows, at = placement_rows(target, "among-short")
    assert rows[at] == target and all(r.length <= 16 for i, r in enumerate(rows) if i != at)
    rows, at = placement_rows(target, "first", fillers=6)
    assert at == 0 and {r.length for r in rows[1:]} == {TOPK, 1, 2, 3}
    with pytest.raises(ValueError, match="placement"):
        placement_rows(target, "middle")


def test_rows_select_distinct_slots_of_the_pool_and_only_those_hold_data():
    batches = [build_batch(*placement_rows(TARGETS["short"], p, fillers=5), CONFIG, 3, 6, "cpu") for p in PLACEMENTS]
    for batch in batches:
        for i, row in enumerate(batch.rows):
            chosen = batch.slots[i, : row.length]
            assert chosen.unique().numel() == row.length and int(chosen.max()) < POOL_SLOTS
            assert bool((batch.slots[i, row.length:] == INVALID).all())
    cache = pool_cache(batches, CONFIG, 3, "cpu")
    used = torch.unique(torch.cat([b.slots[b.slots != INVALID] for b in batches]))
    finite = torch.isfinite(cache.float()).all(dim=-1).flatten()
    assert torch.equal(finite.nonzero().flatten(), used)


def test_bit_share_and_difference_measures():
    a = torch.tensor([1.0, 2.0, float("nan"), float("-inf")], dtype=torch.bfloat16)
    b = torch.tensor([1.0, 2.015625, float("nan"), float("-inf")], dtype=torch.bfloat16)
    assert bits_equal_share(a, b) == 0.75
    assert max_abs_diff(a, b) == 0.015625
    assert max_abs_diff(a, torch.tensor([1.0, 2.0, 0.0, float("-inf")], dtype=torch.bfloat16)) == float("inf")
    assert max_abs_diff(a, torch.tensor([1.0, 2.0, float("nan"), 5.0], dtype=torch.bfloat16)) == float("inf")
