"""Host-side per-row KV lengths, as the production metadata builder computes them.

``ctx = position + 1``; ``len = ctx`` if ``ctx <= topk`` else ``topk + ctx % kpool``. The
context comes from one of three sources:

- without async scheduling: the host upper bound ``seq_lens_cpu_upper_bound`` (no device
  sync; exact in that mode);
- under async scheduling: the device ``positions`` copied to the host (one D2H sync), since
  the host bound is optimistic for spec-decode rows there;
- otherwise the ``seq_lens`` tensor.

When prefills are routed to dense MHA only the decode prefix is planned.
"""

from __future__ import annotations

import torch


def ctx_from_seq_lens(seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """ctx of every row from per-request seq_lens: ``seq_len - q_len + j + 1``."""
    qsl = query_start_loc.to(torch.int64)
    q_lens = qsl[1:] - qsl[:-1]
    first = seq_lens.to(torch.int64) - q_lens + 1
    req = torch.repeat_interleave(torch.arange(q_lens.numel()), q_lens)
    rows = torch.arange(req.numel())
    return first[req] + rows - qsl[:-1][req]


def ctx_from_positions(positions: torch.Tensor, num_rows: int) -> torch.Tensor:
    """ctx of every row from the device positions (one device-to-host copy)."""
    return positions[:num_rows].to("cpu", torch.int64) + 1


def row_contexts(meta, async_scheduling: bool) -> torch.Tensor:
    """ctx of each query row, from the source the production builder would use."""
    num_reqs = meta.num_reqs
    qsl = meta.query_start_loc_cpu[: num_reqs + 1]
    num_rows = int(qsl[-1]) if num_reqs else 0
    if not async_scheduling and meta.seq_lens_cpu_upper_bound is not None:
        return ctx_from_seq_lens(meta.seq_lens_cpu_upper_bound[:num_reqs], qsl)
    if meta.positions is not None and num_rows <= meta.positions.shape[0]:
        return ctx_from_positions(meta.positions, num_rows)
    return ctx_from_seq_lens(meta.seq_lens[:num_reqs].cpu(), qsl)


def kv_lens_from_ctx(ctx: torch.Tensor, topk: int, kpool: int) -> torch.Tensor:
    """The kv_len rule, int32."""
    kpool = max(int(kpool), 1)
    return torch.where(ctx <= topk, ctx, topk + ctx % kpool).to(torch.int32)


def kv_lens_host(meta, topk: int, kpool: int, async_scheduling: bool) -> torch.Tensor:
    """Exact per-row KV lengths on the host (CPU int32, one per query row)."""
    if meta.num_reqs == 0:
        return torch.zeros(0, dtype=torch.int32)
    return kv_lens_from_ctx(row_contexts(meta, async_scheduling), topk, kpool)


def prefills_use_dense_mha(meta, topk: int) -> bool:
    """Hopper routing: prefills go to dense MHA when every prefill has seq_len <= topk."""
    if meta.num_prefills == 0:
        return False
    prefill_seq_lens = meta.seq_lens[meta.num_decodes : meta.num_reqs]
    return int(prefill_seq_lens.max()) <= topk


def planned_lens(meta, lens: torch.Tensor, topk: int) -> torch.Tensor:
    """The lens actually planned: only the decode prefix when prefills go to dense MHA."""
    if prefills_use_dense_mha(meta, topk):
        return lens[: meta.num_decode_tokens]
    return lens
