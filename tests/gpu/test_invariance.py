"""Batch invariance (docs/edges.md#invariance): a row's output bits against the batch it is
planned in. The same row (same q, same slots, same KV values) alone, first and last in a mixed
batch, among long rows and among short rows, through the production attention state.

What a release does is reported, not required: the share of the row's out and LSE elements
whose bits equal the row planned alone, and the largest difference (test property
``invariance``, and printed). A test fails when the row, or any row of a batch, is beyond its
error budget against the references, or when the row's output moves from its output alone by
more than its error budget (a finding).
"""

from __future__ import annotations

import pytest

from backends.flashinfer.port import make_attention_state
from backends.flashinfer.sm90_state import AttentionConfig
from harness.cases import VARIANTS, KernelConfig
from harness.invariance import (
    FILLERS,
    PLACEMENTS,
    TARGETS,
    bits_equal_share,
    build_batch,
    max_abs_diff,
    placement_rows,
    pool_cache,
)
from harness.port.launch import DEVICE, nan_buffers, sync
from harness.row_check import judge_rows
from mla_constants import INVALID, KV_LORA_RANK, TOPK

pytestmark = [pytest.mark.gpu, pytest.mark.edge("invariance")]

SEED = 29
#: One case more at a top-k of 128 (the short target at H 16, its long fillers of 128 slots): the
#: same batches at a width the simulated machine of the suite's self-tests runs in a second.
NARROW_TOPK = 128


def params():
    out = []
    for i, name in enumerate(TARGETS):
        for j, heads in enumerate((16, 128)):
            kv_dtype, rope, k_scale = VARIANTS[(2 * i + j) % len(VARIANTS)]
            config = KernelConfig(kv_dtype, rope, heads, k_scale)
            out.append(pytest.param(name, config, TOPK, id=f"{name}-{config.id}"))
            if name == "short" and heads == 16:
                out.append(pytest.param(name, config, NARROW_TOPK, id=f"{name}-{config.id}-topk{NARROW_TOPK}"))
    return out


def run_batch(state, batch, cache, config: KernelConfig, max_rows: int, regime_log):
    out, lse = nan_buffers(max_rows, config.num_heads)
    state.plan(len(batch.rows), batch.lens)
    state.step(batch.topk_indices, batch.block_table, batch.req_id, batch.q[..., :KV_LORA_RANK],
               batch.q[..., KV_LORA_RANK:], cache[..., :KV_LORA_RANK], cache[..., KV_LORA_RANK:], out, lse)
    sync()
    regime_log.kernel_ran()
    return out, lse


def judge_batch(batch, out, lse, cache, config: KernelConfig):
    n = len(batch.rows)
    slots = batch.slots.to(DEVICE)
    return judge_rows(out[:n], lse[:n], batch.q[:n, :, :KV_LORA_RANK], batch.q[:n, :, KV_LORA_RANK:],
                      cache[:, 0, :KV_LORA_RANK], cache[:, 0, KV_LORA_RANK:], slots.clamp(min=0), slots != INVALID,
                      sm_scale=config.sm_scale, k_scale=config.k_scale, kv_dtype=config.kv_dtype)


def table(found: dict) -> str:
    lines = ["placement     out bits equal  lse bits equal  out max|diff|  lse max|diff|  out change budget"]
    for placement, f in found.items():
        lines.append(f"{placement:<13} {f['out_bitwise_equal']:>14.4f}  {f['lse_bitwise_equal']:>14.4f}  "
                     f"{f['out_max_abs_diff']:>13.3g}  {f['lse_max_abs_diff']:>13.3g}  {f['out_change_budget']:>17.3g}")
    return "\n".join(lines)


@pytest.mark.parametrize(("target_name", "config", "topk"), params())
def test_row_output_against_the_batch_it_is_planned_in(impl, features, record_property, regime_log, target_name,
                                                        config, topk):
    target = TARGETS[target_name]
    max_rows = FILLERS + 1
    batches = {p: build_batch(*placement_rows(target, p, topk=topk), config, SEED, max_rows, DEVICE, topk)
               for p in PLACEMENTS}
    cache = pool_cache(list(batches.values()), config, SEED, DEVICE)
    state = make_attention_state(impl, AttentionConfig(
        num_heads=config.num_heads, max_rows=max_rows, width=topk, layout="compacted", block_size=1,
        sm_scale=config.sm_scale, rope_dim=config.rope_dim, kv_dtype=config.torch_kv_dtype,
        k_scale=config.k_scale), DEVICE)
    rows, problems = {}, []
    for placement, batch in batches.items():
        out, lse = run_batch(state, batch, cache, config, max_rows, regime_log)
        report = judge_batch(batch, out, lse, cache, config)
        t = batch.target
        rows[placement] = (
            out[t].clone(),
            lse[t].clone(),
            float(report.out.max_budget[t]),
            float(report.lse.max_budget[t]),
        )
        if not report.ok:
            def label(r, batch=batch, t=t):
                return f"row of key {batch.rows[r].key}, {batch.rows[r].length} slots" + (
                    ", the target" if r == t else ""
                )

            problems.append(f"{placement}: " + report.describe(label))
    alone_out, alone_lse, out_budget, lse_budget = rows["alone"]
    found = {}
    for placement, (out, lse, _, _) in rows.items():
        found[placement] = {
            "out_bitwise_equal": bits_equal_share(out, alone_out),
            "lse_bitwise_equal": bits_equal_share(lse, alone_lse),
            "out_max_abs_diff": max_abs_diff(out, alone_out),
            "lse_max_abs_diff": max_abs_diff(lse, alone_lse),
            "out_change_budget": out_budget,
            "lse_change_budget": lse_budget,
        }
        if found[placement]["out_max_abs_diff"] > out_budget or found[placement]["lse_max_abs_diff"] > lse_budget:
            problems.append(f"{placement}: the target row moved by more than its error budget from its output alone")
    record_property("invariance", {"flashinfer": features.version, "target": target_name, "topk": topk,
                                   "placements": found})
    summary = (
        f"flashinfer {features.version}, target {target_name} ({target.length} slots), {config.id}, topk {topk}\n"
        f"{table(found)}"
    )
    print(summary)
    assert not problems, summary + "\n" + "\n".join(problems)
