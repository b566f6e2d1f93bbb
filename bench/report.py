"""The run's outputs: the JSON (every number), a markdown summary and a roofline PNG."""

from __future__ import annotations

import json
from pathlib import Path

from .counting import __doc__ as COUNTING_TEXT

GIB = 1 << 30
LAYOUT_ORDER = ("strided", "packed", "compacted")


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=False, default=str) + "\n")


def _us(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f}" if seconds < 1e-3 else f"{seconds * 1e6:.0f}"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _num(x, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def rate(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if x >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.0f} {unit}"


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def header_lines(data: dict) -> list[str]:
    env = data.get("environment", {})
    ceil = data.get("ceilings", {})
    copy, mm = ceil.get("copy", {}), ceil.get("matmul", {})
    lines = [
        f"# Sparse-MLA benchmark: {env.get('gpu') or 'no GPU'}, FlashInfer {env.get('flashinfer')}, "
        f"torch {env.get('torch')}, CUDA {env.get('cuda')} ({data.get('mode')}, {data.get('elapsed_s', 0):.0f} s)",
        "",
    ]
    if "bytes_per_s" in copy and "flops_per_s" in mm:
        lines.append(f"Ceilings measured in this run: device copy {rate(copy['bytes_per_s'], 'B/s')} (read + write), "
                     f"{mm.get('dtype')} matmul {rate(mm['flops_per_s'], 'FLOP/s')} (n = {mm.get('n')}).")
    else:
        lines.append(f"Ceilings: {_short(copy.get('error') or mm.get('error') or 'not measured')}")
    lines += ["", "Bytes: q + each selected KV row once per row + slot ids + out + LSE; "
              "FLOPs: 2*H*L*(512+R) + 2*H*L*512, L = sum of lens (see `counting` in the JSON).", ""]
    return lines


def kernel_cell(r: dict | None) -> str:
    if r is None:
        return "-"
    if "median_s" not in r:
        return "error" if "error" in r else "not timed"
    pct = lambda x: "-" if x is None else f"{100 * x:.0f}"  # noqa: E731
    flag = "" if r.get("finite", True) else " NaN!"
    return f"{_us(r['median_s'])} ({pct(r.get('fraction_of_matmul'))}/{pct(r.get('fraction_of_copy'))}){flag}"


def kernel_lines(data: dict) -> list[str]:
    recs = [r for r in data.get("kernel", []) if "variant" in r and "heads" in r]
    if not recs:
        return []
    rows = sorted({r["rows"] for r in recs})
    keys = list(dict.fromkeys((r["variant"], r["kind"], r["heads"]) for r in recs))
    lines = ["## Kernel: SM90AttentionState.attend, median us (% of matmul FLOP/s / % of copy bytes/s)", "",
             "| variant | kind | H | " + " | ".join(f"rows {n}" for n in rows) + " |",
             "|---|---|---:|" + "---:|" * len(rows)]
    for variant, kind, heads in keys:
        cells = []
        for n in rows:
            hit = [r for r in recs if (r["variant"], r["kind"], r["heads"], r["rows"]) == (variant, kind, heads, n)]
            cells.append(kernel_cell(hit[0]) if hit else "")
        lines.append(f"| {variant} | {kind} | {heads} | " + " | ".join(cells) + " |")
    best = max((r for r in recs if "median_s" in r), key=lambda r: r.get("fraction_of_roofline") or 0, default=None)
    if best and best.get("fraction_of_roofline"):
        lines += [
            "",
            f"Closest to the roofline: {best['variant']} {best['kind']} rows {best['rows']} H {best['heads']} at "
            f"{100 * best['fraction_of_roofline']:.0f}% ({best['flops_per_s'] / 1e12:.0f} TFLOP/s, "
            f"{best['bytes_per_s'] / 1e12:.2f} TB/s). Per-shape rates, intensity and unique bytes: the JSON.",
        ]
    return lines + [""]


# The kernel's bf16 output is about 2e-3 from the float64 truth (rel L2) in every measured
# shape; five times that means the timed output and the reference's inputs do not match.
KERNEL_REL_L2_ALARM = 1e-2


# --- FA3 beside FlashMLA -----------------------------------------------------------------------

FLASHMLA_COVERS = [
    "What each number covers (same shapes, caches and q; both timed alike: the median of device times after a "
    "warm-up, CUDA events on a GPU, inputs rotated so that L2 cannot hold them):",
    "",
    "- FA3: `SM90AttentionState.attend`, FlashInfer's fa3 run; its plan, the convert and the layout are done "
    "beforehand.",
    "- FlashMLA: the FlashMLA kernel calls vLLM's FLASHMLA_SPARSE `forward_mqa` makes for the step "
    "(`sparse_prefill_fwd` on a bf16 cache; `sparse_decode_fwd` on an fp8 cache, and from 32 heads on "
    "`sparse_prefill_fwd` for prefill rows), replayed with the arguments vLLM handed them. Done beforehand, not "
    "timed: vLLM's metadata build, convert kernel, q concat and head padding; the decode kernel's tile schedule "
    "(built by the step's first call, handed in as to a step's later layers); for fp8 prefill rows from 32 heads "
    "on, the gather and upconvert of their context into a bf16 workspace.",
    "- FLOPs: the layer's heads for both (FlashMLA computes vLLM's padded head count: 16 heads as 64).",
    "- Bytes: counted alike but for the KV row as each kernel reads it: FA3 512+R elements of the cache dtype "
    "(fp8: 576 B); FlashMLA bf16 the same, fp8 its own layout (656 B: 512 e4m3, 4 float32 tile scales, 64 bf16 "
    "RoPE), and the bf16 workspace (1152 B) for those fp8 prefill rows.",
    "- rel L2: each kernel's output against the oracle's float32 mode on the same inputs (! above "
    f"{KERNEL_REL_L2_ALARM:g}).",
]


def _tflops(r: dict | None) -> str:
    return "-" if not r or "flops_per_s" not in r else f"{r['flops_per_s'] / 1e12:.1f}"


def _tbps(r: dict | None) -> str:
    return "-" if not r or "bytes_per_s" not in r else f"{r['bytes_per_s'] / 1e12:.2f}"


def _fractions(r: dict | None) -> str:
    if not r or "median_s" not in r:
        return "-"
    pct = lambda x: "-" if x is None else f"{100 * x:.0f}"  # noqa: E731
    return f"{pct(r.get('fraction_of_matmul'))}/{pct(r.get('fraction_of_copy'))}"


def _rel_l2(x) -> str:
    if x is None:
        return "-"
    return f"{x:.1e}" + ("" if x <= KERNEL_REL_L2_ALARM else " !")


def _time(r: dict | None) -> str:
    if r is None:
        return "-"
    if "median_s" in r:
        return _us(r["median_s"]) + ("" if r.get("finite", True) else " NaN!")
    return "unsupported" if "unsupported" in r else "error" if "error" in r else "not timed"


def time_ratio(fa3: dict | None, flashmla: dict) -> float | None:
    """FA3's median time over FlashMLA's (above 1: FlashMLA is faster)."""
    if not fa3 or "median_s" not in fa3 or "median_s" not in flashmla:
        return None
    return fa3["median_s"] / flashmla["median_s"]


def shape_key(r: dict) -> tuple:
    return r.get("variant"), r.get("kind"), r.get("heads"), r.get("rows")


def side_by_side(data: dict) -> list[tuple[dict | None, dict]]:
    """``(FA3 record or None, FlashMLA record)`` per FlashMLA shape, by variant, kind, H, rows."""
    fa3 = {shape_key(r): r for r in data.get("kernel", []) if "heads" in r}
    recs = [r for r in data.get("flashmla", []) if "heads" in r]
    variants = list(dict.fromkeys(r["variant"] for r in recs))
    recs.sort(key=lambda r: (variants.index(r["variant"]), r["kind"] != "decode", r["heads"], r["rows"]))
    return [(fa3.get(shape_key(r)), r) for r in recs]


def flashmla_lines(data: dict) -> list[str]:
    status = data.get("flashmla_backend") or {"status": "not run", "reason": "not attempted"}
    if status["status"] != "run":
        return ["## FA3 vs FlashMLA", "", f"FlashMLA not run: {_short(status.get('reason'), 400)}", ""]
    pairs = side_by_side(data)
    lines = [f"## FA3 vs FlashMLA ({status.get('source')})", "", *FLASHMLA_COVERS, "",
             "| variant | kind | H | rows | FA3 us | FlashMLA us | FA3 t / FlashMLA t | FA3 TFLOP/s | FlashMLA TFLOP/s "
             "| FA3 TB/s | FlashMLA TB/s | FA3 % matmul/copy | FlashMLA % matmul/copy | FA3 rel L2 | FlashMLA rel L2 |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for fa3, fm in pairs:
        lines.append(f"| {fm['variant']} | {fm['kind']} | {fm['heads']} | {fm['rows']} | {_time(fa3)} | {_time(fm)} "
                     f"| {_num(time_ratio(fa3, fm))} | {_tflops(fa3)} | {_tflops(fm)} | {_tbps(fa3)} | {_tbps(fm)} "
                     f"| {_fractions(fa3)} | {_fractions(fm)} | {_rel_l2(fm.get('fa3_rel_l2_vs_reference'))} "
                     f"| {_rel_l2(fm.get('rel_l2_vs_reference'))} |")
    ratios = [x for x in (time_ratio(fa3, fm) for fa3, fm in pairs) if x is not None]
    if ratios:
        lines += ["", f"FlashMLA faster on {sum(x > 1 for x in ratios)} of {len(ratios)} shapes timed on both; "
                  f"FA3 t / FlashMLA t from {min(ratios):.2f} to {max(ratios):.2f}. Per shape, the calls, the heads "
                  "the kernel ran, the KV row bytes and the unique bytes: `flashmla` in the JSON."]
    for reason in dict.fromkeys(fm["unsupported"] for _, fm in pairs if "unsupported" in fm):
        lines.append(f"- unsupported: {_short(reason, 240)}")
    return lines + [""]


def plan_cell(r: dict) -> str:
    if "rejected_at_plan" in r:
        return "rejected"
    if "error" in r:
        return "error"
    plan, reuse = r.get("plan", {}), r.get("reuse", {})
    return f"{_us(plan.get('median_s'))} ({_us(reuse.get('median_s'))})"


def plan_lines(data: dict) -> list[str]:
    recs = [r for r in data.get("plan", []) if "layout" in r]
    if not recs:
        return []
    rows = sorted({r["rows"] for r in recs})
    sized = lambda r: "rows" if r.get("max_rows", r["rows"]) == r["rows"] else r["max_rows"]  # noqa: E731
    keys = sorted(
        {(r["layout"], r["variant"], r["heads"], sized(r)) for r in recs},
        key=lambda k: (str(k[3]) != "rows", LAYOUT_ORDER.index(k[0]) if k[0] in LAYOUT_ORDER else 9, k[1], k[2]),
    )
    lines = ["## plan() host time, us: plan (kept with reuse_plan); device idle at each call", "",
             "| layout | variant | H | buffers for | " + " | ".join(f"rows {n}" for n in rows) + " |",
             "|---|---|---:|---:|" + "---:|" * len(rows)]
    for layout, variant, heads, size in keys:
        cells = []
        for n in rows:
            hit = [
                r
                for r in recs
                if (r["layout"], r["variant"], r["heads"], sized(r), r["rows"]) == (layout, variant, heads, size, n)
            ]
            cells.append(plan_cell(hit[0]) if hit else "-")
        lines.append(f"| {layout} | {variant} | {heads} | {size} | " + " | ".join(cells) + " |")
    rejected = next((r["rejected_at_plan"] for r in recs if "rejected_at_plan" in r), None)
    if rejected:
        lines += ["", f"rejected: {_short(rejected, 220)}"]
    busy = data.get("plan_busy_device") or {}
    if "plan" in busy:
        p, k = busy["plan"], busy.get("reuse", {})
        lines += ["", f"plan() with {busy['busy_s'] * 1e3:.0f} ms of device work queued (rows {busy.get('rows')}, "
                  f"H {busy.get('heads')}): {_us(p['busy_median_s'])} us vs {_us(p['idle_median_s'])} us idle "
                  f"({'waits for the device' if p['waits_for_device'] else 'does not wait'}); kept plan "
                  f"{_us(k.get('busy_median_s'))} us."]
    prof = (data.get("plan_profile") or {}).get("top_self") or []
    if prof:
        lines += ["", "plan() self time by function (cProfile, per plan, top 8):", "",
                  "| function | self us | cumulative us | calls |", "|---|---:|---:|---:|"]
        for row in prof[:8]:
            lines.append(f"| {_short(row['function'], 90)} | {row['self_us_per_plan']:.0f} "
                         f"| {row['cumulative_us_per_plan']:.0f} | {row['calls_per_plan']:.0f} |")
    return lines + [""]


def graph_lines(data: dict) -> list[str]:
    recs = data.get("graph", [])
    if not recs:
        return []
    lines = ["## One step (convert + layout + run): CUDA-graph replay vs eager", "",
             "| rows | H | layout | eager dev us | graph dev us | eager wall us | graph wall us | equal |",
             "|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in recs:
        if "eager_device" not in r:
            why = r.get("rejected_at_plan") or r.get("error") or "-"
            lines.append(f"| {r.get('rows')} | {r.get('heads')} | {r.get('layout')} | {_short(why, 80)} |||||")
            continue
        lines.append(f"| {r['rows']} | {r['heads']} | {r['layout']} | {_us(r['eager_device']['median_s'])} "
                     f"| {_us(r['graph_device']['median_s'])} | {_us(r['eager_wall_per_step_s'])} "
                     f"| {_us(r['graph_wall_per_step_s'])} | {'yes' if r['replay_equals_eager'] else 'NO'} |")
    return lines + [""]


def reference_lines(data: dict) -> list[str]:
    recs = data.get("reference", [])
    if not recs:
        return []
    kernels = {(k.get("kind"), k.get("rows"), k.get("heads"), k.get("variant")): k.get("median_s")
               for k in data.get("kernel", []) if "median_s" in k}
    lines = ["## Reference oracle (memory_budget_bytes 1 GiB)", "",
             "| rows | H | mode | ms | x kernel | extra GiB | of which out | rel L2 |",
             "|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in recs:
        if "median_s" not in r:
            lines.append(
                f"| {r.get('rows')} | {r.get('heads')} | {r.get('mode')} | {_short(r.get('error', '-'), 80)} ||||"
            )
            continue
        ker = kernels.get((r.get("kind"), r["rows"], r["heads"], r.get("variant")))
        rel = []
        if "float32_rel_l2_vs_float64" in r:
            rel.append(f"f32 {r['float32_rel_l2_vs_float64']:.1e}")
        if "kernel_rel_l2_vs_float64" in r:
            rel.append(f"kernel {r['kernel_rel_l2_vs_float64']:.1e}")
        peak = r.get("peak_extra_bytes")
        lines.append(f"| {r['rows']} | {r['heads']} | {r['mode']}{'*' if r.get('bf16_products') else ''} "
                     f"| {r['median_s'] * 1e3:.2f} | {_num(r['median_s'] / ker if ker else None, '{:.1f}')} "
                     f"| {_num(None if peak is None else peak / GIB)} | {r['output_bytes'] / GIB:.2f} "
                     f"| {', '.join(rel) or '-'} |")
    lines += [
        "",
        "\\* float32 with bf16 x bf16 -> float32 products (tensor cores). rel L2 vs float64 on the same inputs.",
    ]
    tg = data.get("targets") or {}
    for key, t in tg.items():
        if "met" not in t:
            lines.append(f"- target {key}: {t.get('status', 'not measured')}")
        elif key.startswith("memory"):
            lines.append(f"- target {key} ({t['shape']}): {t['peak_extra_gib']:.2f} GiB extra (output "
                         f"{t['output_gib']:.2f}, working {t['working_gib']:.2f}) vs <= {t['limit_gib']:.0f}: "
                         f"{'met' if t['met'] else 'NOT met'}")
        else:
            lines.append(f"- target {key} ({t['shape']}): {t['ratio']:.1f}x the kernel vs <= {t['limit']:.0f}x: "
                         f"{'met' if t['met'] else 'NOT met'}")
    return lines + [""]


def disagreement_lines(data: dict) -> list[str]:
    """Reference records where the kernel's output (same inputs) is far from float64."""
    return [f"- kernel output disagrees with the float64 reference ({r.get('variant')} {r.get('kind')} rows "
            f"{r.get('rows')} H {r.get('heads')}): rel L2 {r['kernel_rel_l2_vs_float64']:.2g} vs about 2e-3 "
            f"from bf16 rounding (alarm at {KERNEL_REL_L2_ALARM:g})"
            for r in data.get("reference", [])
            if not r.get("kernel_rel_l2_vs_float64", 0.0) <= KERNEL_REL_L2_ALARM]


def flashmla_problem_lines(data: dict) -> list[str]:
    """FlashMLA shapes where either kernel's output is far from the reference, and what the
    kernel was handed that the read-back found malformed."""
    lines = []
    for r in data.get("flashmla", []):
        where = f"{r.get('variant')} {r.get('kind')} rows {r.get('rows')} H {r.get('heads')}"
        for key, kernel in (("fa3_rel_l2_vs_reference", "FA3"), ("rel_l2_vs_reference", "FlashMLA")):
            if key in r and not r[key] <= KERNEL_REL_L2_ALARM:
                lines.append(f"- {kernel} output disagrees with the float32 reference ({where}): rel L2 "
                             f"{r[key]:.2g} (alarm at {KERNEL_REL_L2_ALARM:g})")
        lines += [f"- FlashMLA read-back ({where}): {_short(p, 200)}" for p in r.get("problems", [])[:3]]
    return lines


def problem_lines(data: dict) -> list[str]:
    lines = disagreement_lines(data) + flashmla_problem_lines(data)
    for section in ("kernel", "flashmla", "plan", "graph", "reference"):
        errors = [r for r in data.get(section, []) if "error" in r]
        for r in errors[:3]:
            where = ", ".join(f"{k}={r[k]}" for k in ("variant", "kind", "rows", "heads", "layout", "mode") if k in r)
            lines.append(f"- {section} error ({where}): {_short(r['error'], 200)}")
        if len(errors) > 3:
            lines.append(f"- {section}: {len(errors) - 3} more errors (see the JSON)")
    skipped = data.get("skipped", [])
    for s in skipped[:5]:
        lines.append(f"- skipped: {_short(json.dumps(s, default=str), 200)}")
    if len(skipped) > 5:
        lines.append(f"- {len(skipped) - 5} more skipped (see the JSON)")
    for name, reason in (data.get("not_run") or {}).items():
        lines.append(f"- not run: {name}: {reason}")
    if data.get("plot"):
        lines.append(f"- plot: {data['plot']}")
    return (["## Problems, skips, notes", ""] + lines + [""]) if lines else []


def markdown(data: dict) -> str:
    parts = (header_lines(data) + kernel_lines(data) + flashmla_lines(data) + plan_lines(data) + graph_lines(data)
             + reference_lines(data))
    return "\n".join(parts + problem_lines(data)).rstrip() + "\n"


def counting_text() -> str:
    return " ".join((COUNTING_TEXT or "").split())


# --- the roofline plot -----------------------------------------------------------------------


def roofline_points(data: dict) -> list[dict]:
    """One point per measured kernel shape (and reference call): intensity, FLOP/s, label."""
    points = []
    for r in data.get("kernel", []):
        if "median_s" in r:
            points.append({"x": r["intensity"], "y": r["flops_per_s"], "group": r["variant"], "kind": r["kind"]})
    for r in data.get("flashmla", []):
        if "median_s" in r:
            points.append({"x": r["intensity"], "y": r["flops_per_s"], "group": f"flashmla {r['variant']}",
                           "kind": r["kind"]})
    for r in data.get("reference", []):
        if "median_s" in r and r.get("problem_bytes"):
            points.append({"x": r["flops"] / r["problem_bytes"], "y": r["flops_per_s"],
                           "group": f"reference {r['mode']}", "kind": "reference"})
    return points


def write_roofline(path: Path, data: dict) -> str:
    """Write the PNG; returns what happened (for the JSON)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return f"not written: matplotlib not importable ({type(exc).__name__})"
    ceil = data.get("ceilings", {})
    copy = ceil.get("copy", {}).get("bytes_per_s")
    mm = ceil.get("matmul", {}).get("flops_per_s")
    points = roofline_points(data)
    if not points or not copy or not mm:
        return "not written: no measured points or ceilings"
    xs = [p["x"] for p in points]
    lo, hi = min(xs + [mm / copy]) / 4, max(xs + [mm / copy]) * 4
    fig, ax = plt.subplots(figsize=(8, 5.5))
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(grid, [copy * x for x in grid], color="0.4", lw=1, ls="--", label=f"copy {rate(copy, 'B/s')} x intensity")
    ax.axhline(mm, color="0.2", lw=1, label=f"matmul {rate(mm, 'FLOP/s')}")
    markers = {"decode": "o", "prefill": "^", "reference": "x"}
    for group in sorted({p["group"] for p in points}):
        for kind in markers:
            sel = [p for p in points if p["group"] == group and p["kind"] == kind]
            if sel:
                ax.scatter([p["x"] for p in sel], [p["y"] for p in sel], marker=markers[kind], s=28,
                           label=f"{group} ({kind})" if kind != "reference" else group)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(min(p["y"] for p in points) / 4, mm * 2)
    ax.set_xlabel("arithmetic intensity (FLOP / byte, each selected KV row counted once per row)")
    ax.set_ylabel("achieved FLOP/s")
    env = data.get("environment", {})
    kernels = "fa3 and FlashMLA" if any(p["group"].startswith("flashmla") for p in points) else "fa3"
    ax.set_title(f"Sparse MLA {kernels}, {env.get('gpu') or 'CPU'}, FlashInfer {env.get('flashinfer')}", fontsize=10)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"written: {path.name} ({len(points)} points)"
