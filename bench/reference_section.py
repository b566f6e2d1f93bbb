"""The reference section: the oracle (float32 and float64) at the kernel's decode shapes, its
time, peak extra memory (``torch.cuda.max_memory_allocated`` above the level before the call)
and agreement with the kernel; at tiny shapes on the CPU; and the two targets at full scale."""

from __future__ import annotations

import time

import torch

from harness import AttentionInputs
from harness.timing import summarize, synchronize
from mla_constants import BF16_ROPE64, KV_LORA_RANK
from reference import sparse_mla_reference
from reference.oracle_fast import float32_uses_bf16_products

from .context import Context
from .counting import attention_bytes, attention_flops, reps_for
from .scenarios import kernel_scenario, planned_lens, random_cache, random_q, shape_record, tensor_bytes, with_config
from .selection import REFERENCE_BUDGET_BYTES, REFERENCE_MODES

GIB = 1 << 30


def peak_extra_bytes(fn, device: torch.device):
    """``(result, peak allocated bytes above the level before the call)``; None off CUDA."""
    if device.type != "cuda":
        return fn(), None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    result = fn()
    synchronize(device)
    return result, torch.cuda.max_memory_allocated(device) - base


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 (outputs: finite, 0 for empty rows)."""
    b = b.double()
    num = float((a.double() - b).norm())
    den = float(b.norm())
    return num / den if den > 0 else num


def measure_reference(ctx: Context, inputs: AttentionInputs, slots: torch.Tensor, lens: torch.Tensor, spec, mode: str):
    """Time and peak extra memory of one oracle call; returns ``(record, (out, lse))``."""
    q_nope, q_pe, ckv, kpe = inputs.q_nope, inputs.q_pe, inputs.ckv, inputs.kpe

    def call(i=0):
        return sparse_mla_reference(q_nope, q_pe, ckv, kpe, slots, lens=lens, sm_scale=spec.sm_scale,
                                    k_scale=spec.k_scale, mode=mode, memory_budget_bytes=REFERENCE_BUDGET_BYTES)

    t0 = time.perf_counter()
    result, peak = peak_extra_bytes(call, ctx.device)
    synchronize(ctx.device)
    first_s = time.perf_counter() - t0
    output_bytes = tensor_bytes(result[0]) + tensor_bytes(result[1])
    reps = reps_for(first_s, target_s=1.0, lo=2, hi=10)
    s = summarize(ctx.timer.wall_times(call, reps, warmup=0))
    total = int(lens.to(torch.int64).sum())
    flops = attention_flops(spec.num_heads, total, spec.rope_dim)
    problem_bytes = attention_bytes(lens.numel(), spec.num_heads, total, spec.rope_dim, spec.kv_dtype)["gathered"]
    record = {"mode": mode, **s, "flops": flops, "flops_per_s": flops / s["median_s"], "problem_bytes": problem_bytes,
              "peak_extra_bytes": peak, "output_bytes": output_bytes,
              "working_bytes": None if peak is None else peak - output_bytes,
              "memory_budget_bytes": REFERENCE_BUDGET_BYTES}
    if mode == "float32":
        record["bf16_products"] = float32_uses_bf16_products(q_nope, q_pe, ckv, kpe)
    return record, result


def reference_records(ctx: Context, kind: str, rows: int, scenario, inputs: AttentionInputs, slots, lens,
                      kernel_out: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """float32 and float64 references at one shape; their agreement with each other and
    with the kernel's output (same inputs) is recorded with the float64 one."""
    results = {}
    for mode in REFERENCE_MODES:
        record = shape_record(kind, rows, scenario)

        def run(mode=mode):
            rec, res = measure_reference(ctx, inputs, slots, lens, scenario.spec, mode)
            results[mode] = res
            return rec

        ctx.guarded("reference", record, run)
    truth = results.get("float64")
    if truth is None:
        return
    record = ctx.results["reference"][-1]
    if "float32" in results:
        record["float32_rel_l2_vs_float64"] = rel_l2(results["float32"][0], truth[0])
        record["float32_lse_max_abs_vs_float64"] = float(
            (results["float32"][1].double() - truth[1]).nan_to_num(0.0, 0.0, 0.0).abs().max())
    if kernel_out is not None:
        record["kernel_rel_l2_vs_float64"] = rel_l2(kernel_out[0][:rows], truth[0])


def decode_reference_problem(impl, rows: int, heads: int, topk: int, variant, device: torch.device,
                             generator: torch.Generator):
    """Decode inputs of the reference section without a kernel: ``(scenario, inputs, slots,
    lens)``, the slots from the reference convert rule, lens int64 on the host."""
    kv_dtype, rope, k_scale = variant
    base = kernel_scenario("decode", rows, topk)
    scenario = with_config(base, kv_dtype, rope, k_scale, heads)
    cache = random_cache(scenario, device, generator)
    q = random_q(rows, heads, scenario.spec.head_dim, device, generator)
    inputs = AttentionInputs(q_nope=q[..., :KV_LORA_RANK], q_pe=q[..., KV_LORA_RANK:], kv_cache=cache)
    return scenario, inputs, base.intended_slots()[:rows], planned_lens(impl, base).to(torch.int64)


def run_cpu_references(ctx: Context) -> None:
    """The reference section on the CPU at tiny shapes."""
    sel = ctx.sel
    generator = torch.Generator(device=ctx.device).manual_seed(1234)
    for rows in sel.reference_rows:
        for heads in sel.reference_heads:
            scenario, inputs, slots, lens = decode_reference_problem(ctx.impl, rows, heads, sel.topk, sel.variants[0],
                                                                     ctx.device, generator)
            reference_records(ctx, "decode", rows, scenario, inputs, slots, lens, None)


def find(records: list[dict], **where) -> dict | None:
    for r in records:
        if all(r.get(k) == v for k, v in where.items()) and "error" not in r:
            return r
    return None


def targets(results: dict, variant: str = BF16_ROPE64) -> dict:
    """The two targets of the reference at full scale, from the records."""
    out = {}
    for mode in REFERENCE_MODES:
        ref = find(results["reference"], kind="decode", rows=8192, heads=128, mode=mode, variant=variant)
        if ref is None or ref.get("peak_extra_bytes") is None:
            out[f"memory_{mode}"] = {"status": "not measured"}
            continue
        out[f"memory_{mode}"] = {
            "shape": "decode rows 8192 x H 128 x topk 2048",
            "peak_extra_gib": ref["peak_extra_bytes"] / GIB, "output_gib": ref["output_bytes"] / GIB,
            "working_gib": ref["working_bytes"] / GIB, "limit_gib": 4.0,
            "met": ref["peak_extra_bytes"] <= 4 * GIB,
        }
    ref = find(results["reference"], kind="decode", rows=256, heads=128, mode="float32", variant=variant)
    ker = find(results["kernel"], kind="decode", rows=256, heads=128, variant=variant)
    if ref is None or ker is None or "median_s" not in ker:
        out["time_ratio_float32"] = {"status": "not measured"}
    else:
        ratio = ref["median_s"] / ker["median_s"]
        out["time_ratio_float32"] = {"shape": "decode rows 256 x H 128 x topk 2048", "reference_s": ref["median_s"],
                                     "kernel_s": ker["median_s"], "ratio": ratio, "limit": 10.0, "met": ratio <= 10.0}
    return out
