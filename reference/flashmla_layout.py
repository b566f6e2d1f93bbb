"""FlashMLA's fp8 KV layout for DeepSeek-V3.2 ("fp8_ds_mla"), modelled in pure PyTorch.

Each token is 656 bytes (FlashMLA's ``flash_mla_with_kvcache`` docstring, vLLM's
``flashmla_sparse.py`` note on the cache format):

- bytes 0..511: the NoPE part, 512 float8_e4m3 values;
- bytes 512..527: 4 float32 scales, one per 128-value tile of the NoPE part (value = fp8 x scale);
- bytes 528..655: the RoPE part, 64 bfloat16 values, not quantised.

The project's caches are ``[..., 512 + R]`` of bf16, or of float8_e4m3fn whose value is
stored x ``k_scale`` (one per-tensor scale, the RoPE part included). :func:`pack` writes either
into the layout:

- an fp8 cache keeps its NoPE bytes and gets every tile scale = ``k_scale``, and its RoPE part
  becomes bf16 of ``fp8 x k_scale``: an e4m3 value has 4 significant bits and bf16 8, so with a
  power-of-two ``k_scale`` nothing is rounded and :func:`unpack_to_project` gives the same bytes
  back;
- a bf16 cache is quantised per tile with scale ``amax / 448`` (e4m3's largest finite value
  maps to the tile's largest magnitude; a tile of zeros gets scale 1), so it comes back within
  e4m3's rounding (half an ulp, 2**-4 relative);
- NoPE (R = 0): the RoPE bytes are zero, as vLLM's cache writer leaves the slot of a rope-free
  model.

NaN bytes stay NaN: a poisoned slot of the project's cache reads NaN in the layout too.
"""

from __future__ import annotations

import torch

from mla_constants import KV_LORA_RANK, ROPE_DIM

TOKEN_BYTES = 656
TILE = 128
TILES = KV_LORA_RANK // TILE  # 4
SCALES_OFFSET = KV_LORA_RANK  # 512
ROPE_OFFSET = SCALES_OFFSET + 4 * TILES  # 528
E4M3_MAX = 448.0
FP8 = torch.float8_e4m3fn


def nope_bytes(packed: torch.Tensor) -> torch.Tensor:
    """``[..., 512]`` uint8 view: the NoPE part's e4m3 bytes."""
    return packed[..., :SCALES_OFFSET]


def tile_scales(packed: torch.Tensor) -> torch.Tensor:
    """``[..., 4]`` float32 view: the scale of each 128-value tile of the NoPE part."""
    return packed[..., SCALES_OFFSET:ROPE_OFFSET].view(torch.float32)


def rope_values(packed: torch.Tensor) -> torch.Tensor:
    """``[..., 64]`` bfloat16 view: the RoPE part."""
    return packed[..., ROPE_OFFSET:].view(torch.bfloat16)


def _check_packed(packed: torch.Tensor) -> None:
    if packed.dtype != torch.uint8 or packed.shape[-1] != TOKEN_BYTES:
        raise ValueError(f"expected uint8 [..., {TOKEN_BYTES}], got {packed.dtype} {tuple(packed.shape)}")


def bf16_tile_scales(nope: torch.Tensor) -> torch.Tensor:
    """float32 ``[..., 4]``: ``amax / 448`` of each 128-value tile of a bf16 NoPE part (1 for
    a tile of zeros; NaN where the tile holds a NaN)."""
    tiles = nope.float().unflatten(-1, (TILES, TILE))
    amax = tiles.abs().amax(dim=-1)
    return torch.where(amax == 0, torch.ones_like(amax), amax / E4M3_MAX)


def pack(cache: torch.Tensor, k_scale: float = 1.0) -> torch.Tensor:
    """The project's cache ``[..., 512 + R]`` (bf16, or float8_e4m3fn with value stored x
    ``k_scale``; R = 64 or 0) as FlashMLA's layout ``[..., 656]`` uint8."""
    rope_dim = cache.shape[-1] - KV_LORA_RANK
    if rope_dim not in (0, ROPE_DIM):
        raise ValueError(f"expected [..., {KV_LORA_RANK}] or [..., {KV_LORA_RANK + ROPE_DIM}], "
                         f"got {tuple(cache.shape)}")
    if cache.dtype not in (torch.bfloat16, FP8):
        raise ValueError(f"expected a bfloat16 or float8_e4m3fn cache, got {cache.dtype}")
    packed = torch.zeros(cache.shape[:-1] + (TOKEN_BYTES,), dtype=torch.uint8, device=cache.device)
    nope = cache[..., :KV_LORA_RANK]
    if cache.dtype == FP8:
        nope_bytes(packed).copy_(nope.view(torch.uint8))
        tile_scales(packed).fill_(float(k_scale))
        rope = cache[..., KV_LORA_RANK:].float() * float(k_scale)
    else:
        scales = bf16_tile_scales(nope)
        quantised = (nope.float().unflatten(-1, (TILES, TILE)) / scales.unsqueeze(-1)).flatten(-2).to(FP8)
        nope_bytes(packed).copy_(quantised.view(torch.uint8))
        tile_scales(packed).copy_(scales)
        rope = cache[..., KV_LORA_RANK:].float()
    if rope_dim:
        rope_values(packed).copy_(rope.to(torch.bfloat16))
    return packed


def dequantize(packed: torch.Tensor, rope_dim: int = ROPE_DIM) -> torch.Tensor:
    """float32 ``[..., 512 + rope_dim]``: each NoPE value times its tile's scale, then the RoPE
    part (dropped with ``rope_dim`` 0)."""
    _check_packed(packed)
    nope = nope_bytes(packed).view(FP8).float().unflatten(-1, (TILES, TILE)) * tile_scales(packed).unsqueeze(-1)
    parts = [nope.flatten(-2)] + ([rope_values(packed).float()] if rope_dim else [])
    return torch.cat(parts, dim=-1)


def upconvert(packed: torch.Tensor) -> torch.Tensor:
    """bf16 ``[..., 576]``: the layout's values rounded to bf16 (what a gather that upconverts
    the cache for the bf16 kernel writes; exact where each tile scale is a power of two)."""
    return dequantize(packed).to(torch.bfloat16)


def unpack_to_project(packed: torch.Tensor, k_scale: float, rope_dim: int = ROPE_DIM) -> torch.Tensor:
    """The project's fp8 cache ``[..., 512 + rope_dim]`` (float8_e4m3fn, value stored x
    ``k_scale``) that :func:`pack` wrote ``packed`` from. A ``ValueError`` where a tile scale is
    not ``k_scale`` (bf16 data, or another scale)."""
    _check_packed(packed)
    scales = tile_scales(packed)
    stray = scales != float(k_scale)
    if bool(stray.any()):
        raise ValueError(f"{int(stray.sum())} tile scales differ from k_scale {k_scale:g} "
                         f"(first {float(scales[stray][0])!r}): not an fp8 cache packed with that k_scale")
    nope = nope_bytes(packed).view(FP8)
    if not rope_dim:
        return nope.clone()
    rope = (rope_values(packed).float() / float(k_scale)).to(FP8)
    return torch.cat([nope.view(torch.uint8), rope.view(torch.uint8)], dim=-1).view(FP8)
