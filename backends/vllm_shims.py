"""Loading vLLM's SM90 sparse-MLA backend from a release's files, with named stand-ins for the
parts of vLLM it imports but the code under test does not use.

The modules of :data:`backends.vllm_source.MODULE_FILES` (the backend, its convert kernel and
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
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import types
from typing import Any

import torch

from fast.convert import request_ids
from fast.kvlen import prefills_use_dense_mha

from .vllm_source import MODULE_FILES, VllmSource

ROOT = "vllm"
SM90_MODULE = "vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90"
SPARSE_UTILS_MODULE = "vllm.v1.attention.backends.mla.sparse_utils"


class ShimGap(ImportError):
    """vLLM's code needs a module or attribute that neither the release's loaded files nor a
    stand-in provide."""


def module_name_of(relative: str) -> str:
    return relative[: -len(".py")].replace("/", ".")


REAL_MODULES = {module_name_of(f): f for f in MODULE_FILES}


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


class StandInSparseImpl(_Subscriptable):
    """``SparseMLACommonImpl``: keeps the shapes, scale, cache dtype and the top-k buffer."""

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
        self.dcp_world_size = 1


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


class _MultipleOf(int):
    pass


def _logger(name: str) -> logging.Logger:
    log = logging.getLogger(name)
    for method in ("info_once", "warning_once", "debug_once"):
        if not hasattr(log, method):
            setattr(log, method, getattr(log, method.split("_")[0]))
    return log


class _DcpGroup:
    rank_in_group = 0
    world_size = 1


def _triton_utils() -> dict[str, Any]:
    import triton
    import triton.language as tl

    return {"triton": triton, "tl": tl, "HAS_TRITON": True}


def _cdiv(a: int, b: int) -> int:
    return -(a // -b)


@dataclasses.dataclass(frozen=True)
class Shim:
    name: str
    why: str
    attrs: Any  # dict, or a callable returning one (evaluated when the shim is made)


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
         {"VllmConfig": object, "get_current_vllm_config": lambda: types.SimpleNamespace(model_config=None)}),
    Shim("vllm.config.cache", "the cache dtype type alias", {"CacheDType": str}),
    Shim("vllm.logger", "logging", {"init_logger": _logger}),
    Shim("vllm.platforms", "the platform object: CUDA where torch sees a GPU",
         lambda: {"current_platform": _Platform()}),
    Shim("vllm.platforms.interface", "the capability type", {"DeviceCapability": _DeviceCapability}),
    Shim("vllm.distributed", "one rank, no context parallelism",
         {"get_dcp_group": lambda: _DcpGroup(), "is_global_first_rank": lambda: True}),
    Shim("vllm.triton_utils", "vLLM's re-export of triton and triton.language", _triton_utils),
    Shim("vllm.utils.flashinfer", "the FlashInfer feature probe of backend selection",
         {"has_flashinfer_sm90_nope_mla": lambda: True}),
    Shim("vllm.v1.worker.block_table", "the block-table width rule of the warm-up keys",
         {"get_block_table_width": lambda blocks, block_size: blocks}),
    Shim("vllm.v1.kv_cache_interface", "cache-spec types (the suite hands a spec with the fields read)",
         {"AttentionSpec": object, "KVCacheSpec": object, "KVCacheLayout": object,
          "get_block_table_width": lambda blocks, block_size: blocks, "is_quantized_kv_cache": lambda d: d != "auto"}),
    Shim("vllm.v1.attention.backend", "the backend interface's base classes and metadata type",
         {"AttentionBackend": object, "AttentionLayer": object, "CommonAttentionMetadata": object,
          "MLAAttentionImpl": StandInSparseImpl, "MultipleOf": _MultipleOf, "AttentionCGSupport": object}),
    Shim("vllm.v1.attention.backends.mla.flashinfer_mla_sparse",
         "the common sparse builder and metadata: fields, request ids per row, the decode/prefill split",
         {"FlashInferMLASparseMetadata": StandInMetadata, "FlashInferMLASparseMetadataBuilder": StandInSparseBuilder}),
    Shim("vllm.model_executor.layers.attention.sparse_mla_attention", "the common sparse impl's constructor",
         {"SparseMLACommonImpl": StandInSparseImpl}),
)
SHIMS_BY_NAME = {s.name: s for s in SHIMS}


def _make_shim(shim: Shim) -> types.ModuleType:
    module = types.ModuleType(shim.name, f"stand-in: {shim.why}")
    attrs = shim.attrs() if callable(shim.attrs) else shim.attrs
    module.__dict__.update(attrs)
    module.__sparse_mla_stand_in__ = shim.why

    def missing(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise ShimGap(f"vLLM's code reads {shim.name}.{attr}, which the stand-in for {shim.name} "
                      f"({shim.why}) lacks: add it in backends/vllm_shims.py")

    module.__getattr__ = missing
    return module


def _parent_names() -> set[str]:
    """Every name that has a loaded or stood-in module below it."""
    names = set()
    for full in list(REAL_MODULES) + list(SHIMS_BY_NAME):
        parts = full.split(".")
        names.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return names


class _Loader(importlib.abc.Loader):
    def __init__(self, finder: VllmFinder):
        self.finder = finder

    def create_module(self, spec):
        if spec.name in SHIMS_BY_NAME:
            module = _make_shim(SHIMS_BY_NAME[spec.name])
            if spec.submodule_search_locations is not None:
                module.__path__ = []
            return module
        return None

    def exec_module(self, module):
        name = module.__name__
        if name in SHIMS_BY_NAME:
            return
        if name in REAL_MODULES:
            path = self.finder.source.path_of(REAL_MODULES[name])
            module.__file__ = str(path)
            code = compile(path.read_bytes(), str(path), "exec")
            exec(code, module.__dict__)  # vLLM's module, as it ships
            return
        module.__path__ = []  # a package that only holds what is loaded or stood in


class VllmFinder(importlib.abc.MetaPathFinder):
    """Serves every ``vllm`` import: the release's own files, the stand-ins, and the packages
    between them; anything else is a :class:`ShimGap`."""

    def __init__(self, source: VllmSource):
        self.source = source
        self.parents = _parent_names()

    def find_spec(self, fullname, path=None, target=None):
        if fullname != ROOT and not fullname.startswith(ROOT + "."):
            return None
        if fullname in REAL_MODULES or fullname in SHIMS_BY_NAME or fullname in self.parents:
            # Stand-ins are packages too, so that an import below one reaches this finder.
            is_package = fullname in self.parents or fullname in SHIMS_BY_NAME
            return importlib.machinery.ModuleSpec(fullname, _Loader(self), is_package=is_package)
        raise ShimGap(f"vLLM {self.source.version}'s code imports {fullname}, which the suite neither loads from "
                      f"the release nor stands in: add a stand-in in backends/vllm_shims.py")


_LOADED: dict[str, Any] = {}


def load_sm90_module(source: VllmSource):
    """vLLM's ``flashinfer_mla_sparse_sm90`` module of ``source`` (once per process).

    ``installed`` imports the installed vllm as it is, stand-ins aside. Any other source
    installs :class:`VllmFinder` first on ``sys.meta_path``; a process that already imported a
    different vllm is refused."""
    key = str(source.root)
    if key in _LOADED:
        return _LOADED[key]
    if _LOADED:
        raise RuntimeError(f"this process already loaded vLLM from {next(iter(_LOADED))}; one vLLM per process")
    if source.installed:
        module = importlib.import_module(SM90_MODULE)
        _LOADED[key] = module
        return module
    present = sys.modules.get(ROOT)
    if present is not None and not any(isinstance(f, VllmFinder) for f in sys.meta_path):
        raise RuntimeError(f"a vllm package is already imported here ({getattr(present, '__file__', present)}); "
                           "run the suite in a fresh process to load another vLLM")
    sys.meta_path.insert(0, VllmFinder(source))
    module = importlib.import_module(SM90_MODULE)
    _LOADED[key] = module
    return module


def stand_ins_in_use() -> list[str]:
    """The stand-in modules loaded in this process."""
    return sorted(n for n, m in sys.modules.items() if getattr(m, "__sparse_mla_stand_in__", None))


__all__ = ["SHIMS", "ShimGap", "StandInMetadata", "VllmFinder", "load_sm90_module", "stand_ins_in_use"]
