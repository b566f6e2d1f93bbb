"""Loading vLLM's SM90 sparse-MLA backend from a release's files, with named stand-ins for the
parts of vLLM it imports but the code under test does not use.

The modules of :data:`backends.vllm.source.MODULE_FILES` (the backend, its convert kernel and
the launch machinery of its Triton kernels) are executed from the release's own files, under
their own names (``vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90``, ...). Every
other ``vllm`` module they import is a stand-in: a small module of :data:`SHIMS`, each with
the attributes the backend reads and the reason it may stand in. A module that is neither
raises :class:`ShimGap` naming it; so does an attribute a stand-in lacks. A new vLLM release
that needs more than a stand-in offers fails loudly here, never silently.

The stand-ins are engine plumbing: configuration objects, the platform, the distributed
group, logging, the JIT warm-up environment, and the base classes whose only job for this
backend is to hold fields (the metadata dataclass, the builder's constructor, the common
impl's constructor). What decides a length, a slot, a plan or an output is vLLM's own code
or FlashInfer's kernel.

:func:`load_flashmla_module` loads vLLM's FLASHMLA_SPARSE backend the same way
(:data:`FLASHMLA_REAL_MODULES`: the backend, vLLM's FlashMLA ops module and FlashMLA's Python
interface, as they ship) and FlashMLA's compiled kernels from the release's ``.so`` files
(:data:`EXTENSION_MODULES`). The stand-ins only it imports (:data:`FLASHMLA_SHIMS`) are served
while its modules are imported, and taken out of ``sys.modules`` after, so the SM90 backend's
imports meet a :class:`ShimGap` for them as before. Two of them do work on tensors, where the
release's own kernel lives in vLLM's 90 MB ``_C`` library, which no slice carries:
``concat_mla_q`` (q_nope and q_pe side by side) and ``cp_gather_and_upconvert_fp8_kv_cache`` (a
prefill's context rows of the fp8 cache, in FlashMLA's layout, gathered into a bf16 workspace:
``reference.flashmla_layout.upconvert``). Four functions of ``vllm/v1/attention/backends/utils.py``
(batch reshapes, prefill chunks) are compiled from the release's file itself
(:func:`release_functions`).
"""

from __future__ import annotations
import __future__

import ast
import contextlib
import dataclasses
import enum
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import math
import sys
import types
from typing import Any

import numpy as np
import torch

from fast.convert import request_ids
from fast.kvlen import prefills_use_dense_mha
from reference.flashmla_layout import upconvert

from .source import MODULE_FILES, OPTIONAL_FILES, SLICE_COMMAND, VllmSource

ROOT = "vllm"
SM90_MODULE = "vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90"
SPARSE_UTILS_MODULE = "vllm.v1.attention.backends.mla.sparse_utils"


class ShimGap(ImportError):
    """vLLM's code needs a module or attribute that neither the release's loaded files nor a
    stand-in provide."""


def module_name_of(relative: str) -> str:
    return relative[: -len(".py")].replace("/", ".")


REAL_MODULES = {module_name_of(f): f for f in MODULE_FILES}
FLASHMLA_SPARSE_MODULE = "vllm.v1.attention.backends.mla.flashmla_sparse"
FLASHMLA_OPS_MODULE = "vllm.v1.attention.ops.flashmla"
FLASHMLA_INTERFACE_MODULE = "vllm.third_party.flashmla.flash_mla_interface"
#: The FLASHMLA_SPARSE modules executed from the release's files (``vllm.third_party.flashmla``,
#: whose ``__init__.py`` holds a comment, is a package holding only its interface).
FLASHMLA_REAL_MODULES = {
    FLASHMLA_SPARSE_MODULE: "vllm/v1/attention/backends/mla/flashmla_sparse.py",
    FLASHMLA_OPS_MODULE: "vllm/v1/attention/ops/flashmla.py",
    FLASHMLA_INTERFACE_MODULE: "vllm/third_party/flashmla/flash_mla_interface.py",
}
#: FlashMLA's compiled kernels, imported from the release's ``.so`` files.
EXTENSION_MODULES = {"vllm._flashmla_C": OPTIONAL_FILES[0], "vllm._flashmla_extension_C": OPTIONAL_FILES[1]}
BACKEND_UTILS_FILE = "vllm/v1/attention/backends/utils.py"


# --- the stand-ins --------------------------------------------------------------------------

class _Subscriptable:
    """A base class that takes ``Base[T]`` as vLLM's generic bases do."""

    def __class_getitem__(cls, item):
        return cls


@dataclasses.dataclass
class StandInMetadata:
    """``FlashInferMLASparseMetadata``: the fields the SM90 backend reads from the common
    sparse builder's output."""

    num_reqs: int = 0
    num_actual_tokens: int = 0
    num_decodes: int = 0
    num_decode_tokens: int = 0
    num_prefills: int = 0
    query_start_loc: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    block_size: int = 0
    req_id_per_token: torch.Tensor | None = None
    prefill_use_dense_mha: bool = False


class StandInSparseBuilder(_Subscriptable):
    """``FlashInferMLASparseMetadataBuilder``: keeps the constructor's arguments; ``build``
    fills :class:`StandInMetadata` from the step's common metadata: request ids per token row,
    padding rows to request 0 (``fast.convert.request_ids``); the decode/prefill split the step
    carries; the Hopper dense-MHA routing of prefills (``fast.kvlen.prefills_use_dense_mha``:
    every prefill's seq_len <= index_topk)."""

    metadata_cls = StandInMetadata

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = layer_names
        self.vllm_config = vllm_config
        self.device = device

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        cam = common_attn_metadata
        req = request_ids(cam.query_start_loc[: cam.num_reqs + 1], cam.req_id_rows)
        topk = int(self.vllm_config.model_config.hf_text_config.index_topk)
        return self.metadata_cls(
            num_reqs=cam.num_reqs,
            num_actual_tokens=cam.num_actual_tokens,
            num_decodes=cam.num_decodes,
            num_decode_tokens=cam.num_decode_tokens,
            num_prefills=cam.num_prefills,
            query_start_loc=cam.query_start_loc,
            seq_lens=cam.seq_lens,
            block_table=cam.block_table_tensor,
            block_size=self.kv_cache_spec.block_size,
            req_id_per_token=req,
            prefill_use_dense_mha=prefills_use_dense_mha(cam, topk),
        )


@dataclasses.dataclass(kw_only=True)
class StandInSparseCommonMetadata(StandInMetadata):
    """``SparseMLACommonMetadata``: the common builder's fields that FLASHMLA_SPARSE reads
    besides the SM90 backend's (one rank, no prefill metadata of the dense-MHA path)."""

    max_query_len: int = 0
    slot_mapping: torch.Tensor | None = None
    topk_tokens: int = 2048
    decode_max_query_len: int = 0
    prefill_max_seq_len: int = 0
    prefill: Any = None
    cp_kv_cache_interleave_size: int = 1
    topk_start: int = 0  # rows of the shared top-k buffer before this layer's (0: one indexer)
    shardq: Any = None  # no sharded-query metadata: one rank


class StandInSparseCommonBuilder(StandInSparseBuilder):
    """``SparseMLACommonMetadataBuilder``: the fields its constructor sets that FLASHMLA_SPARSE's
    builder reads (model config, top-k, one rank: no context parallelism), the reorder threshold
    it is given, and :class:`StandInSparseBuilder`'s ``build`` (the step's decode/prefill split
    and dense-MHA routing)."""

    metadata_cls = StandInSparseCommonMetadata

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.model_config = vllm_config.model_config
        self.topk_tokens = int(vllm_config.model_config.hf_text_config.index_topk)
        self.pcp_world_size = 1
        self.use_pcp = False
        self.dcp_world_size = 1
        self.cp_kv_cache_interleave_size = 1
        self.reorder_batch_threshold = 1

    def _init_reorder_batch_threshold(self, reorder_batch_threshold=1, supports_spec_as_decode=False,
                                      supports_dcp_with_varlen=False) -> None:
        self.reorder_batch_threshold = reorder_batch_threshold


class StandInSparseImpl(_Subscriptable):
    """``SparseMLACommonImpl``: keeps the shapes, scale, cache dtype and the top-k buffer; one
    rank (no context parallelism), no HiSparse index group, no LSE returned for a merge.
    :meth:`_convert_logical_to_physical_topk` is what vLLM's index group does for a group of one
    layer: vLLM's own convert kernel on the step's rows."""

    is_sparse = True
    supports_dense_mha_prefill = True

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap, attn_type, kv_sharing_target_layer_name, indexer=None, topk_indices_buffer=None,
                 **mla_args) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.topk_indices_buffer = topk_indices_buffer
        self.kv_lora_rank = mla_args["kv_lora_rank"]
        self.qk_rope_head_dim = mla_args["qk_rope_head_dim"]
        self.qk_nope_head_dim = mla_args.get("qk_nope_head_dim")
        self.v_head_dim = mla_args.get("v_head_dim")
        self.dcp_world_size = 1
        self.dcp_rank = 0
        self.pcp_world_size = 1
        self.need_to_return_lse_for_decode = False
        self.index_group = None
        self.index_group_index = 0
        self.use_shardq = False

    def _convert_logical_to_physical_topk(self, logical_topk_indices, attn_metadata, *, block_stride_rows,
                                          return_valid_counts):
        convert = importlib.import_module(SPARSE_UTILS_MODULE).triton_convert_req_index_to_global_index
        return convert(
            attn_metadata.req_id_per_token[: logical_topk_indices.shape[0]],
            attn_metadata.block_table,
            logical_topk_indices,
            BLOCK_SIZE=attn_metadata.block_size,
            BLOCK_STRIDE_ROWS=block_stride_rows,
            NUM_TOPK_TOKENS=logical_topk_indices.shape[1],
            return_valid_counts=return_valid_counts,
        )


class StandInTritonKernelBase(_Subscriptable):
    pass


class _DeviceCapability(tuple):
    def __new__(cls, major: int, minor: int):
        obj = super().__new__(cls, (major, minor))
        obj.major, obj.minor = major, minor
        return obj


class _Platform:
    """``vllm.platforms.current_platform``: a CUDA platform when torch sees a GPU."""

    @property
    def device_type(self) -> str:
        return "cuda" if torch.cuda.is_available() else "cpu"

    def is_cuda(self) -> bool:
        return torch.cuda.is_available()

    def is_rocm(self) -> bool:
        return False

    def get_device_capability(self, device_id: int = 0):
        return _DeviceCapability(*torch.cuda.get_device_capability(device_id))

    def is_device_capability_family(self, capability: int, device_id: int = 0) -> bool:
        """vLLM's family test: the major version of the device's capability (90: Hopper)."""
        major, _ = self.get_device_capability(device_id)
        return major == capability // 10


#: The one platform object every stand-in module hands out.
PLATFORM = _Platform()
#: Streaming multiprocessors of an H200, the Hopper GPU the suite targets: what
#: ``num_compute_units`` answers where torch sees no GPU.
HOPPER_SM_COUNT = 132


def _num_compute_units(device_id: int | None = None) -> int:
    if not torch.cuda.is_available():
        return HOPPER_SM_COUNT
    return torch.cuda.get_device_properties(device_id or 0).multi_processor_count


_CONFIG_IN_FORCE: list[Any] = []


def _get_current_vllm_config():
    """The configuration :func:`set_current_vllm_config` put in force, else one without a model."""
    return _CONFIG_IN_FORCE[-1] if _CONFIG_IN_FORCE else types.SimpleNamespace(model_config=None)


@contextlib.contextmanager
def set_current_vllm_config(config):
    """vLLM's context that makes ``config`` the one its constructors read."""
    _CONFIG_IN_FORCE.append(config)
    try:
        yield config
    finally:
        _CONFIG_IN_FORCE.pop()


class _AttentionCGSupport(enum.Enum):
    """The CUDA-graph support levels a backend class names."""

    ALWAYS = 3
    UNIFORM_BATCH = 2
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    NEVER = 0


class _KVQuantMode(enum.IntEnum):
    """The cache quantisation modes a backend class compares against (NONE: unquantised)."""

    NONE = 0
    FP8_PER_TENSOR = 1


def _is_quantized_kv_cache(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype != "auto"


class _MultipleOf(int):
    pass


#: The stand-ins of vLLM's ``MultipleOf`` and ``DeviceCapability``, for callers that build or test them.
MultipleOf = _MultipleOf
DeviceCapability = _DeviceCapability


def _logger(name: str) -> logging.Logger:
    log = logging.getLogger(name)
    for method in ("info_once", "warning_once", "debug_once"):
        if not hasattr(log, method):
            setattr(log, method, getattr(log, method.split("_")[0]))
    return log


class _DcpGroup:
    rank_in_group = 0
    world_size = 1


def triton_utils() -> dict[str, Any]:
    import triton
    import triton.language as tl

    return {"triton": triton, "tl": tl, "HAS_TRITON": True}


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


# --- FLASHMLA_SPARSE's stand-ins: work vLLM's _C library does, and engine plumbing -----------

def concat_mla_q(ql_nope: torch.Tensor, q_pe: torch.Tensor, q_out: torch.Tensor) -> None:
    """vLLM's ``concat_mla_q``: each head's q_nope then q_pe into ``q_out [T, >= H, 512 + R]``
    (heads past ``ql_nope``'s, padding for the kernel, are left as they are)."""
    heads, nope = ql_nope.shape[1], ql_nope.shape[2]
    q_out[:, :heads, :nope].copy_(ql_nope)
    q_out[:, :heads, nope : nope + q_pe.shape[2]].copy_(q_pe)


def gathered_cache_rows(block_table: torch.Tensor, workspace_starts: torch.Tensor, batch_size: int,
                        workspace_rows: int, block_size: int, block_stride_rows: int,
                        seq_starts: torch.Tensor | None = None) -> torch.Tensor:
    """int64 ``[workspace_rows]``: the cache row (block x block stride + offset) each workspace
    row of ``cp_gather_and_upconvert_fp8_kv_cache`` holds. Request ``i`` fills the rows from its
    workspace start to the next request's (the workspace's end for the last) with its tokens in
    order (from ``seq_starts[i]`` where given), block ``block_table[i, token // block_size]``."""
    starts = workspace_starts[:batch_size].to("cpu", torch.int64).tolist()
    ends = starts[1:] + [workspace_rows]
    table = block_table[:batch_size].to("cpu", torch.int64)
    offsets = [0] * batch_size if seq_starts is None else seq_starts[:batch_size].to("cpu", torch.int64).tolist()
    rows = torch.full((workspace_rows,), -1, dtype=torch.int64)
    for i, (start, end, first) in enumerate(zip(starts, ends, offsets, strict=True)):
        tokens = torch.arange(first, first + end - start)
        rows[start:end] = table[i, tokens // block_size] * block_stride_rows + tokens % block_size
    return rows


def cp_gather_and_upconvert_fp8_kv_cache(src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
                                         workspace_starts: torch.Tensor, batch_size: int,
                                         seq_starts: torch.Tensor | None = None, host_cache=None, host_row_ids=None,
                                         device_row_ids=None) -> None:
    """vLLM's ``cp_gather_and_upconvert_fp8_kv_cache``: each prefill request's context rows of
    the fp8 cache ``[num_blocks, block_size, 656]`` (FlashMLA's layout), upconverted to bf16
    ``[rows, 576]`` at its workspace start (:func:`gathered_cache_rows`). The host-cache
    arguments belong to HiSparse, which the suite does not run."""
    if host_cache is not None:
        raise NotImplementedError("stand-in: the HiSparse host cache is not modelled")
    cache = src_cache.view(torch.uint8)
    token_bytes = cache.shape[-1]
    rows = gathered_cache_rows(block_table, workspace_starts, batch_size, dst.shape[0], cache.shape[1],
                               cache.stride(0) // token_bytes, seq_starts)
    flat = cache.as_strided(((cache.shape[0] - 1) * (cache.stride(0) // token_bytes) + cache.shape[1], token_bytes),
                            (token_bytes, 1))
    dst.copy_(upconvert(flat[rows.to(flat.device)]))


def cp_gather_and_upconvert_nvfp4_kv_cache(*args, **kwargs) -> None:
    """vLLM's upconvert of the NVFP4 cache, SM100's only: refused (the suite runs Hopper)."""
    raise NotImplementedError("stand-in: the nvfp4_ds_mla cache is SM100's; the suite runs FlashMLA on SM90")


class StandInAttentionSpec:
    """``AttentionSpec``: a type to test against (the suite hands the builder a namespace with
    the fields it reads, which is no instance of it)."""


class StandInHiSparseIndexGroup:
    """``HiSparseMLAIndexGroup``: never made; the suite runs without HiSparse's host cache, so
    vLLM's ``isinstance`` tests of its index group are False."""


class StandInWorkspaceManager:
    """vLLM's workspace manager as FLASHMLA_SPARSE uses it: ``get_simultaneous(*(shape, dtype))``
    carves one uninitialised tensor per spec out of one byte buffer per device, which grows to
    the largest request and is shared by every layer and call, as the engine's is (a caller that
    keeps a view keeps the storage it was carved from). :attr:`device` is set by the layer that
    drives the backend."""

    ALIGN = 256  # bytes between the starts of two carved tensors

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self._buffers: dict[str, torch.Tensor] = {}

    def get_simultaneous(self, *specs) -> list[torch.Tensor]:
        sizes = [-(-math.prod(shape) * dtype.itemsize // self.ALIGN) * self.ALIGN for shape, dtype in specs]
        key = str(self.device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < sum(sizes):
            buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
            self._buffers[key] = buffer
        carved, offset = [], 0
        for (shape, dtype), size in zip(specs, sizes, strict=True):
            nbytes = math.prod(shape) * dtype.itemsize
            carved.append(buffer[offset : offset + nbytes].view(dtype).view(tuple(shape)))
            offset += size
        return carved


WORKSPACE = StandInWorkspaceManager()


def async_tensor_h2d(data, dtype=None, target_device=None, pin_memory=False, device=None, out=None):
    """vLLM's host-to-device copy: a tensor of ``data`` on the device named, or ``data`` copied
    into the first entries of ``out``."""
    if out is None:
        return torch.as_tensor(np.asarray(data), dtype=dtype, device=target_device or device)
    values = torch.as_tensor(np.asarray(data), dtype=out.dtype).reshape(-1)
    out[: values.numel()].copy_(values)
    return out


def _current_stream():
    return torch.cuda.current_stream() if torch.cuda.is_available() else None


def run_release_nodes(path, nodes: list, namespace: dict[str, Any]) -> dict[str, Any]:
    """The statements ``nodes`` (of the release's file ``path``, parsed) run in ``namespace``,
    compiled as the file is (postponed annotations, line numbers of the file)."""
    exec(compile(ast.Module(body=list(nodes), type_ignores=[]), str(path), "exec",
                 flags=__future__.annotations.compiler_flag, dont_inherit=True), namespace)
    return namespace


def release_functions(source: VllmSource, relative: str, names: tuple[str, ...]) -> dict[str, Any]:
    """The top-level functions ``names`` of the release's file ``relative``, compiled from its
    own source (the rest of the file, and its imports, left out); they may use torch, numpy and
    math. A name the file does not define as a function is missing from the result."""
    path = source.path_of(relative)
    tree = ast.parse(path.read_text())
    picked = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    namespace: dict[str, Any] = {"torch": torch, "np": np, "math": math, "__name__": module_name_of(relative)}
    run_release_nodes(path, picked, namespace)
    return {n: namespace[n] for n in names if n in namespace}


#: The functions of vLLM's ``backends/utils.py`` that FLASHMLA_SPARSE imports.
BACKEND_UTILS_FUNCTIONS = ("get_dcp_local_seq_lens", "reshape_attn_output_for_spec_decode",
                           "reshape_query_for_spec_decode", "split_prefill_chunks")


@dataclasses.dataclass(frozen=True)
class Shim:
    name: str
    why: str
    attrs: Any  # dict, or a callable returning one (evaluated when the shim is made)
    from_release: bool = False  # attrs is called with the release's VllmSource


_ENVS = {
    # the JIT warm-up's thread pool: one thread, the kernels compile at their first launch
    "VLLM_TRITON_JIT_WARMUP_NUM_THREADS": 1,
    "VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE": 394 * 1024 * 1024,
    "is_set": lambda name: False,
}

#: Every vLLM module the backend imports that is not executed from the release's files.
SHIMS = (
    Shim("vllm.envs", "environment settings of the engine; the defaults of the settings read", _ENVS),
    Shim("vllm.config", "engine configuration objects, built by the suite per case",
         {"VllmConfig": object, "get_current_vllm_config": _get_current_vllm_config,
          "set_current_vllm_config": set_current_vllm_config}),
    Shim("vllm.config.cache", "the cache dtype type alias", {"CacheDType": str}),
    Shim("vllm.logger", "logging", {"init_logger": _logger}),
    Shim("vllm.platforms", "the platform object: CUDA where torch sees a GPU", {"current_platform": PLATFORM}),
    Shim("vllm.platforms.interface", "the capability type", {"DeviceCapability": _DeviceCapability}),
    Shim("vllm.distributed", "one rank, no context parallelism",
         {"get_dcp_group": lambda: _DcpGroup(), "is_global_first_rank": lambda: True}),
    Shim("vllm.triton_utils", "vLLM's re-export of triton and triton.language", triton_utils),
    Shim("vllm.utils.flashinfer", "the FlashInfer feature probe of backend selection",
         {"has_flashinfer_sm90_nope_mla": lambda: True}),
    Shim("vllm.v1.worker.block_table", "the block-table width rule of the warm-up keys",
         {"get_block_table_width": lambda blocks, block_size: blocks}),
    Shim("vllm.v1.kv_cache_interface", "cache-spec types (the suite hands a spec with the fields read)",
         {"AttentionSpec": StandInAttentionSpec, "KVCacheSpec": object, "KVCacheLayout": object,
          "KVQuantMode": _KVQuantMode,
          "get_block_table_width": lambda blocks, block_size: blocks, "is_quantized_kv_cache": _is_quantized_kv_cache}),
    Shim("vllm.v1.attention.backend", "the backend interface's base classes and metadata type",
         {"AttentionBackend": object, "AttentionLayer": object, "CommonAttentionMetadata": object,
          "MLAAttentionImpl": StandInSparseImpl, "MultipleOf": _MultipleOf, "AttentionCGSupport": _AttentionCGSupport}),
    Shim("vllm.v1.attention.backends.mla.flashinfer_mla_sparse",
         "the common sparse builder and metadata: fields, request ids per row, the decode/prefill split",
         {"FlashInferMLASparseMetadata": StandInMetadata, "FlashInferMLASparseMetadataBuilder": StandInSparseBuilder}),
    Shim("vllm.model_executor.layers.attention.sparse_mla_attention",
         "the common sparse impl's constructor, the common builder's fields and its metadata",
         {"SparseMLACommonImpl": StandInSparseImpl, "SparseMLACommonMetadata": StandInSparseCommonMetadata,
          "SparseMLACommonMetadataBuilder": StandInSparseCommonBuilder}),
)
SHIMS_BY_NAME = {s.name: s for s in SHIMS}

#: The stand-ins only FLASHMLA_SPARSE imports, served while :func:`load_flashmla_module` runs.
FLASHMLA_SHIMS = (
    Shim("vllm._custom_ops", "two of vLLM's _C kernels, re-created in torch (q concat, fp8 cache upconvert)",
         {"concat_mla_q": concat_mla_q, "cp_gather_and_upconvert_fp8_kv_cache": cp_gather_and_upconvert_fp8_kv_cache,
          "cp_gather_and_upconvert_nvfp4_kv_cache": cp_gather_and_upconvert_nvfp4_kv_cache}),
    Shim("vllm.distributed.parallel_state", "one rank, no context parallelism", {"get_dcp_group": lambda: _DcpGroup()}),
    Shim("vllm.utils.platform_utils", "the SM count (an H200's where torch sees no GPU)",
         {"num_compute_units": _num_compute_units}),
    Shim("vllm.utils.torch_utils", "host-to-device copies and the stream (the suite's device, one stream)",
         {"async_tensor_h2d": async_tensor_h2d, "current_stream": _current_stream,
          "is_quantized_kv_cache": _is_quantized_kv_cache}),
    Shim("vllm.v1.attention.backends.mla.index_group", "HiSparse's index group (not run)",
         {"HiSparseMLAIndexGroup": StandInHiSparseIndexGroup}),
    Shim("vllm.v1.attention.backends.utils", "batch reshapes and prefill chunks, compiled from the release's file",
         lambda source: release_functions(source, BACKEND_UTILS_FILE, BACKEND_UTILS_FUNCTIONS), from_release=True),
    Shim("vllm.v1.worker.workspace", "the engine's shared workspace (StandInWorkspaceManager)",
         {"current_workspace_manager": lambda: WORKSPACE}),
)
FLASHMLA_SHIMS_BY_NAME = {s.name: s for s in FLASHMLA_SHIMS}


def shim_attributes(shim: Shim, source: VllmSource | None = None) -> dict[str, Any]:
    """The attributes a stand-in module gets (``source``: the release, for ``from_release``)."""
    if shim.from_release:
        return shim.attrs(source)
    return shim.attrs() if callable(shim.attrs) else dict(shim.attrs)


def _make_shim(shim: Shim, source: VllmSource | None = None) -> types.ModuleType:
    module = types.ModuleType(shim.name, f"stand-in: {shim.why}")
    attrs = shim_attributes(shim, source)
    module.__dict__.update(attrs)
    module.__sparse_mla_stand_in__ = shim.why

    def missing(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise ShimGap(f"vLLM's code reads {shim.name}.{attr}, which the stand-in for {shim.name} "
                      f"({shim.why}) lacks: add it in backends/vllm/shims.py")

    module.__getattr__ = missing
    return module


def _parent_names() -> set[str]:
    """Every name that has a loaded or stood-in module below it."""
    names = set()
    every = (list(REAL_MODULES) + list(FLASHMLA_REAL_MODULES) + list(SHIMS_BY_NAME) + list(FLASHMLA_SHIMS_BY_NAME)
             + list(EXTENSION_MODULES))
    for full in every:
        parts = full.split(".")
        names.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return names


class _Loader(importlib.abc.Loader):
    def __init__(self, finder: VllmFinder):
        self.finder = finder

    def create_module(self, spec):
        shim = SHIMS_BY_NAME.get(spec.name) or FLASHMLA_SHIMS_BY_NAME.get(spec.name)
        if shim is not None:
            module = _make_shim(shim, self.finder.source)
            if spec.submodule_search_locations is not None:
                module.__path__ = []
            return module
        return None

    def exec_module(self, module):
        name = module.__name__
        if name in SHIMS_BY_NAME or name in FLASHMLA_SHIMS_BY_NAME:
            return
        relative = REAL_MODULES.get(name) or FLASHMLA_REAL_MODULES.get(name)
        if relative is not None:
            path = self.finder.source.path_of(relative)
            module.__file__ = str(path)
            code = compile(path.read_bytes(), str(path), "exec")
            exec(code, module.__dict__)  # vLLM's module, as it ships
            return
        module.__path__ = []  # a package that only holds what is loaded or stood in


class VllmFinder(importlib.abc.MetaPathFinder):
    """Serves every ``vllm`` import: the release's own files (FlashMLA's compiled kernels
    included), the stand-ins (FLASHMLA_SPARSE's while :attr:`flashmla_scope` is set), and the
    packages between them; anything else is a :class:`ShimGap`."""

    def __init__(self, source: VllmSource):
        self.source = source
        self.parents = _parent_names()
        self.flashmla_scope = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != ROOT and not fullname.startswith(ROOT + "."):
            return None
        if fullname in EXTENSION_MODULES:
            return self._extension_spec(fullname)
        scoped = self.flashmla_scope and fullname in FLASHMLA_SHIMS_BY_NAME
        if (fullname in REAL_MODULES or fullname in FLASHMLA_REAL_MODULES or fullname in SHIMS_BY_NAME or scoped
                or fullname in self.parents):
            # Stand-ins are packages too, so that an import below one reaches this finder.
            is_package = fullname in self.parents or fullname in SHIMS_BY_NAME or scoped
            return importlib.machinery.ModuleSpec(fullname, _Loader(self), is_package=is_package)
        raise ShimGap(f"vLLM {self.source.version}'s code imports {fullname}, which the suite neither loads from "
                      f"the release nor stands in: add a stand-in in backends/vllm/shims.py")

    def _extension_spec(self, fullname: str):
        """FlashMLA's compiled kernels from the release's ``.so`` (an ``ImportError`` naming the
        file where the source lacks it, which vLLM's ops module takes as "not available")."""
        path = self.source.path_of(EXTENSION_MODULES[fullname])
        if not path.is_file():
            raise ShimGap(f"{self.source.describe()} lacks {EXTENSION_MODULES[fullname]} (a --modules-only slice?): "
                          f"write a slice with FlashMLA's kernels: {SLICE_COMMAND}")
        return importlib.util.spec_from_file_location(fullname, path)


_LOADED: dict[str, Any] = {}
_LOADED_FLASHMLA: dict[str, Any] = {}


def _loaded_root() -> str | None:
    return next(iter(_LOADED), None) or next(iter(_LOADED_FLASHMLA), None)


def _finder_for(source: VllmSource) -> VllmFinder:
    """The process's :class:`VllmFinder` for ``source``, installed first on ``sys.meta_path``
    once; a process that loaded another release, or imported a vllm package itself, is refused."""
    loaded = _loaded_root()
    if loaded is not None and loaded != str(source.root):
        raise RuntimeError(f"this process already loaded vLLM from {loaded}; one vLLM per process")
    finder = next((f for f in sys.meta_path if isinstance(f, VllmFinder)), None)
    if finder is not None:
        return finder
    present = sys.modules.get(ROOT)
    if present is not None:
        raise RuntimeError(f"a vllm package is already imported here ({getattr(present, '__file__', present)}); "
                           "run the suite in a fresh process to load another vLLM")
    finder = VllmFinder(source)
    sys.meta_path.insert(0, finder)
    return finder


def load_sm90_module(source: VllmSource):
    """vLLM's ``flashinfer_mla_sparse_sm90`` module of ``source`` (once per process).

    ``installed`` imports the installed vllm as it is, stand-ins aside. Any other source
    installs :class:`VllmFinder` first on ``sys.meta_path``; a process that already imported a
    different vllm is refused."""
    key = str(source.root)
    if key in _LOADED:
        return _LOADED[key]
    if source.installed:
        if _loaded_root() not in (None, key):
            raise RuntimeError(f"this process already loaded vLLM from {_loaded_root()}; one vLLM per process")
        module = importlib.import_module(SM90_MODULE)
    else:
        _finder_for(source)
        module = importlib.import_module(SM90_MODULE)
    _LOADED[key] = module
    return module


def _forget_flashmla_shims() -> None:
    """Take FLASHMLA_SPARSE's stand-ins out of ``sys.modules`` and their parents (vLLM's loaded
    modules keep the names they imported from them)."""
    for name in FLASHMLA_SHIMS_BY_NAME:
        sys.modules.pop(name, None)
        parent_name, _, child = name.rpartition(".")
        parent = sys.modules.get(parent_name)
        if parent is not None and child in parent.__dict__:
            delattr(parent, child)


def load_flashmla_module(source: VllmSource):
    """vLLM's ``flashmla_sparse`` module of ``source`` (once per process), with vLLM's FlashMLA
    ops module and FlashMLA's interface behind it; FLASHMLA_SPARSE's stand-ins are served for
    this import only. The ops module decides at import whether FlashMLA's kernels are available
    (a CUDA platform, the ``.so`` files importable), as it does in the engine."""
    key = str(source.root)
    if key in _LOADED_FLASHMLA:
        return _LOADED_FLASHMLA[key]
    if source.installed:
        if _loaded_root() not in (None, key):
            raise RuntimeError(f"this process already loaded vLLM from {_loaded_root()}; one vLLM per process")
        module = importlib.import_module(FLASHMLA_SPARSE_MODULE)
    else:
        finder = _finder_for(source)
        finder.flashmla_scope = True
        try:
            module = importlib.import_module(FLASHMLA_SPARSE_MODULE)
        finally:
            finder.flashmla_scope = False
            _forget_flashmla_shims()
    _LOADED_FLASHMLA[key] = module
    return module


def stand_ins_in_use() -> list[str]:
    """The stand-in modules loaded in this process."""
    return sorted(n for n, m in sys.modules.items() if getattr(m, "__sparse_mla_stand_in__", None))


__all__ = ["FLASHMLA_SHIMS", "SHIMS", "ShimGap", "StandInMetadata", "VllmFinder", "load_flashmla_module",
           "load_sm90_module", "stand_ins_in_use"]
