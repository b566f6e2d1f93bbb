"""How far a step's output moves with the plan it runs on: the number the plan-history bound
(``harness.layer_modes.PLAN_HISTORY_ULPS``) is set from (docs/input-space.md#plan-history).

    python3 -m scripts.plan_history_ulps --vllm SLICE [--cases 512] [--seed 0] [--out DIR]

Each case is a decode step (1 to 8 requests, each context drawn below top-k, where vLLM's
bounded design plans each row's host bound plus its slack) and one kernel configuration, drawn
with a seeded generator (case ``i`` of seed ``s`` is the same on every machine). The step runs
twice, each through a layer of its own and judged by the one judge (``harness.case_runner``):
after a history whose first step is the same requests one token shorter (the bounded design
keeps that plan, planned one entry per row shorter than a fresh plan, and clamps: the KV split
points differ from a fresh plan's) and alone, on a fresh plan. Per case: whether the plan was
kept, whether the planned lengths differ, and the largest distance between the two outputs in
bf16 ULPs. The summary counts the cases by that distance, separately for the cases whose
planned lengths differ (where the bound applies) and those whose planned lengths are the same
(where the outputs must be bit for bit equal).

Writes ``DIR/plan_history_ulps.jsonl`` (one line per case) and ``DIR/plan_history_ulps.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from mla_constants import TOPK

#: Kernel configurations drawn from (kv dtype, rope, heads, k_scale): DeepSeek-V3.2's heads per
#: rank; fp8 at k_scale 1, since vLLM reads an fp8 cache's rope part without k_scale
#: (docs/findings.md#vllm-fp8-kpe-scale), a finding that decides the output at any other scale.
CONFIGS = (("bfloat16", True, 16, 1.0), ("bfloat16", True, 64, 1.0), ("bfloat16", True, 128, 1.0),
           ("bfloat16", False, 32, 1.0), ("float8_e4m3fn", True, 16, 1.0), ("float8_e4m3fn", True, 128, 1.0))
MAX_REQUESTS = 8


def drawn_case(seed: int, index: int) -> dict:
    """Case ``index`` of the draw ``seed``: its configuration, the target step's contexts (each
    in ``[2, TOPK)``, drawn on a log scale so that short rows and rows across many KV tiles both
    appear) and the two steps' input seeds."""
    rng = np.random.default_rng([seed, index])
    kv_dtype, rope, heads, k_scale = CONFIGS[int(rng.integers(len(CONFIGS)))]
    n = int(rng.integers(1, MAX_REQUESTS + 1))
    contexts = sorted({int(x) for x in np.exp(rng.uniform(np.log(2), np.log(TOPK - 1), n))})
    return {"index": index, "kv_dtype": kv_dtype, "rope": rope, "heads": heads, "k_scale": k_scale,
            "contexts": contexts, "history_seed": 2 * index + 1, "target_seed": 2 * index + 2}


def steps_of(case: dict):
    """``(kept history, fresh)``: the steps of each run, ``(spec, seed)`` as the case runner takes
    them, built as the plan-history check builds its decode steps (``harness.plan_history``)."""
    from harness.cases import KernelConfig
    from harness.plan_history import decode_step

    config = KernelConfig(case["kv_dtype"], case["rope"], case["heads"], case["k_scale"])
    target = decode_step(case["contexts"], case["target_seed"], config)
    return [decode_step([c - 1 for c in case["contexts"]], case["history_seed"], config), target], [target]


def measured(backend, case: dict, device) -> dict:
    """One case through ``backend``: the target step after the kept history and on a fresh
    plan, every step judged (a step the judge fails is reported with its message)."""
    from harness.case_runner import Reporter, run_sequence
    from harness.layer_modes import max_ulps, same_plan

    history, fresh_steps = steps_of(case)
    try:
        _, kept = run_sequence(Reporter(), backend, history, device)
        _, fresh = run_sequence(Reporter(), backend, fresh_steps, device)
    except AssertionError as exc:  # a known finding's exception included: its class names it
        lines = str(exc).splitlines()
        return {**case, "error": f"{type(exc).__name__}: {' | '.join(lines[1:3] or lines[:1])[:300]}"}
    target, alone = kept[-1], fresh[-1]
    differing = (target.out.float() != alone.out.float()).sum().item()
    return {**case, "error": None, "plan_kept": target.plans == kept[-2].plans,
            "same_planned_lengths": same_plan(target, alone), "max_ulps": max_ulps(target.out, alone.out),
            "elements_differing": int(differing), "elements": target.out.numel()}


def summary_lines(results: list[dict]) -> list[str]:
    """The markdown summary: cases by their largest ULP distance, apart for planned lengths that
    differ and that are the same, and the cases the judge failed."""
    ran = [r for r in results if r["error"] is None]
    failed = [r for r in results if r["error"] is not None]
    lines = [f"{len(results)} cases: {len(ran)} ran, {len(failed)} failed a check of the judge", ""]
    groups = (("planned lengths differ (the bound applies)", [r for r in ran if not r["same_planned_lengths"]]),
              ("planned lengths the same (bit for bit)", [r for r in ran if r["same_planned_lengths"]]))
    for title, group in groups:
        by_ulps = Counter(r["max_ulps"] for r in group)
        kept = sum(1 for r in group if r["plan_kept"])
        lines += [f"### {title}: {len(group)} cases, {kept} on a kept plan", "",
                  "| max bf16 ULPs | cases | largest share of elements differing |", "|---|---|---|"]
        for ulps in sorted(by_ulps):
            share = max(r["elements_differing"] / r["elements"] for r in group if r["max_ulps"] == ulps)
            lines.append(f"| {ulps} | {by_ulps[ulps]} | {share:.2%} |")
        lines.append("")
    lines += [f"- case {r['index']}: {r['error']}" for r in failed[:20]]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm", required=True,
                        help="the vLLM release (wheel or slice) whose bounded design keeps plans")
    parser.add_argument("--cases", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="out/plan-history-ulps")
    parser.add_argument("--device", default=None, help="default: harness.port.launch.DEVICE")
    args = parser.parse_args(argv)

    from backends.vllm.sm90 import VllmSM90Backend
    from backends.vllm.source import resolve
    from harness.port.launch import DEVICE

    backend = VllmSM90Backend(resolve(args.vllm))
    if backend.design != "bounded":
        print(f"{backend.describe()} plans every step afresh (design {backend.design}): no plan is kept to measure",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results = [measured(backend, drawn_case(args.seed, i), args.device or DEVICE) for i in range(args.cases)]
    (out / "plan_history_ulps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    lines = [f"# Plan history: {backend.describe()}", "",
             f"`python3 -m scripts.plan_history_ulps --vllm {args.vllm} --cases {args.cases} --seed {args.seed}`, "
             f"{time.perf_counter() - start:.0f} s", "", *summary_lines(results)]
    (out / "plan_history_ulps.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if any(r["error"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
