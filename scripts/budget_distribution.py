"""The error-budget ratios of the project's fa3 path over many drawn cases of the production input
space, per kernel variant: the numbers the budget's factors are set from (docs/error-budget.md).

    python3 -m scripts.budget_distribution --variant bf16-rope64 --cases 500 [--start 0] --out ratios.jsonl
    python3 -m scripts.budget_distribution --summarise ratios-*.jsonl

Each case is a full feasible class assignment of the input space (``harness.input_space``) with
the variant fixed, drawn and realised with a seeded generator (case ``i`` of seed ``s`` is the
same on every machine), laid out compacted (the kernel's arithmetic does not depend on the
layout; the strided plan is refused from FlashInfer 0.7), run through the one judge
(``harness.judge.judge_step``) on a fresh layer of the port on fa3, which compares the kernel with
the two references. One JSON line per case: its id,
rows, heads, the out and LSE ratios and errors, and how many work items FlashInfer's schedule
gave the row with the largest output error (a row split over several works is merged from
partial outputs the kernel stores in the output dtype).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from mla_constants import KERNEL_VARIANTS, variant_name

VARIANTS = tuple(variant_name(kv_dtype, rope) for kv_dtype, rope, _ in KERNEL_VARIANTS)
#: Slot ids past 2^23 need caches of gigabytes: the draw keeps below (their arithmetic is the same).
FIXED = {"layout": "compacted", "slot_ids": "below-2^23"}


def drawn_assignment(variant: str, rng: np.random.Generator) -> dict:
    """A full feasible assignment with ``variant`` and :data:`FIXED`, every other class drawn
    uniformly among those that keep it feasible."""
    from harness.input_space import SPACE, feasible

    fixed = {**FIXED, "variant": variant}
    a: dict = {}
    for d in SPACE:
        if d.name in fixed:
            a[d.name] = fixed[d.name]
            continue
        options = [c for c in d.classes if feasible({**a, d.name: c})]
        a[d.name] = options[int(rng.integers(len(options)))]
    return a


def drawn_case(variant: str, seed: int, index: int):
    """Case ``index`` of the draw ``seed`` for ``variant`` (an ``InputCase``)."""
    from harness.input_space import SeededChooser, realize

    rng = np.random.default_rng([seed, VARIANTS.index(variant), index])
    assignment = drawn_assignment(variant, rng)
    return realize(assignment, SeededChooser(int(rng.integers(1 << 62))))


def works_per_row(state, rows: int) -> list[int]:
    """How many fa3 work items each planned row is split into (``[]`` where the schedule cannot
    be read, as on the fa2 kernel)."""
    from backends.flashinfer import fa3_schedule

    try:
        schedule = fa3_schedule.read_schedule(state.wrapper._wrapper)
    except (fa3_schedule.ScheduleUnreadable, AttributeError):
        return []
    counts = [0] * rows
    for r in schedule.row.tolist():
        if 0 <= r < rows:
            counts[r] += 1
    return counts


def measure(variant: str, cases: int, seed: int, out: Path, start: int = 0) -> int:
    import torch

    from backends.flashinfer.compat import detect_features
    from backends.flashinfer.port import PortBackend
    from harness import build_attention_inputs, build_scenario
    from harness.backend_step import layer_config
    from harness.judge import judge_step
    from harness.port.launch import DEVICE

    features = detect_features()
    ran = 0
    with open(out, "a", encoding="utf-8") as sink:
        for i in range(start, start + cases):
            case = drawn_case(variant, seed, i)
            scenario = build_scenario(case.spec, seed=i)
            if scenario.planned_rows == 0:
                continue
            backend = PortBackend("fa3", layout=case.layout)
            layer = backend.open_layer(layer_config(case.spec, max(scenario.topk_indices.shape[0], 1)), DEVICE)
            verdict = judge_step(backend, layer, scenario, build_attention_inputs(scenario, DEVICE))
            if not verdict.comparisons:
                raise verdict.failure or RuntimeError(f"the plan was refused: {verdict.outcome.refusal}")
            out_cmp, lse_cmp = verdict.comparisons
            rows = verdict.outcome.planned_rows
            works = works_per_row(layer.state, rows)
            worst_row = out_cmp.worst[0][0] if out_cmp.worst else None
            record = {
                "variant": variant, "seed": seed, "index": i, "case": case.id, "flashinfer": features.version,
                "rows": rows, "heads": case.spec.num_heads, "topk": case.spec.topk,
                "out_ok": out_cmp.ok, "out_max_ratio": out_cmp.max_ratio, "out_mean_ratio": out_cmp.mean_ratio,
                "out_max_err": out_cmp.max_err, "out_rel_l2": out_cmp.rel_l2,
                "lse_ok": lse_cmp.ok, "lse_max_ratio": lse_cmp.max_ratio, "lse_mean_ratio": lse_cmp.mean_ratio,
                "lse_max_err": lse_cmp.max_err,
                "worst_row": worst_row,
                "worst_row_regime": scenario.row_regime[worst_row] if worst_row is not None else None,
                "worst_row_works": works[worst_row] if works and worst_row is not None else None,
                "max_works": max(works) if works else None,
            }
            sink.write(json.dumps(record) + "\n")
            ran += 1
            del layer, verdict
            if i % 50 == 0:
                torch.cuda.empty_cache()
    return ran


def quantiles(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64)
    return {"p50": float(np.quantile(a, 0.5)), "p99": float(np.quantile(a, 0.99)), "max": float(a.max())}


def summary_rows(records: list[dict]) -> list[dict]:
    """Per variant and per "split" (the worst row executed as one work, or as several): the case
    count and the quantiles of each ratio."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        split = "any" if r["worst_row_works"] is None else ("split" if r["worst_row_works"] > 1 else "one work")
        groups.setdefault((r["variant"], "all"), []).append(r)
        groups.setdefault((r["variant"], split), []).append(r)
    rows = []
    for (variant, split), rs in sorted(groups.items()):
        row = {"variant": variant, "worst row": split, "cases": len(rs)}
        for key in ("out_max_ratio", "out_mean_ratio", "lse_max_ratio", "lse_mean_ratio"):
            finite = [r[key] for r in rs if r[key] is not None and np.isfinite(r[key])]
            row[key] = quantiles(finite) if finite else None
        row["failed"] = sum(1 for r in rs if not (r["out_ok"] and r["lse_ok"]))
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    def q(d):
        return "-" if d is None else f"{d['p50']:.2f} / {d['p99']:.2f} / {d['max']:.2f}"

    lines = ["| variant | worst row | cases | out max ratio p50 / p99 / max | out mean ratio | lse max ratio | "
             "lse mean ratio | beyond the budget |", "|---|---|---:|---|---|---|---|---:|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['worst row']} | {r['cases']} | {q(r['out_max_ratio'])} | "
                     f"{q(r['out_mean_ratio'])} | {q(r['lse_max_ratio'])} | {q(r['lse_mean_ratio'])} | {r['failed']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=VARIANTS)
    parser.add_argument("--cases", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start", type=int, default=0, help="first case index (to share a draw among processes)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--summarise", nargs="+", type=Path, metavar="JSONL")
    args = parser.parse_args(argv)
    if args.summarise:
        records = [json.loads(line) for p in args.summarise for line in p.read_text().splitlines() if line.strip()]
        print(markdown(summary_rows(records)))
        return 0
    if not (args.variant and args.out):
        parser.error("--variant and --out are needed to measure")
    started = time.monotonic()
    ran = measure(args.variant, args.cases, args.seed, args.out, args.start)
    print(f"{args.variant}: {ran} cases ran in {time.monotonic() - started:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
