"""A program shaped like the seed's use of FlashInfer's MLA wrapper (a plan/run per step), with a
FlashInfer-0.6-shaped stand-in wrapper: what ``recording.capture.capture_mla`` records in the
capture and rerun tests."""

from __future__ import annotations

import torch

from harness import batch, build_attention_inputs, build_scenario
from harness.pipeline import meta_on_device
from reference import lse_to_base2, sparse_mla_reference


class StandInWrapper:
    """FlashInfer-0.6-shaped MLA wrapper computing with the float32 reference on the host
    (whatever device the program's kv_indices are on)."""

    def __init__(self, kv_indices: torch.Tensor):
        self.kv_indices = kv_indices

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, use_profiler=False):
        self._plan = (qo_indptr.clone(), kv_indptr.clone(), kv_len_arr.clone(), sm_scale)

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False, return_lse_base_on_e=False):
        qo, kv_indptr, kv_len, sm_scale = (t.cpu() if isinstance(t, torch.Tensor) else t for t in self._plan)
        rows = int(qo[-1])
        width = int(kv_len[:rows].max()) if rows else 0
        pos = kv_indptr[:rows, None] + torch.arange(width)
        mask = torch.arange(width) < kv_len[:rows, None]
        kv_indices = self.kv_indices.cpu()
        slots = torch.where(mask, kv_indices[pos.clamp(max=kv_indices.numel() - 1)], 0)
        o, lse_out = sparse_mla_reference(
            q_nope[:rows], q_pe[:rows], ckv_cache, kpe_cache, slots, mask=mask, sm_scale=sm_scale, mode="float32"
        )
        o = o.to(q_nope.dtype)
        lse_out = lse_out if return_lse_base_on_e else lse_to_base2(lse_out)
        return (o, lse_out) if return_lse else o


def seed_style_program(impl, device, steps: list, max_rows: int, width: int) -> list[torch.Tensor]:
    """Reserved buffers on ``device``; per step: convert into kv_indices (strided), plan with
    exact lens, run."""
    kv_indices = torch.full((max_rows * width + 1,), -1, dtype=torch.int32, device=device)
    wrapper = StandInWrapper(kv_indices)
    outputs = []
    for scenario, inputs in steps:
        n = scenario.num_rows
        lens = impl.kv_lens(
            meta_on_device(scenario.meta, device),
            topk=scenario.spec.topk,
            kpool=scenario.spec.kpool,
            async_scheduling=False,
        )
        qo = torch.arange(max_rows + 1, dtype=torch.int32).clamp(max=n)
        wrapper.plan(
            qo,
            qo * width,
            kv_indices,
            torch.cat([lens, torch.full((max_rows - n,), width, dtype=torch.int32)]),
            scenario.spec.num_heads,
            512,
            64,
            1,
            False,
            scenario.spec.sm_scale,
        )
        rows = kv_indices[: max_rows * width].view(max_rows, width)
        req = impl.request_ids(scenario.meta.query_start_loc_cpu.to(device), max_rows)
        topk = torch.full((max_rows, width), -1, dtype=torch.int32, device=device)
        topk[:n] = scenario.topk_indices[:n].to(device)
        impl.convert(topk, scenario.block_table.to(device), req, scenario.spec.block_size, out=rows)
        out, lse = wrapper.run(inputs.q_nope, inputs.q_pe, inputs.ckv, inputs.kpe, return_lse=True)
        outputs.append(torch.cat([out.float(), lse.unsqueeze(-1)], dim=-1))
    return outputs


def program_steps():
    steps = []
    for i, pairs in enumerate([((70, 1), (3000, 1)), ((2050, 1), (9, 1), (300, 1)), ((5000, 1),)]):
        scenario = build_scenario(batch(*pairs, topk=256, num_heads=2, block_size=16), seed=40 + i)
        steps.append((scenario, build_attention_inputs(scenario)))
    return steps
