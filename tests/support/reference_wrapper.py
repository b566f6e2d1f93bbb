"""A stand-in for FlashInfer's MLA wrapper in the port's attention state (the ``stand_in`` fixture of
``tests/cpu/conftest.py`` installs it): plans as FlashInfer does under CUDA graphs, runs the
low-precision reference."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from reference import sparse_mla_reference


class ReferenceWrapper:
    """Stands in for backends.flashinfer.compat.MLAWrapper: plans like FlashInfer under CUDA graphs
    (the CSR arrays copied into the reserved buffers; kv_indices read at run) and runs the
    low-precision reference."""

    refuse: str | None = None  # raise this ValueError at plan
    plans: list = []

    def __init__(self, workspace, *, qo_indptr, kv_indptr, kv_indices, kv_len_arr, features=None, lse_base_e=True,
                 kernel="fa3"):
        self.buffers = dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_len_arr=kv_len_arr)
        self.kv_indices = kv_indices
        self.features = features or SimpleNamespace(version="stand-in")

    def plan(self, *, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, sm_scale,
             kv_dtype, q_dtype=torch.bfloat16):
        if ReferenceWrapper.refuse:
            raise ValueError(ReferenceWrapper.refuse)
        for key, value in dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_len_arr=kv_len_arr).items():
            self.buffers[key][: value.numel()].copy_(value)
        self._plan = (qo_indptr.clone(), kv_indptr.clone(), kv_len_arr.clone(), float(sm_scale))
        ReferenceWrapper.plans.append(
            dict(
                qo_indptr=qo_indptr.clone(),
                kv_indptr=kv_indptr.clone(),
                kv_len_arr=kv_len_arr.clone(),
                num_heads=num_heads,
                sm_scale=sm_scale,
                kv_dtype=kv_dtype,
            )
        )

    def run(self, q_nope, q_pe, ckv, kpe, *, out, lse, k_scale=1.0):
        qo, indptr, lens, sm_scale = self._plan
        # the plan's query rows: a launch shaped for more (a graph captured after a larger plan)
        # writes only those
        rows = min(q_nope.shape[0], int(qo[-1]))
        q_nope, q_pe = q_nope[:rows], q_pe[:rows]
        req = torch.repeat_interleave(torch.arange(qo.numel() - 1), (qo[1:] - qo[:-1]).long())[:rows]
        starts, row_lens = indptr[req].long(), lens[req].long()
        width = int(row_lens.max()) if rows else 0
        device = self.kv_indices.device  # the plan arrays are host tensors, kv_indices the device's
        pos = (starts[:, None] + torch.arange(width)).clamp(max=self.kv_indices.numel() - 1).to(device)
        mask = (torch.arange(width) < row_lens[:, None]).to(device)
        slots = torch.where(mask, self.kv_indices[pos].long(), 0)
        mask = mask & (slots >= 0)
        o, lse_rows = sparse_mla_reference(q_nope, q_pe, ckv, kpe, slots.clamp(min=0), mask=mask, sm_scale=sm_scale,
                                    k_scale=k_scale, mode="lowp")
        out[:rows].copy_(o)
        lse[:rows].copy_(lse_rows)
