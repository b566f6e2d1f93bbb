"""Host kv_len from each of the three context sources, and the MHA decode-prefix cut."""

from __future__ import annotations

import dataclasses

import torch

from fast import kvlen
from harness import batch, build_scenario
from mla_constants import TOPK
from reference import kv_len_rule


def spec_decode_scenario(async_scheduling: bool, slack: int = 0):
    spec = batch((TOPK + 3, 4), (TOPK - 1, 4), (40, 12), topk=TOPK, kpool=4, decode_threshold=4,
                 async_scheduling=async_scheduling, host_bound_slack=slack)
    return build_scenario(spec, seed=5)


def test_sync_path_reads_the_host_bound_without_touching_device_tensors():
    scenario = spec_decode_scenario(async_scheduling=False)
    meta = dataclasses.replace(scenario.meta, positions=None, seq_lens=torch.full_like(scenario.meta.seq_lens, -99))
    lens = kvlen.kv_lens_host(meta, TOPK, 4, async_scheduling=False)
    assert torch.equal(lens.long(), kv_len_rule(scenario.row_ctx, TOPK, 4))


def test_async_path_reads_positions_not_the_optimistic_bound():
    scenario = spec_decode_scenario(async_scheduling=True, slack=3)
    assert not torch.equal(scenario.meta.seq_lens_cpu_upper_bound, scenario.meta.seq_lens)
    lens = kvlen.kv_lens_host(scenario.meta, TOPK, 4, async_scheduling=True)
    assert torch.equal(lens.long(), kv_len_rule(scenario.row_ctx, TOPK, 4))
    optimistic = kvlen.kv_lens_host(scenario.meta, TOPK, 4, async_scheduling=False)
    assert not torch.equal(optimistic, lens), "the optimistic bound must differ on spec-decode rows"


def test_seq_lens_fallback_when_no_bound_and_no_positions():
    scenario = spec_decode_scenario(async_scheduling=True, slack=3)
    meta = dataclasses.replace(scenario.meta, positions=None, seq_lens_cpu_upper_bound=None)
    lens = kvlen.kv_lens_host(meta, TOPK, 4, async_scheduling=True)
    assert torch.equal(lens.long(), kv_len_rule(scenario.row_ctx, TOPK, 4))


def test_positions_shorter_than_the_rows_fall_back_to_seq_lens():
    scenario = spec_decode_scenario(async_scheduling=True, slack=3)
    meta = dataclasses.replace(scenario.meta, positions=scenario.meta.positions[:3])
    lens = kvlen.kv_lens_host(meta, TOPK, 4, async_scheduling=True)
    assert torch.equal(lens.long(), kv_len_rule(scenario.row_ctx, TOPK, 4))


def test_only_the_decode_prefix_is_planned_when_prefills_go_to_mha():
    scenario = spec_decode_scenario(async_scheduling=False)  # prefill seq_len 40 <= topk
    assert kvlen.prefills_use_dense_mha(scenario.meta, TOPK)
    lens = kvlen.kv_lens_host(scenario.meta, TOPK, 4, async_scheduling=False)
    planned = kvlen.planned_lens(scenario.meta, lens, TOPK)
    assert planned.numel() == scenario.meta.num_decode_tokens == 8
    assert scenario.planned_rows == 8


def test_all_rows_planned_when_a_prefill_is_longer_than_topk():
    scenario = build_scenario(batch((TOPK + 9, 1), (TOPK + 1, 16), topk=TOPK), seed=5)
    assert not kvlen.prefills_use_dense_mha(scenario.meta, TOPK)
    lens = kvlen.kv_lens_host(scenario.meta, TOPK, 1, async_scheduling=False)
    assert kvlen.planned_lens(scenario.meta, lens, TOPK).numel() == scenario.num_rows == 17


def test_empty_batch_plans_no_rows():
    scenario = build_scenario(batch(topk=TOPK), seed=5)
    assert kvlen.kv_lens_host(scenario.meta, TOPK, 4, async_scheduling=False).numel() == 0
