"""A CPU stand-in for FlashMLA's compiled sparse kernels, so that vLLM's FLASHMLA_SPARSE backend
(``backends.vllm.flashmla``) runs end to end without a GPU: its builder, its convert kernel (in
Triton's interpreter), its q concat and head padding, the fp8 cache in FlashMLA's layout, the
fp8 paths' tile-scheduler metadata and workspace, and FlashMLA's Python interface all run as
they ship; only the two kernels are these functions.

:func:`register` defines ``sparse_prefill_fwd`` and ``sparse_decode_fwd`` in an op namespace
of its own (:data:`NAMESPACE`) with the schemas the release's ``_flashmla_C.abi3.so`` carries (so
a call vLLM's interface makes with the wrong arguments fails here as it would there), and, where
torch has no CUDA, puts modules in place of ``vllm._flashmla_C`` and ``vllm._flashmla_extension_C``
(whose import registers the real ops in the engine); :func:`in_place_of_the_kernels` points
FlashMLA's interface at them for a test, so the real kernels, where they load, stay untouched.
:func:`hopper` makes vLLM's platform an SM90 CUDA one and lets torch without an accelerator take
vLLM's pinned host buffers as plain ones.
:func:`interpreter_bool_masks` lets Triton's interpreter run vLLM's convert kernel with a
prefill workspace: the interpreter types ``block_mask & ~scalar_mask`` as int32 (values 0 and
1) and then refuses it as a load or store mask, where the compiled kernel has an i1 mask.

The kernels attend exactly the entries they are handed, with the project's reference
(``reference.sparse_mla_reference``, float32): an index is read when ``0 <= index < s_kv`` and
it lies within ``topk_length`` (prefill: per row; decode: per batch entry), as FlashMLA's
interface and its reference (``tests/ref.py``) define them; the decode kernel takes only -1 as
invalid, so any other index outside the cache is refused here, where the kernel would read out
of bounds. The prefill kernel reads a bf16 ``kv [s_kv, 1, d_qk]``; the decode kernel the
656-byte fp8 layout (``reference.flashmla_layout.dequantize``), so a wrong layout, slot or
length shows in the output. Outputs are shaped as the kernels': ``out`` bf16, natural-log
``lse`` ``[s_q, h]`` (prefill) or ``[b, h, s_q]`` (decode); a row with no entry gets out 0 and
lse +inf, FlashMLA's convention (the project's oracle says -inf); ``max_logits`` is not modelled
(NaN); ``attn_sink`` scales the output by ``exp(lse) / (exp(lse) + exp(sink))``. The decode
kernel returns a tile-scheduler metadata tensor where it was handed none (it builds its schedule
then).
"""

from __future__ import annotations

import os
import sys
import types

import numpy as np
import torch

from backends.vllm import shims as vllm_shims
from backends.vllm.flashmla import RECORDED_OPS, op_schemas
from reference import sparse_mla_reference
from reference.flashmla_layout import TOKEN_BYTES, dequantize

#: The stand-in's own op namespace: FlashMLA's ``_flashmla_C`` stays the release's (real where
#: its ``.so`` loaded, on a GPU runner), and FlashMLA's interface is pointed here for a test.
NAMESPACE = "_flashmla_C_stand_in"
EXTENSIONS = ("vllm._flashmla_C", "vllm._flashmla_extension_C")
#: Rows of the tile-scheduler metadata the stand-in hands back (FlashMLA's TileSchedulerMetaDataSize is 8).
TILE_METADATA_WIDTH = 8
_LIBRARIES: list = []


def handed(indices: torch.Tensor, s_kv: int, lengths: torch.Tensor | None) -> torch.Tensor:
    """``[rows, topk]``: the entries a kernel reads."""
    mask = (indices >= 0) & (indices < s_kv)
    if lengths is not None:
        cols = torch.arange(indices.shape[1], device=indices.device).unsqueeze(0)
        mask &= cols < lengths.to(device=indices.device, dtype=torch.int64).unsqueeze(1)
    return mask


def attend(q: torch.Tensor, kv_rows: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor, sm_scale: float,
           d_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, H, d_v] float32, lse [T, H])`` of ``q [T, H, d_qk]`` over the rows
    ``kv_rows [N, d_qk]`` that ``slots`` selects where ``mask``."""
    d_qk = q.shape[-1]
    safe = torch.where(mask, slots, torch.zeros_like(slots))
    out, lse = sparse_mla_reference(q[..., :d_v], q[..., d_v:d_qk], kv_rows[:, :d_v], kv_rows[:, d_v:d_qk], safe,
                                    mask=mask, sm_scale=sm_scale, mode="float32")
    lonely = ~mask.any(dim=1)  # FlashMLA's LSE of a row that reads nothing
    return out.float(), lse.float().masked_fill(lonely.unsqueeze(1), float("inf"))


def with_sink(out: torch.Tensor, lse: torch.Tensor, attn_sink: torch.Tensor | None) -> torch.Tensor:
    """``out`` scaled by ``exp(lse) / (exp(lse) + exp(sink))`` per head (``out [T, H, D]``)."""
    if attn_sink is None:
        return out
    return out * torch.sigmoid(lse - attn_sink.float().cpu()).unsqueeze(-1)


def sparse_prefill_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out_=None):
    s_kv = kv.shape[0]
    rows = indices[:, 0, :].to(torch.int64)
    mask = handed(rows, s_kv, topk_length)
    out, lse = attend(q, kv[:, 0, :], rows, mask, sm_scale, d_v)
    result = with_sink(out, lse, attn_sink).to(torch.bfloat16)
    if out_ is not None:
        out_.copy_(result)
        result = out_
    return [result, torch.full_like(lse, float("nan")), lse]


def sparse_decode_fwd(q, kv, indices, topk_length, attn_sink, tile_scheduler_metadata, num_splits, extra_kv,
                      extra_indices, extra_topk_length, d_v, sm_scale, out_=None, enable_batch_invariant=False):
    if kv.dtype != torch.uint8 or kv.shape[-1] != TOKEN_BYTES:
        raise RuntimeError(f"stand-in sparse_decode_fwd: expected the 656-byte fp8 layout, got {kv.dtype} "
                           f"{tuple(kv.shape)}")
    if extra_kv is not None:
        raise RuntimeError("stand-in sparse_decode_fwd: an extra KV cache is not modelled")
    b, s_q, heads, d_qk = q.shape
    flat = kv.reshape(-1, TOKEN_BYTES)
    slots = indices.reshape(b * s_q, -1).to(torch.int64)
    lengths = None if topk_length is None else topk_length.to(torch.int64).repeat_interleave(s_q)
    mask = handed(slots, flat.shape[0], lengths)
    outside = handed(torch.zeros_like(slots), 1, lengths) & (slots != -1) & ~mask
    if bool(outside.any()):
        raise RuntimeError(f"stand-in sparse_decode_fwd: index {int(slots[outside][0])} is outside the cache's "
                           f"{flat.shape[0]} tokens (the kernel takes only -1 as invalid)")
    needed, local = torch.unique(slots[mask], return_inverse=True)
    rows = dequantize(flat[needed])[:, :d_qk]
    local_slots = torch.zeros_like(slots)
    local_slots[mask] = local
    out, lse = attend(q.reshape(b * s_q, heads, d_qk), rows, local_slots, mask, sm_scale, d_v)
    result = with_sink(out, lse, attn_sink).to(torch.bfloat16).reshape(b, s_q, heads, d_v)
    if out_ is not None:
        out_.copy_(result)
        result = out_
    lse = lse.reshape(b, s_q, heads).permute(0, 2, 1).contiguous()
    if tile_scheduler_metadata is None:
        tile_scheduler_metadata = torch.zeros((1, TILE_METADATA_WIDTH), dtype=torch.int32, device=q.device)
        num_splits = torch.zeros(b + 1, dtype=torch.int32, device=q.device)
    return result, lse, tile_scheduler_metadata, num_splits


IMPLEMENTATIONS = {"sparse_prefill_fwd": sparse_prefill_fwd, "sparse_decode_fwd": sparse_decode_fwd}


def register(source) -> None:
    """The stand-in kernels under the release's op schemas in :data:`NAMESPACE` (once per
    process, any device), and, where torch has no CUDA (FlashMLA's ``.so`` links CUDA 13's
    runtime and cannot load), modules that register nothing in place of its extensions."""
    if not _LIBRARIES:
        schemas = op_schemas(source)
        missing = [op for op in RECORDED_OPS if op not in schemas]
        if missing:
            raise RuntimeError(f"{source.describe()}: no schema for {missing} in its _flashmla_C library")
        library = torch.library.Library(NAMESPACE, "DEF")
        for op in RECORDED_OPS:
            library.define(schemas[op])
            library.impl(op, IMPLEMENTATIONS[op], "CompositeExplicitAutograd")
        _LIBRARIES.append(library)
    if torch.cuda.is_available():
        return
    for name in EXTENSIONS:
        if name not in sys.modules:
            module = types.ModuleType(name, "stand-in: FlashMLA's compiled kernels (tests/flashmla_stand_in.py)")
            module.__sparse_mla_stand_in__ = "FlashMLA's kernels, computed with the project's reference on the CPU"
            sys.modules[name] = module


def stand_in_ops():
    return getattr(torch.ops, NAMESPACE)


def in_place_of_the_kernels(monkeypatch) -> None:
    """FlashMLA's interface (loaded from the release) calls the stand-in kernels until
    ``monkeypatch`` is undone."""
    monkeypatch.setattr(sys.modules[vllm_shims.FLASHMLA_INTERFACE_MODULE], "flash_mla_cuda", stand_in_ops())


def hopper(monkeypatch) -> None:
    """vLLM's platform as an SM90 CUDA one; pinned host buffers as plain ones and device index
    0 where torch has no accelerator."""
    monkeypatch.setattr(vllm_shims.PLATFORM, "is_cuda", lambda: True)
    monkeypatch.setattr(vllm_shims.PLATFORM, "get_device_capability",
                        lambda device_id=0: vllm_shims.DeviceCapability(9, 0))
    if torch.accelerator.is_available():
        return
    zeros = torch.zeros

    def unpinned_zeros(*args, pin_memory=False, **kwargs):
        return zeros(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", unpinned_zeros)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)


def _as_bool_mask(mask):
    """An interpreter mask handle as bool, where the interpreter typed a 0/1 mask as an integer."""
    from triton.runtime.interpreter import TensorHandle

    data = mask.data
    if data.dtype == np.bool_:
        return mask
    if not np.isin(data, (0, 1)).all():
        raise ValueError(f"an integer mask holding values other than 0 and 1: {np.unique(data)[:8]}")
    import triton.language as tl

    return TensorHandle(data.astype(np.bool_), tl.int1)


def interpreter_bool_masks(monkeypatch) -> None:
    """Under ``TRITON_INTERPRET=1``, a 0/1 integer mask of a masked load or store is taken as
    the bool mask the compiled kernel has (any other integer mask is refused)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime.interpreter import InterpreterBuilder

    load, store = InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store

    def masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        return load(self, ptrs, _as_bool_mask(mask), other, cache_policy, is_volatile)

    def masked_store(self, ptrs, value, mask, cache_policy):
        return store(self, ptrs, value, _as_bool_mask(mask), cache_policy)

    monkeypatch.setattr(InterpreterBuilder, "create_masked_load", masked_load)
    monkeypatch.setattr(InterpreterBuilder, "create_masked_store", masked_store)


__all__ = ["hopper", "interpreter_bool_masks", "register"]
