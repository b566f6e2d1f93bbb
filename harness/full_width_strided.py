"""Run in a subprocess by the crash-safety test: plan the strided layout with full-width lens
(SPEC §6 #4, every row's -1 tail inside the planned span) and launch, the way the seed did.
On FlashInfer <= 0.6.x this may fault the device, which is why it runs in its own process.
Prints one JSON line: what happened."""

from __future__ import annotations

import json
import sys

import torch

from mla_constants import TOPK


def main(seed: int) -> dict:
    from fast.impl import default_impl
    from harness.launch import attention_config, launch_inputs, nan_buffers
    from harness.scenario import batch, build_attention_inputs, build_scenario

    impl = default_impl()
    scenario = build_scenario(batch((300, 1), (1500, 1), (9, 1), topk=TOPK, kpool=1), seed)
    inputs = build_attention_inputs(scenario, "cuda")
    rows = scenario.topk_indices.shape[0]
    state = impl.make_attention_state(attention_config(scenario, "strided", rows), "cuda")
    launch = launch_inputs(impl, scenario, inputs, rows)
    out, lse = nan_buffers(rows, scenario.spec.num_heads)
    full = torch.full((rows,), scenario.spec.resolved_width, dtype=torch.int32)
    result = {"version": state.features.version, "stage": "write"}
    try:
        state.write_indices(launch.topk_indices, launch.block_table, launch.req_id)  # -1 tails in kv_indices
        result["stage"] = "plan"
        state.plan(rows, full)
        result["stage"] = "run"
        state.attend(inputs.q_nope, inputs.q_pe, inputs.ckv, inputs.kpe, out, lse)
        torch.cuda.synchronize()
        result["stage"] = "done"
        result["nan_rows"] = int(torch.isnan(out.float()).flatten(1).any(dim=1).sum())
    except Exception as exc:  # the outcome is the report
        result["error"] = f"{type(exc).__name__}: {exc}"
    return result


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 0)), flush=True)
