"""Run in a subprocess by the crash-safety test: plan the strided layout with full-width lens
(docs/findings.md#full-width-lengths-strided, every row's -1 tail inside the planned span) and
launch, the way the seed did. A FlashInfer that does not check cache coverage at run launches
it and reads slot -1, which may fault the device: that is why it runs in its own process.
Prints one JSON line per stage reached (the last one says what happened, even when the process
dies): ``stage`` is write, plan, run (run() called), sync (run() returned: launched) or done,
with ``error`` where one was raised and, when done, the rows whose output holds NaN."""

from __future__ import annotations

import json
import sys

import torch

from backends.flashinfer.port import make_attention_state
from mla_constants import TOPK

COVERAGE_REFUSAL = "ValueError: KV cache does not cover"


def outcome_problem(outcome: dict, *, run_checks_cache_coverage: bool) -> str:
    """Why the process's outcome (its last stage line, with ``died`` and ``returncode`` when it
    did not exit cleanly) is not one the release may give ("" when it is). A release that
    checks cache coverage at run refuses the launch and the process exits cleanly; one that
    does not launches it (run() returns) and then finishes, faults at the sync with a CUDA
    error, or dies at the sync. Anything else (dying or failing before run() returned, another
    error, dying after finishing) is not this launch's outcome."""
    stage, error, died = outcome.get("stage"), outcome.get("error", ""), bool(outcome.get("died"))
    if run_checks_cache_coverage:
        if stage == "run" and error.startswith(COVERAGE_REFUSAL) and not died:
            return ""
        return f"expected run() to refuse ({COVERAGE_REFUSAL} ...) in a process that exits cleanly"
    if stage == "done" and not error and not died:
        return ""
    if stage == "sync" and ("CUDA error" in error or (died and not error)):
        return ""
    return "expected a launch (run() returned) that finishes, faults at the sync with a CUDA error or dies there"


def main(seed: int) -> dict:
    from fast.impl import default_impl
    from harness.port.launch import attention_config, launch_inputs, nan_buffers
    from harness.scenario import batch, build_attention_inputs, build_scenario

    impl = default_impl()
    scenario = build_scenario(batch((300, 1), (1500, 1), (9, 1), topk=TOPK, kpool=1), seed)
    inputs = build_attention_inputs(scenario, "cuda")
    rows = scenario.topk_indices.shape[0]
    state = make_attention_state(impl, attention_config(scenario, "strided", rows), "cuda")
    launch = launch_inputs(impl, scenario, inputs, rows)
    out, lse = nan_buffers(rows, scenario.spec.num_heads)
    full = torch.full((rows,), scenario.spec.resolved_width, dtype=torch.int32)
    result = {"version": state.features.version, "rows": rows}

    def reached(stage: str) -> None:
        result["stage"] = stage
        print(json.dumps(result), flush=True)

    try:
        reached("write")
        state.write_indices(launch.topk_indices, launch.block_table, launch.req_id)  # -1 tails in kv_indices
        reached("plan")
        state.plan(rows, full)
        reached("run")
        state.attend(inputs.q_nope, inputs.q_pe, inputs.ckv, inputs.kpe, out, lse)
        reached("sync")
        torch.cuda.synchronize()
        result["nan_rows"] = int(torch.isnan(out.float()).flatten(1).any(dim=1).sum())
        reached("done")
    except Exception as exc:  # the outcome is the report
        result["error"] = f"{type(exc).__name__}: {exc}"
        print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
