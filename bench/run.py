"""Benchmark entry point: the production path against the hardware limits, plan() host time,
a CUDA-graph step against the eager step, and the reference oracle at full scale.

    python3 -m bench.run --out DIR            # one H200 with FlashInfer: about 3-4 minutes
    python3 -m bench.run --out DIR --quick    # a small subset (smoke check on a GPU)
    python3 -m bench.run --out DIR --cpu-smoke  # no GPU: reference at tiny shapes, outputs
    python3 -m bench.run --out DIR --vllm PATH  # FlashMLA (vLLM's FLASHMLA_SPARSE) beside FA3

Writes ``DIR/bench.json`` (every number and the environment), ``DIR/bench.md`` and, when
matplotlib is installed, ``DIR/roofline.png``; prints the markdown last. No new measurement
starts after ``--budget-s`` seconds (its units are listed as skipped), so the run ends in time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from fast.impl import default_impl
from harness.timing import Timer
from recording.environment import runtime_environment

from .ceilings import measure_ceilings
from .context import Context, gpu_unavailable_reason, log
from .flashmla import open_flashmla, run_flashmla_alone
from .kernel import run_scenarios
from .plan_cost import run_plan_study
from .reference_section import run_cpu_references, targets
from .report import counting_text, markdown, write_json, write_roofline
from .selection import CPU_SMOKE, FULL, QUICK, describe_subset

SECTIONS = ("ceilings", "plan", "kernel", "graph", "reference")
DEFAULT_BUDGET_S = 270.0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m bench.run", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path, help="directory for bench.json, bench.md, roofline.png")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a much smaller subset (smoke check on a GPU)")
    mode.add_argument("--cpu-smoke", action="store_true", help="no GPU: the reference at tiny shapes and the outputs")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help=f"start no new measurement after this many seconds (default {DEFAULT_BUDGET_S:g})")
    p.add_argument("--vllm", metavar="PATH",
                   help="time FlashMLA beside FA3 from this vLLM release: a wheel, a folder holding the vllm package "
                        "(a slice with FlashMLA's .so), or 'installed'")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    return p.parse_args(argv)


def selected_sections(text: str) -> frozenset:
    chosen = frozenset(s.strip() for s in text.split(",") if s.strip())
    unknown = chosen - set(SECTIONS)
    if unknown:
        raise SystemExit(f"--sections: unknown {sorted(unknown)}; choose from {SECTIONS}")
    return chosen


def device_facts(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    props = torch.cuda.get_device_properties(device)
    facts = {"sm_count": props.multi_processor_count, "capability": f"{props.major}.{props.minor}",
             "memory_bytes": props.total_memory, "l2_bytes": getattr(props, "L2_cache_size", None),
             "allow_tf32_matmul": torch.backends.cuda.matmul.allow_tf32}
    try:
        from backends.flashinfer.compat import detect_features

        facts["flashinfer_features"] = detect_features(device).describe()  # what plan() and run() check, probed
    except Exception as exc:
        facts["flashinfer_features"] = f"unavailable: {type(exc).__name__}: {exc}"
    return facts


def l2_bytes_of(device: torch.device) -> int:
    if device.type == "cuda":
        size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
        if size:
            return int(size)
    return 64 << 20


def make_context(args, device: torch.device, start: float) -> Context:
    sel = CPU_SMOKE if args.cpu_smoke else QUICK if args.quick else FULL
    return Context(impl=default_impl(), device=device, timer=Timer(device), sel=sel, deadline=start + args.budget_s,
                   l2_bytes=l2_bytes_of(device), sections=selected_sections(args.sections))


def run_gpu(ctx: Context, data: dict) -> None:
    if "plan" in ctx.sections:
        log("plan() study")
        run_plan_study(ctx)
    if ctx.sections & {"kernel", "graph", "reference"}:
        log("kernel / reference / graph")
        run_scenarios(ctx)


def run_cpu(ctx: Context, data: dict) -> None:
    reason = gpu_unavailable_reason() or "--cpu-smoke asked for the CPU"
    data["not_run"] = {name: reason for name in ("kernel", "plan", "graph")}
    if "reference" in ctx.sections:
        log("reference at tiny shapes (CPU)")
        run_cpu_references(ctx)
    if ctx.flashmla is not None and "kernel" in ctx.sections:
        log("FlashMLA at tiny shapes (CPU), without FA3")
        run_flashmla_alone(ctx)


def flashmla_status(args, ctx: Context, measures: bool) -> dict:
    """FlashMLA's backend opened into ``ctx`` where the run measures kernels and ``--vllm``
    names a release it opens from; what happened, for the JSON and the report."""
    if not measures:
        return {"status": "not run", "reason": "this run measures no kernel (see not run)"}
    if "kernel" not in ctx.sections:
        return {"status": "not run", "reason": "kernel section not selected"}
    log("FlashMLA (--vllm)" if args.vllm else "FlashMLA: no --vllm")
    ctx.flashmla, reason = open_flashmla(args.vllm)
    if reason:
        return {"status": "not run", "reason": reason}
    return {"status": "run", "source": ctx.flashmla.source.describe(), "backend": ctx.flashmla.describe()}


def main(argv=None) -> int:
    start = time.monotonic()
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    reason = None if args.cpu_smoke else gpu_unavailable_reason()
    device = torch.device("cpu" if args.cpu_smoke or reason else "cuda")
    ctx = make_context(args, device, start)
    data = {
        "schema": 1,
        "command": " ".join(["python3 -m bench.run"] + (sys.argv[1:] if argv is None else list(argv))),
        "mode": ctx.sel.name,
        "environment": {**runtime_environment(), **device_facts(device)},
        "counting": counting_text(),
        "subset": describe_subset(ctx.sel),
    }
    data["flashmla_backend"] = flashmla_status(args, ctx, measures=not reason or args.cpu_smoke)
    if reason and not args.cpu_smoke:
        data["not_run"] = {"all": f"{reason} (use --cpu-smoke on a machine without an SM90 GPU)"}
    else:
        if "ceilings" in ctx.sections:
            log("ceilings")
            measure_ceilings(ctx)
        ctx.timer.calibrate()  # after the ceilings: clocks are up
        data["environment"]["sleep_cycles_per_s"] = ctx.timer.sleep_cycles_per_s
        (run_cpu if device.type == "cpu" else run_gpu)(ctx, data)
    data["ceilings"] = ctx.ceilings
    data.update(ctx.results)
    data["targets"] = targets(ctx.results)
    if device.type == "cuda":
        data["environment"]["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    try:
        from backends.flashinfer.compat import distinct_warnings

        data["flashinfer_warnings"] = distinct_warnings()
    except Exception:
        pass
    data["plot"] = write_roofline(args.out / "roofline.png", data)
    data["elapsed_s"] = time.monotonic() - start
    write_json(args.out / "bench.json", data)
    text = markdown(data)
    (args.out / "bench.md").write_text(text)
    log(f"wrote {args.out / 'bench.json'}, {args.out / 'bench.md'}; plot {data['plot']}")
    print(text, flush=True)
    return 1 if reason and not args.cpu_smoke else 0


if __name__ == "__main__":
    sys.exit(main())
