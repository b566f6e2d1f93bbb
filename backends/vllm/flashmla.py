"""FlashMLA's sparse kernels as vLLM's FLASHMLA_SPARSE backend drives them (the ``flashmla``
backend of ``backends.seam``).

What runs is the release's own code, loaded through ``backends.vllm.shims``: vLLM's
``flashmla_sparse.py`` (``FlashMLASparseMetadataBuilder.build`` and
``FlashMLASparseImpl.forward_mqa``: the choice of kernel, the convert kernel and how it is
called, ``topk_length``, the head padding, the fp8 tile-scheduler metadata, the fp8
mixed-batch or separate prefill/decode paths), vLLM's FlashMLA ops module and FlashMLA's Python
interface, and FlashMLA's compiled kernels from the release's ``.so`` files. For a bf16 cache
vLLM runs the sparse prefill kernel on every row; for an fp8 cache ("fp8_ds_mla") the sparse
decode kernel (``flash_mla_with_kvcache`` with a fresh ``FlashMLASchedMeta``) on every row below
32 heads, and from 32 heads on the decode rows, with the prefill rows' context upconverted to
bf16 for the prefill kernel.

What this module adds, and why:

- the engine around one layer: the configuration objects vLLM's constructors read
  (:func:`vllm_config`), the step's common metadata (``backends.vllm.sm90.common_metadata``: the
  host's query split on the host, the device's on the device, where adaptive verification
  makes them differ), the shared top-k buffer, and the MLA layer's routing: ``forward_mqa``
  gets the step's actual tokens, or its decode tokens where the builder routes the prefills to
  dense MHA and the impl allows it (vLLM's ``MLAAttention.forward_impl``, not loaded: it needs
  the model's weights);
- the fp8 cache in FlashMLA's layout: the project's fp8 cache (one per-tensor ``k_scale``)
  packed losslessly by ``reference.flashmla_layout.pack``, where the engine's cache writer
  (vLLM's ``concat_and_cache_mla``, in its ``_C`` library) would have quantised bf16 tokens;
- what the kernel was handed, read at the kernel's door: FlashMLA's op namespace in the
  interface module is wrapped for the step (:class:`KernelRecorder`), so every call's indices,
  ``topk_length``, head count and LSE are recorded as the kernel receives them. The executed
  slots are the valid indices (``0 <= index < s_kv``, within ``topk_length``) mapped to cache
  slots (indices into a prefill workspace through the rows the upconvert gathered); the
  executed lengths are ``topk_length`` where vLLM passes it, else the count of valid indices;
  the LSE (natural log) is the kernel's, cut to the layer's heads. ``forward_mqa`` returns no
  LSE outside context parallelism, so this is the only place it can be read.

The decode/prefill split is the step's (``harness.spec.StepMetadata``), as for the SM90
backend; vLLM's builder would split with its own reorder threshold (128 or 256 on SM90) and
uniform decode lengths, which the engine's batch reordering guarantees.

Re-created rather than loaded (``backends.vllm.shims``, each because what vLLM runs is not in a
release's Python files or needs the whole engine): vLLM's ``concat_mla_q`` and
``cp_gather_and_upconvert_fp8_kv_cache`` (kernels of its 90 MB ``_C`` library, which no slice
carries), its workspace manager, its index group's conversion for a group of one layer (vLLM's
convert kernel on the step's rows), and the common builder's and impl's fields. Here,
:func:`kernel_heads` re-states vLLM's padding of the prefill kernel's heads to a multiple of 64
(``FlashMLASparseImpl.prefill_padding``, set in its constructor) for :meth:`FlashMLABackend.unsupported`;
the fp8 decode kernel's padding is vLLM's own ``_compute_fp8_decode_padded_heads``.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import re
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from mla_constants import INVALID, KV_LORA_RANK
from reference.flashmla_layout import pack

from ..seam import (
    LayerConfig,
    StepInput,
    StepOutcome,
    block_stride_of,
    blocks_apart,
    query_rows,
    slots_of_cache_rows,
)
from . import shims as vllm_shims
from .shims import (
    FLASHMLA_INTERFACE_MODULE,
    FLASHMLA_OPS_MODULE,
    FLASHMLA_REAL_MODULES,
    FLASHMLA_SHIMS_BY_NAME,
    FLASHMLA_SPARSE_MODULE,
    gathered_cache_rows,
    load_flashmla_module,
    stand_ins_in_use,
)
from .sm90 import common_metadata
from .source import OPTIONAL_FILES, SLICE_COMMAND, VllmSource, missing_flashmla_files

LAYER_NAME = "model.layers.0.self_attn.attn"
#: vLLM's kv_cache_dtype string and the torch dtype of its cache tensor for each project dtype.
CACHE_DTYPES = {"bfloat16": ("auto", torch.bfloat16), "float8_e4m3fn": ("fp8_ds_mla", torch.uint8)}
#: DeepSeek-V3.2's max_model_len: the prefill workspace of the fp8 path holds a multiple of it.
MAX_MODEL_LEN = 163_840
#: vLLM's sparse_mla_prefill_workspace_factor at a max_model_len of at most 256K tokens.
PREFILL_WORKSPACE_FACTOR = 5
#: The engine's max_num_seqs (vLLM's default): the builder's per-request buffers.
MAX_NUM_SEQS = 1024
#: The Hopper capability the backend is judged for (vLLM's backend selection reads it).
HOPPER = (9, 0)
#: Heads FlashMLA's SM90 sparse kernels take (its interface's docstring: prefill 8 to 128; vLLM
#: pads the decode kernel's to 64 or 128).
SM90_KERNEL_HEADS = (8, 16, 32, 64, 128)
#: vLLM's padding of the bf16 prefill kernel's heads on Hopper (``FlashMLASparseImpl.prefill_padding``,
#: set in its constructor, so not readable from the class).
PREFILL_HEAD_PADDING = 64
#: Rows of the pages FlashMLA's SM90 fp8 kernel reads: off SM100, vLLM's ``customize_spec`` aligns an
#: fp8 cache's block stride to a multiple of them (``block_stride_alignment=MultipleOf(64)``).
FP8_PAGE_ROWS = 64
#: The FlashMLA ops the recorder wraps (and the static check looks for in the release's ``.so``).
RECORDED_OPS = ("sparse_prefill_fwd", "sparse_decode_fwd")
#: What this module reads from the release's modules: names at module level, and in classes.
MODULE_READS = {
    FLASHMLA_SPARSE_MODULE: ("FlashMLASparseBackend", "FlashMLASparseImpl", "FlashMLASparseMetadataBuilder",
                             "MIN_HEADS_FOR_BF16_PREFILL", "ops"),
    FLASHMLA_OPS_MODULE: ("_is_flashmla_available",),
    FLASHMLA_INTERFACE_MODULE: ("flash_mla_cuda",),
}
CLASS_READS = {
    "FlashMLASparseBackend": ("supported_kv_cache_dtypes", "get_supported_head_sizes",
                              "get_supported_kernel_block_sizes", "supports_combination"),
    "FlashMLASparseImpl": ("_compute_fp8_decode_padded_heads", "forward_mqa"),
    "FlashMLASparseMetadataBuilder": ("build",),
}


class FlashMLAUnavailable(RuntimeError):
    """The release's FlashMLA backend cannot be opened here: files missing from its source, or
    FlashMLA's kernels not importable on this machine."""


# --- what the backend can run ---------------------------------------------------------------

def padded_heads(num_heads: int, multiple: int) -> int:
    return -(-num_heads // multiple) * multiple


def kernel_heads(module, config: LayerConfig) -> list[int]:
    """The head counts FlashMLA's kernels see for a layer, after vLLM's padding: the prefill
    kernel's (a multiple of 64) for a bf16 cache; for an fp8 cache the decode kernel's (64 or
    128), and from 32 heads on the prefill kernel's too."""
    heads = config.num_heads
    prefill = padded_heads(heads, PREFILL_HEAD_PADDING)
    if config.kv_dtype != "float8_e4m3fn":
        return [prefill]
    decode = max(heads, module.FlashMLASparseImpl._compute_fp8_decode_padded_heads(heads))
    return [decode] + ([prefill] if heads >= module.MIN_HEADS_FOR_BF16_PREFILL else [])


def block_size_fits(block_size: int, supported) -> bool:
    """``supported`` is an exact size, or vLLM's ``MultipleOf`` (a stand-in int subclass)."""
    if isinstance(supported, vllm_shims.MultipleOf):
        return block_size % int(supported) == 0
    return block_size == int(supported)


def reads_block_stride(module) -> bool:
    """Whether the release's FLASHMLA_SPARSE reads a cache whose blocks lie apart (it views the cache
    as rows with ``flat_kv_row_view`` and hands its convert kernel the block stride)."""
    return "flat_kv_row_view" in inspect.getsource(module)


def blocks_apart_reason(module, version: str, config: LayerConfig) -> str | None:
    """Why the engine never hands this release's FLASHMLA_SPARSE the layer's cache with its blocks
    ``config.kv_block_stride`` rows apart, or None."""
    if not config.blocks_apart:
        return None
    if not reads_block_stride(module):
        return f"vLLM {version}'s FLASHMLA_SPARSE reads contiguous blocks (no flat_kv_row_view)"
    if config.kv_dtype == "float8_e4m3fn" and config.kv_block_stride % FP8_PAGE_ROWS:
        return (f"vLLM {version}'s FLASHMLA_SPARSE aligns an fp8 cache's blocks to {FP8_PAGE_ROWS}-row pages "
                f"(customize_spec): the engine never hands it blocks {config.kv_block_stride} rows apart")
    return None


def unsupported_reason(module, version: str, config: LayerConfig) -> str | None:
    """Why vLLM's FLASHMLA_SPARSE of this release does not serve ``config`` on Hopper, in the
    backend's own terms (its head sizes, cache dtypes, block sizes and ``supports_combination``),
    or why FlashMLA's SM90 kernels cannot run the head count vLLM pads to; None where it runs."""
    cls = module.FlashMLASparseBackend
    head_size = KV_LORA_RANK + config.rope_dim
    cache_dtype = CACHE_DTYPES[config.kv_dtype][0]
    if head_size not in cls.get_supported_head_sizes():
        return (f"vLLM {version}'s FLASHMLA_SPARSE serves head sizes {cls.get_supported_head_sizes()}, not "
                f"{head_size} (rope {config.rope_dim})")
    if cache_dtype not in cls.supported_kv_cache_dtypes:
        return (f"vLLM {version}'s FLASHMLA_SPARSE takes kv-cache dtypes {cls.supported_kv_cache_dtypes}, "
                f"not {cache_dtype}")
    sizes = cls.get_supported_kernel_block_sizes()
    if not any(block_size_fits(config.block_size, s) for s in sizes):
        return f"vLLM {version}'s FLASHMLA_SPARSE takes kernel block sizes {sizes!r}, not {config.block_size}"
    capability = vllm_shims.DeviceCapability(*HOPPER)
    reason = cls.supports_combination(
        head_size=head_size, dtype=torch.bfloat16, kv_cache_dtype=cache_dtype, block_size=config.block_size,
        use_mla=True, has_sink=False, use_sparse=True, use_mm_prefix=False, device_capability=capability)
    if reason:
        return f"vLLM {version}'s FLASHMLA_SPARSE: {reason}"
    apart = blocks_apart_reason(module, version, config)
    if apart:
        return apart
    beyond = [h for h in kernel_heads(module, config) if h not in SM90_KERNEL_HEADS]
    if beyond:
        return (f"{config.num_heads} heads reach FlashMLA's SM90 kernels as {beyond} after vLLM's padding; they take "
                f"{list(SM90_KERNEL_HEADS)}")
    return None


# --- what the kernel is handed --------------------------------------------------------------

def _prefill_signature(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out_=None):
    """FlashMLA's ``sparse_prefill_fwd`` arguments, in the op schema's order."""


def _decode_signature(q, kv, indices, topk_length, attn_sink, tile_scheduler_metadata, num_splits, extra_kv,
                      extra_indices, extra_topk_length, d_v, sm_scale, out_=None, enable_batch_invariant=False):
    """FlashMLA's ``sparse_decode_fwd`` arguments, in the op schema's order."""


SIGNATURES = {"sparse_prefill_fwd": inspect.signature(_prefill_signature),
              "sparse_decode_fwd": inspect.signature(_decode_signature)}


@dataclass
class KernelCall:
    """One call of a FlashMLA sparse kernel, per query row in the order the kernel numbers them:
    the cache slots of its valid indices (``mask``), its executed length, its LSE over the
    layer's heads and the head count the kernel ran."""

    op: str
    slots: torch.Tensor  # int64 [rows, topk], INVALID outside mask (host)
    mask: torch.Tensor  # bool [rows, topk] (host)
    lengths: torch.Tensor  # int64 [rows] (host)
    lse: torch.Tensor  # float32 [rows, H] (device)
    heads: int
    fresh_schedule: bool = False


def within_length(indices: torch.Tensor, topk_length: torch.Tensor | None) -> torch.Tensor:
    """``[rows, topk]``: the columns within each row's ``topk_length`` (all without one)."""
    cols = torch.arange(indices.shape[1], device=indices.device).unsqueeze(0).expand(indices.shape)
    if topk_length is None:
        return torch.ones_like(cols, dtype=torch.bool)
    return cols < topk_length.to(indices.device).unsqueeze(1)


def handed_mask(indices: torch.Tensor, s_kv: int, topk_length: torch.Tensor | None) -> torch.Tensor:
    """``[rows, topk]``: the entries the kernel attends: ``0 <= index < s_kv`` (the prefill
    kernel takes -1 and indices past the KV as invalid; the decode kernel -1, and reads any other
    index, which the recorder reports) within each row's ``topk_length``."""
    return (indices >= 0) & (indices < s_kv) & within_length(indices, topk_length)


def executed_lengths(mask: torch.Tensor, topk_length: torch.Tensor | None) -> torch.Tensor:
    """``topk_length`` where the kernel is handed one, else the count of valid indices."""
    return (topk_length if topk_length is not None else mask.sum(dim=1)).to(torch.int64)


def rows_read(kv: torch.Tensor, indices: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """The rows of ``cache``'s buffer (counted from its first row, in rows of its last dimension)
    that the indices of a kernel's ``kv`` (a view of the same buffer: ``[pages, page_rows, D]``,
    index ``page * page_rows + offset``) read."""
    size = kv.element_size()
    page_rows = kv.shape[1]
    page, offset = indices.div(page_rows, rounding_mode="floor"), indices.remainder(page_rows)
    start = kv.storage_offset() * size - cache.storage_offset() * cache.element_size()
    at = start + (page * kv.stride(0) + offset * kv.stride(1)) * size
    return at.div(cache.shape[-1] * cache.element_size(), rounding_mode="floor")


@dataclass
class KernelRecorder:
    """Wraps FlashMLA's op namespace (``flash_mla_interface.flash_mla_cuda``) and the fp8
    upconvert (``flashmla_sparse.ops``) for one step; :meth:`per_row` joins the calls' rows."""

    heads: int
    # the cache handed to forward_mqa: the rows the kernels read of it are reported as its slot ids
    cache: torch.Tensor | None = None
    calls: list[KernelCall] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    workspaces: dict[int, torch.Tensor] = field(default_factory=dict)  # data_ptr -> cache row of each row

    @contextlib.contextmanager
    def installed(self, interface, module):
        real_ops, real_custom = interface.flash_mla_cuda, module.ops
        interface.flash_mla_cuda = _RecordingOps(real_ops, self)
        module.ops = _RecordingCustomOps(real_custom, self)
        try:
            yield self
        finally:
            interface.flash_mla_cuda, module.ops = real_ops, real_custom

    def gathered(self, args: tuple, kwargs: dict) -> None:
        """The rows ``cp_gather_and_upconvert_fp8_kv_cache`` put in its workspace."""
        bound = inspect.signature(vllm_shims.cp_gather_and_upconvert_fp8_kv_cache).bind(*args, **kwargs)
        a = bound.arguments
        cache = a["src_cache"].view(torch.uint8)
        self.workspaces[a["dst"].data_ptr()] = gathered_cache_rows(
            a["block_table"], a["workspace_starts"], a["batch_size"], a["dst"].shape[0], cache.shape[1],
            cache.stride(0) // cache.shape[-1], a.get("seq_starts"))

    def _slots(self, kv: torch.Tensor, indices: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Cache slots of the handed indices: of the cache row the index reads (where the blocks
        lie apart, a row id is not a slot id), through the gathered row for a prefill workspace."""
        slots = torch.where(mask, indices, torch.full_like(indices, INVALID))
        origin = self.workspaces.get(kv.data_ptr())
        if origin is not None:
            rows = origin[slots.clamp(min=0)]
        elif self.cache is not None and kv.untyped_storage().data_ptr() == self.cache.untyped_storage().data_ptr():
            rows = rows_read(kv, slots.clamp(min=0), self.cache)
        else:
            return slots
        if self.cache is not None:
            rows = slots_of_cache_rows(rows, self.cache.shape[1], block_stride_of(self.cache))
        return torch.where(mask, rows, slots)

    def prefill(self, args: tuple, kwargs: dict, result) -> None:
        a = SIGNATURES["sparse_prefill_fwd"].bind(*args, **kwargs).arguments
        q, kv, topk_length = a["q"], a["kv"], a.get("topk_length")
        indices = a["indices"][:, 0, :].to("cpu", torch.int64)
        lengths = None if topk_length is None else topk_length.to("cpu", torch.int64)
        mask = handed_mask(indices, kv.shape[0], lengths)
        self.calls.append(KernelCall("sparse_prefill_fwd", self._slots(kv, indices, mask), mask,
                                     executed_lengths(mask, lengths), result[2][:, : self.heads], q.shape[1]))

    def decode(self, args: tuple, kwargs: dict, result) -> None:
        a = SIGNATURES["sparse_decode_fwd"].bind(*args, **kwargs).arguments
        q, kv, topk_length = a["q"], a["kv"], a.get("topk_length")
        b, s_q = q.shape[0], q.shape[1]
        if a.get("extra_kv") is not None:
            self.problems.append("sparse_decode_fwd was handed an extra KV cache, which DeepSeek-V3.2 has none of")
        indices = a["indices"].reshape(b * s_q, -1).to("cpu", torch.int64)
        lengths = None
        if topk_length is not None:  # one length per batch entry, for its s_q rows
            lengths = topk_length.to("cpu", torch.int64).repeat_interleave(s_q)
        s_kv = kv.shape[0] * kv.shape[1]
        mask = handed_mask(indices, s_kv, lengths)
        stray = within_length(indices, lengths) & ((indices < INVALID) | (indices >= s_kv))
        if bool(stray.any()):  # the decode kernel takes only -1 as invalid: these are read out of bounds
            row, col = (int(v) for v in stray.nonzero()[0])
            self.problems.append(f"sparse_decode_fwd was handed index {int(indices[row, col])} (row {row} of the call, "
                                 f"column {col}), outside [-1, {s_kv})")
        lse = result[1].permute(0, 2, 1).reshape(b * s_q, -1)[:, : self.heads]  # [b, h, s_q] -> rows
        self.calls.append(KernelCall("sparse_decode_fwd", self._slots(kv, indices, mask), mask,
                                     executed_lengths(mask, lengths), lse, q.shape[2],
                                     fresh_schedule=a.get("tile_scheduler_metadata") is None))

    def per_row(self, rows: int, device) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        """``(lse [rows, H], (slots, mask), lengths)`` of the calls in order; a problem where the
        calls serve another number of rows."""
        served = sum(c.lengths.numel() for c in self.calls)
        if served != rows:
            self.problems.append(f"FlashMLA's kernels were called for {served} rows, the step hands {rows}")
        width = max((c.slots.shape[1] for c in self.calls), default=0)
        slots = torch.full((rows, width), INVALID, dtype=torch.int64)
        mask = torch.zeros((rows, width), dtype=torch.bool)
        lengths = torch.zeros(rows, dtype=torch.int64)
        lse = torch.full((rows, self.heads), float("nan"), dtype=torch.float32, device=device)
        start = 0
        for call in self.calls:
            n = min(call.lengths.numel(), rows - start)
            k = call.slots.shape[1]
            slots[start : start + n, :k] = call.slots[:n]
            mask[start : start + n, :k] = call.mask[:n]
            lengths[start : start + n] = call.lengths[:n]
            lse[start : start + n] = call.lse[:n].float()
            start += n
        return lse, (slots, mask), lengths


class _RecordingOps:
    """FlashMLA's op namespace with the sparse kernels' calls recorded."""

    def __init__(self, ops, recorder: KernelRecorder):
        self._ops, self._recorder = ops, recorder

    def __getattr__(self, name):
        op = getattr(self._ops, name)
        record = {"sparse_prefill_fwd": self._recorder.prefill, "sparse_decode_fwd": self._recorder.decode}.get(name)
        if record is None:
            return op

        def recorded(*args, **kwargs):
            result = op(*args, **kwargs)
            record(args, kwargs, result)
            return result

        return recorded


class _RecordingCustomOps:
    """vLLM's ``_custom_ops`` as FLASHMLA_SPARSE reaches it, with the fp8 upconvert recorded."""

    def __init__(self, ops, recorder: KernelRecorder):
        self._ops, self._recorder = ops, recorder

    def __getattr__(self, name):
        op = getattr(self._ops, name)
        if name != "cp_gather_and_upconvert_fp8_kv_cache":
            return op

        def recorded(*args, **kwargs):
            op(*args, **kwargs)
            self._recorder.gathered(args, kwargs)

        return recorded


# --- the backend ----------------------------------------------------------------------------

def vllm_config(config: LayerConfig, cache_dtype: str, layer) -> SimpleNamespace:
    """The engine configuration vLLM's FLASHMLA_SPARSE constructors read, for one layer on one
    rank (no context parallelism, no HiSparse)."""
    hf = SimpleNamespace(index_topk=config.topk, index_kpool=config.kpool, kv_lora_rank=KV_LORA_RANK,
                         qk_rope_head_dim=config.rope_dim)
    model = SimpleNamespace(hf_text_config=hf, max_model_len=MAX_MODEL_LEN, dtype=torch.bfloat16,
                            get_num_attention_heads=lambda parallel_config=None: config.num_heads)
    return SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context={LAYER_NAME: layer}),
        model_config=model,
        cache_config=SimpleNamespace(cache_dtype=cache_dtype, block_size=config.block_size),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, decode_context_parallel_size=1,
                                        prefill_context_parallel_size=1, cp_kv_cache_interleave_size=1,
                                        dcp_comm_backend="ag_rs"),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=config.max_tokens,
                                         max_num_seqs=max(MAX_NUM_SEQS, config.max_tokens),
                                         async_scheduling=config.async_scheduling),
        attention_config=SimpleNamespace(hisparse_config=None, sparse_mla_force_mqa=False,
                                         sparse_mla_prefill_workspace_factor=PREFILL_WORKSPACE_FACTOR),
        speculative_config=SimpleNamespace(enable_adaptive_verification=config.adaptive_verification),
    )


def import_problem(name: str) -> str | None:
    """Why ``import name`` fails here (the loader's own error, which vLLM's ops module swallows
    into "not available"), or None."""
    try:
        importlib.import_module(name)
    except ImportError as exc:
        return f"import {name}: {exc}"
    return None


class FlashMLABackend:
    """vLLM's FLASHMLA_SPARSE of one release on FlashMLA's kernels (a ``backends.seam.Backend``)."""

    kernel = "flashmla"
    returns_lse = True
    executes_valid_counts = True  # topk_length: each row's valid count (backends.seam.CAPABILITIES)

    def __init__(self, source: VllmSource):
        missing = missing_flashmla_files(source)
        if missing:
            raise FlashMLAUnavailable(
                f"{source.describe()} lacks {', '.join(missing)}: the flashmla backend runs vLLM's FLASHMLA_SPARSE "
                f"and FlashMLA's kernels from the release; write a slice that carries them "
                f"(without --modules-only): {SLICE_COMMAND}")
        self.source = source
        self.version = source.version
        self.name = f"flashmla-{source.version}"
        self.module = load_flashmla_module(source)
        available, reason = sys.modules[FLASHMLA_OPS_MODULE]._is_flashmla_available()
        if not available:
            problems = [p for p in map(import_problem, vllm_shims.EXTENSION_MODULES) if p]
            raise FlashMLAUnavailable(f"{source.describe()}: FlashMLA's kernels cannot be used here: {reason}"
                                      + "".join(f"; {p}" for p in problems))
        self.interface = sys.modules[FLASHMLA_INTERFACE_MODULE]

    def describe(self) -> str:
        stand_ins = [n for n in stand_ins_in_use() if n.startswith("vllm")] + list(FLASHMLA_SHIMS_BY_NAME)
        return (f"{self.source.describe()}: FLASHMLA_SPARSE (vLLM's flashmla_sparse.py) on FlashMLA's kernels "
                f"({', '.join(OPTIONAL_FILES)}); stand-ins: {', '.join(sorted(stand_ins))}")

    def unsupported(self, config: LayerConfig) -> str | None:
        return unsupported_reason(self.module, self.version, config)

    def open_layer(self, config: LayerConfig, device) -> FlashMLALayer:
        return FlashMLALayer(self, config, torch.device(device))


class FlashMLALayer:
    """vLLM's FLASHMLA_SPARSE impl and builder for one layer configuration; steps share the
    top-k buffer and the engine's workspace."""

    def __init__(self, backend: FlashMLABackend, config: LayerConfig, device: torch.device):
        m = backend.module
        self.backend, self.config, self.device = backend, config, device
        self.cache_dtype, self.cache_torch_dtype = CACHE_DTYPES[config.kv_dtype]
        self.topk_indices_buffer = torch.full((max(config.max_tokens, 1), config.width), INVALID, dtype=torch.int32,
                                              device=device)
        self.attention_layer = SimpleNamespace(_k_scale_float=config.k_scale)
        self.engine_config = vllm_config(config, self.cache_dtype, self.attention_layer)
        head_size = KV_LORA_RANK + config.rope_dim
        with self.engine():
            self.impl = m.FlashMLASparseImpl(
                config.num_heads, head_size, config.sm_scale, 1, None, None, self.cache_dtype, None, "decoder", None,
                topk_indices_buffer=self.topk_indices_buffer, indexer=None, q_lora_rank=None,
                kv_lora_rank=KV_LORA_RANK, qk_nope_head_dim=128, qk_rope_head_dim=config.rope_dim,
                qk_head_dim=128 + config.rope_dim, v_head_dim=128, kv_b_proj=None,
            )
            spec = SimpleNamespace(dtype=self.cache_torch_dtype, block_size=config.block_size,
                                   tokens_per_state=config.kpool)
            self.builder = m.FlashMLASparseMetadataBuilder(spec, [LAYER_NAME], self.engine_config, device)
        self.attention_layer.impl = self.impl
        self.plans = 0  # tile schedules FlashMLA's decode kernel built (one per fresh FlashMLASchedMeta)

    #: Why the forward is not captured in a CUDA graph here (``backends.seam.Layer``).
    capture_unsupported = ("the FlashMLA layer reads every kernel call's arguments back on the host at FlashMLA's door "
                           "(KernelRecorder: indices, topk_length, LSE), which a CUDA graph capture cannot hold")

    def float_workspaces(self) -> list[torch.Tensor]:
        """The builder's tile-scheduler and split-count buffers (int32: poisoned, they read -1), where the
        release allocates them."""
        names = ("tile_scheduler_metadata_buffer", "num_splits_buffer")
        return [b for b in (getattr(self.builder, name, None) for name in names) if isinstance(b, torch.Tensor)]

    def unread_rows(self, step: StepInput) -> list[torch.Tensor]:
        """The top-k buffer's rows past those the step's metadata counts (``num_actual_tokens``)."""
        return [self.topk_indices_buffer[step.meta.num_actual_tokens:]]

    @contextlib.contextmanager
    def engine(self):
        """This layer's configuration in force and the engine's workspace on its device."""
        vllm_shims.WORKSPACE.device = self.device
        with vllm_shims.set_current_vllm_config(self.engine_config):
            yield

    def mqa_rows(self, metadata) -> int:
        """The rows ``forward_mqa`` serves: the decode tokens where the builder routes the
        prefills to dense MHA and the impl has that path, else every actual token."""
        to_mha = metadata.num_prefills > 0 and metadata.prefill_use_dense_mha and self.impl.supports_dense_mha_prefill
        return metadata.num_decode_tokens if to_mha else metadata.num_actual_tokens

    def kernel_cache(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The cache as vLLM holds it for this backend: bf16 as it is; fp8 in FlashMLA's layout,
        its blocks as far apart as the step's."""
        if self.cache_dtype == "auto":
            return kv_cache
        packed = pack(kv_cache, self.config.k_scale)
        stride = block_stride_of(kv_cache)
        return packed if stride == kv_cache.shape[1] else blocks_apart(packed, stride)

    def step(self, step: StepInput) -> StepOutcome:
        """build, then ``forward_mqa`` on the routed rows when the step has queries."""
        rows_with_padding = step.topk_indices.shape[0]
        cam = common_metadata(step.meta, step.block_table, rows_with_padding, self.device)
        with self.engine():
            metadata = self.builder.build(0, cam)
        rows = self.mqa_rows(metadata)
        served = min(rows, query_rows(step.meta))  # a FULL graph's padded rows run, unread
        outcome = StepOutcome(backend=self.backend.name, planned_rows=served, plans=self.plans,
                              dense_prefill=bool(self.impl.supports_dense_mha_prefill))
        if not step.runs_kernel:
            return outcome
        heads = self.config.num_heads
        if rows == 0:
            outcome.out = torch.zeros((0, heads, KV_LORA_RANK), dtype=torch.bfloat16, device=self.device)
            outcome.lse = torch.zeros((0, heads), dtype=torch.float32, device=self.device)
            outcome.executed_lengths = torch.zeros(0, dtype=torch.int64)
            return outcome
        self.topk_indices_buffer[:rows_with_padding].copy_(step.topk_indices.to(self.device))
        cache = self.kernel_cache(step.kv_cache)
        recorder = KernelRecorder(heads, cache)
        with self.engine(), recorder.installed(self.backend.interface, self.backend.module):
            out, _ = self.impl.forward_mqa((step.q_nope[:rows], step.q_pe[:rows]), cache, metadata,
                                           self.attention_layer)
        self.plans += sum(c.fresh_schedule for c in recorder.calls)
        outcome.plans = self.plans
        outcome.out = out[:served]
        lse, (slots, mask), lengths = recorder.per_row(rows, self.device)
        outcome.lse, outcome.executed_slots, outcome.executed_lengths = lse[:served], (slots[:served], mask[:served]), \
            lengths[:served]
        outcome.schedule_problems = recorder.problems
        return outcome


# --- what the backend reads from a release, checked without running it ----------------------

def _defined_names(body: list[ast.stmt]) -> set[str]:
    """Names a module or class body defines: functions, classes, assignments, imports."""
    names = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.If, ast.Try)):
            names.update(_defined_names(node.body))
            names.update(_defined_names(node.orelse))
            for handler in getattr(node, "handlers", []):
                names.update(_defined_names(handler.body))
    return names


def _class_names(tree: ast.Module) -> dict[str, set[str]]:
    return {n.name: _defined_names(n.body) for n in tree.body if isinstance(n, ast.ClassDef)}


def op_schemas(source: VllmSource) -> dict[str, str]:
    """The sparse ops' schemas as FlashMLA's ``_flashmla_C`` library registers them (read from
    the release's ``.so``: the schema strings it carries)."""
    data = source.path_of(OPTIONAL_FILES[0]).read_bytes()
    found = {}
    for name in RECORDED_OPS:
        match = re.search(rb"\x00(" + name.encode() + rb"\([^\x00]*\) -> [^\x00]+)\x00", data)
        if match:
            found[name] = match.group(1).decode()
    return found


def schema_arguments(schema: str) -> list[str]:
    """The argument names of an op schema, in order (``op(Tensor q, int d_v=512) -> ...``)."""
    inside = schema[schema.index("(") + 1 : schema.index(") ->")]
    return [part.split("=")[0].split()[-1] for part in inside.split(",") if part.strip()]


def signature_gaps(schemas: dict[str, str]) -> list[str]:
    """Ops whose schema's arguments are not, in order, those the recorder binds the kernel's
    calls by (:data:`SIGNATURES`; a trailing argument the release lacks is allowed)."""
    gaps = []
    for op, schema in schemas.items():
        ours = list(SIGNATURES[op].parameters)
        theirs = schema_arguments(schema)
        if ours[: len(theirs)] != theirs:
            gaps.append(f"{OPTIONAL_FILES[0]}: op {op} takes ({', '.join(theirs)}), the recorder binds "
                        f"({', '.join(ours)})")
    return gaps


def release_read_gaps(source: VllmSource) -> list[str]:
    """Every name this module reads from the release's modules, classes and FlashMLA's ops that
    the release's files do not define, and every op whose arguments the recorder would bind
    wrongly, each as ``where: what``."""
    gaps = []
    for module_name, names in MODULE_READS.items():
        tree = ast.parse(source.path_of(FLASHMLA_REAL_MODULES[module_name]).read_text())
        defined = _defined_names(tree.body)
        gaps += [f"{module_name}: {n}" for n in names if n not in defined]
        classes = _class_names(tree)
        for cls, members in CLASS_READS.items():
            if module_name == FLASHMLA_SPARSE_MODULE:
                gaps += [f"{module_name}.{cls}: {m}" for m in members if m not in classes.get(cls, set())]
    schemas = op_schemas(source)
    gaps += [f"{OPTIONAL_FILES[0]}: op {op}" for op in RECORDED_OPS if op not in schemas]
    return gaps + signature_gaps(schemas)
