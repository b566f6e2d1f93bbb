"""Reference models of the rules around the kernel: row context, kv_len, convert, regimes.

These are the rules of docs/computation.md#the-production-path written as small pure
functions; ``fast/`` holds the
production versions that the tests compare against them.
"""

from __future__ import annotations

import torch

from mla_constants import INVALID

REGIMES: dict[str, str] = {
    "A": "identity fill, ctx <= topk",
    "B": "pooled, ctx < topk, r = 0",
    "C": "pooled, ctx < topk, r != 0 (valid entries not a prefix)",
    "D": "pooled, ctx = topk",
    "E": "pooled, topk < ctx < topk + kpool",
    "F": "pooled, ctx >= topk + kpool, r = 0",
    "G": "pooled, ctx > topk, r != 0",
    "H": "kpool = 1, any ctx",
}


def row_context(seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """ctx = position + 1 of every query row: ``seq_len - q_len + j + 1`` for the j-th token."""
    qsl = query_start_loc.to(torch.int64).cpu()
    q_lens = qsl[1:] - qsl[:-1]
    first_ctx = seq_lens.to(torch.int64).cpu() - q_lens + 1
    req = torch.repeat_interleave(torch.arange(q_lens.numel()), q_lens)
    rows = torch.arange(int(qsl[-1]) if qsl.numel() else 0)
    return first_ctx[req] + rows - qsl[req]


def kv_len_rule(ctx: torch.Tensor, topk: int, kpool: int) -> torch.Tensor:
    """Planned length of a row: ctx if ctx <= topk, else topk + ctx % kpool."""
    ctx = ctx.to(torch.int64)
    return torch.where(ctx <= topk, ctx, topk + ctx % max(kpool, 1))


def classify_row(ctx: int, topk: int, kpool: int, identity: bool) -> str:
    """The context regime A–H of one row (docs/regimes.md#context-regimes)."""
    if ctx < 1:
        raise ValueError(f"ctx must be >= 1, got {ctx}")
    if identity:
        return "A"
    if kpool == 1:
        return "H"
    r = ctx % kpool
    if ctx < topk:
        return "B" if r == 0 else "C"
    if ctx == topk:
        return "D"
    if ctx < topk + kpool:
        return "E"
    return "F" if r == 0 else "G"


def classify_rows(ctx: torch.Tensor, identity: torch.Tensor, topk: int, kpool: int) -> list[str]:
    return [classify_row(int(c), topk, kpool, bool(i)) for c, i in zip(ctx.tolist(), identity.tolist(), strict=True)]


def request_ids_per_row(query_start_loc: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Request id of every row; rows past the last request (CUDA-graph padding) map to 0."""
    qsl = query_start_loc.to(torch.int64).cpu()
    q_lens = qsl[1:] - qsl[:-1]
    req = torch.repeat_interleave(torch.arange(q_lens.numel()), q_lens)
    if req.numel() > num_rows:
        raise ValueError(f"num_rows={num_rows} < {req.numel()} query tokens")
    pad = torch.zeros(num_rows - req.numel(), dtype=torch.int64)
    return torch.cat([req, pad]).to(torch.int32)


def convert_rule(
    topk_indices: torch.Tensor, block_table: torch.Tensor, req_id: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Column-preserving map of request-local token indices to global slot ids
    (docs/computation.md#convert-kernel).

    ``slot = block_table[req_id[t], tok // block_size] * block_size + tok % block_size``;
    -1 where ``tok < 0`` or the block column is past the table width. A token past the
    request's allocation but inside the table maps through whatever the table holds.
    """
    if req_id.shape[0] != topk_indices.shape[0]:
        raise ValueError(f"req_id has {req_id.shape[0]} rows but topk_indices has {topk_indices.shape[0]}")
    tok = topk_indices.to(torch.int64)
    table = block_table.to(device=tok.device, dtype=torch.int64)
    blk = torch.div(tok, block_size, rounding_mode="trunc")
    valid = (tok >= 0) & (blk < table.shape[1])
    req = req_id.to(device=tok.device, dtype=torch.int64).unsqueeze(1).expand_as(tok)
    slots = torch.full_like(tok, INVALID)  # only valid entries read the table (it may have no row)
    slots[valid] = table[req[valid], blk[valid]] * block_size + tok[valid] % block_size
    return slots.to(torch.int32)


def valid_counts(slots: torch.Tensor) -> torch.Tensor:
    """Number of valid (!= -1) entries in each row."""
    return (slots != INVALID).sum(dim=1).to(torch.int32)


def valid_is_prefix(slots: torch.Tensor) -> torch.Tensor:
    """Per row: the valid entries occupy exactly the first ``count`` columns."""
    valid = slots != INVALID
    cols = torch.arange(slots.shape[1], device=slots.device).unsqueeze(0)
    return ((cols < valid.sum(dim=1, keepdim=True)) == valid).all(dim=1)


def route_prefills_to_mha(prefill_seq_lens: torch.Tensor, topk: int) -> bool:
    """On Hopper, prefills go to dense MHA when every prefill has seq_len <= topk."""
    return prefill_seq_lens.numel() > 0 and int(prefill_seq_lens.max()) <= topk


def valid_first(slots: torch.Tensor) -> torch.Tensor:
    """Each row's valid entries moved to the front in column order (-1 after): the row as a
    compacting layout reads it."""
    order = torch.sort((slots == INVALID).to(torch.int8), dim=1, stable=True).indices
    return torch.gather(slots, 1, order)
