"""The plan section: ``plan()`` host time per layout, with and without
``AttentionConfig.reuse_plan``, with buffers sized for more rows than planned, a cProfile
breakdown of one plan and plan() while the device is still busy (bench/PLAN_COST.md reads them)."""

from __future__ import annotations

import cProfile
import dataclasses
import functools
import pstats
import time
from pathlib import Path

import torch

from backends.flashinfer.port import make_attention_state
from harness import build_scenario
from harness.timing import summarize, synchronize
from mla_constants import variant_name

from .context import Context, error_text, free_memory, log
from .counting import reps_for
from .scenarios import mixed_decode_spec, planned_lens, with_config

REPO_ROOT = str(Path(__file__).resolve().parents[1]) + "/"


def short_function(key: tuple) -> str:
    file, line, name = key
    for marker in ("site-packages/", "dist-packages/", REPO_ROOT):
        if marker in file:
            file = file.split(marker, 1)[1]
    return f"{file}:{line}({name})"


def profile_table(profile: cProfile.Profile, calls: int, sort: str, limit: int = 25) -> list[dict]:
    stats = pstats.Stats(profile).stats
    rows = [{"function": short_function(key), "calls_per_plan": nc / calls, "self_us_per_plan": tt / calls * 1e6,
             "cumulative_us_per_plan": ct / calls * 1e6} for key, (cc, nc, tt, ct, callers) in stats.items()]
    rows.sort(key=lambda r: r[sort], reverse=True)
    return rows[:limit]


def plan_state(ctx: Context, scenario, layout: str, rows: int, reuse: bool, max_rows: int | None = None):
    from harness.port.launch import attention_config

    config = dataclasses.replace(attention_config(scenario, layout, max_rows or rows), reuse_plan=reuse)
    return make_attention_state(ctx.impl, config, ctx.device)


def time_plans(ctx: Context, state, rows: int, lens: torch.Tensor) -> dict:
    """Host time of ``state.plan`` (device idle at each call), after a first plan."""
    for _ in range(2):
        state.plan(rows, lens)
    estimate = summarize(ctx.timer.host_times(lambda i, state=state: state.plan(rows, lens), 3, warmup=0))["median_s"]
    reps = reps_for(estimate, target_s=ctx.sel.plan_target_s, lo=10, hi=200)
    plans_before, reused_before = state.plans, state.reused_plans
    s = summarize(ctx.timer.host_times(lambda i, state=state: state.plan(rows, lens), reps, warmup=0))
    return {**s, "flashinfer_plans": (state.plans - plans_before) - (state.reused_plans - reused_before),
            "kept_plans": state.reused_plans - reused_before}


def measure_plan(
    ctx: Context, scenario, layout: str, rows: int, lens: torch.Tensor, max_rows: int | None = None
) -> dict:
    """plan() host time without and with reuse_plan, buffers sized for ``max_rows`` (default
    ``rows``); a refused plan is recorded as such."""
    out = {}
    for reuse in (False, True):
        key = "reuse" if reuse else "plan"
        state = plan_state(ctx, scenario, layout, rows, reuse, max_rows)
        try:
            state.plan(rows, lens)  # first plan: JIT build or load, workspace set-up
        except Exception as exc:
            out["rejected_at_plan"] = error_text(exc)
            return out
        out[key] = time_plans(ctx, state, rows, lens)
        del state
    out["speedup_with_reuse"] = out["plan"]["median_s"] / out["reuse"]["median_s"]
    return out


def profile_plan(ctx: Context, scenario, layout: str, rows: int, lens: torch.Tensor, calls: int = 20) -> dict:
    """cProfile of ``calls`` plans (the profiler inflates Python-heavy parts; read the
    shares, not the absolute times)."""
    state = plan_state(ctx, scenario, layout, rows, False)
    for _ in range(3):
        state.plan(rows, lens)
    synchronize(ctx.device)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        state.plan(rows, lens)
    profile.disable()
    synchronize(ctx.device)
    return {"calls": calls, "top_cumulative": profile_table(profile, calls, "cumulative_us_per_plan"),
            "top_self": profile_table(profile, calls, "self_us_per_plan")}


def plan_while_busy(ctx: Context, scenario, layout: str, rows: int, lens: torch.Tensor, busy_s: float = 0.005,
                    reps: int = 7) -> dict:
    """plan() host time when the device still has ``busy_s`` of work queued, against idle:
    a plan that waits for the device (a device-to-host read) takes about ``busy_s`` longer."""
    out = {"busy_s": busy_s}
    for reuse in (False, True):
        state = plan_state(ctx, scenario, layout, rows, reuse)
        for _ in range(3):
            state.plan(rows, lens)
        idle = summarize(ctx.timer.host_times(lambda i, state=state: state.plan(rows, lens), reps, warmup=0))
        busy = []
        for _ in range(reps):
            synchronize(ctx.device)
            if not ctx.timer.backlog(busy_s):
                return {"not_run": "no torch.cuda._sleep to keep the device busy"}
            t0 = time.perf_counter()
            state.plan(rows, lens)
            busy.append(time.perf_counter() - t0)
        synchronize(ctx.device)
        busy_summary = summarize(busy)
        out["reuse" if reuse else "plan"] = {
            "idle_median_s": idle["median_s"], "busy_median_s": busy_summary["median_s"],
            "waits_for_device": busy_summary["median_s"] - idle["median_s"] > 0.5 * busy_s,
        }
    return out


def plan_lens(ctx: Context, rows: int):
    base = build_scenario(mixed_decode_spec(rows, ctx.sel.topk), seed=1000 + rows)
    return base, planned_lens(ctx.impl, base)


def plan_record(layout: str, rows: int, max_rows: int, heads: int, variant: str, lens: torch.Tensor, topk: int) -> dict:
    return {"layout": layout, "rows": rows, "max_rows": max_rows, "heads": heads, "variant": variant,
            "lens_below_topk": int((lens < topk).sum()), "total_len": int(lens.to(torch.int64).sum())}


def run_plan_study(ctx: Context) -> None:
    """plan() per layout x rows x heads (buffers sized for the rows), then with buffers sized
    for the largest row count (a CUDA-graph state planned for fewer live rows), then the
    cProfile breakdown and the busy-device probe at one shape."""
    sel = ctx.sel
    (kv0, rope0, k0), fp8 = sel.variants[0], ("float8_e4m3fn", True, 0.5)
    cells = [(kv0, rope0, k0, h) for h in sel.plan_heads] + [(*fp8, h) for h in sel.plan_fp8_heads]
    lens_by_rows = {}
    for rows in sel.plan_rows:
        if ctx.expired():
            ctx.skip({"section": "plan", "rows": rows}, "time budget of the run spent")
            continue
        log(f"plan(): rows {rows}")
        try:
            lens_by_rows[rows] = plan_lens(ctx, rows)
        except Exception as exc:
            ctx.results["plan"].append({"rows": rows, "error": error_text(exc)})
            continue
        base, lens = lens_by_rows[rows]
        for layout in sel.plan_layouts:
            for kv_dtype, rope, k_scale, heads in cells:
                scenario = with_config(base, kv_dtype, rope, k_scale, heads)
                record = plan_record(layout, rows, rows, heads, variant_name(kv_dtype, rope), lens, sel.topk)
                ctx.guarded("plan", record, functools.partial(measure_plan, ctx, scenario, layout, rows, lens))
                free_memory(ctx.device)
    if not sel.plan_heads or not lens_by_rows:
        return
    heads, largest = max(sel.plan_heads), max(lens_by_rows)
    for rows, (base, lens) in sorted(lens_by_rows.items()):
        if rows == largest:
            continue
        scenario = with_config(base, kv0, rope0, k0, heads)
        record = plan_record("packed", rows, largest, heads, variant_name(kv0, rope0), lens, sel.topk)
        ctx.guarded("plan", record, functools.partial(measure_plan, ctx, scenario, "packed", rows, lens, largest))
        free_memory(ctx.device)
    probe = 256 if 256 in lens_by_rows else largest
    base, lens = lens_by_rows[probe]
    scenario = with_config(base, kv0, rope0, k0, heads)
    where = {"layout": "packed", "rows": probe, "heads": heads, "variant": variant_name(kv0, rope0)}
    ctx.results["plan_profile"] = ctx.guarded(
        "plan", dict(where), lambda: profile_plan(ctx, scenario, "packed", probe, lens), append=False)
    ctx.results["plan_busy_device"] = ctx.guarded(
        "plan", dict(where), lambda: plan_while_busy(ctx, scenario, "packed", probe, lens), append=False)
    free_memory(ctx.device)
