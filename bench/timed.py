"""One kernel shape timed the way the kernel section times it, with its rates against the
measured ceilings."""

from __future__ import annotations

from harness.timing import estimate_seconds, summarize

from .context import Context
from .counting import rates, reps_for, roofline_time


def timed_record(ctx: Context, fn, sets: int, flops: int, moved: dict[str, int]) -> dict:
    """Device times of ``fn(i)`` (CUDA events after a warm-up, at least one call per rotated
    set) and its rates against the measured ceilings."""
    estimate = estimate_seconds(fn, ctx.device)
    reps = max(sets, reps_for(estimate, target_s=ctx.sel.kernel_target_s, lo=20, hi=300))
    times, how = ctx.timer.device_times(fn, reps)
    s = summarize(times)
    out = {
        **s,
        **how,
        "flops": flops,
        "bytes": moved["gathered"],
        "bytes_unique": moved.get("unique"),
        **rates(s["median_s"], flops, moved["gathered"], ctx.matmul_rate, ctx.copy_rate),
    }
    if moved.get("unique"):
        out["bytes_unique_per_s"] = moved["unique"] / s["median_s"]
    if ctx.matmul_rate and ctx.copy_rate:
        floor = roofline_time(flops, moved["gathered"], ctx.matmul_rate, ctx.copy_rate)
        out["roofline_s"] = floor
        out["fraction_of_roofline"] = floor / s["median_s"]
    return out
