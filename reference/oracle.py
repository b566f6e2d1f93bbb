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
  accumulation; the probabilities split into two bf16 terms, see ``PROBABILITY_TERMS``) on the
  tensor cores: on an H200 at 256 rows x H 128 x topk 2048 it is 4.2e-6 (rel L2) from float64,
  against 3.3e-6 for an exact three-term split; elsewhere they are float32 products.
- ``"lowp"``: rounds where an FA3-style kernel rounds (bf16 operands, float32 accumulation
  and softmax, unnormalised probabilities exp(s - max) rounded to bf16 before the P.V
  product, division by the float32 row sum after it, output rounded to bf16).
  It measures the error that working precision alone costs (the error budget's yardstick).

Rows are processed in chunks so that the extra memory stays under ``memory_budget_bytes``
whatever the number of rows.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

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
    else:
        if mask.shape != slots.shape or mask.dtype != torch.bool:
            raise ValueError(f"mask: expected bool of shape {tuple(slots.shape)}, got {mask.dtype} {tuple(mask.shape)}")


def selection_mask(slots: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Mask of the first ``lens[t]`` columns of each row."""
    cols = torch.arange(slots.shape[1], device=slots.device)
    return cols.unsqueeze(0) < lens.to(slots.device).unsqueeze(1)


class SelectionFacts(NamedTuple):
    all_selected: bool  # every row selects every column: nothing to mask
    any_row_empty: bool  # some row selects nothing: out 0, lse -inf to fill in
    any_selected: bool  # some row selects something: anything to compute


def check_selection(slots: torch.Tensor, lens: torch.Tensor | None, mask: torch.Tensor,
                  num_slots: int) -> SelectionFacts:
    """Lens within [0, row width] and selected slots within [0, num_slots), and what the
    selection looks like. The facts come back to the host in one transfer (one
    synchronisation on a GPU) from two min/max reductions; only an error looks further."""
    width = slots.shape[1]
    counts = lens if lens is not None else mask.sum(dim=1)  # selected columns per row
    if counts.numel() == 0:  # no rows
        return SelectionFacts(all_selected=True, any_row_empty=False, any_selected=False)
    ranges = [torch.aminmax(counts)] + ([torch.aminmax(torch.where(mask, slots, 0))] if width else [])
    values = torch.stack([v.to(torch.int64) for pair in ranges for v in pair]).tolist()
    count_min, count_max = values[:2]
    slot_min, slot_max = values[2:] if width else (0, 0)
    if count_min < 0 or count_max > width:  # (mask counts are always in range)
        row = int(((lens < 0) | (lens > width)).nonzero()[0])
        raise ValueError(f"lens: row {row} has len {int(lens[row])} outside [0, {width}] (row width)")
    if slot_min < 0 or slot_max >= num_slots:  # (unselected columns count as 0: an empty cache fails)
        bad = mask & ((slots < 0) | (slots >= num_slots))
        if bool(bad.any()):
            row, col = (int(v) for v in bad.nonzero()[0])
            raise ValueError(
                f"slots: row {row} column {col} selects slot {int(slots[row, col])}, outside [0, {num_slots}) "
                f"({int(bad.sum())} such entries)"
            )
    return SelectionFacts(all_selected=count_min == width, any_row_empty=count_min == 0, any_selected=count_max > 0)


def _row_bytes(num_heads: int, width: int, d_ckv: int, d_pe: int, elem: int, operand: int | None = None) -> int:
    """Working bytes of one row of a chunk: ``elem`` is the working precision (8, 4), ``operand``
    the matrix products' operand size (``elem``, or 2 for bf16 x bf16 -> float32 products)."""
    operand = elem if operand is None else operand
    dims = d_ckv + d_pe
    gathered = width * dims * (3 if operand == 2 else 2 + operand)  # rows as stored (<= 2 B) + cast copy
    scores = num_heads * width * (2 * elem + 2)  # scores and probabilities, or probabilities and bf16 terms
    rows = num_heads * dims * elem * 3  # q, output, one more product's output
    return gathered + scores + rows + width * 16  # + the row's mask and slot index


def rows_per_chunk(num_heads: int, width: int, d_ckv: int, d_pe: int, mode: str, budget_bytes: int,
                   bf16_products: bool = False) -> int:
    """How many rows fit in one chunk under the memory budget (at least one)."""
    elem = 8 if mode == "float64" else 4
    per_row = _row_bytes(num_heads, width, d_ckv, d_pe, elem, 2 if bf16_products else elem)
    return max(1, budget_bytes // max(1, per_row))


def gather_index(slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The slot each column gathers (int64): selected columns their own slot, unselected ones
    the row's first selected slot. A slot the row reads anyway keeps poison (NaN in slot 0 or
    in stale slots) out of the P.V product without zeroing the gathered rows: the column's
    probability is exactly 0 and its value is finite unless the row's own selection is
    poisoned. Rows with no selection gather slot 0; the caller sets them to out 0, lse -inf."""
    first_col = mask.to(torch.uint8).argmax(dim=1, keepdim=True)
    first = torch.where(mask.any(dim=1, keepdim=True), slots.gather(1, first_col), torch.zeros_like(first_col))
    return torch.where(mask, slots, first).long()


def joined_parts(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(a|b,)``, one view of both along the last dimension, when ``b`` directly follows ``a``
    in one buffer (q as ``[T, H, 576]`` split in two, the cache as ``[N, 1, 576]`` split in two)
    or is empty; otherwise ``(a, b)``, to be joined piece by piece with :func:`cat_parts`."""
    if b.shape[-1] == 0:
        return (a,)
    adjacent = (
        a.dtype == b.dtype and a.device == b.device and a.shape[:-1] == b.shape[:-1] and a.stride() == b.stride()
        and a.stride(-1) == 1 and b.storage_offset() == a.storage_offset() + a.shape[-1]
        and all(st >= a.shape[-1] + b.shape[-1] for st, n in zip(a.stride()[:-1], a.shape[:-1]) if n > 1)
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    )
    if not adjacent:
        return (a, b)
    return (a.as_strided(a.shape[:-1] + (a.shape[-1] + b.shape[-1],), a.stride(), a.storage_offset()),)


def cat_parts(parts: list[torch.Tensor]) -> torch.Tensor:
    """The pieces of :func:`joined_parts` (already indexed) along the last dimension."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def softmax_and_lse(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled, masked (-inf) ``scores [C,H,K]`` to ``(probs, lse)``: normalised probabilities
    (0 on masked columns) and ``lse = z_max - ln p_max`` at the arg-max column, which is
    ``ln sum exp z`` to the working precision. Empty rows come out NaN; the caller
    overwrites them."""
    probs = torch.softmax(scores, dim=-1)
    top = scores.argmax(dim=-1, keepdim=True)
    lse = scores.gather(-1, top).sub_(probs.gather(-1, top).log_()).squeeze(-1)
    return probs, lse


def _attend_chunk_lowp(q, kv, mask, d_ckv, scale, k_scale):
    """Where an FA3-style kernel rounds: unnormalised probabilities ``exp(s - max)`` go to
    bf16 for the P.V product (float32 accumulation), the row sum stays float32 and divides
    the float32 accumulator, and the output is rounded to bf16."""
    kv = kv.float()  # [C, K, D+R]
    scores = torch.bmm(q.to(torch.bfloat16).float(), kv.transpose(1, 2))
    scores.mul_(scale)
    if mask is not None:
        scores.masked_fill_(~mask.unsqueeze(1), float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = scores.sub_(row_max).exp_()  # 0 on masked columns
    row_sum = p.sum(dim=-1)
    acc = torch.bmm(p.to(torch.bfloat16).float(), kv[..., :d_ckv])
    safe_sum = torch.where(row_sum > 0, row_sum, torch.ones_like(row_sum))
    out = (acc / safe_sum.unsqueeze(-1)).mul_(k_scale).to(torch.bfloat16)
    return out, row_max.squeeze(-1) + torch.log(safe_sum)


# --- float64 and float32 ---------------------------------------------------------------------
#
# A bf16 (or float8_e4m3fn) value is exact in bf16 and a product of two bf16 values is exact
# in float32, so where the inputs are bf16-exact the float32 answer can use bf16 matrix
# products that return float32 (tensor cores on a GPU): q.k exactly as float32 arithmetic
# would, and P.V with P split into bf16 terms (PROBABILITY_TERMS).

BF16_EXACT_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


def _baddbmm_into(dst, a, b, alpha, accumulate, **kwargs):
    return torch.baddbmm(dst, a, b, beta=1.0 if accumulate else 0.0, alpha=alpha, out=dst, **kwargs)


def _bf16_product_into(dst, a, b, alpha, accumulate):
    return _baddbmm_into(dst, a, b, alpha, accumulate, out_dtype=torch.float32)


def _upcast_product_into(dst, a, b, alpha, accumulate):
    """What :func:`_bf16_product_into` computes, with float32 operands (any device)."""
    return _baddbmm_into(dst, a.float(), b.float(), alpha, accumulate)


def product_into(dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0,
                 accumulate: bool = False) -> torch.Tensor:
    """``dst = alpha * a @ b`` (``+ dst`` with ``accumulate``), batched, written in place:
    ``dst``'s old values are not read otherwise (beta 0), so it may be uninitialised. bf16
    operands into a float32 ``dst`` run as bf16 x bf16 -> float32 (exact products, float32
    accumulation, the scale applied once to the float32 sum)."""
    if a.dtype == torch.bfloat16 and dst.dtype == torch.float32:
        return _bf16_product_into(dst, a, b, alpha, accumulate)
    return _baddbmm_into(dst, a, b, alpha, accumulate)


_PROBES: dict[tuple[str, torch.device], bool] = {}


def _cuda_probe(name: str, device: torch.device, check) -> bool:
    """``check(device)`` once per CUDA device (False elsewhere, or when it raises a type, runtime
    or not-implemented error), remembered under ``name``."""
    device = torch.device(device)
    key = (name, device)
    if key not in _PROBES:
        ok = False
        if device.type == "cuda":
            try:
                ok = bool(check(device))
            except (TypeError, RuntimeError, NotImplementedError):
                ok = False
        _PROBES[key] = ok
    return _PROBES[key]


def _bf16_products_keep_float32(device: torch.device) -> bool:
    a = torch.tensor([[[1.0, 2.0**-9]]], dtype=torch.bfloat16, device=device)
    b = torch.ones((1, 2, 2), dtype=torch.bfloat16, device=device)
    dst = torch.full((1, 1, 2), float("nan"), dtype=torch.float32, device=device)
    scaled = _bf16_product_into(dst, a, b, 0.5, False).flatten().tolist()  # the NaN must not be read
    summed = _bf16_product_into(dst, a, b, 1.0, True).flatten().tolist()
    return dst.dtype == torch.float32 and scaled == [0.5 + 2.0**-10] * 2 and summed == [1.5 + 1.5 * 2.0**-9] * 2


def bf16_products_into_float32(device: torch.device) -> bool:
    """Whether ``torch.baddbmm(dst, bf16, bf16, out_dtype=float32, out=dst)`` works on ``device``
    as :func:`product_into` needs: a float32 result (``1 + 2**-9`` survives, which bf16 rounding
    would lose), the scale as alpha, ``dst`` ignored at beta 0 (NaN in it stays out) and added
    at beta 1."""
    return _cuda_probe("bf16 products into float32", device, _bf16_products_keep_float32)


def scaled_masked_scores(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """``scale * q @ keys^T`` (``[C,H,K]``, float32 for bf16 operands, else their dtype) with
    -inf on unselected columns (``mask`` None: every column selected): one product with the
    scale in its epilogue, then a fill."""
    c, h, k = q.shape[0], q.shape[1], keys.shape[1]
    dtype = torch.float32 if q.dtype == torch.bfloat16 else q.dtype
    scores = product_into(torch.empty((c, h, k), dtype=dtype, device=q.device), q, keys.transpose(1, 2), scale)
    return scores if mask is None else scores.masked_fill_(~mask.unsqueeze(1), float("-inf"))


def split_bf16_into(x: torch.Tensor, terms: list[torch.Tensor]) -> None:
    """Write ``x`` (float32) as ``len(terms)`` bf16 terms (tensors of ``x``'s shape), largest
    first: each is the bf16 rounding of what the earlier ones leave (8 significant bits each),
    so ``|x - sum(terms)| <= 2**(-8 * len(terms)) * |x|``; three terms represent any float32
    value exactly. The remainders are exact float32 values (the rounding error of a bf16
    rounding); from three terms on ``x`` is consumed, left holding a remainder."""
    terms[0].copy_(x)
    for i in range(1, len(terms)):
        if i < len(terms) - 1:
            x.sub_(terms[i - 1])
            terms[i].copy_(x)
        else:  # the last remainder goes straight to bf16
            torch.sub(x, terms[i - 1], out=terms[i])


def bf16_terms(x: torch.Tensor, count: int) -> list[torch.Tensor]:
    """``x`` (float32, left unchanged) as ``count`` bf16 terms (:func:`split_bf16_into`)."""
    terms = [torch.empty(x.shape, dtype=torch.bfloat16, device=x.device) for _ in range(count)]
    split_bf16_into(x.clone(), terms)
    return terms


# Probabilities in [0, 1] split into two bf16 terms: relative error <= 2**-16 per probability
# (2**-17 typical worst), within the float32 summation error bound of the P.V product for
# K >= 256 terms (K * 2**-24) and of the order of its typical size (sqrt(K) * 2**-24), at two
# passes over P and two products, the second accumulated into the first's output.
PROBABILITY_TERMS = 2


def _values_times_split_probs(probs: torch.Tensor, values: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst = probs [C,H,K] @ values [C,K,D]`` (float32) to float32 precision: ``probs`` split
    into bf16 terms, each multiplied as bf16 x bf16 -> float32 and added into ``dst``."""
    terms = [torch.empty(probs.shape, dtype=torch.bfloat16, device=probs.device) for _ in range(PROBABILITY_TERMS)]
    split_bf16_into(probs, terms)
    for i, term in enumerate(terms):
        product_into(dst, term, values, accumulate=i > 0)


def _attend_chunk(q, kv, mask, d_ckv, scale, k_scale, operand, out, lse):
    """float64 or float32, into ``out [C,H,D]`` and ``lse [C,H]``: one gather of the cache
    rows, one q.k product, the softmax, the P.V product. With a bf16 ``operand`` (float32
    mode, bf16-exact inputs) the products run as bf16 x bf16 -> float32."""
    kv = kv.to(operand)  # [C, K, D+R]
    scores = scaled_masked_scores(q.to(operand), kv, mask, scale)  # [C, H, K]
    probs, row_lse = softmax_and_lse(scores)
    del scores
    lse.copy_(row_lse)
    values = kv[..., :d_ckv]
    if operand == torch.bfloat16:
        _values_times_split_probs(probs, values, out)
    else:
        product_into(out, probs, values)
    if k_scale != 1.0:
        out.mul_(k_scale)


def float32_uses_bf16_products(q_nope, q_pe, ckv, kpe) -> bool:
    """Whether float32 mode computes its products as bf16 x bf16 -> float32 for these inputs
    (bf16 q, bf16 or float8_e4m3fn cache, on a device whose bmm returns float32 for them)."""
    return (
        q_nope.dtype == torch.bfloat16
        and q_pe.dtype == torch.bfloat16
        and ckv.dtype in BF16_EXACT_DTYPES
        and kpe.dtype in BF16_EXACT_DTYPES
        and bf16_products_into_float32(q_nope.device)
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
    facts = check_selection(slots, lens, mask, ckv.shape[0])

    t, h, d_ckv = q_nope.shape
    out_dtype = {"float64": torch.float64, "float32": torch.float32, "lowp": torch.bfloat16}[mode]
    lse_dtype = torch.float64 if mode == "float64" else torch.float32
    out = torch.empty((t, h, d_ckv), dtype=out_dtype, device=q_nope.device)
    lse = torch.empty((t, h), dtype=lse_dtype, device=q_nope.device)
    if not facts.any_selected:  # every row empty (no rows, no columns, or nothing selected)
        return out.zero_(), lse.fill_(float("-inf"))
    bf16_products = mode == "float32" and float32_uses_bf16_products(q_nope, q_pe, ckv, kpe)
    operand = torch.bfloat16 if bf16_products else out_dtype
    chunk = rows_per_chunk(h, slots.shape[1], d_ckv, kpe.shape[1], mode, memory_budget_bytes, bf16_products)
    # once for all rows: q and cache as joined views where they can be, the slots to gather
    q_parts, cache_parts = joined_parts(q_nope, q_pe), joined_parts(ckv, kpe)
    idx = slots.long() if facts.all_selected else gather_index(slots, mask)
    scale = float(sm_scale) * float(k_scale)
    for start in range(0, t, chunk):
        rows = slice(start, min(t, start + chunk))
        q = cat_parts([part[rows] for part in q_parts])  # [C, H, D+R]
        kv = cat_parts([part[idx[rows]] for part in cache_parts])  # [C, K, D+R], as stored
        row_mask = None if facts.all_selected else mask[rows]  # None: no column to mask
        if mode == "lowp":
            out[rows], lse[rows] = _attend_chunk_lowp(q, kv, row_mask, d_ckv, scale, float(k_scale))
        else:
            _attend_chunk(q, kv, row_mask, d_ckv, scale, float(k_scale), operand, out[rows], lse[rows])
        del q, kv
    if facts.any_row_empty:  # masked_fill_, not indexing: no host synchronisation
        empty = ~mask.any(dim=1)
        out.masked_fill_(empty[:, None, None], 0.0)
        lse.masked_fill_(empty[:, None], float("-inf"))
    return out, lse
