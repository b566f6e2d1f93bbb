"""The implementation-under-test seam.

The suite talks to the production path only through an object with the methods of
:class:`SparseMLAImpl`. ``pytest --impl module:factory`` swaps the project's own
:class:`FastImpl` for any other object with those methods (for example a thin adapter
around an inference engine's own functions); ``factory()`` is called once per session.
Every method has the semantics of the production path it names:

- ``kv_lens(meta, topk=, kpool=, async_scheduling=)``: host int32 length of every query row;
- ``planned_lens(meta, lens, topk=)``: the lens actually planned (the decode prefix when
  prefills are routed to dense MHA);
- ``request_ids(query_start_loc, num_rows)``: each row's request id, padding -> 0;
- ``convert(topk_indices, block_table, req_id, block_size, out=, with_counts=)``: the
  convert kernel;
- ``kv_indptr(layout, lens, max_rows, width)`` and
  ``write_kv_indices(layout, slots, lens, indptr, out)``: the kv_indices layouts;
- optionally ``make_attention_state(config, device)``: an attention state of the impl's own,
  with the methods of :class:`AttentionState` (plan on the host, then convert -> layout ->
  run on the device, capturable in a CUDA graph), in place of the port's
  (``backends.flashinfer.port.make_attention_state``, FlashInfer's wrapper driven by these host stages).

``fast/`` is host stages only: it imports no vendor package.
"""

from __future__ import annotations

import importlib
from typing import Protocol, runtime_checkable

import torch

from mla_constants import DEFAULT_IMPL_SPEC  # noqa: F401  (re-exported: --impl's default)

from . import convert as _convert
from . import kvlen as _kvlen
from . import layouts as _layouts


@runtime_checkable
class SparseMLAImpl(Protocol):
    name: str

    def kv_lens(self, meta, *, topk: int, kpool: int, async_scheduling: bool) -> torch.Tensor: ...

    def planned_lens(self, meta, lens: torch.Tensor, *, topk: int) -> torch.Tensor: ...

    def request_ids(self, query_start_loc: torch.Tensor, num_rows: int) -> torch.Tensor: ...

    def convert(self, topk_indices, block_table, req_id, block_size, *, out=None, with_counts=False): ...

    def kv_indptr(self, layout: str, lens: torch.Tensor, max_rows: int, width: int) -> torch.Tensor: ...

    def write_kv_indices(self, layout: str, slots, lens, indptr, out) -> None: ...


@runtime_checkable
class AttentionState(Protocol):
    """What the GPU tier drives: ``num_rows`` planned rows, the reserved device buffers
    (``kv_indices``, ``kv_indptr``, ``kv_len``), the host staging of the last plan
    (``planned_kv_indptr``, ``planned_kv_len``), and ``features`` (a
    :class:`backends.flashinfer.compat.Features`)."""

    num_rows: int

    def plan(self, num_rows: int, lens: torch.Tensor) -> None: ...

    def write_indices(self, topk_indices, block_table, req_id) -> None: ...

    def attend(self, q_nope, q_pe, ckv, kpe, out, lse) -> None: ...

    def step(self, topk_indices, block_table, req_id, q_nope, q_pe, ckv, kpe, out, lse) -> None: ...


class FastImpl:
    """The project's host stages of the production path (``fast/``)."""

    name = "fast"

    def kv_lens(self, meta, *, topk, kpool, async_scheduling):
        return _kvlen.kv_lens_host(meta, topk, kpool, async_scheduling)

    def planned_lens(self, meta, lens, *, topk):
        return _kvlen.planned_lens(meta, lens, topk)

    def request_ids(self, query_start_loc, num_rows):
        return _convert.request_ids(query_start_loc, num_rows)

    def convert(self, topk_indices, block_table, req_id, block_size, *, out=None, with_counts=False):
        return _convert.convert_topk_to_slots(
            topk_indices, block_table, req_id, block_size, out=out, with_counts=with_counts
        )

    def kv_indptr(self, layout, lens, max_rows, width):
        return _layouts.kv_indptr_host(layout, lens, max_rows, width)

    def write_kv_indices(self, layout, slots, lens, indptr, out):
        _layouts.write_kv_indices(layout, slots, lens, indptr, out)


def default_impl() -> FastImpl:
    return FastImpl()


def load_impl(spec: str) -> SparseMLAImpl:
    """Load ``module:factory`` and call the factory; check the result has the protocol."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--impl expects 'module:factory', got {spec!r}")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--impl {spec!r}: cannot load the factory: {exc}") from exc
    try:
        impl = factory()
    except Exception as exc:  # whatever the user's factory raises is named
        raise ValueError(f"--impl {spec!r}: the factory raised {type(exc).__name__}: {exc}") from exc
    missing = [
        m
        for m in ("kv_lens", "planned_lens", "request_ids", "convert", "kv_indptr", "write_kv_indices")
        if not callable(getattr(impl, m, None))
    ]
    if missing:
        raise ValueError(f"--impl {spec!r}: the object lacks {missing} (see fast.impl.SparseMLAImpl)")
    return impl
