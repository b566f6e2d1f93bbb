"""The convert kernel (Triton): request-local top-k token indices -> global KV slot ids.

Column-preserving: output column j is input column j mapped through the block table, or -1
where the input is negative or its block column is past the table width. Int32 arithmetic.
Optionally writes each row's count of valid entries. Runs on a GPU, and on CPU under
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK_COLS = 128
# Triton picks compiled or interpreted kernels when they are defined, i.e. at this import.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _convert_kernel(
    topk_ptr,
    topk_stride,
    table_ptr,
    table_stride,
    table_width,
    req_ptr,
    out_ptr,
    out_stride,
    counts_ptr,
    num_rows,
    width,
    BLOCK_SIZE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    WITH_COUNTS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    req = tl.load(req_ptr + rows, mask=row_ok, other=0)
    count = tl.zeros((ROWS, BLOCK), dtype=tl.int32)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        live = row_ok[:, None] & (cols < width)[None, :]
        tok = tl.load(topk_ptr + rows[:, None] * topk_stride + cols[None, :], mask=live, other=-1)
        blk = tok // BLOCK_SIZE
        valid = (tok >= 0) & (blk < table_width) & live
        phys = tl.load(table_ptr + req[:, None] * table_stride + blk, mask=valid, other=0)
        slot = tl.where(valid, phys * BLOCK_SIZE + tok % BLOCK_SIZE, -1)
        tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], slot, mask=live)
        count += valid.to(tl.int32)
    if WITH_COUNTS:
        tl.store(counts_ptr + rows, tl.sum(count, axis=1), mask=row_ok)


def unit_column_stride(t: torch.Tensor) -> bool:
    """Whether the kernel may address ``t [R, C]`` as ``row * stride(0) + column``: a column
    stride of 1, or one that is never used (no element, or a single column). An empty block
    table (a step with no request, padded rows only) may have any strides: built on the host
    from an empty numpy array it has strides (0, 0)."""
    return t.numel() == 0 or t.shape[1] == 1 or t.stride(1) == 1


def _rows_per_program(device: torch.device) -> int:
    """Rows per program: a few on a GPU; many in the interpreter, whose cost is per operation."""
    return 64 if device.type == "cpu" else 4


def _columns_per_step(device: torch.device, width: int) -> int:
    """Columns per loop step: 128 on a GPU; up to 1024 in the interpreter, whose cost is per
    operation, so fewer and wider steps run the same rule faster."""
    return BLOCK_COLS if device.type != "cpu" else min(1024, triton.next_power_of_2(width))


def convert_topk_to_slots(
    topk_indices: torch.Tensor,
    block_table: torch.Tensor,
    req_id: torch.Tensor,
    block_size: int,
    *,
    out: torch.Tensor | None = None,
    with_counts: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Map ``topk_indices [T, W]`` (int32, -1 invalid) to slot ids ``[T, W]`` int32.

    ``req_id [T]`` gives each row's request (padded rows: 0). ``out`` may be a reused buffer
    (any int32 ``[T, W]`` view, e.g. a row-strided view of the plan's kv_indices). With
    ``with_counts`` also returns each row's count of valid entries (int32 ``[T]``).
    """
    if topk_indices.dim() != 2 or topk_indices.dtype != torch.int32:
        raise ValueError(f"topk_indices: expected int32 [T, W], got {topk_indices.dtype} {tuple(topk_indices.shape)}")
    rows, width = topk_indices.shape
    if width % BLOCK_COLS:
        raise ValueError(f"topk_indices: width {width} is not a multiple of {BLOCK_COLS}")
    if req_id.shape != (rows,):
        raise ValueError(f"req_id: expected [{rows}] (one per token row), got {tuple(req_id.shape)}")
    if block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise ValueError(
            f"block_table: expected int32 [num_reqs, blocks], got {block_table.dtype} {tuple(block_table.shape)}"
        )
    if not (unit_column_stride(topk_indices) and unit_column_stride(block_table)):
        raise ValueError("topk_indices and block_table need unit column stride")
    devices = {t.device for t in (topk_indices, block_table, req_id) + ((out,) if out is not None else ())}
    if len(devices) != 1:
        raise ValueError(f"inputs on several devices: {devices}")
    if topk_indices.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError("the convert kernel runs on CPU tensors only in Triton's interpreter: "
                           "set TRITON_INTERPRET=1 before fast.convert is imported")
    if out is None:
        out = torch.empty_like(topk_indices)
    elif out.shape != (rows, width) or out.dtype != torch.int32 or not unit_column_stride(out):
        raise ValueError(
            f"out: expected int32 [{rows}, {width}] with unit column stride, got {out.dtype} {tuple(out.shape)}"
        )
    counts = torch.empty(rows, dtype=torch.int32, device=topk_indices.device) if with_counts else out
    if rows:
        rows_per_program = _rows_per_program(topk_indices.device)
        _convert_kernel[(triton.cdiv(rows, rows_per_program),)](
            topk_indices,
            topk_indices.stride(0),
            block_table,
            block_table.stride(0),
            block_table.shape[1],
            req_id.to(torch.int32),
            out,
            out.stride(0),
            counts,
            rows,
            width,
            BLOCK_SIZE=block_size,
            ROWS=rows_per_program,
            BLOCK=_columns_per_step(topk_indices.device, width),
            WITH_COUNTS=with_counts,
        )
    return (out, counts) if with_counts else out


def request_ids(query_start_loc: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Request id of each of ``num_rows`` rows on the device of ``query_start_loc``; rows past
    the last query token (CUDA-graph padding) map to request 0."""
    qsl = query_start_loc.to(torch.int64)
    counts = (qsl[1:] - qsl[:-1]).clamp(min=0)
    ids = torch.repeat_interleave(torch.arange(counts.numel(), device=qsl.device), counts)
    if ids.numel() > num_rows:
        raise ValueError(f"num_rows={num_rows} < {ids.numel()} query tokens")
    out = torch.zeros(num_rows, dtype=torch.int32, device=qsl.device)
    out[: ids.numel()] = ids[:num_rows].to(torch.int32)
    return out
