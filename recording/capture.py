"""Record what a running program hands FlashInfer's MLA wrapper, as replayable fixtures.

    with capture_mla("captured/", every=10, max_cases=8, max_bytes=32 << 20):
        serve()   # any program that plans and runs BatchMLAPagedAttentionWrapper

Inside the context each ``plan`` is remembered per wrapper and each following ``run`` (every
``every``-th, at most ``max_cases`` files and ``max_bytes`` in all) is written as a fixture
with the kernel's own output. The program's calls go to FlashInfer unchanged, first, and the
recorder only reads their arguments and results; runs during CUDA-graph capture are never
recorded (their outputs do not exist yet). Only the page-size-1, non-causal plans of the
sparse path are recorded; others are counted in ``skipped``.
"""

from __future__ import annotations

import inspect
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .environment import runtime_environment
from .fixture import build_fixture, save_fixture

PLAN_FLAT = ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr", "num_heads", "head_dim_ckv", "head_dim_kpe",
             "page_size", "causal", "sm_scale", "q_data_type", "kv_data_type")
RUN_FLAT = ("q_nope", "q_pe", "ckv_cache", "kpe_cache", "out", "lse", "return_lse")


@dataclass
class CaptureLog:
    directory: Path
    every: int
    max_cases: int
    max_bytes: int
    runs_seen: int = 0
    written: list[Path] = field(default_factory=list)
    bytes_written: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, why: str) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + 1


def bind_arguments(func, self_obj, args, kwargs, flat_names) -> dict:
    """Name the arguments of a call, by the function's signature or else the flat order."""
    try:
        bound = inspect.signature(func).bind(self_obj, *args, **kwargs)
        named = dict(bound.arguments)
        named.pop("self", None)
        named.update(named.pop("kwargs", {}) or {})
        return named
    except (TypeError, ValueError):
        named = dict(zip(flat_names, args, strict=False))
        named.update(kwargs)
        return named


def plan_record(named: dict) -> dict:
    """Host copies of what a plan call describes (flat or ``metadata=`` form)."""
    meta = named.get("metadata")

    def get(k):
        if meta is not None and getattr(meta, k, None) is not None:
            return getattr(meta, k)
        return named.get(k)

    tensors = {k: get(k) for k in ("qo_indptr", "kv_indptr", "kv_len_arr")}
    record = {k: (v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v) for k, v in tensors.items()}
    # Production writes kv_indices after plan (the convert kernel fills the reserved buffer
    # inside the step), so the buffer itself is kept and read when the run is recorded.
    record["kv_indices"] = get("kv_indices")
    for key in ("num_heads", "head_dim_ckv", "head_dim_kpe", "page_size", "causal", "sm_scale", "q_data_type",
                "kv_data_type", "lse_mode"):
        record[key] = named.get(key)
    return record


def run_tensors(named: dict, result):
    """``(q_nope, q_pe, ckv, kpe, out, lse, lse_base_e, ckv_scale)`` of a run call."""
    q_nope, q_pe = named.get("query") or (named.get("q_nope"), named.get("q_pe"))
    ckv, kpe = named.get("kv_cache") or (named.get("ckv_cache"), named.get("kpe_cache"))
    if isinstance(result, tuple):
        out, lse = result[0], result[1]
    else:
        out, lse = result, named.get("lse") if named.get("return_lse") else None
    scale = named.get("ckv_scale")
    return (
        q_nope,
        q_pe,
        ckv,
        kpe,
        out,
        lse,
        bool(named.get("return_lse_base_on_e")),
        1.0 if scale is None else float(scale),
    )


def per_row_plan(plan: dict, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row's kv start and length (a request's rows share its KV span)."""
    qo = plan["qo_indptr"].to(torch.int64)
    kv_indptr = plan["kv_indptr"].to(torch.int64)
    kv_len = plan["kv_len_arr"].to(torch.int64)
    q_counts = (qo[1:] - qo[:-1]).clamp(min=0)
    req = torch.repeat_interleave(torch.arange(q_counts.numel()), q_counts)[:rows]
    starts = kv_indptr[req]
    return torch.cat([starts, (starts[-1:] + kv_len[req][-1:]) if rows else torch.zeros(1, dtype=torch.int64)]), kv_len[
        req
    ]


def record_pair(log: CaptureLog, plan: dict, named_run: dict, result) -> Path | None:
    """Write one plan/run pair as a fixture; None when it is not recordable or over the caps."""
    if plan.get("page_size") not in (1, None) or plan.get("causal"):
        log.skip("page_size != 1 or causal plan")
        return None
    q_nope, q_pe, ckv, kpe, out, lse, lse_base_e, k_scale = run_tensors(named_run, result)
    if any(t is None for t in (q_nope, q_pe, ckv, kpe, out)):
        log.skip("run without recognisable tensors")
        return None
    rows = int(plan["qo_indptr"][-1]) if plan["qo_indptr"] is not None else q_nope.shape[0]
    rows = min(rows, q_nope.shape[0])
    kv_indptr, kv_len = per_row_plan(plan, rows)
    if lse is None:
        lse_nat = torch.full(out.shape[:2], float("nan"))
    else:
        base_e = lse_base_e or plan.get("lse_mode") == "basee"
        lse_nat = lse.detach().float().cpu() * (1.0 if base_e else math.log(2.0))
    kv_dtype = plan.get("kv_data_type") or ckv.dtype
    fixture = build_fixture(
        meta=dict(
            name=f"capture-{len(log.written):04d}",
            source="capture",
            layout="captured",
            sm_scale=float(plan["sm_scale"]),
            k_scale=k_scale,
            kv_dtype=str(kv_dtype).replace("torch.", ""),
            lse_recorded=lse is not None,
            environment=runtime_environment(),
            run_index=log.runs_seen,
        ),
        q_nope=q_nope[:rows].detach().cpu(),
        q_pe=q_pe[:rows].detach().cpu(),
        ckv=ckv.detach(),
        kpe=kpe.detach(),
        kv_indptr=kv_indptr,
        kv_indices=plan["kv_indices"],
        kv_len=kv_len,
        outputs={str(runtime_environment()["flashinfer"]): (out[:rows].detach().cpu(), lse_nat[:rows])},
    )
    add_captured_plan(fixture, plan)
    size = sum(t.numel() * t.element_size() for t in fixture.tensors.values())
    if log.bytes_written + size > log.max_bytes:
        log.skip("byte cap reached")
        return None
    path = save_fixture(log.directory / f"{fixture.meta['name']}.safetensors", fixture)
    log.written.append(path)
    log.bytes_written += path.stat().st_size
    return path


def add_captured_plan(fixture, plan: dict) -> None:
    """Keep the plan exactly as handed to FlashInfer, for a re-run as recorded: the CSR arrays
    (``capture/qo_indptr``, ``capture/kv_indptr``, ``capture/kv_len_arr``, positions into the
    fixture's kv_indices) and the plan arguments (metadata ``capture``)."""
    for key in ("qo_indptr", "kv_indptr", "kv_len_arr"):
        fixture.tensors[f"capture/{key}"] = plan[key].to(torch.int32).cpu()
    args = {
        k: plan.get(k)
        for k in ("num_heads", "head_dim_ckv", "head_dim_kpe", "page_size", "causal", "sm_scale", "lse_mode")
    }
    for key in ("q_data_type", "kv_data_type"):
        args[key] = None if plan.get(key) is None else str(plan[key]).replace("torch.", "")
    indices = plan.get("kv_indices")
    args["kv_indices_len"] = int(indices.numel()) if isinstance(indices, torch.Tensor) else None
    fixture.meta["capture"] = args


@contextmanager
def capture_mla(directory, *, every: int = 1, max_cases: int = 16, max_bytes: int = 64 << 20, wrapper_cls=None):
    """Record plan/run pairs of ``wrapper_cls`` (default: FlashInfer's
    ``BatchMLAPagedAttentionWrapper``) made inside the block; yields the :class:`CaptureLog`."""
    if wrapper_cls is None:
        from backends.registry import flashinfer_wrapper_class

        wrapper_cls = flashinfer_wrapper_class()
    if every < 1 or max_cases < 0 or max_bytes < 0:
        raise ValueError("every >= 1, max_cases >= 0 and max_bytes >= 0 are required")
    log = CaptureLog(Path(directory), every, max_cases, max_bytes)
    original_plan, original_run = wrapper_cls.plan, wrapper_cls.run
    plans: dict[int, dict] = {}

    def plan(self, *args, **kwargs):
        result = original_plan(self, *args, **kwargs)
        try:
            plans[id(self)] = plan_record(bind_arguments(original_plan, self, args, kwargs, PLAN_FLAT))
        except Exception as exc:  # the recorder must never break the program
            log.skip(f"plan not understood: {type(exc).__name__}")
        return result

    def run(self, *args, **kwargs):
        result = original_run(self, *args, **kwargs)
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return result
        log.runs_seen += 1
        if (log.runs_seen - 1) % log.every or len(log.written) >= log.max_cases or id(self) not in plans:
            return result
        try:
            record_pair(log, plans[id(self)], bind_arguments(original_run, self, args, kwargs, RUN_FLAT), result)
        except Exception as exc:
            log.skip(f"run not recorded: {type(exc).__name__}: {exc}")
        return result

    wrapper_cls.plan, wrapper_cls.run = plan, run
    try:
        yield log
    finally:
        wrapper_cls.plan, wrapper_cls.run = original_plan, original_run
