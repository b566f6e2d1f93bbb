"""Tensors a fixture file does not store: rebuilt at load, bit for bit, from what it does store.

A fixture's metadata field ``derived`` maps a tensor's name to where it comes from:

- ``scenario:q``: ``q_nope`` and ``q_pe`` as the scenario builder draws q for the fixture's
  ``spec`` and ``seed`` (:func:`harness.scenario.build_attention_inputs`), at the fixture's rows
  (``rows``, else the first ``num_rows``) and heads (``heads``, else all);
- ``scenario:kv``: ``ckv`` and ``kpe`` as the scenario builder fills the poisoned KV cache
  (values keyed by seed and slot, NaN in every slot no row should read), at ``slot_ids``;
- ``scenario:kv-sequential``: ``ckv`` and ``kpe`` from one NumPy standard-normal stream keyed
  by ``(seed, "kv")`` (:func:`harness.scenario.component_seed`) over the slot of every token of
  the scenario, request by request and token by token, NaN in every other slot: the values the
  checked-in fixtures were recorded with;
- ``tensor:NAME``: bitwise the tensor ``NAME`` the file stores (a recorded output that another
  FlashInfer release returned bit for bit).

Every derived tensor keeps its entry in the content digest, and the tensor rebuilt at load is
checked against it: a scenario builder that no longer rebuilds it is a
:class:`~recording.fixture.FixtureError` naming the file and the tensor, never a verdict.
"""

from __future__ import annotations

import torch

from mla_constants import KV_LORA_RANK

Q_TENSORS = ("q_nope", "q_pe")
KV_TENSORS = ("ckv", "kpe")
#: Each scenario source with the tensors it rebuilds.
SCENARIO_SOURCES = {"scenario:q": Q_TENSORS, "scenario:kv": KV_TENSORS, "scenario:kv-sequential": KV_TENSORS}
TENSOR_SOURCE = "tensor:"
#: Rows of normals drawn at a time for ``scenario:kv-sequential`` (about 2 MB of float32 each).
_DRAW_ROWS = 1024
#: ``scenario:kv-sequential`` caches rebuilt in this process, by scenario and slots: a long
#: context's stream takes a second or more to draw, and a run loads a fixture more than once.
_SEQUENTIAL_KV: dict[tuple, torch.Tensor] = {}
_SEQUENTIAL_KV_KEPT = 4


def source_problem(name: str, source, stored: set[str], derived: dict) -> str | None:
    """What is wrong with deriving tensor ``name`` from ``source`` (None: nothing)."""
    if not isinstance(source, str):
        return f"maps '{name}' to {type(source).__name__} {source!r:.40}, expected a string"
    if name in stored:
        return f"maps '{name}' to {source!r}, but the file stores '{name}' too"
    if source.startswith(TENSOR_SOURCE):
        target = source[len(TENSOR_SOURCE):]
        if target not in stored:
            return f"maps '{name}' to {source!r}, but the file stores no tensor '{target}'"
        return None
    if source not in SCENARIO_SOURCES:
        known = ", ".join([*SCENARIO_SOURCES, TENSOR_SOURCE + "NAME"])
        return f"maps '{name}' to {source!r}, expected one of {known}"
    if name not in SCENARIO_SOURCES[source]:
        return f"maps '{name}' to {source!r}, which rebuilds only {', '.join(SCENARIO_SOURCES[source])}"
    return None


def derived_problem(meta: dict, stored: set[str]) -> str | None:
    """What is wrong with the metadata field ``derived`` (None: nothing, or no such field)."""
    derived = meta.get("derived")
    if derived is None:
        return None
    if not isinstance(derived, dict):
        return f"metadata field 'derived' is {type(derived).__name__}, expected an object"
    for name, source in derived.items():
        problem = source_problem(name, source, stored, derived)
        if problem:
            return f"metadata field 'derived' {problem}"
    if any(s.startswith("scenario:") for s in derived.values()):
        missing = [k for k in ("spec", "seed") if k not in meta]
        if missing:
            return f"metadata field 'derived' rebuilds tensors from the scenario, but the metadata lacks {missing}"
    return None


def _rows_and_heads(meta: dict) -> tuple[torch.Tensor, torch.Tensor]:
    rows = meta.get("rows")
    heads = meta.get("heads")
    r = torch.tensor(rows if rows is not None else range(int(meta["num_rows"])), dtype=torch.int64)
    h = torch.tensor(heads if heads is not None else range(int(meta["num_heads"])), dtype=torch.int64)
    return r, h


def sequential_kv(scenario, slot_ids: torch.Tensor) -> torch.Tensor:
    """``[len(slot_ids), head_dim]`` of the ``scenario:kv-sequential`` cache at ``slot_ids``."""
    import dataclasses
    import hashlib
    import json

    ids = slot_ids.to(torch.int64).contiguous()
    key = (json.dumps(dataclasses.asdict(scenario.spec), sort_keys=True), scenario.seed,
           hashlib.sha256(ids.numpy().tobytes()).hexdigest())
    if key not in _SEQUENTIAL_KV:
        if len(_SEQUENTIAL_KV) >= _SEQUENTIAL_KV_KEPT:
            _SEQUENTIAL_KV.pop(next(iter(_SEQUENTIAL_KV)))
        _SEQUENTIAL_KV[key] = _draw_sequential_kv(scenario, slot_ids)
    return _SEQUENTIAL_KV[key].clone()


def _draw_sequential_kv(scenario, slot_ids: torch.Tensor) -> torch.Tensor:
    import numpy as np

    from harness.scenario import component_seed, nan_kv_buffer

    spec = scenario.spec
    bs = spec.block_size
    parts = [
        (blocks.to(torch.int64).unsqueeze(1) * bs + torch.arange(bs)).reshape(-1)[: r.seq_len]
        for blocks, r in zip(scenario.allocations, spec.requests, strict=True)
    ]
    tokens = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    position = torch.full((scenario.num_slots,), -1, dtype=torch.int64)
    position[tokens] = torch.arange(tokens.numel())
    where = position[slot_ids.to(torch.int64)].numpy()
    held = np.flatnonzero(where >= 0)  # the slots of tokens, in the order of the stream
    held = held[np.argsort(where[held], kind="stable")]
    picked = np.empty((held.size, spec.head_dim), dtype=np.float32)
    rng = np.random.default_rng(component_seed(scenario.seed, "kv"))
    end = int(where[held[-1]]) + 1 if held.size else 0
    first = 0
    for start in range(0, end, _DRAW_ROWS):
        count = min(_DRAW_ROWS, end - start)
        values = rng.standard_normal(size=(count, spec.head_dim), dtype=np.float32)
        last = first + int(np.searchsorted(where[held[first:]], start + count))
        picked[first:last] = values[where[held[first:last]] - start]
        first = last
    cache = nan_kv_buffer((slot_ids.numel(), spec.head_dim), spec.kv_dtype, "cpu")
    cache[torch.from_numpy(held)] = torch.from_numpy(picked).to(spec.torch_kv_dtype)
    return cache


def rebuild_derived(meta: dict, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor the metadata field ``derived`` names, rebuilt (``stored``: the file's
    tensors). Raises ``ValueError`` or ``KeyError`` where the scenario cannot be built."""
    derived = meta.get("derived") or {}
    sources = set(derived.values())
    result: dict[str, torch.Tensor] = {}
    if sources & set(SCENARIO_SOURCES):
        from harness.scenario import build_attention_inputs, build_scenario, spec_from_dict

        scenario = build_scenario(spec_from_dict(meta["spec"]), int(meta["seed"]))
        slot_ids = stored["slot_ids"].to(torch.int64)
        if slot_ids.numel() and (int(slot_ids.min()) < 0 or int(slot_ids.max()) >= scenario.num_slots):
            raise ValueError(f"tensor 'slot_ids' holds slots outside the scenario's {scenario.num_slots}")
        d_ckv = int(meta["head_dim_ckv"])
        if "scenario:q" in sources or "scenario:kv" in sources:
            inputs = build_attention_inputs(scenario)
            q = torch.cat([inputs.q_nope, inputs.q_pe], dim=-1)
            rows, heads = _rows_and_heads(meta)
            q = q[rows][:, heads]
            built = {"q_nope": q[..., :d_ckv], "q_pe": q[..., d_ckv:]}
            flat = inputs.kv_cache.view(-1, inputs.kv_cache.shape[-1])[slot_ids]
            built |= {"ckv": flat[:, :KV_LORA_RANK], "kpe": flat[:, KV_LORA_RANK:]}
            for name, source in derived.items():
                if source in ("scenario:q", "scenario:kv"):
                    result[name] = built[name].contiguous()
        if "scenario:kv-sequential" in sources:
            flat = sequential_kv(scenario, slot_ids)
            built = {"ckv": flat[:, :KV_LORA_RANK], "kpe": flat[:, KV_LORA_RANK:]}
            for name, source in derived.items():
                if source == "scenario:kv-sequential":
                    result[name] = built[name].contiguous()
    for name, source in derived.items():
        if source.startswith(TENSOR_SOURCE):
            result[name] = stored[source[len(TENSOR_SOURCE):]].clone()
    return result


def derivable(meta: dict, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Which of ``tensors`` the fixture need not store: the inputs its scenario rebuilds bit for
    bit, and each output bitwise equal to one stored before it (in name order)."""
    from harness.bits import bitwise_equal

    derived: dict[str, str] = {}
    if isinstance(meta.get("spec"), dict) and isinstance(meta.get("seed"), int) and "slot_ids" in tensors:
        for source, names in SCENARIO_SOURCES.items():
            if any(n in derived for n in names):
                continue
            try:
                built = rebuild_derived({**meta, "derived": dict.fromkeys(names, source)}, tensors)
            except (ValueError, KeyError, TypeError, IndexError, RuntimeError):
                continue
            if all(bitwise_equal(built[n], tensors[n]) for n in names):
                derived.update(dict.fromkeys(names, source))
    kept: list[str] = []
    for name in sorted(n for n in tensors if n.startswith(("out/", "lse/"))):
        twin = next((k for k in kept if k.split("/")[0] == name.split("/")[0]
                     and bitwise_equal(tensors[k], tensors[name])), None)
        if twin is None:
            kept.append(name)
        else:
            derived[name] = TENSOR_SOURCE + twin
    return derived
