"""The dense oracle: sparse MLA attention over gathered KV slots, in pure PyTorch.

Per query row t and head h, over the row's selected slots (a multiset: a slot listed twice
counts twice):

    s[t,h,j] = sm_scale * (q_nope[t,h] . ckv[j] + q_pe[t,h] . kpe[j])     (ckv, kpe dequantised)
    out[t,h] = sum_j softmax_j(s[t,h,:]) * ckv[j]        lse[t,h] = ln sum_j exp(s[t,h,j])

A row with no selected slot gives out = 0 and lse = -inf. LSE is natural log; use
:func:`lse_to_base2` for FlashInfer's default base-2 convention.

Three compute modes:

- ``"float64"``: the truth.
- ``"float32"``: float32 arithmetic. Where the inputs are bf16-exact (bf16 q, bf16 or fp8
  cache) on a GPU, the matrix products run as bf16 x bf16 -> float32 (exact products, float32
  accumulation; the probabilities split into three bf16 terms), which is float32-accurate
  and uses the tensor cores; elsewhere they are float32 products.
- ``"lowp"``: rounds where an FA3-style kernel rounds (bf16 operands, float32 accumulation
  and softmax, unnormalised probabilities exp(s - max) rounded to bf16 before the P.V
  product, division by the float32 row sum after it, output rounded to bf16).
  It measures the error that working precision alone costs (the error budget's yardstick).

Rows are processed in chunks so that the extra memory stays under ``memory_budget_bytes``
whatever the number of rows.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

ComputeMode = Literal["float64", "float32", "lowp"]
COMPUTE_MODES: tuple[str, ...] = ("float64", "float32", "lowp")
DEFAULT_MEMORY_BUDGET_BYTES = 1 << 30
LOG2_E = 1.0 / math.log(2.0)


def lse_to_base2(lse_natural: torch.Tensor) -> torch.Tensor:
    """Natural-log LSE to base 2 (FlashInfer's default): lse2 = lse_e * log2(e)."""
    return lse_natural * LOG2_E


def lse_from_base2(lse_base2: torch.Tensor) -> torch.Tensor:
    """Base-2 LSE to natural log."""
    return lse_base2 / LOG2_E


def flatten_slots_view(cache_part: torch.Tensor, name: str) -> torch.Tensor:
    """Accept ``[N, D]`` or the kernel's ``[N, 1, D]`` view; return ``[N, D]``."""
    if cache_part.dim() == 3 and cache_part.shape[1] == 1:
        return cache_part[:, 0, :]
    if cache_part.dim() == 2:
        return cache_part
    raise ValueError(f"{name}: expected shape [num_slots, D] or [num_slots, 1, D], got {tuple(cache_part.shape)}")


def _check_inputs(q_nope, q_pe, ckv, kpe, slots, lens, mask) -> None:
    if (lens is None) == (mask is None):
        raise ValueError("give exactly one of lens or mask")
    tensors = {"q_nope": q_nope, "q_pe": q_pe, "ckv": ckv, "kpe": kpe, "slots": slots}
    tensors.update({"lens": lens} if lens is not None else {"mask": mask})
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) != 1:
        raise ValueError(f"all inputs must be on one device, got {devices}")
    if q_nope.dim() != 3:
        raise ValueError(f"q_nope: expected [T, H, D_ckv], got shape {tuple(q_nope.shape)}")
    t, h, d_ckv = q_nope.shape
    if q_pe.dim() != 3 or q_pe.shape[:2] != (t, h):
        raise ValueError(f"q_pe: expected [T={t}, H={h}, R], got shape {tuple(q_pe.shape)}")
    if ckv.shape[1] != d_ckv:
        raise ValueError(f"ckv: head dim {ckv.shape[1]} != q_nope head dim {d_ckv}")
    if kpe.shape[1] != q_pe.shape[2]:
        raise ValueError(f"kpe: head dim {kpe.shape[1]} != q_pe head dim {q_pe.shape[2]}")
    if kpe.shape[0] != ckv.shape[0]:
        raise ValueError(f"kpe: {kpe.shape[0]} slots but ckv has {ckv.shape[0]}")
    if slots.dim() != 2 or slots.shape[0] != t:
        raise ValueError(f"slots: expected [T={t}, K], got shape {tuple(slots.shape)}")
    if slots.dtype.is_floating_point or slots.dtype.is_complex or slots.dtype == torch.bool:
        raise ValueError(f"slots: expected an integer dtype, got {slots.dtype}")
    if lens is not None:
        if lens.shape != (t,):
            raise ValueError(f"lens: expected shape [T={t}], got {tuple(lens.shape)}")
        if lens.dtype.is_floating_point or lens.dtype == torch.bool:
            raise ValueError(f"lens: expected an integer dtype, got {lens.dtype}")
        if t and (int(lens.min()) < 0 or int(lens.max()) > slots.shape[1]):
            bad = int(((lens < 0) | (lens > slots.shape[1])).nonzero()[0])
            raise ValueError(f"lens: row {bad} has len {int(lens[bad])} outside [0, {slots.shape[1]}] (row width)")
    else:
        if mask.shape != slots.shape or mask.dtype != torch.bool:
            raise ValueError(f"mask: expected bool of shape {tuple(slots.shape)}, got {mask.dtype} {tuple(mask.shape)}")


def selection_mask(slots: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Mask of the first ``lens[t]`` columns of each row."""
    cols = torch.arange(slots.shape[1], device=slots.device)
    return cols.unsqueeze(0) < lens.to(slots.device).unsqueeze(1)


def _check_selected_slots(slots: torch.Tensor, mask: torch.Tensor, num_slots: int) -> None:
    bad = mask & ((slots < 0) | (slots >= num_slots))
    if bool(bad.any()):
        row, col = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"slots: row {row} column {col} selects slot {int(slots[row, col])}, outside [0, {num_slots}) "
            f"({int(bad.sum())} such entries)"
        )


def _row_bytes(num_heads: int, width: int, d_ckv: int, d_pe: int, elem: int) -> int:
    gathered = width * (d_ckv + d_pe) * elem * 2  # gather + cast copy
    scores = num_heads * width * elem * 3  # scores, probabilities, low-precision copy
    rows = num_heads * (d_ckv + d_pe) * elem * 3  # q cast, output accumulator, cast
    return gathered + scores + rows + width * 16


def rows_per_chunk(num_heads: int, width: int, d_ckv: int, d_pe: int, mode: str, budget_bytes: int) -> int:
    """How many rows fit in one chunk under the memory budget (at least one)."""
    elem = 8 if mode == "float64" else 4
    return max(1, budget_bytes // max(1, _row_bytes(num_heads, width, d_ckv, d_pe, elem)))


def _gathered(cache_part, idx, keep, dtype):
    """``cache_part[idx]`` in ``dtype`` with unselected columns zeroed, so that a poisoned
    slot 0 (what they gather) stays out of the P.V product. One fresh tensor."""
    rows = cache_part[idx]
    if rows.dtype != dtype:
        rows = rows.to(dtype)
    return rows.masked_fill_(~keep, 0.0)


def _softmax_in_place(scores, mask, scale):
    """Scale, mask and exponentiate ``scores [C,H,K]`` in place; returns ``(probs, lse)``
    with ``probs = exp(s - lse)`` (0 on masked columns) and ``lse = -inf`` for empty rows."""
    scores.mul_(scale)
    scores.masked_fill_(~mask.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    finite_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return scores.sub_(finite_lse.unsqueeze(-1)).exp_(), lse


def _attend_chunk(qn, qp, ckv, kpe, slots, mask, sm_scale, k_scale, mode):
    work = torch.float64 if mode == "float64" else torch.float32
    idx = torch.where(mask, slots, torch.zeros_like(slots)).long()
    keep = mask.unsqueeze(-1)
    kv_c = _gathered(ckv, idx, keep, work)  # [C, K, D_ckv]
    kv_p = _gathered(kpe, idx, keep, work)  # [C, K, R]
    if mode == "lowp":
        qn_w, qp_w = qn.to(torch.bfloat16).to(work), qp.to(torch.bfloat16).to(work)
    else:
        qn_w, qp_w = qn.to(work), qp.to(work)
    scores = torch.einsum("chd,ckd->chk", qn_w, kv_c)
    if qp_w.shape[-1]:
        scores += torch.einsum("chr,ckr->chk", qp_w, kv_p)
    if mode == "lowp":
        return _lowp_softmax_and_values(scores, mask, sm_scale * k_scale, kv_c, k_scale)
    probs, lse = _softmax_in_place(scores, mask, sm_scale * k_scale)
    out = torch.einsum("chk,ckd->chd", probs, kv_c).mul_(k_scale)
    return out, lse


def _lowp_softmax_and_values(scores, mask, scale, kv_c, k_scale):
    """Where an FA3-style kernel rounds: unnormalised probabilities ``exp(s - max)`` go to
    bf16 for the P.V product (float32 accumulation), the row sum stays float32 and divides
    the float32 accumulator, and the output is rounded to bf16."""
    scores.mul_(scale)
    scores.masked_fill_(~mask.unsqueeze(1), float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = scores.sub_(row_max).exp_()  # 0 on masked columns
    row_sum = p.sum(dim=-1)
    acc = torch.einsum("chk,ckd->chd", p.to(torch.bfloat16).to(p.dtype), kv_c)
    safe_sum = torch.where(row_sum > 0, row_sum, torch.ones_like(row_sum))
    out = (acc / safe_sum.unsqueeze(-1)).mul_(k_scale).to(torch.bfloat16)
    lse = torch.where(row_sum > 0, row_max.squeeze(-1) + torch.log(safe_sum), torch.full_like(row_sum, float("-inf")))
    return out, lse


# --- float32 -------------------------------------------------------------------------------
#
# A bf16 (or float8_e4m3fn) value is exact in bf16 and a product of two bf16 values is exact
# in float32, so where the inputs are bf16-exact the float32 answer can use bf16 matrix
# products that return float32 (tensor cores on a GPU): q.k exactly as float32 arithmetic
# would, and P.V with P split into three bf16 terms (P = p1 + p2 + p3 to float32 precision).

BF16_EXACT_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


def _bmm_f32_reference(a, b):
    return torch.bmm(a.float(), b.float())


def _bmm_f32_out_dtype(a, b):
    return torch.bmm(a, b, out_dtype=torch.float32)


_BF16_BMM_F32: dict[torch.device, bool] = {}


def bf16_bmm_returns_float32(device: torch.device) -> bool:
    """Whether ``torch.bmm(bf16, bf16, out_dtype=float32)`` works on ``device`` and keeps a
    float32 result (1 + 2**-9 survives, which bf16 rounding would lose)."""
    device = torch.device(device)
    if device not in _BF16_BMM_F32:
        ok = False
        if device.type == "cuda":
            try:
                a = torch.tensor([[[1.0, 2.0**-9]]], dtype=torch.bfloat16, device=device)
                b = torch.ones((1, 2, 1), dtype=torch.bfloat16, device=device)
                r = _bmm_f32_out_dtype(a, b)
                ok = r.dtype == torch.float32 and float(r) == 1.0 + 2.0**-9
            except (TypeError, RuntimeError, NotImplementedError):
                ok = False
        _BF16_BMM_F32[device] = ok
    return _BF16_BMM_F32[device]


def split_bf16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` (float32) as three bf16 terms whose float32 sum is ``x`` to float32 precision."""
    hi = x.to(torch.bfloat16)
    rest = x - hi
    mid = rest.to(torch.bfloat16)
    rest.sub_(mid)
    return hi, mid, rest.to(torch.bfloat16)


def _attend_chunk_float32(qn, qp, ckv, kpe, slots, mask, sm_scale, k_scale, bf16_products):
    """float32 mode: one gather, batched matrix products, in-place softmax. With
    ``bf16_products`` (bf16-exact inputs) the products run as bf16 x bf16 -> float32."""
    idx = torch.where(mask, slots, torch.zeros_like(slots)).long()
    keep = mask.unsqueeze(-1)
    if bf16_products:
        dtype, mm = torch.bfloat16, _bmm_f32_out_dtype
    else:
        dtype, mm = torch.float32, torch.bmm
    kv_c = _gathered(ckv, idx, keep, dtype)  # [C, K, D_ckv]
    scores = mm(qn.to(dtype), kv_c.transpose(1, 2))  # [C, H, K] float32
    if qp.shape[-1]:
        kv_p = _gathered(kpe, idx, keep, dtype)
        scores += mm(qp.to(dtype), kv_p.transpose(1, 2))
        del kv_p
    probs, lse = _softmax_in_place(scores, mask, sm_scale * k_scale)
    if bf16_products:
        terms = split_bf16(probs)
        del probs, scores
        out = mm(terms[0], kv_c)
        for term in terms[1:]:
            out += mm(term, kv_c)
    else:
        out = mm(probs, kv_c)
    return out.mul_(k_scale), lse


def float32_uses_bf16_products(q_nope, q_pe, ckv, kpe) -> bool:
    """Whether float32 mode computes its products as bf16 x bf16 -> float32 for these inputs
    (bf16 q, bf16 or float8_e4m3fn cache, on a device whose bmm returns float32 for them)."""
    return (
        q_nope.dtype == torch.bfloat16
        and q_pe.dtype == torch.bfloat16
        and ckv.dtype in BF16_EXACT_DTYPES
        and kpe.dtype in BF16_EXACT_DTYPES
        and bf16_bmm_returns_float32(q_nope.device)
    )


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA attention of each row over its selected slots; returns ``(out, lse)``.

    ``q_nope [T,H,512]``, ``q_pe [T,H,R]`` (R = 64, or 0 for NoPE), ``ckv [N,512]`` and
    ``kpe [N,R]`` (or the kernel's ``[N,1,D]`` views; bf16, float32 or float8_e4m3fn, the
    latter dequantised as value * k_scale), ``slots [T,K]`` integer slot ids. The selection
    is the first ``lens[t]`` columns of row t, or the True entries of ``mask``; unselected
    entries may hold anything (-1 included). Returns ``out [T,H,512]`` (float64, float32 or
    bf16 by mode) and natural-log ``lse [T,H]`` (float64 or float32).
    """
    if mode not in COMPUTE_MODES:
        raise ValueError(f"mode: expected one of {COMPUTE_MODES}, got {mode!r}")
    ckv = flatten_slots_view(ckv, "ckv")
    kpe = flatten_slots_view(kpe, "kpe")
    _check_inputs(q_nope, q_pe, ckv, kpe, slots, lens, mask)
    if mask is None:
        mask = selection_mask(slots, lens)
    _check_selected_slots(slots, mask, ckv.shape[0])

    t, h, d_ckv = q_nope.shape
    out_dtype = {"float64": torch.float64, "float32": torch.float32, "lowp": torch.bfloat16}[mode]
    lse_dtype = torch.float64 if mode == "float64" else torch.float32
    out = torch.empty((t, h, d_ckv), dtype=out_dtype, device=q_nope.device)
    lse = torch.empty((t, h), dtype=lse_dtype, device=q_nope.device)
    chunk = rows_per_chunk(h, slots.shape[1], d_ckv, kpe.shape[1], mode, memory_budget_bytes)
    bf16_products = mode == "float32" and float32_uses_bf16_products(q_nope, q_pe, ckv, kpe)
    for start in range(0, t, chunk):
        stop = min(t, start + chunk)
        args = (q_nope[start:stop], q_pe[start:stop], ckv, kpe, slots[start:stop], mask[start:stop],
                float(sm_scale), float(k_scale))
        if mode == "float32":
            o, l = _attend_chunk_float32(*args, bf16_products)
        else:
            o, l = _attend_chunk(*args, mode)
        out[start:stop] = o
        lse[start:stop] = l
    return out, lse
