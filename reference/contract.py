"""Two oracles of a row handed to a sparse kernel as indices and a length, and where they differ
(docs/findings.md#top-k-holes-attended).

A kernel is handed, per query row, ``indices [T, K]`` (slot ids, -1 invalid) and a length
``lens [T]``. What the row attends is stated two ways:

- the contract (:func:`contract_reference`), the semantics vLLM states for its sparse MLA
  kernels (its ``sparse_mla_reference.py``): column ``c`` of row ``t`` is attended when
  ``c < lens[t]`` and ``indices[t, c] >= 0``; a row that attends nothing gives out 0 and LSE
  -inf;
- the implementation (:func:`implementation_reference`): the multiset of the first ``lens[t]``
  slots as a layout that packs each row hands them to the kernel, a -1 among them replaced by the
  layout's filler (:data:`FILLERS`: physical slot 0, or the row's first slot).

They differ exactly on the rows with a -1 inside their length (:func:`oracle_differences`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mla_constants import FIRST_SLOT, SLOT_ZERO

from .oracle import ComputeMode, sparse_mla_reference

FILLERS = (SLOT_ZERO, FIRST_SLOT)


def within_lengths(indices: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """``[T, K]``: the columns before each row's length."""
    cols = torch.arange(indices.shape[1], device=indices.device).unsqueeze(0)
    return cols < lens.to(indices.device).unsqueeze(1)


def contract_mask(indices: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """``[T, K]``: the columns the contract attends, ``c < lens[t]`` and ``indices[t, c] >= 0``."""
    return within_lengths(indices, lens) & (indices >= 0)


def filled_slots(indices: torch.Tensor, lens: torch.Tensor, filler: str) -> torch.Tensor:
    """The indices with each -1 before its row's length replaced by ``filler``'s slot: 0, or the
    row's column 0 (0 where that is -1 too)."""
    if filler not in FILLERS:
        raise ValueError(f"filler must be one of {FILLERS}, got {filler!r}")
    fill = torch.zeros_like(indices[:, :1])
    if filler == FIRST_SLOT and indices.shape[1]:
        fill = indices[:, :1].clamp(min=0)
    return torch.where(within_lengths(indices, lens) & (indices < 0), fill.expand_as(indices), indices)


def contract_reference(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                       indices: torch.Tensor, lens: torch.Tensor, *, sm_scale: float, k_scale: float = 1.0,
                       mode: ComputeMode = "float64") -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of each row over the columns the contract attends (:func:`contract_mask`);
    arguments as :func:`reference.oracle.sparse_mla_reference`'s."""
    return sparse_mla_reference(q_nope, q_pe, ckv, kpe, indices, mask=contract_mask(indices, lens),
                                sm_scale=sm_scale, k_scale=k_scale, mode=mode)


def implementation_reference(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                             indices: torch.Tensor, lens: torch.Tensor, filler: str, *, sm_scale: float,
                             k_scale: float = 1.0, mode: ComputeMode = "float64") -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of each row over the multiset of its first ``lens[t]`` slots, a -1 among
    them read as ``filler``'s slot (:func:`filled_slots`)."""
    return sparse_mla_reference(q_nope, q_pe, ckv, kpe, filled_slots(indices, lens, filler), lens=lens,
                                sm_scale=sm_scale, k_scale=k_scale, mode=mode)


class OracleDifference(NamedTuple):
    """A row on which the two oracles differ: its length, the columns the contract attends
    within it, and the -1 entries the implementation reads as its filler."""

    row: int
    length: int
    attended: int
    holes: int


def oracle_differences(indices: torch.Tensor, lens: torch.Tensor) -> list[OracleDifference]:
    """The rows with a -1 before their length, where the contract and the implementation attend
    different multisets (whatever the filler: the contract never attends a -1)."""
    inside = within_lengths(indices, lens)
    holes = (inside & (indices < 0)).sum(dim=1)
    attended = contract_mask(indices, lens).sum(dim=1)
    return [OracleDifference(r, int(lens[r]), int(attended[r]), int(holes[r]))
            for r in holes.nonzero().flatten().tolist()]
