"""Plans from 1 row to production batch sizes, every row judged on its own (docs/edges.md#scale).

The cases (:func:`scale_cases`) are batches of the one scenario builder: at 1, 2 and 3 rows a
few decodes; from 1024 rows on, decodes of every short regime context, two decodes of 100k and
128k tokens, and three prefill chunks (one at the end of a 128k request, one after 3000 tokens
of context, one from the first token, which crosses topk), so regimes B to G (kpool 4) or H
(kpool 1) share one plan. Kernel variants and kpool alternate over sizes and head counts (16
and 128), so each head count meets every variant and both kpools.

:func:`check_scale_case` runs one case through the implementation under test: convert, kv_len
and layout (compacted), the invariants and (b) == (a) on the device, plan, run, and every row
against the float64 truth and the yardstick (:mod:`harness.row_check`). It returns a
JSON-able result, so a case that may crash the process (a plan beyond the scheduler's work
capacity, :mod:`harness.plan_limits`) can run in a child: ``python3 -m harness.port.scale --case ID``
prints a ``STAGE`` line per stage reached and the ``RESULT`` last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass

import torch

from backends.flashinfer.port import make_attention_state
from mla_constants import GPU_TIER_DEFAULT_DEVICE, GPU_TIER_DEVICE_ENV, TOPK

from ..cases import LONG_CTX, LONG_CTX_128K, VARIANTS, KernelConfig, regime_contexts
from ..memory_retry import out_of_gpu_memory, retried_when_out_of_gpu_memory, retries_note
from ..plan_limits import REPO_ROOT, child_env, exceeds_work_capacity
from ..scenario import BatchSpec, Scenario, batch, build_scenario

SCALE_ROWS = (1, 2, 3, 1024, 8192, 16384, 32768)
SCALE_HEADS = (16, 128)
#: From this many rows on a case is marked ``gpu_large`` (deselect with ``-m "not gpu_large"``).
LARGE_ROWS = 8192
SCALE_LAYOUT = "compacted"
SCALE_SEED = 23
CHILD_TIMEOUT_S = 120.0  # a case takes seconds; a hang must not hold the GPU for long


def scale_spec(rows: int, kpool: int, topk: int = TOPK) -> BatchSpec:
    """A batch of exactly ``rows`` query rows, all planned (the prefills are long, so none is
    routed to dense MHA)."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    small = {1: [(LONG_CTX, 1)], 2: [(LONG_CTX, 1), (5, 1)], 3: [(LONG_CTX, 1), (topk, 1), (2 * topk + 1, 1)]}
    if rows in small:
        return batch(*small[rows], topk=topk, kpool=kpool)
    if rows < 16:
        raise ValueError(f"scale batches have 1, 2, 3 or at least 16 rows, got {rows}")
    short = [c for c in regime_contexts(topk, kpool) if c < LONG_CTX]
    num_decodes = max(rows // 32, 1)
    decodes = [(short[i % len(short)] + 4 * (i // len(short)), 1) for i in range(num_decodes - 2)]
    decodes += [(LONG_CTX_128K, 1), (LONG_CTX, 1)]
    rest = rows - num_decodes
    chunks = [rest // 2, rest // 4]
    chunks.append(rest - sum(chunks))
    prefills = [(LONG_CTX_128K, chunks[0]), (3000 + chunks[1], chunks[1]), (chunks[2], chunks[2])]
    return batch(*decodes, *[p for p in prefills if p[1] > 0], topk=topk, kpool=kpool)


@dataclass(frozen=True)
class ScaleCase:
    rows: int
    kpool: int
    config: KernelConfig
    topk: int = TOPK

    @property
    def id(self) -> str:
        width = "" if self.topk == TOPK else f"-topk{self.topk}"
        return f"rows{self.rows}-kpool{self.kpool}{width}-{self.config.id}"

    @property
    def spec(self) -> BatchSpec:
        return self.config.apply(scale_spec(self.rows, self.kpool, self.topk))

    @property
    def large(self) -> bool:
        return self.rows >= LARGE_ROWS

    @property
    def over_capacity(self) -> bool:
        """Beyond the fa3 scheduler's work capacity on any GPU: run in a child process."""
        return exceeds_work_capacity(self.rows)


def scale_cases() -> list[ScaleCase]:
    """Every size of :data:`SCALE_ROWS` at H 16 and 128; the variant index ``2 * size + head``
    walks the three kernel variants (each head count meets all three), kpool alternates."""
    cases = []
    for i, rows in enumerate(SCALE_ROWS):
        for j, heads in enumerate(SCALE_HEADS):
            kv_dtype, rope, k_scale = VARIANTS[(2 * i + j) % len(VARIANTS)]
            cases.append(ScaleCase(rows, 4 if (i + j) % 2 == 0 else 1, KernelConfig(kv_dtype, rope, heads, k_scale)))
    return cases


#: Top-k of :func:`narrow_scale_cases`.
NARROW_TOPK = 64


def narrow_scale_cases() -> list[ScaleCase]:
    """The 1024-row batch of :func:`scale_cases` at H 16 and kpool 1, at a top-k of 64: the same
    1024 planned rows (past the 512-row grid an engine captures in a CUDA graph), each of at
    most 64 slots, a case the simulated machine of the suite's self-tests runs in seconds."""
    base = next(c for c in scale_cases() if c.rows == 1024 and c.kpool == 1 and c.config.num_heads == 16)
    return [dataclasses.replace(base, topk=NARROW_TOPK)]


def case_by_id(case_id: str) -> ScaleCase:
    cases = scale_cases() + narrow_scale_cases()
    for case in cases:
        if case.id == case_id:
            return case
    raise ValueError(f"no scale case {case_id!r}; the cases are {[c.id for c in cases]}")


def row_label(scenario: Scenario, lens: torch.Tensor):
    """``label(row)`` for failure lines: the row's request, regime, context and planned length."""
    requests = scenario.request_ids()
    ctx = scenario.row_ctx

    def label(r: int) -> str:
        return (f"request {int(requests[r])}, regime {scenario.row_regime[r]}, ctx {int(ctx[r])}, "
                f"planned len {int(lens[r])}")

    return label


def check_scale_case(impl, case: ScaleCase, device, seed: int = SCALE_SEED, emit=lambda stage, info: None) -> dict:
    """One case, every row: a result with ``outcome`` right, wrong (rows beyond their budget, no
    error), invalid (an invariant or the selection broke, nothing launched), refused (plan()
    raised) or run-error, the failing rows described, and the regimes of the planned rows.
    ``emit(stage, info)`` is called as each stage is reached."""
    from ..pipeline import describe_rows, prepare_step
    from ..row_check import judge_rows, planned_selection_on, selection_mismatches_on
    from ..scenario import build_attention_inputs_on
    from .launch import attention_config, launch_inputs, nan_buffers

    start = time.perf_counter()
    times: dict[str, float] = {}
    result: dict = {"case": case.id, "rows": case.rows, "outcome": "", "detail": ""}

    def reached(stage: str, **info) -> None:
        times[stage] = round(time.perf_counter() - start, 3)
        result["stage"] = stage
        emit(stage, info)

    scenario = build_scenario(case.spec, seed)
    n = scenario.planned_rows
    result["regimes"] = dict(Counter(scenario.row_regime[:n]))
    reached("scenario", regimes=result["regimes"])
    step = prepare_step(impl, scenario, SCALE_LAYOUT, device=device, reached=reached)
    label = row_label(scenario, step.planned_lens)
    reached("invariants")
    if step.violations or step.num_planned != n:
        problems = [str(v) for v in step.violations[:8]]
        if step.num_planned != n:
            problems.append(f"{step.num_planned} rows planned but q has {n}")
        result.update(outcome="invalid", detail="invariant violations (kernel not launched)", problems=problems,
                      bad_row_regimes=sorted({scenario.row_regime[v.row] for v in step.violations
                                              if v.row is not None and v.row < n}))
        return result | {"seconds": times}
    mismatches = selection_mismatches_on(step, device)
    reached("selection")
    if mismatches:
        result.update(outcome="invalid", detail=f"planned slots (b) != intended slots (a) on {len(mismatches)} rows "
                      "(kernel not launched)", problems=describe_rows(step, mismatches).splitlines(),
                      bad_row_regimes=sorted({scenario.row_regime[r] for r in mismatches if r < n}))
        return result | {"seconds": times}
    inputs = build_attention_inputs_on(scenario, device)
    state = make_attention_state(impl, attention_config(scenario, SCALE_LAYOUT, step.max_rows), device)
    launch = launch_inputs(impl, scenario, inputs, step.max_rows)
    out, lse = nan_buffers(step.max_rows, case.config.num_heads, device)
    reached("plan")
    try:
        state.plan(n, step.planned_lens)
    except Exception as exc:  # a refusal is an outcome
        result.update(outcome="refused", detail=f"{type(exc).__name__}: {str(exc)[:600]}",
                      refusal_is_value_error=isinstance(exc, ValueError))
        return result | {"seconds": times}
    reached("run")
    try:
        state.step(*launch.step_args(out, lse))
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:
        result.update(outcome="run-error", detail=f"{type(exc).__name__}: {str(exc)[:600]}")
        return result | {"seconds": times}
    reached("judge")
    untouched = bool(torch.isnan(out[n:].float()).all()) if out.shape[0] > n else True
    slots, mask = planned_selection_on(step.kv_indptr, step.kv_indices, step.planned_lens, n, device)
    spec = scenario.spec
    report = judge_rows(out[:n], lse[:n], inputs.q_nope[:n], inputs.q_pe[:n], inputs.ckv, inputs.kpe, slots, mask,
                        sm_scale=spec.sm_scale, k_scale=spec.k_scale, kv_dtype=spec.kv_dtype)
    bad = report.bad_rows()
    result.update(summary=report.summary(), bad_row_regimes=sorted({scenario.row_regime[r] for r in bad}))
    if bad or not untouched:
        result.update(outcome="wrong", detail=report.describe(label) if bad else "",
                      wrote_past_planned_rows=not untouched)
    else:
        result.update(outcome="right", detail=f"{n} rows within their budgets (worst {report.worst_ratio():.2f}x)")
    reached("done")
    return result | {"seconds": times}


def run_case_in_child(
    case: ScaleCase, impl_spec: str, seed: int = SCALE_SEED, timeout: float = CHILD_TIMEOUT_S
) -> dict:
    """:func:`check_scale_case` in a child process: its result, or ``crashed`` / ``timeout``
    with the last stage reached (and the regimes, once the scenario was built). A child that
    ran out of GPU memory is made again in a fresh one (:mod:`harness.memory_retry`)."""
    result, made_again = retried_when_out_of_gpu_memory(
        lambda: _case_in_one_child(case, impl_spec, seed, timeout), lambda r: bool(r.get("out_of_gpu_memory")))
    if made_again:
        result["memory_retries"] = made_again
        result["detail"] = (result.get("detail") or "") + retries_note(made_again)
    return result


def _case_in_one_child(case: ScaleCase, impl_spec: str, seed: int, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "harness.port.scale", "--case", case.id, "--impl", impl_spec, "--seed", str(seed)]
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT, env=child_env())
        stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        code = None
    stages = [json.loads(line[6:]) for line in stdout.splitlines() if line.startswith("STAGE ")]
    results = [json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("RESULT ")]
    if results and code == 0:
        return results[-1] | {"child_seconds": round(time.perf_counter() - started, 1)}
    regimes = next((s.get("regimes") for s in stages if s.get("regimes")), {})
    tail = " | ".join(line.strip() for line in stderr.strip().splitlines()[-4:])[-600:]
    return {"case": case.id, "rows": case.rows, "regimes": regimes, "stage": stages[-1]["stage"] if stages else None,
            "out_of_gpu_memory": code is not None and out_of_gpu_memory(stderr),
            "outcome": "timeout" if code is None else "crashed",
            "detail": (f"no result within {timeout:.0f} s" if code is None else f"child exited with {code}") +
                      (f" at stage {stages[-1]['stage']}" if stages else "") + (f": {tail}" if tail else "")}


def child_main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="one scale case in its own process (see harness.port.scale)")
    parser.add_argument("--case", required=True)
    parser.add_argument("--impl", default="fast.impl:default_impl")
    parser.add_argument("--seed", type=int, default=SCALE_SEED)
    args = parser.parse_args(argv)
    from fast.impl import load_impl

    from .launch import DEVICE

    def emit(stage, info):
        print("STAGE " + json.dumps({"stage": stage, **info}), flush=True)

    result = check_scale_case(load_impl(args.impl), case_by_id(args.case), DEVICE, args.seed, emit)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault(GPU_TIER_DEVICE_ENV, GPU_TIER_DEFAULT_DEVICE)
    sys.exit(child_main())
