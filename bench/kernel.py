"""The kernel section: ``SM90AttentionState.attend`` after a plan and a convert + layout
(``harness.port.launch`` builds the config and the step inputs, as in the GPU tier), per variant x
heads x decode and prefill rows; time, FLOP/s and bytes/s against the measured ceilings. With
``--vllm``, FlashMLA's kernels on the same shape, caches and q right after FA3's
(``bench.flashmla``). The same scenario loop runs the reference and graph sections on the
decode shapes they select."""

from __future__ import annotations

import functools

import torch

from mla_constants import variant_name

from .context import Context, error_text, free_memory, log
from .counting import attention_bytes, attention_flops, rotation_count
from .flashmla import FLASHMLA_SEED, flashmla_unit
from .graph_step import measure_graph
from .reference_section import reference_records
from .scenarios import (
    Prepared,
    distinct_slots,
    kernel_scenario,
    planned_lens,
    prepare,
    random_cache,
    shape_record,
    with_config,
)
from .timed import timed_record


def time_kernel(ctx: Context, prep: Prepared, lens: torch.Tensor, distinct: int | None) -> dict:
    spec = prep.scenario.spec
    total = int(lens.to(torch.int64).sum())
    flops = attention_flops(spec.num_heads, total, spec.rope_dim)
    moved = attention_bytes(prep.rows, spec.num_heads, total, spec.rope_dim, spec.kv_dtype, distinct)
    return {
        **timed_record(ctx, prep.attend, prep.sets.count, flops, moved),
        "total_len": total,
        "rotation": {"caches": len(prep.sets.caches), "q_out_sets": len(prep.sets.qs)},
        "finite": prep.outputs_finite(),
    }


def run_scenarios(ctx: Context) -> None:
    sel = ctx.sel
    generator = torch.Generator(device=ctx.device).manual_seed(1234)
    flashmla_generator = torch.Generator(device=ctx.device).manual_seed(FLASHMLA_SEED)
    for kind, rows in sel.scenario_order():
        if ctx.expired():
            ctx.skip({"section": "kernel", "kind": kind, "rows": rows}, "time budget of the run spent")
            continue
        log(f"{kind} rows {rows}")
        try:
            base = kernel_scenario(kind, rows, sel.topk)
            lens = planned_lens(ctx.impl, base)
        except Exception as exc:
            ctx.results["kernel"].append({"kind": kind, "rows": rows, "error": error_text(exc)})
            continue
        distinct = None
        for index, (kv_dtype, rope, k_scale) in enumerate(sel.variants):
            if ctx.expired():
                ctx.skip({"section": "kernel", "kind": kind, "rows": rows, "variant": variant_name(kv_dtype, rope)},
                         "time budget of the run spent")
                continue
            try:
                first = with_config(base, kv_dtype, rope, k_scale, sel.heads[0])
                cache_bytes = first.num_slots * first.spec.head_dim * (1 if kv_dtype == "float8_e4m3fn" else 2)
                caches = [
                    random_cache(first, ctx.device, generator) for _ in range(rotation_count(cache_bytes, ctx.l2_bytes))
                ]
            except Exception as exc:
                ctx.results["kernel"].append({"kind": kind, "rows": rows, "variant": variant_name(kv_dtype, rope),
                                              "error": error_text(exc)})
                free_memory(ctx.device)
                continue
            for heads in sel.heads:
                scenario = with_config(base, kv_dtype, rope, k_scale, heads)
                holder = {}

                def kernel_unit(scenario=scenario, holder=holder, lens=lens, caches=caches, rows=rows):
                    nonlocal distinct
                    holder["prep"] = prep = prepare(ctx, scenario, lens, caches, generator)
                    if distinct is None:
                        distinct = distinct_slots(prep.state, rows)
                    if "kernel" not in ctx.sections:
                        return {"not_timed": "kernel section not selected"}
                    return time_kernel(ctx, prep, lens, distinct)

                fa3 = ctx.guarded("kernel", shape_record(kind, rows, scenario), kernel_unit)
                del kernel_unit  # its defaults hold the caches, freed below
                prep = holder.get("prep")
                if ctx.flashmla is not None and "kernel" in ctx.sections:
                    flashmla_beside(ctx, kind, scenario, lens, caches, prep, fa3, flashmla_generator)
                if prep is not None and index == 0 and kind == "decode":
                    extra_units(ctx, kind, rows, scenario, prep, lens)
                holder.clear()
                del prep
                free_memory(ctx.device)
            caches = None
            free_memory(ctx.device)


def flashmla_beside(ctx: Context, kind: str, scenario, lens: torch.Tensor, caches, prep: Prepared | None,
                    fa3: dict | None, generator: torch.Generator) -> None:
    """FlashMLA on FA3's shape, caches and q of set 0, with FA3's output of those inputs (where
    FA3 was timed) measured against the same reference."""
    fa3_timed = prep is not None and fa3 is not None and "median_s" in fa3
    unit = functools.partial(flashmla_unit, ctx, scenario, lens, caches, generator,
                             fa3_inputs=prep.sets.inputs(0) if prep is not None else None,
                             fa3_out=prep.sets.out(0)[0] if fa3_timed else None)
    ctx.guarded("flashmla", shape_record(kind, lens.numel(), scenario), unit)
    free_memory(ctx.device)


def extra_units(ctx: Context, kind: str, rows: int, scenario, prep: Prepared, lens: torch.Tensor) -> None:
    sel, heads = ctx.sel, scenario.spec.num_heads
    if "reference" in ctx.sections and rows in sel.reference_rows and heads in sel.reference_heads:
        device_lens = lens.to(device=ctx.device, dtype=torch.int64)
        kernel_out = prep.sets.out(0) if "kernel" in ctx.sections else None
        reference_records(
            ctx, kind, rows, scenario, prep.sets.inputs(0), prep.state.slots[:rows], device_lens, kernel_out
        )
        free_memory(ctx.device)
    if "graph" in ctx.sections and rows in sel.graph_rows and heads in sel.graph_heads:
        for layout in sel.graph_layouts:
            record = {**shape_record(kind, rows, scenario), "layout": layout}
            ctx.guarded("graph", record, functools.partial(measure_graph, ctx, prep, lens, layout))
            free_memory(ctx.device)
