"""The host stages of a pipeline fixture re-run through the implementation under test, on any
machine: kv_len (its rule on the scenario rebuilt from the fixture's spec and seed), convert,
the kv_indptr of the layout and the kv_indices layout, over the fixture's stored KV slots as a
one-request cache (block size 1, identity block table: :func:`recording.rerun.identity_cache_inputs`).

:func:`recording.replay.replay` judges the plan this gives against the intent, so a replay
without a GPU judges the code under test now, not only what it planned when the fixture was
written: a fixture dumped under a planning bug fails with the bug and passes once it is fixed.
Where a GPU re-runs the fixture (:mod:`recording.rerun`) these stages run there as part of it.
"""

from __future__ import annotations

import torch

from .fixture import Fixture
from .replay import HOST_STAGES as HOST
from .replay import Rerun
from .rerun import identity_cache_inputs, is_captured, lens_from_impl


def restage_fixture(fx: Fixture, impl, impl_spec: str | None = None, device="cpu") -> Rerun | None:
    """The plan the implementation under test makes for ``fx`` now (a :class:`Rerun` without
    kernel outputs), the stage it raised at as a refusal, or None for a captured fixture
    (its plan is the program's, not this project's pipeline). The device stages (convert,
    layout) get their tensors on ``device``."""
    if is_captured(fx):
        return None
    from fast.layouts import indices_capacity

    meta, n = fx.meta, fx.num_rows
    layout, width = meta["layout"], int(meta["width"])
    max_rows = max(int(meta.get("max_rows") or n), n, 1)
    stage = "kv_len"
    try:
        lens = lens_from_impl(fx, impl)
        source = (
            "its kv_len rule on the rebuilt scenario"
            if lens is not None
            else "the recorded kv_len (scenario not rebuilt)"
        )
        lens = lens if lens is not None else fx["kv_len"].to(torch.int32)
        how = f"host stages re-run through the implementation under test: {source}, convert, layout {layout}, kv_indptr"
        stage = "convert"
        topk, table, req = identity_cache_inputs(fx, max_rows, device)
        slots = impl.convert(topk, table, req, 1)
        stage = "kv_indptr"
        indptr = impl.kv_indptr(layout, lens, max_rows, width).to(torch.int32).cpu()
        stage = "layout"
        lens_all = torch.zeros(max_rows, dtype=torch.int32)
        lens_all[:n] = lens[:n]
        indices = torch.full((indices_capacity(max_rows, width),), -1, dtype=torch.int32, device=device)
        impl.write_kv_indices(layout, slots, lens_all.to(device), indptr[: max_rows + 1].to(device), indices)
        indices = indices.cpu()
    except Exception as exc:  # the code under test raising is an outcome
        return Rerun(HOST, f"host stages re-run through the implementation under test (raised at {stage})",
                     refused=f"{type(exc).__name__} at {stage}: {exc}"[:400], impl=impl_spec)
    kv_len = lens[:n].to(torch.int32).cpu()
    indptr = indptr[: n + 1]
    end = int((indptr[:-1].to(torch.int64) + kv_len).max()) if n else 0
    stored = fx["ckv"].shape[0]
    indices = indices[:end]
    indices = torch.where((indices >= -1) & (indices < stored), indices, torch.full_like(indices, -1))
    plan = {"kv_indptr": indptr, "kv_indices": indices, "kv_len": kv_len}
    return Rerun(HOST, how, plan=plan, impl=impl_spec)
