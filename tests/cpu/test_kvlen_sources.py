"""Host kv_len from each of the three context sources, and the MHA decode-prefix cut, through
the implementation under test (``impl.kv_lens`` / ``impl.planned_lens``), with the metadata's
device tensors (seq_lens, positions) on the test device."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness import batch, build_scenario
from harness.pipeline import meta_on_device
from mla_constants import TOPK
from reference import kv_len_rule
from tests.cpu.host_stages import host_stages_apart

impl = pytest.fixture(scope="module", name="impl")(host_stages_apart)


def spec_decode_scenario(async_scheduling: bool, slack: int = 0):
    spec = batch((TOPK + 3, 4), (TOPK - 1, 4), (40, 12), topk=TOPK, kpool=4, decode_threshold=4,
                 async_scheduling=async_scheduling, host_bound_slack=slack)
    return build_scenario(spec, seed=5)


def host_lens(impl, meta, *, kpool: int = 4, async_scheduling: bool) -> torch.Tensor:
    lens = impl.kv_lens(meta, topk=TOPK, kpool=kpool, async_scheduling=async_scheduling)
    assert lens.device.type == "cpu" and lens.dtype == torch.int32, (
        f"kv_lens must be host int32, got {lens.dtype} on {lens.device}"
    )
    return lens


def test_sync_path_reads_the_host_bound_without_touching_device_tensors(impl, device):
    scenario = spec_decode_scenario(async_scheduling=False)
    meta = dataclasses.replace(meta_on_device(scenario.meta, device), positions=None,
                               seq_lens=torch.full_like(scenario.meta.seq_lens, -99, device=device))
    lens = host_lens(impl, meta, async_scheduling=False)
    assert torch.equal(lens.long(), kv_len_rule(scenario.row_ctx, TOPK, 4))


def test_async_path_reads_positions_not_the_optimistic_bound(impl, device):
    scenario = spec_decode_scenario(async_scheduling=True, slack=3)
    meta = meta_on_device(scenario.meta, device)
    assert not torch.equal(scenario.meta.seq_lens_cpu_upper_bound, scenario.meta.seq_lens)
    lens = host_lens(impl, meta, async_scheduling=True)
    assert torch.equal(lens.long(), kv_len_rule(scenario.row_ctx, TOPK, 4))
    optimistic = host_lens(impl, meta, async_scheduling=False)
    assert not torch.equal(optimistic, lens), "the optimistic bound must differ on spec-decode rows"


def test_seq_lens_fallback_when_no_bound_and_no_positions(impl, device):
    scenario = spec_decode_scenario(async_scheduling=True, slack=3)
    meta = dataclasses.replace(meta_on_device(scenario.meta, device), positions=None, seq_lens_cpu_upper_bound=None)
    lens = host_lens(impl, meta, async_scheduling=True)
    assert torch.equal(lens.long(), kv_len_rule(scenario.row_ctx, TOPK, 4))


def test_positions_shorter_than_the_rows_fall_back_to_seq_lens(impl, device):
    scenario = spec_decode_scenario(async_scheduling=True, slack=3)
    meta = meta_on_device(scenario.meta, device)
    meta = dataclasses.replace(meta, positions=meta.positions[:3])
    lens = host_lens(impl, meta, async_scheduling=True)
    assert torch.equal(lens.long(), kv_len_rule(scenario.row_ctx, TOPK, 4))


def test_only_the_decode_prefix_is_planned_when_prefills_go_to_mha(impl, device):
    scenario = spec_decode_scenario(async_scheduling=False)  # prefill seq_len 40 <= topk
    meta = meta_on_device(scenario.meta, device)
    assert scenario.prefills_to_mha
    lens = host_lens(impl, meta, async_scheduling=False)
    planned = impl.planned_lens(meta, lens, topk=TOPK)
    assert planned.numel() == scenario.meta.num_decode_tokens == 8
    assert scenario.planned_rows == 8
    assert torch.equal(planned, lens[:8])


def test_all_rows_planned_when_a_prefill_is_longer_than_topk(impl, device):
    scenario = build_scenario(batch((TOPK + 9, 1), (TOPK + 1, 16), topk=TOPK), seed=5)
    meta = meta_on_device(scenario.meta, device)
    assert not scenario.prefills_to_mha
    lens = host_lens(impl, meta, kpool=1, async_scheduling=False)
    assert impl.planned_lens(meta, lens, topk=TOPK).numel() == scenario.num_rows == 17


def test_empty_batch_plans_no_rows(impl, device):
    scenario = build_scenario(batch(topk=TOPK), seed=5)
    meta = meta_on_device(scenario.meta, device)
    lens = host_lens(impl, meta, async_scheduling=False)
    assert lens.numel() == 0
    assert impl.planned_lens(meta, lens, topk=TOPK).numel() == 0


def test_every_context_source_gives_int64_contexts_on_the_host(device):
    """The contexts of the positions source are int64 on the host, as those of the host bound
    and of seq_lens, whatever the positions' integer type."""
    from fast.kvlen import ctx_from_positions, ctx_from_seq_lens

    positions = torch.tensor([4, 9, 2**31 - 1], dtype=torch.int32, device=device)
    ctx = ctx_from_positions(positions, 3)
    assert ctx.dtype == torch.int64 and ctx.device.type == "cpu", (ctx.dtype, ctx.device)
    assert ctx.tolist() == [5, 10, 2**31]
    seq = ctx_from_seq_lens(torch.tensor([3], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32))
    assert seq.dtype == ctx.dtype and seq.device == ctx.device


def test_async_path_reads_positions_that_cover_exactly_the_rows(impl, device):
    """Positions with one entry per row (no padded rows) are the async source: seq_lens is not
    read."""
    scenario = spec_decode_scenario(async_scheduling=True, slack=3)
    meta = meta_on_device(scenario.meta, device)
    assert meta.positions.shape[0] == scenario.num_rows, "test setup: no padded rows"
    meta = dataclasses.replace(meta, seq_lens=torch.full_like(meta.seq_lens, -99))
    lens = host_lens(impl, meta, async_scheduling=True)
    assert torch.equal(lens.long(), kv_len_rule(scenario.row_ctx, TOPK, 4))


def test_a_query_start_loc_longer_than_the_batch_gives_the_same_lens(impl, device):
    """query_start_loc as the engine's persistent buffer: entries past the batch's requests
    (repeating its last offset) are not read."""
    scenario = spec_decode_scenario(async_scheduling=False)
    meta = meta_on_device(scenario.meta, device)
    qsl = meta.query_start_loc_cpu
    longer = dataclasses.replace(meta, query_start_loc_cpu=torch.cat([qsl, qsl[-1:].repeat(3)]))
    assert torch.equal(host_lens(impl, longer, async_scheduling=False), host_lens(impl, meta, async_scheduling=False))


def test_an_empty_batch_of_padded_rows_has_no_contexts(device):
    """A step of padded rows only has positions for its padding but no row to give a context."""
    from fast.kvlen import row_contexts

    scenario = build_scenario(batch(topk=TOPK, padded_rows=3), seed=5)
    meta = meta_on_device(scenario.meta, device)
    assert meta.positions is not None and meta.positions.shape[0] == 3, "test setup: padded positions"
    assert row_contexts(meta, async_scheduling=True).numel() == 0


def test_a_batch_without_prefills_routes_nothing_to_dense_mha(device):
    from fast.kvlen import prefills_use_dense_mha

    scenario = build_scenario(batch((40, 1), (TOPK + 9, 1), topk=TOPK), seed=5)
    assert scenario.meta.num_prefills == 0
    assert prefills_use_dense_mha(meta_on_device(scenario.meta, device), TOPK) is False
