"""Reference model of the rows the DSA indexer writes into ``topk_indices_buffer``
(docs/regimes.md#indexer-rows).

Each row holds request-local token indices, -1 = invalid. Notation: ctx = position + 1,
r = ctx % kpool, P = ctx // kpool complete pools, S = topk // kpool pools selected.

- identity short fill: ``0..ctx-1`` then -1;
- kpool = 1: a prefix ``0..ctx-1`` if ctx <= topk, else topk distinct indices in any order;
- pooled (kpool > 1): columns ``c < topk`` hold selected pools expanded to tokens, columns
  ``topk .. topk+r-1`` the trailing incomplete pool; with P < S the selected pools are
  ``0..P-1`` and the columns up to topk stay -1, so the valid entries are not a prefix
  when r != 0.
"""

from __future__ import annotations

import numpy as np
import torch

from mla_constants import INVALID


def buffer_width(topk: int, kpool: int) -> int:
    """Width of ``topk_indices_buffer``: ``roundup(topk + kpool - 1, 128)``."""
    return -(-(topk + max(kpool, 1) - 1) // 128) * 128


def decode_rows_use_identity(max_seq_len: int, topk: int) -> bool:
    """Decode rows take the identity short fill when the batch's max seq_len <= topk."""
    return max_seq_len <= topk


def prefill_rows_use_identity(max_prefill_seq_len: int, topk: int) -> bool:
    """Prefill rows take the identity short fill when the batch's max prefill seq_len <= topk."""
    return max_prefill_seq_len <= topk


def identity_row(ctx: int, width: int) -> np.ndarray:
    """``0..ctx-1`` then -1."""
    if ctx > width:
        raise ValueError(f"identity fill needs ctx <= width, got ctx={ctx}, width={width}")
    row = np.full(width, INVALID, dtype=np.int32)
    row[:ctx] = np.arange(ctx, dtype=np.int32)
    return row


def kpool1_row(ctx: int, topk: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """kpool = 1: a prefix when ctx <= topk, else topk distinct tokens of ``[0, ctx)`` shuffled."""
    if ctx <= topk:
        return identity_row(ctx, width)
    row = np.full(width, INVALID, dtype=np.int32)
    row[:topk] = rng.choice(ctx, size=topk, replace=False).astype(np.int32)
    return row


def pooled_row(ctx: int, topk: int, kpool: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """kpool > 1: selected pools expanded in columns ``< topk``, the tail at column topk."""
    if topk % kpool:
        raise ValueError(f"topk={topk} must be a multiple of kpool={kpool}")
    if width < topk + kpool - 1:
        raise ValueError(f"width={width} < topk + kpool - 1 = {topk + kpool - 1}")
    complete, tail = divmod(ctx, kpool)
    selectable = topk // kpool
    row = np.full(width, INVALID, dtype=np.int32)
    if complete >= selectable:
        pools = rng.choice(complete, size=selectable, replace=False)
    else:
        pools = np.arange(complete)
    tokens = (pools[:, None] * kpool + np.arange(kpool)[None, :]).reshape(-1)
    row[: tokens.size] = tokens
    row[topk : topk + tail] = np.arange(complete * kpool, ctx, dtype=np.int32)
    return row


def indexer_row(ctx: int, identity: bool, topk: int, kpool: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """The row for one query token: identity fill, kpool = 1, or pooled."""
    if identity:
        return identity_row(ctx, width)
    if kpool == 1:
        return kpool1_row(ctx, topk, width, rng)
    return pooled_row(ctx, topk, kpool, width, rng)


def indexer_rows(
    ctx: torch.Tensor, identity: torch.Tensor, topk: int, kpool: int, width: int, seed: int, num_padded_rows: int = 0
) -> torch.Tensor:
    """``[len(ctx) + num_padded_rows, width]`` int32; padded rows are all -1."""
    rng = np.random.default_rng(seed)
    rows = [
        indexer_row(int(c), bool(i), topk, kpool, width, rng)
        for c, i in zip(ctx.tolist(), identity.tolist(), strict=True)
    ]
    rows += [np.full(width, INVALID, dtype=np.int32)] * num_padded_rows
    if not rows:
        return torch.empty((0, width), dtype=torch.int32)
    return torch.from_numpy(np.stack(rows))
