"""Faithful re-creations of the CPU-visible production bugs
(docs/findings.md#at-a-glance), as implementations
that plug into the suite with ``--impl tests.bugs:<ClassName>`` (a class is its own factory). The suite must fail on each
(``tests/cpu/test_suite_catches_bugs.py`` checks that it does)."""

from __future__ import annotations

import torch

from fast import kvlen
from fast.impl import FastImpl
from mla_constants import INVALID


class KpoolFromWrongSpec(FastImpl):
    """docs/findings.md#kpool-wrong-cache-spec:
    kpool read from the wrong cache spec (1 instead of 4): rows with ctx > topk are
    planned ``ctx % kpool`` short."""

    name = "bug1-kpool-from-wrong-spec"

    def kv_lens(self, meta, *, topk, kpool, async_scheduling):
        return super().kv_lens(meta, topk=topk, kpool=1, async_scheduling=async_scheduling)


class PrefillsStillPlanned(FastImpl):
    """docs/findings.md#prefills-to-mha-still-planned:
    prefills routed to dense MHA are still planned: planned rows != q rows."""

    name = "bug2-prefills-still-planned"

    def planned_lens(self, meta, lens, *, topk):
        return lens


class CompactionPlansPrefix(FastImpl):
    """docs/findings.md#regime-c-compacted:
    the compacted layout copies the first ``len`` columns like packed, so regime C
    rows (valid entries not a prefix) are planned as prefixes."""

    name = "bug3-regime-c-as-prefix"

    def write_kv_indices(self, layout, slots, lens, indptr, out):
        super().write_kv_indices("packed" if layout == "compacted" else layout, slots, lens, indptr, out)


class PackedWithMaxTailLength(FastImpl):
    """docs/findings.md#packed-clamp-with-a-wrong-length:
    rows past topk planned with the widest tail (topk + kpool - 1) while the packed
    layout clamps -1 to 0: the extra columns silently attend slot 0."""

    name = "bug5-packed-clamp-wrong-length"

    def kv_lens(self, meta, *, topk, kpool, async_scheduling):
        ctx = kvlen.row_contexts(meta, async_scheduling) if meta.num_reqs else torch.zeros(0, dtype=torch.int64)
        return torch.where(ctx <= topk, ctx, topk + max(kpool, 1) - 1).to(torch.int32)


class ContextIsPosition(FastImpl):
    """docs/findings.md#ctx-off-by-one:
    ctx taken as the position instead of position + 1."""

    name = "bug9-ctx-off-by-one"

    def kv_lens(self, meta, *, topk, kpool, async_scheduling):
        if meta.num_reqs == 0:
            return torch.zeros(0, dtype=torch.int32)
        return kvlen.kv_lens_from_ctx(kvlen.row_contexts(meta, async_scheduling) - 1, topk, kpool)


class OptimisticBoundAsExact(FastImpl):
    """docs/findings.md#optimistic-async-bounds:
    the host upper bound used under async scheduling, where it is optimistic for
    spec-decode rows."""

    name = "bug9-async-bound-as-exact"

    def kv_lens(self, meta, *, topk, kpool, async_scheduling):
        return super().kv_lens(meta, topk=topk, kpool=kpool, async_scheduling=False)


class ConvertWithoutTableBound(FastImpl):
    """docs/findings.md#convert-block-column-out-of-range:
    the convert kernel does not map block columns past the table width to -1; it
    reads on into the flat block table (the next request's row)."""

    name = "bug10-convert-no-width-check"

    def convert(self, topk_indices, block_table, req_id, block_size, *, out=None, with_counts=False):
        tok = topk_indices.to(torch.int64)
        flat = block_table.reshape(-1).to(torch.int64)
        pos = req_id.to(torch.int64).unsqueeze(1) * block_table.shape[1] + torch.div(tok, block_size, rounding_mode="trunc")
        phys = flat[pos.clamp(0, max(flat.numel() - 1, 0))] if flat.numel() else torch.zeros_like(pos)
        slots = torch.where(tok >= 0, phys * block_size + tok % block_size, INVALID).to(torch.int32)
        if out is not None:
            out.copy_(slots)
            slots = out
        counts = (slots != INVALID).sum(dim=1).to(torch.int32)
        return (slots, counts) if with_counts else slots


class ConvertAcceptsMismatchedReqIds(FastImpl):
    """docs/findings.md#convert-request-id-rows-mismatch:
    req_id with fewer rows than the token rows is accepted (rows past it reuse
    request 0) instead of being rejected."""

    name = "bug10-req-id-rows-mismatch"

    def convert(self, topk_indices, block_table, req_id, block_size, *, out=None, with_counts=False):
        rows = topk_indices.shape[0]
        fixed = torch.zeros(rows, dtype=torch.int32, device=req_id.device)
        n = min(rows, req_id.shape[0])
        fixed[:n] = req_id[:n]
        return super().convert(topk_indices, block_table, fixed, block_size, out=out, with_counts=with_counts)
