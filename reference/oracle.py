"""The oracle: sparse MLA attention over gathered KV slots, in pure PyTorch.

Per query row t and head h, over the row's selected slots (a multiset: a slot listed twice
counts twice):

    s[t,h,j] = sm_scale * (q_nope[t,h] . ckv[j] + q_pe[t,h] . kpe[j])     (ckv, kpe dequantised)
    out[t,h] = sum_j softmax_j(s[t,h,:]) * ckv[j]        lse[t,h] = ln sum_j exp(s[t,h,j])

A row with no selected slot gives out = 0 and lse = -inf. LSE is natural log; use
:func:`lse_to_base2` for FlashInfer's default base-2 convention. :func:`sparse_mla_float64`
is this definition in float64, the truth the suite compares against (see
docs/computation.md#the-computation).

:func:`sparse_mla_reference` is the entry point: it checks the inputs and computes in one of
three modes, ``"float64"`` (the definition, rows in chunks under a memory budget),
``"float32"`` and ``"lowp"`` (working precision, ``reference/oracle_fast.py``).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from .oracle_fast import DEFAULT_MEMORY_BUDGET_BYTES, chunk_budget_bytes, rows_per_chunk, sparse_mla_working_precision
from .oracle_inputs import check_inputs, check_selection, flatten_slots_view, gather_index, selection_mask

ComputeMode = Literal["float64", "float32", "lowp"]
COMPUTE_MODES: tuple[str, ...] = ("float64", "float32", "lowp")
OUT_DTYPES = {"float64": torch.float64, "float32": torch.float32, "lowp": torch.bfloat16}
LOG2_E = 1.0 / math.log(2.0)

__all__ = ["COMPUTE_MODES", "DEFAULT_MEMORY_BUDGET_BYTES", "LOG2_E", "flatten_slots_view", "lse_from_base2",
           "lse_to_base2", "sparse_mla_float64", "sparse_mla_reference"]


def lse_to_base2(lse_natural: torch.Tensor) -> torch.Tensor:
    """Natural-log LSE to base 2 (FlashInfer's default): lse2 = lse_e * log2(e)."""
    return lse_natural * LOG2_E


def lse_from_base2(lse_base2: torch.Tensor) -> torch.Tensor:
    """Base-2 LSE to natural log."""
    return lse_base2 / LOG2_E


def sparse_mla_float64(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                       slots: torch.Tensor, mask: torch.Tensor, *, sm_scale: float,
                       k_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition in float64: ``(out [T,H,512], lse [T,H])`` of rows ``q_nope [T,H,512]``,
    ``q_pe [T,H,R]`` attending the cache rows ``ckv [N,512]``, ``kpe [N,R]`` (as stored: bf16,
    float32 or float8_e4m3fn, whose value is stored * k_scale) that ``slots [T,K]`` selects where
    ``mask [T,K]`` is True. Inputs are taken as checked (:func:`sparse_mla_reference` checks them)."""
    d_ckv = ckv.shape[1]
    idx = gather_index(slots, mask)  # unselected columns read a slot the row reads anyway
    kv = torch.cat([ckv[idx], kpe[idx]], dim=-1).double()  # [T, K, 512+R]
    q = torch.cat([q_nope, q_pe], dim=-1).double()  # [T, H, 512+R]
    # s = sm_scale * q . (k_scale * kv): the dequantisation folded into the scale, applied once
    # to each float64 sum (baddbmm at beta 0 ignores its uninitialised first argument)
    scores = torch.baddbmm(q.new_empty(q.shape[0], q.shape[1], kv.shape[1]), q, kv.mT, beta=0.0,
                           alpha=float(sm_scale) * float(k_scale))
    scores.masked_fill_(~mask.unsqueeze(1), float("-inf"))  # [T, H, K]
    probs = torch.softmax(scores, dim=-1)
    top = scores.argmax(dim=-1, keepdim=True)  # ln sum exp s = s_max - ln p_max, read at the arg-max
    lse = (scores.gather(-1, top) - probs.gather(-1, top).log()).squeeze(-1)
    out = torch.bmm(probs, kv[..., :d_ckv]) * float(k_scale)  # values dequantised after the sum
    empty = ~mask.any(dim=1)  # rows that select nothing: out 0, lse -inf
    return out.masked_fill_(empty[:, None, None], 0.0), lse.masked_fill_(empty[:, None], float("-inf"))


def sparse_mla_reference(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv: torch.Tensor,
    kpe: torch.Tensor,
    slots: torch.Tensor,
    *,
    lens: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    sm_scale: float,
    k_scale: float = 1.0,
    mode: ComputeMode = "float64",
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
    parts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA attention of each row over its selected slots; returns ``(out, lse)``.

    ``q_nope [T,H,512]``, ``q_pe [T,H,R]`` (R = 64, or 0 for NoPE), ``ckv [N,512]`` and
    ``kpe [N,R]`` (or the kernel's ``[N,1,D]`` views; bf16, float32 or float8_e4m3fn, the
    latter dequantised as value * k_scale), ``slots [T,K]`` integer slot ids. The selection
    is the first ``lens[t]`` columns of row t, or the True entries of ``mask``; unselected
    entries may hold anything (-1 included). Returns ``out [T,H,512]`` (float64, float32 or
    bf16 by mode) and natural-log ``lse [T,H]`` (float64 or float32). Rows are computed in
    chunks so that the extra memory stays under ``memory_budget_bytes`` whatever their number
    (on a CPU, under ``CPU_CHUNK_BYTES`` too: see ``reference/oracle_fast.py``).

    ``parts [T,K]`` (``"lowp"`` only; integer, ignored on unselected columns): the work item of
    the kernel that reads each column, numbered from 0 per row. A row read in several parts is
    computed as a split kernel computes it: one partial output per part, rounded to bf16, merged
    by their LSEs (FlashInfer's fa3 and fa2 store split partial outputs in the output dtype).
    """
    if parts is not None and (mode != "lowp" or parts.shape != slots.shape):
        raise ValueError(f"parts: for mode 'lowp', shaped as slots {tuple(slots.shape)}; got mode {mode!r}, "
                         f"shape {tuple(parts.shape)}")
    if mode not in COMPUTE_MODES:
        raise ValueError(f"mode: expected one of {COMPUTE_MODES}, got {mode!r}")
    ckv = flatten_slots_view(ckv, "ckv")
    kpe = flatten_slots_view(kpe, "kpe")
    check_inputs(q_nope, q_pe, ckv, kpe, slots, lens, mask)
    if mask is None:
        mask = selection_mask(slots, lens)
    facts = check_selection(slots, lens, mask, ckv.shape[0])

    t, h, d_ckv = q_nope.shape
    out = torch.empty((t, h, d_ckv), dtype=OUT_DTYPES[mode], device=q_nope.device)
    lse = torch.empty((t, h), dtype=torch.float64 if mode == "float64" else torch.float32, device=q_nope.device)
    if not facts.any_selected:  # every row empty (no rows, no columns, or nothing selected)
        return out.zero_(), lse.fill_(float("-inf"))
    if mode != "float64":
        return sparse_mla_working_precision(q_nope, q_pe, ckv, kpe, slots, mask, facts, sm_scale=sm_scale,
                                            k_scale=k_scale, mode=mode, memory_budget_bytes=memory_budget_bytes,
                                            parts=None if parts is None else torch.where(mask, parts.long(), -1))
    chunk = rows_per_chunk(h, slots.shape[1], d_ckv, kpe.shape[1], mode,
                           chunk_budget_bytes(memory_budget_bytes, q_nope.device))
    for start in range(0, t, chunk):
        rows = slice(start, min(t, start + chunk))
        out[rows], lse[rows] = sparse_mla_float64(q_nope[rows], q_pe[rows], ckv, kpe, slots[rows], mask[rows],
                                                  sm_scale=sm_scale, k_scale=k_scale)
    return out, lse
