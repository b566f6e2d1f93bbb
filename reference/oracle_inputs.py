"""The oracle's inputs: shapes, dtypes and devices, the selection (lens or mask) and its range,
and the slot each column gathers. Shared by the definition (``reference/oracle.py``) and its
accelerated modes (``reference/oracle_fast.py``)."""

from __future__ import annotations

from typing import NamedTuple

import torch


def flatten_slots_view(cache_part: torch.Tensor, name: str) -> torch.Tensor:
    """Accept ``[N, D]`` or the kernel's ``[N, 1, D]`` view; return ``[N, D]``."""
    if cache_part.dim() == 3 and cache_part.shape[1] == 1:
        return cache_part[:, 0, :]
    if cache_part.dim() == 2:
        return cache_part
    raise ValueError(f"{name}: expected shape [num_slots, D] or [num_slots, 1, D], got {tuple(cache_part.shape)}")


def check_inputs(q_nope, q_pe, ckv, kpe, slots, lens, mask) -> None:
    """Shapes, dtypes and devices of the oracle's arguments; a ValueError naming the argument."""
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


def gather_index(slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The slot each column gathers (int64): selected columns their own slot, unselected ones
    the row's first selected slot. A slot the row reads anyway keeps poison (NaN in slot 0 or
    in stale slots) out of the P.V product without zeroing the gathered rows: the column's
    probability is exactly 0 and its value is finite unless the row's own selection is
    poisoned. Rows with no selection gather slot 0; they come out as out 0, lse -inf."""
    first_col = mask.to(torch.uint8).argmax(dim=1, keepdim=True)
    first = torch.where(mask.any(dim=1, keepdim=True), slots.gather(1, first_col), torch.zeros_like(first_col))
    return torch.where(mask, slots, first).long()
