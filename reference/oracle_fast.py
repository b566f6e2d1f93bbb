"""The oracle's working-precision modes: ``"float32"`` and ``"lowp"`` of
:func:`reference.oracle.sparse_mla_reference`, and the row chunking that keeps every mode under a
memory budget. The definition is ``sparse_mla_float64`` in ``reference/oracle.py``; these
modes compute the same attention in less precision and less time, and the tests hold them to it
(``tests/cpu/test_oracle.py``, ``tests/cpu/test_oracle_float32.py``).

- ``"float32"``: float32 arithmetic. Where the inputs are bf16-exact (bf16 q, bf16 or fp8
  cache) on a GPU, the matrix products run as bf16 x bf16 -> float32 (exact products, float32
  accumulation; the probabilities split into two bf16 terms, see ``PROBABILITY_TERMS``) on the
  tensor cores: on an H200 at 256 rows x H 128 x topk 2048 it is 4.2e-6 (rel L2) from float64,
  against 3.3e-6 for an exact three-term split; elsewhere they are float32 products.
- ``"lowp"``: rounds where an FA3-style kernel rounds (bf16 operands, float32 accumulation
  and softmax, unnormalised probabilities exp(s - max) rounded to bf16 before the P.V
  product, division by the float32 row sum after it, output rounded to bf16).
  It measures the error that working precision alone costs (the error budget's yardstick).

For speed, q and the cache are gathered as one joined view where their two parts are halves of
one buffer (:func:`joined_parts`), and products are written in place with the scale as alpha.
"""

from __future__ import annotations

import torch

from .oracle_inputs import SelectionFacts, gather_index

DEFAULT_MEMORY_BUDGET_BYTES = 1 << 30

# On a CPU the chunks are kept this small whatever the budget: glibc's malloc hands a freed block
# of up to 32 MiB out again from its heap, while a larger one is mapped afresh and zero-filled by
# the kernel at each allocation. On 2 cores at 66 rows x topk 2176 the CPU time of a call falls,
# against one 1 GiB chunk, from 0.87 s to 0.42 s (float64, H 16), 1.73 s to 1.53 s (float64,
# H 128) and 1.00 s to 0.68 s ("lowp", H 128): ``python3 -m bench.reference_profile --rows 66
# --heads 16 --topk 2176 --mode float64 --cpu-chunk-mib 1024`` (and 32, the default).
CPU_CHUNK_BYTES = 32 << 20


def chunk_budget_bytes(memory_budget_bytes: int, device: torch.device) -> int:
    """The bytes one chunk of rows may use on ``device``: the memory budget, and on a CPU no more
    than :data:`CPU_CHUNK_BYTES`."""
    return memory_budget_bytes if torch.device(device).type != "cpu" else min(memory_budget_bytes, CPU_CHUNK_BYTES)


def _row_bytes(num_heads: int, width: int, d_ckv: int, d_pe: int, elem: int, operand: int | None = None) -> int:
    """Working bytes of one row of a chunk: ``elem`` is the working precision (8, 4), ``operand``
    the matrix products' operand size (``elem``, or 2 for bf16 x bf16 -> float32 products)."""
    operand = elem if operand is None else operand
    dims = d_ckv + d_pe
    # rows as stored (<= 2 B) + cast copy; float64 also joins its two gathered parts, 2 B more
    # per value not counted here (13% of a row at H 128, topk 2048)
    gathered = width * dims * (3 if operand == 2 else 2 + operand)
    scores = num_heads * width * (2 * elem + 2)  # scores and probabilities, or probabilities and bf16 terms
    rows = num_heads * dims * elem * 3  # q, output, one more product's output
    return gathered + scores + rows + width * 16  # + the row's mask and slot index


def rows_per_chunk(num_heads: int, width: int, d_ckv: int, d_pe: int, mode: str, budget_bytes: int,
                   bf16_products: bool = False) -> int:
    """How many rows fit in one chunk under the memory budget (at least one)."""
    elem = 8 if mode == "float64" else 4
    per_row = _row_bytes(num_heads, width, d_ckv, d_pe, elem, 2 if bf16_products else elem)
    return max(1, budget_bytes // max(1, per_row))


def joined_parts(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(a|b,)``, one view of both along the last dimension, when ``b`` directly follows ``a``
    in one buffer (q as ``[T, H, 576]`` split in two, the cache as ``[N, 1, 576]`` split in two)
    or is empty; otherwise ``(a, b)``, to be joined piece by piece with :func:`cat_parts`."""
    if b.shape[-1] == 0:
        return (a,)
    adjacent = (
        a.dtype == b.dtype and a.device == b.device and a.shape[:-1] == b.shape[:-1] and a.stride() == b.stride()
        and a.stride(-1) == 1 and b.storage_offset() == a.storage_offset() + a.shape[-1]
        and all(st >= a.shape[-1] + b.shape[-1] for st, n in zip(a.stride()[:-1], a.shape[:-1], strict=True) if n > 1)
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    )
    if not adjacent:
        return (a, b)
    return (a.as_strided(a.shape[:-1] + (a.shape[-1] + b.shape[-1],), a.stride(), a.storage_offset()),)


def cat_parts(parts: list[torch.Tensor]) -> torch.Tensor:
    """The pieces of :func:`joined_parts` (already indexed) along the last dimension."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def softmax_and_lse(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled, masked (-inf) ``scores [C,H,K]`` to ``(probs, lse)`` as the definition computes
    them (normalised probabilities, 0 on masked columns, and ``lse = z_max - ln p_max`` at the
    arg-max column, ``ln sum exp z`` to the working precision), the LSE computed in place in
    its gathered scores. Empty rows come out NaN; the caller overwrites them."""
    probs = torch.softmax(scores, dim=-1)
    top = scores.argmax(dim=-1, keepdim=True)
    lse = scores.gather(-1, top).sub_(probs.gather(-1, top).log_()).squeeze(-1)
    return probs, lse


def _partial_lowp(scores, values, d_ckv, k_scale):
    """One part of each row (``scores [C,H,K]`` scaled, -inf off the part): unnormalised
    probabilities ``exp(s - max)`` to bf16 for the P.V product (float32 accumulation), the
    float32 sum dividing the accumulator, the output rounded to bf16; and the part's LSE."""
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = scores.sub_(row_max).exp_()  # 0 on masked columns
    row_sum = p.sum(dim=-1)
    acc = torch.bmm(p.to(torch.bfloat16).float(), values)
    safe_sum = torch.where(row_sum > 0, row_sum, torch.ones_like(row_sum))
    out = (acc / safe_sum.unsqueeze(-1)).mul_(k_scale).to(torch.bfloat16)
    lse = torch.where(row_sum > 0, row_max.squeeze(-1) + torch.log(safe_sum), float("-inf"))
    return out, lse


def _attend_chunk_lowp(q, kv, mask, d_ckv, scale, k_scale, parts=None, num_parts=1):
    """Where an FA3-style kernel rounds: per part of a row (``parts [C,K]``: the kernel's work
    item reading each column, ``None``: one part), :func:`_partial_lowp`; a row read in several
    parts is merged as the kernel merges its split partial outputs, which it stores in the output
    dtype: the bf16 partial outputs weighted by ``exp(lse_part - lse)`` in float32, rounded to
    bf16 once more."""
    kv = kv.float()  # [C, K, D+R]
    scores = torch.bmm(q.to(torch.bfloat16).float(), kv.transpose(1, 2))
    scores.mul_(scale)
    if mask is not None:
        scores.masked_fill_(~mask.unsqueeze(1), float("-inf"))
    values = kv[..., :d_ckv]
    if parts is None or num_parts <= 1:
        out, lse = _partial_lowp(scores, values, d_ckv, k_scale)
        return out, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    outs, lses = [], []
    for part in range(num_parts):
        off_part = (parts != part).unsqueeze(1)  # [C, 1, K]
        out_p, lse_p = _partial_lowp(scores.masked_fill(off_part, float("-inf")), values, d_ckv, k_scale)
        outs.append(out_p.float())
        lses.append(lse_p)
    part_lse = torch.stack(lses, dim=-1)  # [C, H, P]
    lse = torch.logsumexp(part_lse, dim=-1)
    finite = torch.isfinite(lse)
    weights = torch.exp(part_lse - torch.where(finite, lse, torch.zeros_like(lse)).unsqueeze(-1))
    weights = torch.where(torch.isfinite(part_lse), weights, torch.zeros_like(weights))
    out = sum(w.unsqueeze(-1) * o for w, o in zip(weights.unbind(-1), outs, strict=True))
    return out.to(torch.bfloat16), torch.where(finite, lse, torch.zeros_like(lse))


# --- float32 -----------------------------------------------------------------------------------
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
    """float32, into ``out [C,H,D]`` and ``lse [C,H]``: one q.k product over the gathered cache
    rows, the softmax, the P.V product. With a bf16 ``operand`` (bf16-exact inputs on a device
    that has the product) the products run as bf16 x bf16 -> float32."""
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


def sparse_mla_working_precision(q_nope, q_pe, ckv, kpe, slots, mask, facts: SelectionFacts, *, sm_scale: float,
                                 k_scale: float, mode: str, memory_budget_bytes: int, parts=None):
    """``(out, lse)`` of :func:`reference.oracle.sparse_mla_reference` in ``"float32"`` or
    ``"lowp"`` mode, for checked inputs (``[N, D]`` cache parts, a mask, the selection's facts)
    with at least one selected column: rows in chunks under ``memory_budget_bytes``. ``parts``
    (lowp only): the kernel's part of each column, see :func:`_attend_chunk_lowp`."""
    num_parts = int(parts.max()) + 1 if parts is not None and parts.numel() else 1
    t, h, d_ckv = q_nope.shape
    out_dtype = {"float32": torch.float32, "lowp": torch.bfloat16}[mode]
    out = torch.empty((t, h, d_ckv), dtype=out_dtype, device=q_nope.device)
    lse = torch.empty((t, h), dtype=torch.float32, device=q_nope.device)
    bf16_products = mode == "float32" and float32_uses_bf16_products(q_nope, q_pe, ckv, kpe)
    operand = torch.bfloat16 if bf16_products else out_dtype
    chunk = rows_per_chunk(h, slots.shape[1], d_ckv, kpe.shape[1], mode,
                           chunk_budget_bytes(memory_budget_bytes, q_nope.device), bf16_products)
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
            row_parts = parts[rows] if num_parts > 1 else None
            out[rows], lse[rows] = _attend_chunk_lowp(q, kv, row_mask, d_ckv, scale, float(k_scale), row_parts,
                                                      num_parts)
        else:
            _attend_chunk(q, kv, row_mask, d_ckv, scale, float(k_scale), operand, out[rows], lse[rows])
        del q, kv
    if facts.any_row_empty:  # masked_fill_, not indexing: no host synchronisation
        empty = ~mask.any(dim=1)
        out.masked_fill_(empty[:, None, None], 0.0)
        lse.masked_fill_(empty[:, None], float("-inf"))
    return out, lse
