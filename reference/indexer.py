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

Holes in the top-k (docs/input-space.md#holes-in-the-top-k): :func:`row_with_holes` writes a
row from indexer scores through a model of the top-k kernel (:func:`topk_with_holes`) that
writes -1 *inside* the first ``min(ctx, topk)`` columns where scores tie at the selection
threshold or are not finite, as SGLang #30645 reports of its fused top-k kernel (tie overflow,
inf scores).
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


# --- holes in the top-k ---------------------------------------------------------------------

#: The score patterns that make the modelled top-k write -1 inside a row's valid prefix.
HOLE_KINDS = ("ties", "inf", "nan")


def tie_capacity(k: int) -> int:
    """How many of the selected entries tied at the selection threshold the modelled top-k
    kernel writes: ``k // 2``. SGLang's fused top-k v2 (topk 2048 only) keeps at most
    ``kMaxNumTie = 1024`` candidates of the threshold bin and pads the rest with -1 (SGLang
    #30645: seq 8320, topk 2048, 100 winners and 8220 equal zeros gave 924 invalid entries,
    2048 - 100 - 1024); the model scales that bound with k."""
    return k // 2


def selection_order(scores: torch.Tensor) -> torch.Tensor:
    """Candidate ids as the modelled kernel ranks their scores: NaN first (a radix select orders
    a positive NaN's bits above +inf's), then by score, highest first, -inf last; equal scores in
    id order."""
    nan = torch.isnan(scores)
    key = torch.where(nan, torch.full_like(scores, float("inf")), scores)
    order = torch.argsort(-key, stable=True)
    return order[torch.argsort((~nan[order]).to(torch.int8), stable=True)]


def topk_with_holes(scores: torch.Tensor, k: int, kept_ties: int | None = None) -> torch.Tensor:
    """The ``min(n, k)`` entries (int64) the modelled top-k kernel writes for ``n`` candidate
    scores: the ids of the first ``min(n, k)`` candidates of :func:`selection_order`, in
    increasing id order, each written as -1 where its score is not finite, and of the selected
    candidates tied at the threshold (the last selected score, when finite) all but the first
    ``kept_ties`` (default :func:`tie_capacity` of ``k``) written as -1."""
    selected = selection_order(scores)[: min(scores.numel(), k)]
    picked = scores[selected]
    hole = ~torch.isfinite(picked)
    if selected.numel() and bool(torch.isfinite(picked[-1])):
        tied = (picked == picked[-1]).nonzero().flatten()
        hole[tied[tie_capacity(k) if kept_ties is None else kept_ties :]] = True
    written = torch.where(hole, INVALID, selected)
    return written[torch.argsort(selected)]


def hole_scores(kind: str, n: int, k: int, count: int, rng: np.random.Generator) -> torch.Tensor:
    """float64 scores of ``n`` candidates of a row whose top-``k`` leaves holes: ``ties``: fewer
    than ``k // 4 + 1`` winners above ``n - winners`` equal zeros (the shape of SGLang #30645);
    ``inf``: ``count`` candidates at +inf, -inf, +inf, ..., the rest distinct and finite;
    ``nan``: ``count`` candidates NaN, the rest distinct and finite. Which candidates: from ``rng``."""
    if kind not in HOLE_KINDS:
        raise ValueError(f"kind must be one of {HOLE_KINDS}, got {kind!r}")
    if kind == "ties":
        scores = np.zeros(n)
        winners = rng.choice(n, size=min(n, int(rng.integers(0, k // 4 + 1))), replace=False)
        scores[winners] = 1.0 + rng.random(winners.size)
        return torch.from_numpy(scores)
    scores = rng.standard_normal(n)
    odd = rng.choice(n, size=min(n, count), replace=False)
    scores[odd] = np.where(np.arange(odd.size) % 2 == 0, np.inf, -np.inf) if kind == "inf" else np.nan
    return torch.from_numpy(scores)


def row_with_holes(ctx: int, topk: int, kpool: int, width: int, kind: str, count: int,
                   rng: np.random.Generator) -> np.ndarray:
    """A row of the indexer's top-k (not the identity fill) written from scores of ``kind``
    (:func:`hole_scores`) by :func:`topk_with_holes`: kpool 1 ranks the ``ctx`` tokens and writes
    ``min(ctx, topk)`` entries; pooled ranks the ``P`` complete pools, writes ``min(P, S)`` pools
    expanded to tokens (a pool written as -1 is ``kpool`` -1 entries) and the trailing incomplete
    pool at column topk, as :func:`pooled_row`."""
    kpool = max(kpool, 1)
    complete, tail = divmod(ctx, kpool)
    selectable = topk // kpool
    row = np.full(width, INVALID, dtype=np.int32)
    if complete:
        pools = topk_with_holes(hole_scores(kind, complete, selectable, count, rng), selectable).numpy()
        tokens = pools[:, None] * kpool + np.arange(kpool)[None, :]
        row[: pools.size * kpool] = np.where(pools[:, None] < 0, INVALID, tokens).reshape(-1)
    row[topk : topk + tail] = np.arange(complete * kpool, ctx, dtype=np.int32)
    return row
