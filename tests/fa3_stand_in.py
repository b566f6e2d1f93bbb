"""A CPU stand-in for FlashInfer's ``BatchMLAPagedAttentionWrapper`` that keeps its schedule as
fa3 does, so vLLM's SM90 backend runs end to end without a GPU.

``plan()`` copies the indptr arrays into the reserved buffers (``use_cuda_graph=True``), splits
each query row's planned KV length into work items of the scheduler's chunk length (the rule of
``harness.plan_limits.scheduler``), deals them to clusters and writes the per-work arrays
(q_indptr, kv_indptr, kv_start, kv_end) and work_indptr into an int workspace at the offsets of
an 18-field ``_plan_info``, laid out as FlashInfer lays them out. ``run()`` reads that
workspace at run time, as the kernel does: each work item attends the slots
``kv_indices[kv_indptr + kv_start : kv_indptr + kv_end]`` of its row, so whatever rewrote
kv_end since the plan (vLLM's clamp) decides what is read. Like FlashInfer, plan() refuses a
KV dtype other than float16, bfloat16 and float8_e4m3fn. It computes in float32 with the
per-tensor scales it is given (``ckv_scale`` on the ckv part, ``kpe_scale`` on the kpe part).

``releases``: ``"0.7"`` keeps the workspace on ``_planned_backend`` (0.7.x), ``"0.6"`` on the
wrapper (0.6.x, which has no ``_planned_backend``).
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import torch

from backends.flashinfer import fa3_schedule as fs
from harness.plan_limits.scheduler import scheduler_chunk

NUM_CLUSTERS = 4
CAPACITY = 4096  # per-work slots of the stand-in's arrays
#: The KV dtypes FlashInfer's MLA plan() takes (0.6.18.post1 refuses uint8 with this message).
PLANNABLE_KV_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)


def chunk_length(kv_lens: list[int]) -> int:
    """The scheduler's KV chunk for these planned lengths over the stand-in's clusters."""
    return scheduler_chunk(max(-(-sum(kv_lens) // NUM_CLUSTERS), 1))


class StandInWrapper:
    release = "0.7"

    def __init__(self, float_workspace, use_cuda_graph=False, qo_indptr=None, kv_indptr=None, kv_indices=None,
                 kv_len_arr=None, backend="auto"):
        self.backend = backend
        self.qo_indptr, self._kv_indptr_buf = qo_indptr, kv_indptr
        self.kv_indices, self.kv_len_arr = kv_indices, kv_len_arr
        buffer = torch.zeros(8 * CAPACITY * 4 + 64 * 4, dtype=torch.uint8, device=float_workspace.device)
        if self.release == "0.7":
            self._planned_backend = None
            self._buffer = buffer
        else:
            self._int_workspace_buffer = buffer
        self.plans = 0
        self.planned_lens: list[int] = []

    @property
    def _ws(self) -> torch.Tensor:
        holder = self._planned_backend if self.release == "0.7" else self
        return holder._int_workspace_buffer.view(torch.int32)

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type=None, kv_data_type=None, **kwargs):
        if kv_data_type not in PLANNABLE_KV_DTYPES:
            raise ValueError(f"MLA kv_data_type {kv_data_type} is not supported. Supported dtypes: "
                             f"{list(PLANNABLE_KV_DTYPES)}.")
        if self.release == "0.7":
            self._planned_backend = SimpleNamespace(_int_workspace_buffer=self._buffer)
        self.qo_indptr.copy_(qo_indptr)
        self._kv_indptr_buf.copy_(kv_indptr)
        self.kv_len_arr.copy_(kv_len_arr)
        self.sm_scale, self.kv_data_type = sm_scale, kv_data_type
        qo = qo_indptr.tolist()
        rows = [r for r in range(len(qo) - 1) if qo[r + 1] > qo[r]]
        lens = [int(kv_len_arr[r]) for r in rows]
        chunk = chunk_length(lens)
        works = []  # (row, kv_start, kv_end)
        for r, length in zip(rows, lens, strict=True):
            works += [(r, s, min(s + chunk, length)) for s in range(0, max(length, 1), chunk)]
        if len(works) > CAPACITY:
            raise ValueError(f"stand-in: {len(works)} works exceed its capacity {CAPACITY}")
        per_cluster = [works[c::NUM_CLUSTERS] for c in range(NUM_CLUSTERS)]
        ordered = [w for cluster in per_cluster for w in cluster]
        work_indptr = [0]
        for cluster in per_cluster:
            work_indptr.append(work_indptr[-1] + len(cluster))
        q_off, kv_off, start_off, end_off = (i * CAPACITY * 4 for i in range(4))
        indptr_off = 4 * CAPACITY * 4
        ws = self._ws
        ws.zero_()
        for base, values in ((q_off, [w[0] for w in ordered]), (kv_off, [int(kv_indptr[w[0]]) for w in ordered]),
                             (start_off, [w[1] for w in ordered]), (end_off, [w[2] for w in ordered]),
                             (indptr_off, work_indptr)):
            if values:
                ws[base // 4 : base // 4 + len(values)] = torch.tensor(values, dtype=torch.int32)
        info = [0] * fs.PLAN_INFO_LEN
        info[0], info[fs.NUM_CLUSTERS] = 1, NUM_CLUSTERS
        info[fs.Q_INDPTR], info[fs.KV_INDPTR], info[fs.KV_START], info[fs.KV_END] = q_off, kv_off, start_off, end_off
        info[fs.WORK_INDPTR] = indptr_off
        self._plan_info = info
        self.plans += 1
        self.planned_lens = lens

    def run(self, q_nope, q_pe, ckv, kpe, ckv_scale=None, kpe_scale=None, out=None, lse=None, return_lse=False,
            **kwargs):
        rows, heads = q_nope.shape[0], q_nope.shape[1]
        result = torch.zeros(rows, heads, ckv.shape[-1], dtype=torch.float32, device=q_nope.device)
        selected = self.selected_slots(ckv)
        c_scale = 1.0 if ckv_scale is None else float(ckv_scale)
        p_scale = 1.0 if kpe_scale is None else float(kpe_scale)
        for r, slots in selected.items():
            if not slots or r >= rows:
                continue
            index = torch.tensor(slots, dtype=torch.int64, device=q_nope.device)
            c = ckv[index, 0].float() * c_scale
            scores = q_nope[r].float() @ c.T
            if kpe.shape[-1]:
                scores = scores + q_pe[r].float() @ (kpe[index, 0].float() * p_scale).T
            result[r] = torch.softmax(scores * self.sm_scale, dim=-1) @ c
        result = result.to(q_nope.dtype)
        if out is not None:
            out.copy_(result)
            return out
        return result


    def selected_slots(self, ckv: torch.Tensor) -> dict[int, list[int]]:
        """Per row, the kv_indices entries its work items attend (``ckv``: the cache's rows)."""
        schedule = fs.read_schedule(self)
        selected: dict[int, list[int]] = {}
        indptr = self._kv_indptr_buf
        for r, s, e in zip(schedule.row.tolist(), schedule.kv_start.tolist(), schedule.kv_end.tolist(), strict=True):
            base = int(indptr[r])
            selected.setdefault(r, []).extend(self.kv_indices[base + s : base + e].tolist())
        return selected


class StandIn06Wrapper(StandInWrapper):
    release = "0.6"


class ReadsPastTheLastSpan(StandInWrapper):
    """A planted fault: the last planned row also attends the kv_indices entry just past its span
    (``kv_indptr[row + 1]``), where the step wrote nothing (a kernel reading past the planned
    indices; SGLang #27338: ``sum(kv_len)`` beyond ``kv_indices.numel()``), wherever that entry
    names a written row of the cache. A fresh buffer holds slot 0 there, a row no request of the
    tests' caches writes (NaN), so a plain run on fresh buffers attends nothing more."""

    def selected_slots(self, ckv: torch.Tensor) -> dict[int, list[int]]:
        selected = super().selected_slots(ckv)
        if selected:
            last = max(selected)
            end = int(self._kv_indptr_buf[last + 1])
            past = int(self.kv_indices[end]) if end < self.kv_indices.numel() else -1
            if 0 <= past < ckv.shape[0] and bool(torch.isfinite(ckv[past].float()).all()):
                selected[last].append(past)
        return selected


class ReadsPastTheLastSpan06(ReadsPastTheLastSpan):
    release = "0.6"


class StandInQueryShapeWrapper(StandInWrapper):
    """The stand-in with FlashInfer 0.7.4's check at run: q rows and heads must be the planned
    ones (the plan's last qo_indptr entry, its num_heads), else FlashInfer's ValueError."""

    checks_query_shape = True

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, *args, **kwargs):
        super().plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, *args, **kwargs)
        self.planned_query_shape = (int(qo_indptr[-1]), int(num_heads))

    def run(self, q_nope, *args, **kwargs):
        if tuple(q_nope.shape[:2]) != self.planned_query_shape:
            raise ValueError("q_nope rows and heads must match the planned query shape.")
        return super().run(q_nope, *args, **kwargs)


class StandInCoverageWrapper(StandInWrapper):
    """The stand-in with FlashInfer 0.7.4's cache coverage as it judges it
    (``coverage_from_plan_slots``): plan() records the range of the slot ids ``kv_indices`` holds
    over the planned spans at that moment; run() refuses a cache that does not cover it, with
    FlashInfer's ValueError."""

    coverage_from_plan_slots = True

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, *args, **kwargs):
        super().plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, *args, **kwargs)
        rows = int((torch.as_tensor(qo_indptr)[1:] > torch.as_tensor(qo_indptr)[:-1]).sum())
        start, end = int(kv_indptr[0]), int(kv_indptr[rows])
        held = kv_indices[start:end]
        self.planned_page_range = (int(held.min()), int(held.max()) + 1) if end > start else (0, 0)

    def run(self, q_nope, q_pe, ckv, *args, **kwargs):
        low, needed = self.planned_page_range
        if low < 0 or ckv.shape[0] < needed:
            raise ValueError("KV cache does not cover the planned CSR page indices.")
        return super().run(q_nope, q_pe, ckv, *args, **kwargs)


def install(monkeypatch, wrapper_cls=StandInWrapper) -> None:
    """Make ``from flashinfer.mla import BatchMLAPagedAttentionWrapper`` give ``wrapper_cls``; on
    a torch without CUDA, nothing is being captured (its ``is_current_stream_capturing``
    raises there)."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    mla = types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper = wrapper_cls
    if "flashinfer" not in sys.modules:
        package = types.ModuleType("flashinfer")
        package.__path__ = []
        monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
