"""FlashInfer's fa3 MLA scheduler, counted: the work items a plan makes and whether they fit.

The scheduler (``MLAPlan`` in ``scheduler.cuh``) sizes its per-work-item arrays for
:data:`FA3_WORK_CAPACITY` work items. A query row that is its own request and reads at most the
scheduler's KV chunk is one work item, so from a few hundred rows on a plan of N rows has N
work items (:func:`fa3_work_items` counts them). Releases whose plan() counts them first refuse
larger plans; a release that does not writes the arrays past their end.
"""

from __future__ import annotations

from mla_constants import FA3_WORK_CAPACITY


def scheduler_chunk(average: int) -> int:
    """The KV chunk length the fa3 MLA scheduler splits rows at, from the average KV length per
    cluster (its rounding steps: 32, 64, 128, 192, then multiples of 256)."""
    for limit, chunk in ((8, 32), (16, 64), (32, 128), (64, 192)):
        if average <= limit:
            return chunk
    return -(-average // 256) * 256


def cluster_size(total_q: int, num_heads: int, batch_size: int) -> int:
    """The thread-block cluster size the scheduler picks at plan time: 2 CTAs per cluster when
    the average packed query ``total_q * num_heads // batch_size`` exceeds 64, else 1
    (``batch_size``: the length of kv_len_arr, the reserved row count under CUDA graphs). A
    captured launch keeps the cluster size of the plan it was captured after
    (docs/findings.md#graph-replay-with-stale-plan-state)."""
    return 2 if batch_size and total_q * num_heads // batch_size > 64 else 1


def fa3_work_items(q_lens, kv_lens, num_heads: int, num_sm: int) -> int:
    """Work items the fa3 MLA scheduler makes for a non-causal plan: every request's packed query
    (q_len x heads) in tiles of 64 rows per CTA (2 CTAs per cluster when the average packed
    query exceeds 64), every tile's KV in chunks of the scheduler's length (at least one item,
    an empty KV included). ``kv_lens`` counts every request of the plan (padded rows too)."""
    q_lens, kv_lens = list(q_lens), list(kv_lens)
    if not kv_lens:
        return 0
    cluster = cluster_size(sum(q_lens), num_heads, len(kv_lens))
    clusters = num_sm // cluster
    tile = 64 * cluster
    tiles = [-(-q * num_heads // tile) for q in q_lens]
    total = sum(t * kv for t, kv in zip(tiles, kv_lens, strict=True))
    chunk = scheduler_chunk(max(-(-total // clusters), 1))
    return sum(t * max(1, -(-kv // chunk)) for t, kv in zip(tiles, kv_lens, strict=True))


def exceeds_work_capacity(rows: int) -> bool:
    """Whether a plan of ``rows`` query rows with at least one work item each (any row with a
    query, at any SM count) is beyond the scheduler's capacity."""
    return rows > FA3_WORK_CAPACITY
