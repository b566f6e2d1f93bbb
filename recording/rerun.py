"""Re-running a fixture's plan and run on the installed FlashInfer (SM90 GPU): the thin GPU glue
behind ``--replay``; :mod:`recording.replay` judges what comes back.

- A fixture from the project's pipeline (``--dump-failures``, ``scripts.record_fixtures``) runs
  through the implementation under test: its attention state plans and runs with the
  fixture's stored KV slots as a one-request cache (block size 1, the identity block table),
  so convert, the kv_indices layout and the plan are the implementation's own. The lens are
  the implementation's kv_len rule on the scenario rebuilt from the fixture's spec and seed
  where that rebuilds the same indexer rows, else the recorded ones (the report says which).
- A fixture from :func:`recording.capture.capture_mla` runs exactly as recorded: the captured
  CSR arrays and plan arguments handed to FlashInfer's wrapper, the recorded kv_indices.

An exception FlashInfer raises at plan or run comes back as the re-run's refusal.
"""

from __future__ import annotations

import functools
import json

import torch

from backends.flashinfer.port import lay_out_rows, make_attention_state
from backends.seam import LaidOut
from reference.rules import convert_rule

from .environment import flashinfer_version
from .fixture import Fixture
from .replay import Rerun


def is_captured(fx: Fixture) -> bool:
    return fx.meta.get("source") == "capture" or fx.meta.get("layout") == "captured"


def rerun_fixture(fx: Fixture, impl, impl_spec: str | None, device="cuda") -> Rerun:
    """Plan and run ``fx`` on the installed FlashInfer (see the module docstring)."""
    if is_captured(fx):
        return _rerun_captured(fx, device)
    return _rerun_pipeline(fx, impl, impl_spec, device)


def identity_cache_inputs(fx: Fixture, max_rows: int, device):
    """The fixture's rows as indexer rows over a one-request cache of its stored slots: block
    size 1 and block table ``[0, 1, .., M-1]`` make every local slot id its own token index."""
    n, width = fx.num_rows, int(fx.meta["width"])
    slots = max(fx["ckv"].shape[0], 1)
    topk = torch.full((max_rows, width), -1, dtype=torch.int32)
    topk[:n] = fx["intended"].to(torch.int32)
    table = torch.arange(slots, dtype=torch.int32).view(1, slots)
    req = torch.zeros(max_rows, dtype=torch.int32)
    return topk.to(device), table.to(device), req.to(device)


def kv_views(fx: Fixture, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``[M, 1, D]`` device views of the stored slots (one zero slot where none is stored)."""
    ckv, kpe = fx["ckv"], fx["kpe"]
    if ckv.shape[0] == 0:
        ckv, kpe = torch.zeros((1, ckv.shape[1]), dtype=ckv.dtype), torch.zeros((1, kpe.shape[1]), dtype=kpe.dtype)
    return ckv.unsqueeze(1).to(device), kpe.unsqueeze(1).to(device)


def lens_from_impl(fx: Fixture, impl) -> torch.Tensor | None:
    """The implementation's planned lens of the fixture's rows on the scenario rebuilt from its
    spec and seed, or None where the fixture has none or the rebuilt rows are not the stored
    ones. Only the fixture's rows are converted and compared (a shrunk fixture keeps a few
    rows of a batch that may hold thousands)."""
    spec, seed = fx.meta.get("spec"), fx.meta.get("seed")
    if not isinstance(spec, dict) or not isinstance(seed, int):
        return None
    try:
        rebuilt = _rebuilt_rows_and_lens(json.dumps(spec, sort_keys=True), seed, impl)
    except (TypeError, ValueError, KeyError):
        return None
    topk, table, req, block_size, lens = rebuilt
    rows = source_rows(fx)
    if "rows" not in fx.meta and lens.numel() != fx.num_rows:
        return None  # the implementation plans another number of rows: the recorded lens are judged
    if rows.numel() and int(rows.max()) >= min(topk.shape[0], lens.numel()):
        return None
    intended = convert_rule(topk[rows], table, req[rows], block_size).to(torch.int64)
    local = fx["intended"].to(torch.int64)
    stored = torch.where(local >= 0, fx["slot_ids"][local.clamp(min=0)] if fx["slot_ids"].numel() else local, -1)
    if intended.shape != stored.shape or not torch.equal(intended, stored):
        return None
    return lens[rows]


@functools.lru_cache(maxsize=4)
def _rebuilt_rows_and_lens(spec_json: str, seed: int, impl):
    """The rebuilt scenario's indexer rows, block table, request ids and block size, and the
    implementation's planned lens (kept for the few scenarios a shrink or a replay asks about
    again and again; the KV cache is never built)."""
    from harness.scenario import build_scenario, spec_from_dict

    scenario = build_scenario(spec_from_dict(json.loads(spec_json)), seed)
    s, meta = scenario.spec, scenario.meta
    lens = impl.planned_lens(meta, impl.kv_lens(meta, topk=s.topk, kpool=s.kpool, async_scheduling=s.async_scheduling),
                             topk=s.topk).to(torch.int32).cpu()
    return scenario.topk_indices, scenario.block_table, scenario.request_ids(), s.block_size, lens


def rows_reading_outside_the_cache(laid: LaidOut, lens: torch.Tensor, num_slots: int) -> list[int]:
    """The planned rows (``lens``) whose span of the laid-out kv_indices holds an entry outside
    ``[0, num_slots)`` or runs past the buffer: a kernel launched on that plan reads outside the KV
    cache (on a GPU, an illegal address that poisons the process's CUDA context), so nothing is
    launched for it."""
    indptr, indices = laid.kv_indptr.tolist(), laid.kv_indices.cpu()
    outside = []
    for row, length in enumerate(lens.tolist()):
        span = indices[indptr[row] : indptr[row] + length]
        if span.numel() < length or bool(((span < 0) | (span >= num_slots)).any()):
            outside.append(row)
    return outside


def source_rows(fx: Fixture) -> torch.Tensor:
    """The fixture's rows as rows of the scenario its spec and seed build (a shrunk fixture
    keeps some of them: ``rows`` in its metadata)."""
    rows = fx.meta.get("rows")
    return torch.tensor(rows, dtype=torch.int64) if rows is not None else torch.arange(fx.num_rows)


def _refusal(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"[:400]


def _rerun_pipeline(fx: Fixture, impl, impl_spec: str | None, device) -> Rerun:
    from backends.flashinfer.port import AttentionConfig

    version = flashinfer_version() or "unknown"
    meta, n = fx.meta, fx.num_rows
    max_rows = max(int(meta.get("max_rows") or n), n, 1)
    lens = lens_from_impl(fx, impl)
    source = "the implementation's kv_len rule" if lens is not None else "recorded (scenario not rebuilt)"
    lens = lens if lens is not None else fx["kv_len"].to(torch.int32)
    how = f"re-run through the implementation under test: layout {meta['layout']}, lens {source}"
    config = AttentionConfig(
        num_heads=int(meta["num_heads"]), max_rows=max_rows, width=int(meta["width"]), layout=meta["layout"],
        block_size=1, sm_scale=float(meta["sm_scale"]), rope_dim=int(meta["head_dim_kpe"]), kv_dtype=fx["ckv"].dtype,
        k_scale=float(meta["k_scale"]),
    )
    state = make_attention_state(impl, config, device)
    topk, table, req = identity_cache_inputs(fx, max_rows, device)
    slots = max(fx["ckv"].shape[0], 1)
    laid = lay_out_rows(impl, meta["layout"], topk, table, req, lens.to(torch.int32), block_size=1,
                        max_rows=max_rows, width=int(meta["width"]), device=device)
    outside = rows_reading_outside_the_cache(laid, lens, slots)
    if outside:
        plan = plan_as_local_ids(laid.kv_indptr.to(torch.int32), lens, laid.kv_indices, slots)
        return Rerun(version, how + " (not launched)", plan=plan, impl=impl_spec, withheld=(
            f"planned rows {outside[:8]} would hand the kernel kv_indices entries outside the "
            f"cache's {slots} slots (-1 or past its end): it would read outside its KV cache"))
    ckv, kpe = kv_views(fx, device)
    out, lse = _nan_buffers(max_rows, fx, device)
    try:
        state.plan(n, lens)
    except Exception as exc:
        return Rerun(version, how + " (refused at plan)", refused=_refusal(exc), impl=impl_spec)
    try:
        state.step(topk, table, req, fx["q_nope"].to(device), fx["q_pe"].to(device), ckv, kpe, out, lse)
        _sync(device)
    except Exception as exc:
        return Rerun(version, how + " (refused at run)", refused=_refusal(exc), impl=impl_spec)
    plan = plan_as_local_ids(state.planned_kv_indptr, state.planned_kv_len[:n], state.kv_indices, fx["ckv"].shape[0])
    return Rerun(version, how, out[:n].cpu(), lse[:n].cpu(), plan=plan, impl=impl_spec)


def plan_as_local_ids(kv_indptr: torch.Tensor, kv_len: torch.Tensor, kv_indices: torch.Tensor,
                      stored: int) -> dict[str, torch.Tensor]:
    """A re-run's plan as the replay judges it (host int32, the planned spans of kv_indices): an
    entry that names no stored slot is -1."""
    n = kv_len.numel()
    indptr = kv_indptr[: n + 1].clone().to(torch.int32).cpu()
    kv_len = kv_len.clone().to(torch.int32).cpu()
    end = int((indptr[:-1].to(torch.int64) + kv_len).max()) if n else 0
    indices = kv_indices[:end].cpu().to(torch.int32)
    indices = torch.where((indices >= -1) & (indices < stored), indices, torch.full_like(indices, -1))
    return {"kv_indptr": indptr, "kv_indices": indices, "kv_len": kv_len}


def _rerun_captured(fx: Fixture, device) -> Rerun:
    from backends.flashinfer.port import open_wrapper

    version = flashinfer_version() or "unknown"
    how = "re-run exactly as captured: the recorded CSR arrays, plan arguments and kv_indices"
    cap = fx.meta.get("capture")
    if not isinstance(cap, dict) or "capture/qo_indptr" not in fx.tensors:
        return Rerun(
            version,
            how,
            refused="not re-run: the fixture was captured without its CSR arrays (recorded outputs judged only)",
        )
    qo, kv_indptr, kv_len = (fx[f"capture/{k}"].to(torch.int32) for k in ("qo_indptr", "kv_indptr", "kv_len_arr"))
    indices = _captured_indices(fx, int(cap.get("kv_indices_len", 0)))
    rows = fx.num_rows
    dev = torch.device(device)
    buffers = dict(qo_indptr=torch.zeros_like(qo, device=dev), kv_indptr=torch.zeros_like(kv_indptr, device=dev),
                   kv_indices=indices.to(dev), kv_len_arr=torch.zeros_like(kv_len, device=dev))
    wrapper = open_wrapper(dev, **buffers)
    kv_dtype = getattr(torch, str(cap.get("kv_data_type") or fx.meta.get("kv_dtype", "bfloat16")).replace("torch.", ""))
    q_dtype = getattr(torch, str(cap.get("q_data_type") or "bfloat16").replace("torch.", ""))
    try:
        wrapper.plan(
            qo_indptr=qo,
            kv_indptr=kv_indptr,
            kv_indices=buffers["kv_indices"],
            kv_len_arr=kv_len,
            num_heads=int(cap["num_heads"]),
            head_dim_ckv=int(cap["head_dim_ckv"]),
            head_dim_kpe=int(cap["head_dim_kpe"]),
            sm_scale=float(cap["sm_scale"]),
            kv_dtype=kv_dtype,
            q_dtype=q_dtype,
        )
    except Exception as exc:
        return Rerun(version, how + " (refused at plan)", refused=_refusal(exc))
    ckv, kpe = kv_views(fx, dev)
    out, lse = _nan_buffers(rows, fx, dev)
    try:
        wrapper.run(
            fx["q_nope"].to(dev), fx["q_pe"].to(dev), ckv, kpe, out=out, lse=lse, k_scale=float(fx.meta["k_scale"])
        )
        _sync(dev)
    except Exception as exc:
        return Rerun(version, how + " (refused at run)", refused=_refusal(exc))
    return Rerun(version, how, out[:rows].cpu(), lse[:rows].cpu())


def _captured_indices(fx: Fixture, length: int) -> torch.Tensor:
    """The recorded kv_indices (local ids) padded with slot 0 to the recorded buffer length;
    entries outside every planned span, never read, are slot 0 too."""
    indices = fx["kv_indices"].to(torch.int32)
    indptr, lens = fx["kv_indptr"].to(torch.int64), fx["kv_len"].to(torch.int64)
    entry = torch.arange(indices.numel())
    in_span = (
        (entry.unsqueeze(0) >= indptr[:-1].unsqueeze(1)) & (entry.unsqueeze(0) < (indptr[:-1] + lens).unsqueeze(1))
    ).any(dim=0)
    indices = torch.where(in_span, indices, torch.zeros_like(indices))
    if indices.numel() < max(length, 1):
        indices = torch.cat([indices, torch.zeros(max(length, 1) - indices.numel(), dtype=torch.int32)])
    return indices


def _nan_buffers(rows: int, fx: Fixture, device):
    heads, d = int(fx.meta["num_heads"]), int(fx.meta["head_dim_ckv"])
    out = torch.full((max(rows, 1), heads, d), float("nan"), dtype=torch.bfloat16, device=device)
    lse = torch.full((max(rows, 1), heads), float("nan"), dtype=torch.float32, device=device)
    return out, lse


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
