"""The measurements, each on the project's own production path and scenarios:

- the attention kernel: ``SM90AttentionState.attend`` after a plan and a convert + layout
  (``harness.launch`` builds the config and the step inputs, as in the GPU tier);
- ``plan()`` host time per layout, with and without ``AttentionConfig.reuse_plan``, a
  cProfile breakdown of one plan and plan() while the device is still busy;
- a CUDA-graph replay of one step (convert -> layout -> run) against the eager step;
- the reference oracle (float32 and float64): time, peak extra memory, and its agreement
  with the kernel.

Scenarios come from ``harness.build_scenario`` (block tables, indexer rows, lens); q and KV
values are drawn on the device (their values do not matter for timing, and drawing tens of
GB of them on the host would take minutes). Every unit is guarded: a failure is recorded
with its shape and the others still run.
"""

from __future__ import annotations

import cProfile
import dataclasses
import gc
import pstats
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fast.layouts import LAYOUTS
from harness import AttentionInputs, batch, build_scenario
from harness.cases import VARIANTS, KernelConfig
from harness.timing import Timer, estimate_seconds, summarize, synchronize
from mla_constants import BF16_ROPE64, FP8_ROPE64, KV_LORA_RANK, TOPK, variant_name
from reference import sparse_mla_reference
from reference.oracle import float32_uses_bf16_products

from .counting import attention_bytes, attention_flops, rates, reps_for, roofline_time, rotation_count

KERNEL_LAYOUT = "packed"  # the layout of later production (the kernel reads the same either way)
REFERENCE_BUDGET_BYTES = 1 << 30  # memory_budget_bytes handed to the oracle
REFERENCE_MODES = ("float32", "float64")
GIB = 1 << 30


@dataclass(frozen=True)
class Selection:
    """Which shapes a run measures."""

    name: str
    topk: int
    variants: tuple[tuple[str, bool, float], ...]  # (kv_dtype, rope, k_scale), as harness.cases.VARIANTS
    heads: tuple[int, ...]
    decode_rows: tuple[int, ...]
    prefill_rows: tuple[int, ...]
    plan_rows: tuple[int, ...]
    plan_heads: tuple[int, ...]
    plan_fp8_heads: tuple[int, ...]
    plan_layouts: tuple[str, ...]
    graph_rows: tuple[int, ...]
    graph_heads: tuple[int, ...]
    graph_layouts: tuple[str, ...]
    reference_rows: tuple[int, ...]
    reference_heads: tuple[int, ...]
    kernel_target_s: float = 0.15  # device time aimed at per kernel shape
    plan_target_s: float = 0.25
    ceiling_copy_bytes: int = 1 << 30
    ceiling_matmul_n: int = 8192
    ceiling_reps: int = 20

    def __post_init__(self) -> None:
        for name in ("graph", "reference"):
            rows, heads = getattr(self, f"{name}_rows"), getattr(self, f"{name}_heads")
            if not set(rows) <= set(self.decode_rows) or not set(heads) <= set(self.heads):
                raise ValueError(f"{self.name}: {name} shapes must be decode shapes of the kernel section")

    def scenario_order(self) -> list[tuple[str, int]]:
        return [("decode", r) for r in self.decode_rows] + [("prefill", r) for r in self.prefill_rows]


FULL = Selection(
    name="full", topk=TOPK, variants=VARIANTS, heads=(16, 64, 128),
    decode_rows=(1, 64, 256, 1024, 8192), prefill_rows=(64, 256, 1024, 8192),
    plan_rows=(1, 64, 256, 1024, 8192), plan_heads=(16, 64, 128), plan_fp8_heads=(128,), plan_layouts=LAYOUTS,
    graph_rows=(1, 64, 1024), graph_heads=(16, 128), graph_layouts=LAYOUTS,
    reference_rows=(1, 64, 256, 1024, 8192), reference_heads=(16, 64, 128),
)
QUICK = Selection(
    name="quick", topk=TOPK, variants=VARIANTS[:1], heads=(16, 128),
    decode_rows=(1, 256), prefill_rows=(1024,),
    plan_rows=(64, 256), plan_heads=(128,), plan_fp8_heads=(), plan_layouts=LAYOUTS,
    graph_rows=(256,), graph_heads=(128,), graph_layouts=("packed",),
    reference_rows=(1, 256), reference_heads=(16, 128),
    kernel_target_s=0.05, plan_target_s=0.1, ceiling_copy_bytes=256 << 20, ceiling_matmul_n=4096, ceiling_reps=10,
)
CPU_SMOKE = Selection(
    name="cpu-smoke", topk=128, variants=VARIANTS[:1], heads=(4, 8),
    decode_rows=(1, 4), prefill_rows=(),
    plan_rows=(), plan_heads=(), plan_fp8_heads=(), plan_layouts=(),
    graph_rows=(), graph_heads=(), graph_layouts=(),
    reference_rows=(1, 4), reference_heads=(4, 8),
    kernel_target_s=0.01, plan_target_s=0.01, ceiling_copy_bytes=32 << 20, ceiling_matmul_n=256, ceiling_reps=5,
)


def describe_subset(sel: Selection) -> dict[str, str]:
    """What each section covers, in words (recorded in the JSON and the markdown)."""
    variants = ", ".join(variant_name(k, r) for k, r, _ in sel.variants)
    return {
        "kernel": (f"variants {variants} (each its own JIT build; fp8 NoPE would be a fourth) x H {list(sel.heads)} "
                   f"x decode rows {list(sel.decode_rows)} (one request per row, distinct KV) and prefill rows "
                   f"{list(sel.prefill_rows)} (one request of that many query tokens, its rows share one KV pool; "
                   f"a 1-row prefill is a decode row); topk {sel.topk}, kpool 1, every row selecting topk slots; "
                   f"layout {KERNEL_LAYOUT}; the state plans one query row per token, so decode and prefill differ "
                   "only in how much KV the rows share"),
        "plan": (f"layouts {list(sel.plan_layouts)} x rows {list(sel.plan_rows)} x H {list(sel.plan_heads)} "
                 f"({variant_name(*sel.variants[0][:2])}), plus {FP8_ROPE64} at H {list(sel.plan_fp8_heads)}; "
                 "decode rows of mixed lengths (some shorter than topk); with and without reuse_plan"),
        "graph": (f"decode rows {list(sel.graph_rows)} x H {list(sel.graph_heads)} x layouts {list(sel.graph_layouts)}, "
                  f"{variant_name(*sel.variants[0][:2])}"),
        "reference": (f"decode rows {list(sel.reference_rows)} x H {list(sel.reference_heads)}, "
                      f"{variant_name(*sel.variants[0][:2])}, modes {list(REFERENCE_MODES)}, "
                      f"memory_budget_bytes {REFERENCE_BUDGET_BYTES}"),
    }


# --- bookkeeping -----------------------------------------------------------------------------


def log(text: str) -> None:
    print(f"[bench] {text}", flush=True)


def error_text(exc: BaseException, limit: int = 600) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass
class Context:
    impl: object
    device: torch.device
    timer: Timer
    sel: Selection
    deadline: float  # time.monotonic() after which no new unit starts
    l2_bytes: int
    ceilings: dict = field(default_factory=dict)
    sections: frozenset = frozenset({"ceilings", "plan", "kernel", "graph", "reference"})
    results: dict = field(default_factory=lambda: {"kernel": [], "plan": [], "graph": [], "reference": [], "skipped": []})

    def expired(self) -> bool:
        return time.monotonic() > self.deadline

    def skip(self, what: dict, reason: str) -> None:
        self.results["skipped"].append({**what, "reason": reason})

    def guarded(self, section: str, record: dict, fn, *, append: bool = True) -> dict | None:
        """Run ``fn()`` into ``record`` (appended to ``section``); a failure is recorded.
        None when the time budget is spent (the unit is listed as skipped)."""
        if self.expired():
            self.skip({"section": section, **record}, "time budget of the run spent")
            return None
        try:
            record.update(fn())
        except Exception as exc:  # one failing unit must not stop the others
            record["error"] = error_text(exc)
            record["traceback"] = traceback.format_exc(limit=6)[-1500:]
        if append:
            self.results[section].append(record)
        return record

    @property
    def matmul_rate(self) -> float | None:
        return self.ceilings.get("matmul", {}).get("flops_per_s")

    @property
    def copy_rate(self) -> float | None:
        return self.ceilings.get("copy", {}).get("bytes_per_s")


# --- scenarios and device data ---------------------------------------------------------------


def decode_spec(rows: int, topk: int):
    """``rows`` decode requests whose every row selects topk slots (ctx > topk, kpool 1)."""
    return batch(*[(topk + 64, 1)] * rows, topk=topk, kpool=1)


def prefill_spec(rows: int, topk: int):
    """One chunked-prefill request of ``rows`` query tokens, each with ctx > topk."""
    return batch((rows + topk + 64, rows), topk=topk, kpool=1)


def mixed_decode_spec(rows: int, topk: int):
    """``rows`` decode requests with lengths spread over (topk/2, 5 topk/2): some rows
    shorter than topk (len = ctx), the rest topk."""
    return batch(*[(topk // 2 + (i * 997) % (2 * topk), 1) for i in range(rows)], topk=topk, kpool=1)


def kernel_scenario(kind: str, rows: int, topk: int):
    spec = decode_spec(rows, topk) if kind == "decode" else prefill_spec(rows, topk)
    return build_scenario(spec, seed=rows * 2 + (kind == "prefill"))


def planned_lens(impl, scenario) -> torch.Tensor:
    """Host int32 lens of the planned rows, as the production builder computes them."""
    spec, meta = scenario.spec, scenario.meta
    lens = impl.kv_lens(meta, topk=spec.topk, kpool=spec.kpool, async_scheduling=spec.async_scheduling)
    return impl.planned_lens(meta, lens, topk=spec.topk).to(torch.int32)


def with_config(scenario, kv_dtype: str, rope: bool, k_scale: float, heads: int):
    """The scenario under one kernel configuration (slots and lens do not depend on it)."""
    return dataclasses.replace(scenario, spec=KernelConfig(kv_dtype, rope, heads, k_scale).apply(scenario.spec))


def random_cache(scenario, device: torch.device, generator: torch.Generator) -> torch.Tensor:
    """``[num_blocks, block_size, 512 + R]`` of the spec's dtype, standard normal values."""
    spec = scenario.spec
    cache = torch.empty((scenario.num_blocks, spec.block_size, spec.head_dim), dtype=spec.torch_kv_dtype, device=device)
    flat = cache.view(-1, spec.head_dim)
    step = max(1, (256 << 20) // (2 * spec.head_dim))
    for start in range(0, flat.shape[0], step):
        part = flat[start : start + step]
        part.copy_(torch.randn(part.shape, dtype=torch.bfloat16, device=device, generator=generator))
    return cache


def random_q(rows: int, heads: int, head_dim: int, device: torch.device, generator: torch.Generator) -> torch.Tensor:
    return torch.randn((rows, heads, head_dim), dtype=torch.bfloat16, device=device, generator=generator)


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class Sets:
    """Rotated input/output sets of one shape. Set ``i % count`` pairs ``caches[j % len]`` and
    ``qs[j % len]`` (j = i % count) with its own out/lse, so an output always comes from the
    same inputs whatever the two rotation lengths."""

    caches: list[torch.Tensor]
    qs: list[torch.Tensor]
    outs: list[tuple[torch.Tensor, torch.Tensor]]  # one per set: len(outs) == count

    @property
    def count(self) -> int:
        return max(len(self.caches), len(self.qs))

    def inputs(self, i: int) -> AttentionInputs:
        j = i % self.count
        q = self.qs[j % len(self.qs)]
        return AttentionInputs(q_nope=q[..., :KV_LORA_RANK], q_pe=q[..., KV_LORA_RANK:], kv_cache=self.caches[j % len(self.caches)])

    def out(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.outs[i % self.count]


def make_sets(scenario, caches, rows: int, device, generator, l2_bytes: int) -> Sets:
    spec = scenario.spec
    per_set = rows * spec.num_heads * (spec.head_dim * 2 + KV_LORA_RANK * 2 + 4)
    count = rotation_count(per_set, l2_bytes)
    qs = [random_q(rows, spec.num_heads, spec.head_dim, device, generator) for _ in range(count)]
    outs = [(torch.full((rows, spec.num_heads, KV_LORA_RANK), float("nan"), dtype=torch.bfloat16, device=device),
             torch.full((rows, spec.num_heads), float("nan"), dtype=torch.float32, device=device))
            for _ in range(max(count, len(caches)))]
    return Sets(caches, qs, outs)


@dataclass
class Prepared:
    """A planned state with its slots laid out, ready to ``attend`` on rotated sets."""

    scenario: object
    state: object
    launch: object
    sets: Sets
    rows: int

    def attend(self, i: int) -> None:
        x = self.sets.inputs(i)
        out, lse = self.sets.out(i)
        self.state.attend(x.q_nope, x.q_pe, x.ckv, x.kpe, out, lse)

    def step_args(self, i: int):
        x = self.sets.inputs(i)
        out, lse = self.sets.out(i)
        l = self.launch
        return (l.topk_indices, l.block_table, l.req_id, x.q_nope, x.q_pe, x.ckv, x.kpe, out, lse)

    def outputs_finite(self) -> bool:
        n = self.rows
        return all(bool(torch.isfinite(o[:n].float()).all()) and bool(torch.isfinite(l[:n]).all()) for o, l in self.sets.outs)


def prepare(ctx: Context, scenario, lens: torch.Tensor, caches, generator, layout: str = KERNEL_LAYOUT) -> Prepared:
    from harness.launch import attention_config, launch_inputs

    rows = lens.numel()
    sets = make_sets(scenario, caches, rows, ctx.device, generator, ctx.l2_bytes)
    state = ctx.impl.make_attention_state(attention_config(scenario, layout, rows), ctx.device)
    state.plan(rows, lens)
    launch = launch_inputs(ctx.impl, scenario, sets.inputs(0), rows)
    state.write_indices(launch.topk_indices, launch.block_table, launch.req_id)
    synchronize(ctx.device)
    return Prepared(scenario, state, launch, sets, rows)


def distinct_slots(state, rows: int) -> int:
    slots = state.slots[:rows]
    return int(torch.unique(slots[slots >= 0]).numel())


# --- the kernel ------------------------------------------------------------------------------


def shape_record(kind: str, rows: int, scenario) -> dict:
    spec = scenario.spec
    return {"variant": variant_name(spec.kv_dtype, spec.rope), "kind": kind, "rows": rows, "heads": spec.num_heads,
            "topk": spec.topk, "rope_dim": spec.rope_dim, "kv_dtype": spec.kv_dtype}


def time_kernel(ctx: Context, prep: Prepared, lens: torch.Tensor, distinct: int | None) -> dict:
    spec = prep.scenario.spec
    total = int(lens.to(torch.int64).sum())
    flops = attention_flops(spec.num_heads, total, spec.rope_dim)
    moved = attention_bytes(prep.rows, spec.num_heads, total, spec.rope_dim, spec.kv_dtype, distinct)
    estimate = estimate_seconds(prep.attend, ctx.device)
    reps = max(prep.sets.count, reps_for(estimate, target_s=ctx.sel.kernel_target_s, lo=20, hi=300))
    times, how = ctx.timer.device_times(prep.attend, reps)
    s = summarize(times)
    out = {**s, **how, "total_len": total, "flops": flops, "bytes": moved["gathered"], "bytes_unique": moved.get("unique"),
           "rotation": {"caches": len(prep.sets.caches), "q_out_sets": len(prep.sets.qs)},
           "finite": prep.outputs_finite(),
           **rates(s["median_s"], flops, moved["gathered"], ctx.matmul_rate, ctx.copy_rate)}
    if moved.get("unique"):
        out["bytes_unique_per_s"] = moved["unique"] / s["median_s"]
    if ctx.matmul_rate and ctx.copy_rate:
        floor = roofline_time(flops, moved["gathered"], ctx.matmul_rate, ctx.copy_rate)
        out["roofline_s"] = floor
        out["fraction_of_roofline"] = floor / s["median_s"]
    return out


# --- the reference ---------------------------------------------------------------------------


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


# --- the CUDA-graph step ---------------------------------------------------------------------


def measure_graph(ctx: Context, prep: Prepared, lens: torch.Tensor, layout: str) -> dict:
    """Eager ``state.step`` against a CUDA graph captured once over the same step, one step
    per rotated set (so one replay runs ``count`` steps); times are per step."""
    from harness.launch import attention_config

    rows = prep.rows
    state = ctx.impl.make_attention_state(attention_config(prep.scenario, layout, rows), ctx.device)
    try:
        state.plan(rows, lens)
    except Exception as exc:
        return {"rejected_at_plan": error_text(exc)}
    count = prep.sets.count
    args = [prep.step_args(i) for i in range(count)]

    def eager(i):
        state.step(*args[i % count])

    for i in range(max(2, count)):
        eager(i)
    synchronize(ctx.device)
    out, lse = prep.sets.out(0)
    want = out[:rows].clone(), lse[:rows].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(count):
            state.step(*args[i])
    synchronize(ctx.device)

    def replay(i):
        graph.replay()

    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    replay(0)
    synchronize(ctx.device)
    same = torch.equal(out[:rows], want[0]) and torch.equal(lse[:rows], want[1])
    reps = max(count, reps_for(estimate_seconds(eager, ctx.device), target_s=ctx.sel.kernel_target_s, lo=20, hi=300))
    replays = max(10, reps // count)
    eager_dev, eager_how = ctx.timer.device_times(eager, reps)
    graph_dev, graph_how = ctx.timer.device_times(replay, replays)
    record = {
        "layout": layout,
        "replay_equals_eager": same,
        "steps_per_replay": count,
        "eager_device": summarize(eager_dev),
        "graph_device": summarize([t / count for t in graph_dev]),
        "eager_wall_per_step_s": ctx.timer.throughput(eager, reps),
        "graph_wall_per_step_s": ctx.timer.throughput(replay, replays) / count,
        "eager_host_enqueue_s": eager_how.get("host_enqueue_s"),
        "graph_host_enqueue_per_step_s": (graph_how.get("host_enqueue_s") or 0.0) / count,
    }
    return record


# --- plan() ----------------------------------------------------------------------------------


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
    from harness.launch import attention_config

    config = dataclasses.replace(attention_config(scenario, layout, max_rows or rows), reuse_plan=reuse)
    return ctx.impl.make_attention_state(config, ctx.device)


def time_plans(ctx: Context, state, rows: int, lens: torch.Tensor) -> dict:
    """Host time of ``state.plan`` (device idle at each call), after a first plan."""
    for _ in range(2):
        state.plan(rows, lens)
    estimate = summarize(ctx.timer.host_times(lambda i: state.plan(rows, lens), 3, warmup=0))["median_s"]
    reps = reps_for(estimate, target_s=ctx.sel.plan_target_s, lo=10, hi=200)
    plans_before, reused_before = state.plans, state.reused_plans
    s = summarize(ctx.timer.host_times(lambda i: state.plan(rows, lens), reps, warmup=0))
    return {**s, "flashinfer_plans": (state.plans - plans_before) - (state.reused_plans - reused_before),
            "kept_plans": state.reused_plans - reused_before}


def measure_plan(ctx: Context, scenario, layout: str, rows: int, lens: torch.Tensor, max_rows: int | None = None) -> dict:
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
        idle = summarize(ctx.timer.host_times(lambda i: state.plan(rows, lens), reps, warmup=0))
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
                ctx.guarded("plan", record, lambda: measure_plan(ctx, scenario, layout, rows, lens))
                free_memory(ctx.device)
    if not sel.plan_heads or not lens_by_rows:
        return
    heads, largest = max(sel.plan_heads), max(lens_by_rows)
    for rows, (base, lens) in sorted(lens_by_rows.items()):
        if rows == largest:
            continue
        scenario = with_config(base, kv0, rope0, k0, heads)
        record = plan_record("packed", rows, largest, heads, variant_name(kv0, rope0), lens, sel.topk)
        ctx.guarded("plan", record, lambda: measure_plan(ctx, scenario, "packed", rows, lens, largest))
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


# --- the scenario loop (kernel, reference, graph) ------------------------------------------


def run_scenarios(ctx: Context) -> None:
    sel = ctx.sel
    generator = torch.Generator(device=ctx.device).manual_seed(1234)
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
                caches = [random_cache(first, ctx.device, generator) for _ in range(rotation_count(cache_bytes, ctx.l2_bytes))]
            except Exception as exc:
                ctx.results["kernel"].append({"kind": kind, "rows": rows, "variant": variant_name(kv_dtype, rope),
                                              "error": error_text(exc)})
                free_memory(ctx.device)
                continue
            for heads in sel.heads:
                scenario = with_config(base, kv_dtype, rope, k_scale, heads)
                holder = {}

                def kernel_unit():
                    nonlocal distinct
                    holder["prep"] = prep = prepare(ctx, scenario, lens, caches, generator)
                    if distinct is None:
                        distinct = distinct_slots(prep.state, rows)
                    if "kernel" not in ctx.sections:
                        return {"not_timed": "kernel section not selected"}
                    return time_kernel(ctx, prep, lens, distinct)

                ctx.guarded("kernel", shape_record(kind, rows, scenario), kernel_unit)
                prep = holder.get("prep")
                if prep is not None and index == 0 and kind == "decode":
                    extra_units(ctx, kind, rows, scenario, prep, lens)
                holder.clear()
                del prep
                free_memory(ctx.device)
            caches = None
            free_memory(ctx.device)


def extra_units(ctx: Context, kind: str, rows: int, scenario, prep: Prepared, lens: torch.Tensor) -> None:
    sel, heads = ctx.sel, scenario.spec.num_heads
    if "reference" in ctx.sections and rows in sel.reference_rows and heads in sel.reference_heads:
        device_lens = lens.to(device=ctx.device, dtype=torch.int64)
        kernel_out = prep.sets.out(0) if "kernel" in ctx.sections else None
        reference_records(ctx, kind, rows, scenario, prep.sets.inputs(0), prep.state.slots[:rows], device_lens, kernel_out)
        free_memory(ctx.device)
    if "graph" in ctx.sections and rows in sel.graph_rows and heads in sel.graph_heads:
        for layout in sel.graph_layouts:
            record = {**shape_record(kind, rows, scenario), "layout": layout}
            ctx.guarded("graph", record, lambda: measure_graph(ctx, prep, lens, layout))
            free_memory(ctx.device)


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


# --- ceilings and targets --------------------------------------------------------------------


def measure_ceilings(ctx: Context) -> None:
    from harness.timing import copy_ceiling, matmul_ceiling

    sel = ctx.sel
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    for name, fn in (("copy", lambda: copy_ceiling(ctx.timer, sel.ceiling_copy_bytes, sel.ceiling_reps)),
                     ("matmul", lambda: matmul_ceiling(ctx.timer, sel.ceiling_matmul_n, sel.ceiling_reps, dtype))):
        try:
            ctx.ceilings[name] = fn()
        except Exception as exc:
            ctx.ceilings[name] = {"error": error_text(exc)}
        free_memory(ctx.device)


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


def gpu_unavailable_reason() -> str | None:
    from harness.availability import sm90_flashinfer_unavailable_reason

    return sm90_flashinfer_unavailable_reason()
