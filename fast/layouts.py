"""The three kv_indices layouts the plan can point at (docs/computation.md#layouts).

- ``strided`` (the seed): row t is ``kv_indices[t*W:(t+1)*W]``, the convert output itself;
  ``kv_indptr = qo_indptr * W``. The -1 tail past each row's length is never read.
- ``packed`` (later production): ``kv_indptr = [0, cumsum(lens)]``; the first ``len``
  columns of each row are copied with -1 clamped to slot 0.
- ``compacted``: ``kv_indptr = [0, cumsum(lens)]``; each row's valid entries are packed in
  column order, so a row whose valid entries are not a prefix (regime C) is still read
  right. A row with fewer valid entries than its length keeps -1 in its span (an invariant
  violation, caught before launch).

``kv_indptr`` is built on the host (plan takes host tensors); the indices are written on the
device with fixed-shape operations so that the step can be captured in a CUDA graph. The
indices buffer has one trailing dump entry that fixed-shape scatters aim unused lanes at.
"""

from __future__ import annotations

import torch

LAYOUTS = ("strided", "packed", "compacted")


def check_layout(name: str) -> None:
    if name not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {name!r}")


def indices_capacity(max_rows: int, width: int) -> int:
    """Length of the reserved kv_indices buffer: every row full, plus the dump entry."""
    return max_rows * width + 1


def kv_indptr_host(layout: str, lens: torch.Tensor, max_rows: int, width: int) -> torch.Tensor:
    """Host int32 ``[max_rows + 1]``; rows past ``len(lens)`` are empty (flat indptr)."""
    check_layout(layout)
    num_rows = lens.numel()
    if num_rows > max_rows:
        raise ValueError(f"{num_rows} rows > max_rows {max_rows}")
    if layout == "strided":
        return torch.arange(max_rows + 1, dtype=torch.int32).clamp(max=num_rows) * width
    indptr = torch.zeros(max_rows + 1, dtype=torch.int32)
    indptr[1 : num_rows + 1] = torch.cumsum(lens.to(torch.int64), 0).to(torch.int32)
    indptr[num_rows + 1 :] = indptr[num_rows]
    return indptr


def write_kv_indices(
    layout: str, slots: torch.Tensor, lens: torch.Tensor, indptr: torch.Tensor, out: torch.Tensor
) -> None:
    """Write the layout's kv_indices into ``out`` (flat int32, ``indices_capacity`` long).

    ``slots [R, W]`` is the convert output for all R rows (padding included), ``lens [R]``
    and ``indptr [R + 1]`` device int32 with padded rows' lens 0. Fixed-shape: capturable.
    """
    check_layout(layout)
    rows, width = slots.shape
    if out.numel() < rows * width + 1:
        raise ValueError(f"kv_indices buffer of {out.numel()} < {rows * width + 1} entries")
    if layout == "strided":
        target = out[: rows * width].view(rows, width)
        if target.data_ptr() != slots.data_ptr():
            target.copy_(slots)
        return
    dump = out.numel() - 1
    cols = torch.arange(width, device=slots.device, dtype=torch.int32).unsqueeze(0)
    lens = lens.to(torch.int32).unsqueeze(1)
    if layout == "packed":
        rank = cols.expand(rows, width)
        keep = rank < lens
        values = slots.clamp(min=0)
    else:
        valid = slots != -1
        rank = torch.cumsum(valid.to(torch.int32), dim=1) - 1
        keep = valid & (rank < lens)
        values = slots
        # Rows with fewer valid entries than their length: the leftover span holds -1.
        fill_rank = cols.expand(rows, width)
        short = (fill_rank >= valid.sum(dim=1, keepdim=True, dtype=torch.int32)) & (fill_rank < lens)
        fill_dest = torch.where(short, indptr[:-1].unsqueeze(1).to(torch.int64) + fill_rank, dump)
        out.scatter_(0, fill_dest.reshape(-1), torch.full_like(slots, -1).reshape(-1))
    dest = torch.where(keep, indptr[:-1].unsqueeze(1).to(torch.int64) + rank, dump)
    out.scatter_(0, dest.reshape(-1), values.reshape(-1))
