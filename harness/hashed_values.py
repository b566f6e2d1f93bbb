"""Counter-based random values that are the same on any machine and device: a splitmix64 hash
of ``(seed, key, index)`` indexing a fixed table of standard normals. A KV slot's values
(:func:`slot_values`, :func:`slot_values_on`) and a query row's q (:func:`query_rows`) depend
on their key alone, whatever else is generated with them. :func:`component_seed` keys every
random component of a scenario by ``(seed, component)``.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np
import torch

from mla_constants import KV_LORA_RANK, ROPE_DIM

_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)
_LANES = 4  # 16-bit table indices per 64-bit hash: a value costs a quarter hash and a lookup
_MAX_HEAD_DIM = KV_LORA_RANK + ROPE_DIM


def component_seed(seed: int, component: str) -> int:
    """A stable 63-bit seed for one random component of a scenario."""
    digest = hashlib.sha256(f"{seed}:{component}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, in place on a uint64 array (wrapping arithmetic)."""
    x ^= x >> _U64(30)
    x *= _U64(0xBF58476D1CE4E5B9)
    x ^= x >> _U64(27)
    x *= _U64(0x94D049BB133111EB)
    x ^= x >> _U64(31)
    return x


@functools.lru_cache(maxsize=1)
def _normal_table() -> np.ndarray:
    """2**16 standard normals (float32) that 16-bit hash lanes index."""
    return np.random.default_rng(component_seed(0, "normal-table")).standard_normal(1 << 16, dtype=np.float32)


def slot_values(seed: int, slots: np.ndarray, head_dim: int) -> np.ndarray:
    """Standard-normal float32 values ``[len(slots), head_dim]`` of the given KV slots. Value j
    of slot s is a function of ``(seed, s, j)`` alone: 16-bit lane ``j % 4`` of element
    ``s * 144 + j // 4`` of the splitmix64 stream seeded by ``seed`` indexes a fixed table of
    normals. So a slot holds the same values whichever other slots are generated (and, for
    its first 512 values, whether the cache has rope or not), and integer arithmetic makes
    them the same on any machine."""
    chunks = -(-head_dim // _LANES)
    counters = np.asarray(slots, dtype=_U64)[:, None] * _U64(_MAX_HEAD_DIM // _LANES) + np.arange(
        1, chunks + 1, dtype=_U64
    )
    with np.errstate(over="ignore"):
        counters *= _GOLDEN
        counters += _U64(seed)
        bits = _splitmix64(counters)
    lanes = bits.astype("<u8", copy=False).view("<u2")  # lane 0 = the low 16 bits, whatever the byte order
    return _normal_table()[lanes[:, :head_dim]]


_HASH_ELEMENTS = 1 << 23  # 64-bit hash values per chunk on the device (64 MiB)


def _as_int64(value: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _logical_shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x >> bits`` on the 64 bits of an int64 tensor as unsigned (zeros shifted in)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64_torch(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser of :func:`_splitmix64` on an int64 tensor holding uint64 bits
    (wrapping arithmetic), in place, on any device."""
    x ^= _logical_shift_right(x, 30)
    x *= _as_int64(0xBF58476D1CE4E5B9)
    x ^= _logical_shift_right(x, 27)
    x *= _as_int64(0x94D049BB133111EB)
    x ^= _logical_shift_right(x, 31)
    return x


def fill_hashed_normals(out: torch.Tensor, seed: int, keys: torch.Tensor, stride: int) -> torch.Tensor:
    """Write standard normals into ``out [len(keys), width]`` (any float dtype, any device, rounded
    to it): value j of row i is the normal-table entry that 16-bit lane ``j % 4`` of
    ``splitmix64(seed + GOLDEN * (keys[i] * stride + j // 4 + 1))`` indexes. With
    ``stride = 144`` this is :func:`slot_values`, bit for bit; a row's values depend on its key
    alone. Chunked so the 64-bit intermediates stay small."""
    rows, width = out.shape
    chunks = -(-width // _LANES)
    if chunks > stride:
        raise ValueError(f"width {width} needs {chunks} hash values per key, more than the stride {stride}")
    device = out.device
    table = torch.from_numpy(_normal_table()).to(device)
    steps = torch.arange(1, chunks + 1, dtype=torch.int64, device=device)
    keys = keys.to(device=device, dtype=torch.int64)
    per = max(1, _HASH_ELEMENTS // chunks)
    for start in range(0, rows, per):
        part = keys[start : start + per]
        bits = (part[:, None] * stride + steps[None, :]).mul_(_as_int64(int(_GOLDEN))).add_(_as_int64(seed % (1 << 64)))
        bits = splitmix64_torch(bits)
        values = torch.empty((part.numel(), chunks, _LANES), dtype=torch.float32, device=device)
        for lane in range(_LANES):
            values[:, :, lane] = table[_logical_shift_right(bits, 16 * lane) & 0xFFFF]
        out[start : start + part.numel()] = values.view(part.numel(), chunks * _LANES)[:, :width].to(out.dtype)
    return out


def slot_values_on(seed: int, slots: torch.Tensor, head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`slot_values` computed on ``slots``' device, as ``dtype``: bitwise the same values."""
    out = torch.empty((slots.numel(), head_dim), dtype=dtype, device=slots.device)
    return fill_hashed_normals(out, seed, slots.reshape(-1), _MAX_HEAD_DIM // _LANES)


def query_rows(seed: int, keys: torch.Tensor, num_heads: int, head_dim: int, device) -> torch.Tensor:
    """bf16 q ``[len(keys), H, head_dim]`` on ``device``: row i is a function of ``(seed, keys[i],
    H, head_dim)`` alone (:func:`fill_hashed_normals`), whatever rows are drawn with it."""
    width = num_heads * head_dim
    out = torch.empty((keys.numel(), width), dtype=torch.bfloat16, device=device)
    fill_hashed_normals(out, seed, keys.reshape(-1), -(-width // _LANES))
    return out.view(keys.numel(), num_heads, head_dim)
