"""Faithful re-creations of production bugs (docs/findings.md#at-a-glance), as implementations
that plug into the suite with ``--impl tests.bugs:<ClassName>`` (a class is its own factory).
The suite must fail on each (``tests/cpu/test_suite_catches_bugs.py`` checks that it does).
Most are CPU-visible; the last ones live in the attention state and are caught by the GPU
tier's edge families (docs/edges.md), one per family."""

from __future__ import annotations

import torch

from fast import kvlen
from fast.impl import FastImpl
from mla_constants import INVALID, KV_LORA_RANK


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
        pos = req_id.to(torch.int64).unsqueeze(1) * block_table.shape[1] + torch.div(
            tok, block_size, rounding_mode="trunc"
        )
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



class PlanKeptForTheSameRowCount(FastImpl):
    """docs/findings.md#plan-kept-for-the-same-row-count:
    plan reuse keyed on the row count alone (as an engine that keys its plans, like its CUDA
    graphs, on the batch size): a step with as many rows as the last one but other lengths
    keeps the last plan, so the kernel reads the last step's spans: slots past each row's new
    kv_len."""

    name = "edge-plan-kept-for-the-same-row-count"

    def make_attention_state(self, config, device="cuda", **kwargs):
        from backends.flashinfer.sm90_state import SM90AttentionState  # FlashInfer is imported only with a state

        class State(SM90AttentionState):
            def _same_as_last_plan(self, num_rows, lens):
                return self._planned and num_rows == self.num_rows

        return State(self, config, device, **kwargs)


class LseBaseChangedThroughExp(FastImpl):
    """docs/findings.md#lse-base-changed-through-exp:
    FlashInfer's base-2 LSE turned into natural log through the sum it stands for,
    ``log(exp2(lse))``, instead of a multiplication by ln 2: right while the sum fits float32,
    +inf or -inf once |lse| passes about 88 (scores far from zero)."""

    name = "edge-lse-base-changed-through-exp"

    def make_attention_state(self, config, device="cuda", **kwargs):
        from backends.flashinfer.sm90_state import SM90AttentionState  # FlashInfer is imported only with a state

        class State(SM90AttentionState):
            def attend(self, q_nope, q_pe, ckv, kpe, out, lse):
                super().attend(q_nope, q_pe, ckv, kpe, out, lse)
                n = self.num_rows
                lse[:n] = torch.log(torch.exp2(lse[:n]))

        return State(self, config, device, **dict(kwargs, lse_base_e=False))  # FlashInfer's own base-2 LSE


class QPeHeadsRolled(FastImpl):
    """A kernel-input bug: the attention state hands the kernel q_pe with its heads rolled by
    one (a head-major layout read as token-major, say), so every head scores its keys with its
    neighbour's rope part. The plan is right; the kernel's output is wrong. A fixture dumped
    under it replays red under it and green once fixed: the re-run on the installed FlashInfer
    decides, not the recorded output (GPU only)."""

    name = "kernel-input-q-pe-heads-rolled"

    def make_attention_state(self, config, device="cuda", **kwargs):
        from backends.flashinfer.sm90_state import SM90AttentionState

        class State(SM90AttentionState):
            def attend(self, q_nope, q_pe, ckv, kpe, out, lse):
                super().attend(q_nope, torch.roll(q_pe, 1, dims=1), ckv, kpe, out, lse)

        return State(self, config, device, **kwargs)


class StaleSplitPartialMerged(FastImpl):
    """The stale split partial of TensorRT-LLM #18755 (docs/input-space.md#poisoned-workspaces):
    an attention state whose merge takes, besides the row's own, the partial of a split that
    computed nothing from FlashInfer's float workspace, with weight 0; 0 x a NaN partial is NaN.
    The workspace is zero when the state is made and the stand-in kernels never write it, so every
    clean step is right: only the poisoned-workspace check shows it (on the simulated machine too)."""

    name = "workspace-stale-split-partial-merged"

    def make_attention_state(self, config, device="cuda", **kwargs):
        from backends.flashinfer.sm90_state import SM90AttentionState

        class State(SM90AttentionState):
            def __init__(self, *args, **kw):
                super().__init__(*args, **kw)
                self.workspace.zero_()

            def attend(self, q_nope, q_pe, ckv, kpe, out, lse):
                super().attend(q_nope, q_pe, ckv, kpe, out, lse)
                n, empty_split = self.num_rows, self.workspace[:4].view(torch.float32)[0]
                out[:n] = (out[:n].float() + 0.0 * empty_split).to(out.dtype)

        return State(self, config, device, **kwargs)


class GraphOutputLeftInItsStaticBuffers(FastImpl):
    """A bug only a CUDA graph shows (docs/input-space.md#graph-against-eager): an attention state
    whose step hands the kernel output and LSE buffers of its own, sized for the rows a graph
    captures, and copies the planned rows into the step's ``out`` and ``lse`` after the kernel only
    when it runs eagerly: while a graph captures it leaves the copy out, taking its own buffers for
    the graph's output, which no caller reads. Every eager step is right (a rerun on the same plan,
    the poisoned and against-fresh modes included); after a graph replay the step's ``out`` and
    ``lse`` still hold what they held before it, stale as a captured launch's plan state is
    (docs/findings.md#graph-replay-with-stale-plan-state): the last eager step's results, or the
    NaN the graphed mode poisons them with (``harness.layer_modes.GraphedLayer``)."""

    name = "graph-output-left-in-its-static-buffers"

    def make_attention_state(self, config, device="cuda", **kwargs):
        from backends.flashinfer.sm90_state import SM90AttentionState

        class State(SM90AttentionState):
            def __init__(self, *args, **kw):
                super().__init__(*args, **kw)
                rows, heads = self.config.max_rows, self.config.num_heads
                self.static_out = torch.zeros((rows, heads, KV_LORA_RANK), dtype=torch.bfloat16, device=self.device)
                self.static_lse = torch.zeros((rows, heads), dtype=torch.float32, device=self.device)

            def step(self, topk_indices, block_table, req_id, q_nope, q_pe, ckv, kpe, out, lse):
                super().step(topk_indices, block_table, req_id, q_nope, q_pe, ckv, kpe, self.static_out,
                             self.static_lse)
                if not torch.cuda.is_current_stream_capturing():
                    n = self.num_rows
                    out[:n].copy_(self.static_out[:n])
                    lse[:n].copy_(self.static_lse[:n])

        return State(self, config, device, **kwargs)


#: Rows the step kernels of :class:`StepKernelsOnTheCapturedGrid` cover: the largest batch an
#: engine captures in a CUDA graph (vLLM's default largest capture size).
CAPTURED_GRID_ROWS = 512


class StepKernelsOnTheCapturedGrid(FastImpl):
    """docs/findings.md#step-kernels-on-the-captured-grid:
    the convert and layout kernels of a step launched on a fixed grid of 512 rows, the largest
    batch captured in a CUDA graph, also for the larger batches an engine runs eagerly: rows past
    512 are planned and run, but their kv_indices keep what the buffer held (zeros in a fresh
    state, the previous step's slots in a used one)."""

    name = "edge-step-kernels-on-the-captured-grid"

    def make_attention_state(self, config, device="cuda", **kwargs):
        from backends.flashinfer.sm90_state import SM90AttentionState  # FlashInfer is imported only with a state

        class State(SM90AttentionState):
            def write_indices(self, topk_indices, block_table, req_id):
                cfg = self.config
                grid = min(CAPTURED_GRID_ROWS, cfg.max_rows)
                self.impl.convert(topk_indices[:grid], block_table, req_id[:grid], cfg.block_size,
                                  out=self.slots[:grid])
                if cfg.layout != "strided":
                    self.impl.write_kv_indices(cfg.layout, self.slots[:grid], self.kv_len[:grid],
                                               self.kv_indptr[: grid + 1], self.kv_indices)

        return State(self, config, device, **kwargs)


class PlanKeptForAReorderedBatch(FastImpl):
    """docs/findings.md#plan-kept-for-a-reordered-batch:
    FlashInfer's plan kept while the batch's row count and sorted lengths repeat (what the cost
    of a plan depends on), not which row has which length. The step's metadata still goes into
    the reserved buffers, so the layout writes each row's new span; the kernel runs the kept
    plan's spans over it: after a step with the same rows in another order, each row reads the
    slots that now lie where the row in its place before had its span. The plan is kept with
    ``AttentionConfig.reuse_plan`` on or off."""

    name = "edge-plan-kept-for-a-reordered-batch"

    def make_attention_state(self, config, device="cuda", **kwargs):
        from backends.flashinfer.sm90_state import SM90AttentionState  # FlashInfer is imported only with a state

        class State(SM90AttentionState):
            kept_profile = None

            def plan(self, num_rows, lens):
                profile = (num_rows, sorted(lens.tolist()))
                if not (self._planned and profile == self.kept_profile):
                    super().plan(num_rows, lens)
                    self.kept_profile = profile
                    return
                # FlashInfer's plan kept; the step's metadata written as plan() writes it.
                cfg = self.config
                torch.clamp(self._arange, max=num_rows, out=self._qo_host)
                self._kv_len_host.zero_()
                self._kv_len_host[:num_rows] = lens.to(torch.int32)
                self._kv_indptr_host.copy_(self.impl.kv_indptr(cfg.layout, self._kv_len_host[:num_rows], cfg.max_rows,
                                                               cfg.width))
                for buffer, host in ((self.qo_indptr, self._qo_host), (self.kv_indptr, self._kv_indptr_host),
                                     (self.kv_len, self._kv_len_host)):
                    buffer.copy_(host)
                self.num_rows = num_rows
                self.plans += 1
                self.reused_plans += 1

        return State(self, config, device, **kwargs)


class ConvertReadsTheTableOfInvalidEntries(FastImpl):
    """A convert kernel (as vLLM's Triton one) that reads ``block_table[req, 0]`` for the -1
    entries too: in a step with padded rows only the block table has no row, and the read
    faults. Re-created as the fault's effect: the process is killed by SIGSEGV."""

    name = "crash-convert-reads-an-empty-block-table"

    def convert(self, topk_indices, block_table, req_id, block_size, *, out=None, with_counts=False):
        if block_table.shape[0] == 0 and topk_indices.numel():
            import os
            import signal

            os.kill(os.getpid(), signal.SIGSEGV)
        return super().convert(topk_indices, block_table, req_id, block_size, out=out, with_counts=with_counts)


class ConvertFaultsOnPaddedRowsOnly(FastImpl):
    """A convert kernel that dereferences a null pointer on a step whose rows are all padding
    (every index -1, as in a CUDA-graph step with no request): a real fault, the process killed
    by SIGSEGV, wherever convert is called (the pipeline's stages or a test's direct call)."""

    name = "crash-convert-null-on-padded-rows"

    def convert(self, topk_indices, block_table, req_id, block_size, *, out=None, with_counts=False):
        if topk_indices.numel() and bool((topk_indices == -1).all()):
            import ctypes

            ctypes.string_at(0)
        return super().convert(topk_indices, block_table, req_id, block_size, out=out, with_counts=with_counts)


class ConvertKillsItsProcess(FastImpl):
    """A convert kernel that faults on every step (the process is killed by SIGSEGV): what a
    scale case run in a child process must survive as one failed test with a recipe."""

    name = "crash-convert-always"

    def convert(self, *args, **kwargs):
        import os
        import signal

        os.kill(os.getpid(), signal.SIGSEGV)


class HostStagesKillTheirProcess(FastImpl):
    """The host lengths and the layout's indptr kill their process (SIGSEGV): each test that
    calls them directly must fail, naming the stage, and the session go on."""

    name = "crash-host-stages"

    def kv_lens(self, *args, **kwargs):
        _killed()

    def kv_indptr(self, *args, **kwargs):
        _killed()


def _killed():
    import os
    import signal

    os.kill(os.getpid(), signal.SIGSEGV)


class BlockSizeAsShift(FastImpl):
    """docs/input-space.md#block-sizes:
    the convert rule with the block size taken as a power of two (``tok >> log2(bs)``,
    ``tok & (bs - 1)``): right for 64, 128, 256, wrong for the multiples of 64 that are not
    powers of two (192, 320, 576), which the engine can choose."""

    name = "input-space-block-size-as-shift"

    def convert(self, topk_indices, block_table, req_id, block_size, *, out=None, with_counts=False):
        shift = int(block_size).bit_length() - 1
        tok = topk_indices.to(torch.int64)
        blk, off = tok >> shift, tok & ((1 << shift) - 1)
        table = block_table if block_table.shape[0] else torch.zeros((1, 1), dtype=torch.int32, device=tok.device)
        valid = (tok >= 0) & (blk < block_table.shape[1])
        phys = table[req_id.to(torch.int64)].to(torch.int64).gather(1, blk.clamp(0, table.shape[1] - 1))
        slots = torch.where(valid, phys * block_size + off, INVALID).to(torch.int32)
        result = slots if out is None else out.copy_(slots)
        return (result, valid.sum(dim=1).to(torch.int32)) if with_counts else result


class RequestIdsSkipEmptyRequests(FastImpl):
    """docs/input-space.md#batch-composition:
    request ids numbered over the requests that have query rows, so every row after a
    request with no query row this step reads the block-table row of the request before it."""

    name = "input-space-request-ids-skip-empty-requests"

    def request_ids(self, query_start_loc, num_rows):
        qsl = query_start_loc.to(torch.int64)
        counts = qsl[1:] - qsl[:-1]
        live = counts[counts > 0]
        ids = torch.repeat_interleave(torch.arange(live.numel(), device=qsl.device), live)
        out = torch.zeros(num_rows, dtype=torch.int32, device=qsl.device)
        out[: ids.numel()] = ids.to(torch.int32)
        return out


class RowsFromTheTokenCount(FastImpl):
    """docs/input-space.md#batch-composition:
    host lengths for ``num_actual_tokens`` rows, their contexts from the positions: right where
    the metadata counts the query rows, wrong under a FULL CUDA graph, whose token count holds
    the padded rows too (their positions are what an earlier step left in the buffer)."""

    name = "input-space-rows-from-the-token-count"

    def kv_lens(self, meta, *, topk, kpool, async_scheduling):
        if meta.positions is None or meta.num_reqs == 0:
            return super().kv_lens(meta, topk=topk, kpool=kpool, async_scheduling=async_scheduling)
        return kvlen.kv_lens_from_ctx(kvlen.ctx_from_positions(meta.positions, meta.num_actual_tokens), topk, kpool)


class StaleLengthsPastTheRowCount(FastImpl):
    """docs/findings.md#stale-lengths-after-a-smaller-replan:
    an attention state whose plan writes the lengths of the current rows over the last plan's
    without zeroing the rest, so after a smaller replan the rows past the current count keep the
    larger step's lengths (what the plan hands FlashInfer for padded rows). One step on a fresh
    state is right: only a state carried from a larger step shows it (GPU only)."""

    name = "sequence-stale-lengths-past-the-row-count"

    def make_attention_state(self, config, device="cuda", **kwargs):
        from backends.flashinfer.sm90_state import SM90AttentionState

        class State(SM90AttentionState):
            def plan(self, num_rows, lens):
                kept, plan = self._kv_len_host.clone(), self.wrapper.plan

                def plan_with_stale_lengths(**kwargs):
                    kwargs["kv_len_arr"][num_rows:] = kept[num_rows:]
                    return plan(**kwargs)

                self.wrapper.plan = plan_with_stale_lengths
                try:
                    super().plan(num_rows, lens)
                finally:
                    self.wrapper.plan = plan

        return State(self, config, device, **kwargs)


class PackedRewritesOnlyChangedRows(FastImpl):
    """docs/findings.md#packed-rows-rewritten-only-when-their-span-changes:
    an incremental packed layout: into a kv_indices buffer it wrote before, it rewrites only the
    rows whose span (offset, length) changed since, as if a row's slots changed only with its
    length. A row past topk keeps its length from one decode step to the next while its
    selection moves, so the kernel reads the previous step's slots there. One step on fresh
    buffers is right: only a sequence that carries the buffers shows it."""

    name = "sequence-packed-rewrites-only-changed-rows"

    def __init__(self):
        self._written: dict[int, tuple] = {}  # id of a live kv_indices buffer -> (indptr, lens) last written

    def write_kv_indices(self, layout, slots, lens, indptr, out):
        import weakref

        last = self._written.get(id(out))
        if last is None:  # forget the buffer when it is freed (its id may be reused)
            weakref.finalize(out, self._written.pop, id(out), None)
        fresh = out.clone()
        super().write_kv_indices(layout, slots, lens, indptr, fresh)
        if layout != "packed" or last is None:
            out.copy_(fresh)
        else:
            old_indptr, old_lens = last
            rows = lens.numel()
            changed = (lens != old_lens) | (indptr[:rows] != old_indptr[:rows])
            for r in changed.nonzero().flatten().tolist():
                start, length = int(indptr[r]), int(lens[r])
                out[start : start + length] = fresh[start : start + length]
        self._written[id(out)] = (indptr.clone(), lens.clone())
