"""FlashMLA's 656-byte fp8 KV layout (``reference.flashmla_layout``): where each field sits, and
that the project's caches pack into it and back as the module says."""

from __future__ import annotations

import struct

import pytest
import torch

from reference import flashmla_layout as layout

FP8 = torch.float8_e4m3fn


def fp8_cache(seed: int, tokens: int, rope_dim: int = 64, nan_tokens: tuple[int, ...] = ()) -> torch.Tensor:
    """A float8_e4m3fn cache ``[tokens, 512 + rope_dim]`` of normals, some tokens NaN (0x7F)."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(tokens, 512 + rope_dim, generator=gen) * 4
    cache = values.to(FP8)
    for t in nan_tokens:
        cache.view(torch.uint8)[t] = 0x7F
    return cache


def bf16_cache(seed: int, tokens: int, rope_dim: int = 64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    cache = (torch.randn(tokens, 512 + rope_dim, generator=gen) * 3).to(torch.bfloat16)
    cache[0, :128] = 0  # a tile of zeros
    return cache


def test_fields_sit_at_the_documented_byte_offsets():
    """One token written field by field: 512 e4m3 bytes, 4 little-endian float32 scales at byte
    512, 64 bf16 rope values at byte 528."""
    cache = torch.zeros(1, 576, dtype=FP8)
    cache[0, 0] = 2.0  # e4m3 2.0 is 0x40
    cache[0, 512] = 1.5
    packed = layout.pack(cache, k_scale=0.25)
    raw = bytes(packed[0].tolist())
    assert len(raw) == layout.TOKEN_BYTES == 656
    assert raw[0] == 0x40
    assert struct.unpack("<4f", raw[512:528]) == (0.25, 0.25, 0.25, 0.25)
    rope0 = torch.tensor(list(raw[528:530]), dtype=torch.uint8).view(torch.bfloat16)
    assert float(rope0[0]) == 1.5 * 0.25


@pytest.mark.parametrize("k_scale", [1.0, 0.5, 2.0 ** -7, 8.0])
@pytest.mark.parametrize("rope_dim", [64, 0])
def test_fp8_cache_round_trips_bit_for_bit_with_a_power_of_two_k_scale(k_scale, rope_dim):
    cache = fp8_cache(1, 96, rope_dim)
    packed = layout.pack(cache, k_scale)
    back = layout.unpack_to_project(packed, k_scale, rope_dim)
    assert torch.equal(back.view(torch.uint8), cache.view(torch.uint8))
    assert torch.equal(layout.nope_bytes(packed), cache[:, :512].view(torch.uint8))
    assert bool((layout.tile_scales(packed) == k_scale).all())


def test_fp8_values_are_the_project_values():
    """The layout's dequantised values are the project's stored value x k_scale, exactly."""
    cache = fp8_cache(2, 64)
    packed = layout.pack(cache, 0.5)
    assert torch.equal(layout.dequantize(packed), cache.float() * 0.5)
    assert torch.equal(layout.upconvert(packed), (cache.float() * 0.5).to(torch.bfloat16))


def test_nope_leaves_the_rope_bytes_zero():
    packed = layout.pack(fp8_cache(3, 8, rope_dim=0), 1.0)
    assert not bool(packed[:, layout.ROPE_OFFSET:].any())


def test_nan_slots_stay_nan():
    """A poisoned slot reads NaN in the layout and unpacks to NaN (the sign of a NaN is not
    kept through bf16), its neighbours unchanged."""
    cache = fp8_cache(4, 16, nan_tokens=(3,))
    packed = layout.pack(cache, 0.5)
    values = layout.dequantize(packed)
    assert bool(values[3].isnan().all()) and not bool(values[:3].isnan().any())
    back = layout.unpack_to_project(packed, 0.5)
    assert bool(back[3].float().isnan().all())
    assert torch.equal(back[4:].view(torch.uint8), cache[4:].view(torch.uint8))


def test_bf16_cache_comes_back_within_e4m3_rounding():
    """NoPE values within half an e4m3 ulp of the tile's scale-relative value (2**-4 of each
    value, or of the scale's subnormal step), rope exactly."""
    cache = bf16_cache(5, 80)
    packed = layout.pack(cache)
    values = layout.dequantize(packed)
    nope, truth = values[:, :512], cache[:, :512].float()
    scales = layout.tile_scales(packed).repeat_interleave(layout.TILE, dim=-1)
    allowed = torch.maximum(truth.abs() * 2.0 ** -4, scales * 2.0 ** -10)
    assert bool(((nope - truth).abs() <= allowed).all())
    assert bool(((nope - truth).abs() > 0).any()), "bf16 values were not rounded at all: the test checks nothing"
    assert torch.equal(values[:, 512:], cache[:, 512:].float())
    assert float(layout.tile_scales(packed)[0, 0]) == 1.0  # the tile of zeros


def test_tile_maxima_map_to_e4m3_max():
    cache = bf16_cache(6, 4)
    packed = layout.pack(cache)
    codes = layout.nope_bytes(packed).view(FP8).float().unflatten(-1, (4, 128))
    assert bool((codes[1:].abs().amax(dim=-1) == layout.E4M3_MAX).all())


def test_unpacking_with_another_k_scale_is_refused():
    packed = layout.pack(fp8_cache(7, 4), 0.5)
    with pytest.raises(ValueError, match="differ from k_scale 1"):
        layout.unpack_to_project(packed, 1.0)


def test_a_cache_of_another_width_is_refused():
    with pytest.raises(ValueError, match=r"\[\.\.\., 512\]"):
        layout.pack(torch.zeros(2, 520, dtype=torch.bfloat16))
