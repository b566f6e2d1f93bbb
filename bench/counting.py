"""What one attention launch must do, counted from its shape (pure functions).

FLOPs: the two matrix products of absorbed MLA over each row's selected slots,
``2*H*L*(512+R)`` for q.k and ``2*H*L*512`` for p.v, with ``L = sum(lens)`` (= rows * topk
when every row selects topk slots).

Bytes, the fewest that must move for one launch (``gathered``): q read once
(``rows*H*(512+R)`` bf16), every selected KV row read once per query row that selects it
(``L*(512+R)`` elements of the cache dtype), the slot ids read once (``L`` int32), the output
written once (``rows*H*512`` bf16) and the LSE written once (``rows*H`` float32). Rows that
share slots (prefill) can be served from L2, so their achieved rate can exceed the copy
rate; ``unique`` counts each distinct slot once instead, a lower bound on DRAM traffic.

FlashMLA (``--vllm``) is counted the same way with each KV row as its kernel is handed it:
bf16 rows as the project's cache (``(512+R)*2`` bytes); an fp8 cache in FlashMLA's 656-byte
layout (512 e4m3 values, 4 float32 tile scales, 64 bf16 RoPE values; FA3's fp8 row is
``512+R`` e4m3 bytes); the fp8 prefill rows that vLLM gathers into a bf16 workspace first
(from 32 heads on) as bf16 rows of that workspace.
"""

from __future__ import annotations

import math

from mla_constants import KV_LORA_RANK

Q_BYTES = 2  # bf16
OUT_BYTES = 2  # bf16
LSE_BYTES = 4
INDEX_BYTES = 4

KV_ELEMENT_BYTES = {"bfloat16": 2, "float8_e4m3fn": 1}


def attention_flops(num_heads: int, total_len: int, rope_dim: int) -> int:
    """``2*H*L*(512+R) + 2*H*L*512``."""
    return 2 * num_heads * total_len * (KV_LORA_RANK + rope_dim) + 2 * num_heads * total_len * KV_LORA_RANK


def attention_bytes(rows: int, num_heads: int, total_len: int, rope_dim: int, kv_dtype: str,
                    distinct_slots: int | None = None, *, kv_row_bytes: int | None = None) -> dict[str, int]:
    """``{"gathered": ..., "unique": ...}`` bytes of one launch (see the module docstring);
    ``unique`` is present when ``distinct_slots`` is given. ``kv_row_bytes``: the bytes of one
    KV row as the kernel reads it, where that is not ``512+R`` elements of ``kv_dtype``."""
    head = KV_LORA_RANK + rope_dim
    fixed = (rows * num_heads * head * Q_BYTES + total_len * INDEX_BYTES
             + rows * num_heads * KV_LORA_RANK * OUT_BYTES + rows * num_heads * LSE_BYTES)
    kv_row = head * KV_ELEMENT_BYTES[kv_dtype] if kv_row_bytes is None else kv_row_bytes
    out = {"gathered": fixed + total_len * kv_row}
    if distinct_slots is not None:
        out["unique"] = fixed + distinct_slots * kv_row
    return out


def rates(time_s: float, flops: int, nbytes: int, matmul_flops_per_s: float | None,
          copy_bytes_per_s: float | None) -> dict[str, float | None]:
    """Achieved FLOP/s and bytes/s, as fractions of the measured ceilings where known."""
    flops_per_s = flops / time_s
    bytes_per_s = nbytes / time_s
    return {
        "flops_per_s": flops_per_s,
        "bytes_per_s": bytes_per_s,
        "intensity": flops / nbytes,
        "fraction_of_matmul": flops_per_s / matmul_flops_per_s if matmul_flops_per_s else None,
        "fraction_of_copy": bytes_per_s / copy_bytes_per_s if copy_bytes_per_s else None,
    }


def roofline_time(flops: int, nbytes: int, matmul_flops_per_s: float, copy_bytes_per_s: float) -> float:
    """The larger of the two floors: no launch of this shape runs much faster."""
    return max(flops / matmul_flops_per_s, nbytes / copy_bytes_per_s)


def rotation_count(set_bytes: int, l2_bytes: int, *, factor: int = 4, cap: int = 64) -> int:
    """How many copies of a buffer set to rotate through so that together they span at
    least ``factor`` times the L2 (one when a single set already does)."""
    if set_bytes <= 0:
        return 1
    return max(1, min(cap, math.ceil(factor * l2_bytes / set_bytes)))


def reps_for(estimate_s: float, *, target_s: float, lo: int, hi: int) -> int:
    """Repetitions that fill about ``target_s`` at ``estimate_s`` each, within [lo, hi]."""
    if estimate_s <= 0:
        return hi
    return max(lo, min(hi, int(target_s / estimate_s)))
