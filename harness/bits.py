"""Bit-for-bit comparison of tensors: NaN-poisoned entries compare by their bits, so an output
that keeps its NaN pattern is equal and one that changes it is not."""

from __future__ import annotations

import torch

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (NaN-poisoned entries included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        bits = _BITS[a.element_size()]
        return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))
    return torch.equal(a, b)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element: the same bits (a NaN equals a NaN of the same bits); values compared where
    the dtypes differ."""
    if a.dtype != b.dtype:
        return a.double() == b.double()
    if a.dtype.is_floating_point:
        bits = _BITS[a.element_size()]
        return a.contiguous().view(bits) == b.contiguous().view(bits)
    return a == b


def ulp_distance_bf16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element, how many bf16 values lie between ``a`` and ``b`` (both bf16, finite)."""
    def ordered(x: torch.Tensor) -> torch.Tensor:
        bits = x.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits + 32768), bits)

    return (ordered(a) - ordered(b)).abs()
