"""The indexer rows of a whole step written at once: bitwise the per-row model
(:func:`reference.indexer.indexer_rows`), without a Python array per row, so that batches of
10^4-10^5 rows build in seconds (docs/edges.md#scale)."""

from __future__ import annotations

import numpy as np
import torch

from mla_constants import INVALID


def indexer_rows_fast(
    ctx: torch.Tensor, identity: torch.Tensor, topk: int, kpool: int, width: int, seed: int, num_padded_rows: int = 0
) -> torch.Tensor:
    """Bitwise what :func:`reference.indexer.indexer_rows` returns: the rows that draw (kpool 1
    with ctx > topk, pooled with at least topk / kpool complete pools) call the generator in row
    order exactly as the per-row model does; prefixes and pooled tails are written for all rows
    at once."""
    kpool = max(int(kpool), 1)
    if kpool > 1 and topk % kpool:
        raise ValueError(f"topk={topk} must be a multiple of kpool={kpool}")
    if kpool > 1 and width < topk + kpool - 1:
        raise ValueError(f"width={width} < topk + kpool - 1 = {topk + kpool - 1}")
    c = ctx.to(torch.int64).numpy()
    ident = identity.to(torch.bool).numpy()
    n = c.size
    too_wide = ident & (c > width)
    if too_wide.any():
        raise ValueError(f"identity fill needs ctx <= width, got ctx={int(c[too_wide][0])}, width={width}")
    out = np.full((n + num_padded_rows, width), INVALID, dtype=np.int32)
    if kpool == 1:
        draws = ~ident & (c > topk)
        prefix = np.where(draws, 0, c)
        complete = tail = None
    else:
        complete, tail = np.divmod(c, kpool)
        draws = ~ident & (complete >= topk // kpool)
        prefix = np.where(ident, c, np.where(draws, 0, complete * kpool))
        tail = np.where(ident, 0, tail)
    _write_prefixes(out, prefix)
    if kpool > 1:
        _write_pool_tails(out, complete * kpool, tail, topk)
    rng = np.random.default_rng(seed)
    selectable = topk // kpool
    spread = np.arange(kpool)
    for r in np.flatnonzero(draws):
        if kpool == 1:
            out[r, :topk] = rng.choice(int(c[r]), size=topk, replace=False)
        else:
            pools = rng.choice(int(complete[r]), size=selectable, replace=False)
            out[r, :topk] = (pools[:, None] * kpool + spread).reshape(-1)
    return torch.from_numpy(out)


_FILL_ROWS = 4096  # rows per vectorised write (bounds the temporaries)


def _write_prefixes(out: np.ndarray, lengths: np.ndarray) -> None:
    """Row r of ``out`` gets ``0..lengths[r]-1`` in its leading columns."""
    cols = np.arange(out.shape[1], dtype=np.int32)
    for start in range(0, lengths.size, _FILL_ROWS):
        part = lengths[start : start + _FILL_ROWS, None]
        rows = out[start : start + part.shape[0]]
        np.copyto(rows, cols[None, :], where=cols[None, :] < part)


def _write_pool_tails(out: np.ndarray, first: np.ndarray, counts: np.ndarray, topk: int) -> None:
    """Row r of ``out`` gets ``first[r] .. first[r] + counts[r] - 1`` from column topk on (the
    trailing incomplete pool)."""
    if not counts.any():
        return
    span = int(counts.max())
    offsets = np.arange(span)
    for start in range(0, counts.size, _FILL_ROWS):
        n = counts[start : start + _FILL_ROWS].size
        values = (first[start : start + n, None] + offsets[None, :]).astype(np.int32)
        block = out[start : start + n, topk : topk + span]
        np.copyto(block, values, where=offsets[None, :] < counts[start : start + n, None])

