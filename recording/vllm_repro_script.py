"""Standalone reproducer of a failing case of vLLM's SM90 sparse-MLA backend
(``FlashInferMLASparseSM90``), on FlashInfer's ``BatchMLAPagedAttentionWrapper``.

    python3 repro.py VLLM_ROOT [--device cuda|cpu] [--data case.pt]

Needs torch (with Triton), FlashInfer and a vLLM release's files: VLLM_ROOT holds ``vllm/`` (a
wheel unpacked, a slice, a checkout). vLLM's backend module, its convert kernel
(``sparse_utils.py``), the launch machinery of its Triton kernels and ``utils/math_utils.py``
run from VLLM_ROOT as they ship; every other vLLM import is a stand-in defined below (engine
configuration, platform, logging, one rank, and the base classes that only hold fields). The
common builder's request id of each token row and its routing of prefills to dense MHA are read
from the case's data, as the engine computed them.

Every step of the case runs in order through one layer (one builder, one impl, one top-k
buffer, one KV cache), as the test ran it, so a kept plan, the clamp of a kept plan or a replan
carries into the next step: vLLM's ``build()`` (host lengths, plan, clamp), the indexer's rows
written into the top-k buffer, vLLM's ``forward_mqa()`` (convert, pack, FlashInfer's run). After
``build()`` FlashInfer's schedule is read back from the wrapper (its ``_plan_info`` fields and
int workspace): each row's executed length is the end of its work items' coverage from 0, and the
slots it is handed are its kv_indices over that span. Per row that is off the script prints its
valid count (the non -1 entries of its converted row), the host length and the planned and
executed lengths, and the output's max error against a float64 softmax over (i) the row's valid
slots (the contract) and (ii) the slots the kernel was handed.

Verdict: "vLLM's plan/clamp" where a row's executed length differs from its valid count or its
handed slots are not its valid slots (as multisets), or build() raised; "FlashInfer's kernel"
where every row was handed its valid slots and the output is beyond the tolerance against the
float64 softmax over them (the budget of the tolerance policy below: the error that working
precision alone costs, computed here over the same slots and split as the kernel split each
row, times a factor, plus a floor; NaN never passes); else "nothing: the step is right on this
install". Exit status 0 right, 1 wrong, 2 usage, 4 it cannot run here (torch, Triton or FlashInfer
not importable, or no device of the kind asked for): nothing was judged.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import logging
import sys
import types
from pathlib import Path
from types import SimpleNamespace

CANNOT_RUN_HERE = 4


def cannot_run_here(why: str) -> int:
    """One line on stderr for what this machine lacks; the exit status that says so."""
    print(f"cannot run here: {why}; nothing was judged", file=sys.stderr)
    return CANNOT_RUN_HERE


try:
    import torch
except ImportError as missing:
    sys.exit(cannot_run_here(f"{missing.name or missing} is not importable (this reproducer needs torch with Triton, "
                             "FlashInfer and a vLLM release's files)"))

# --- written with the case ---------------------------------------------------------------------
CASE = {}
# The tolerance policy's factors for the case's KV dtype and its absolute floor.
MAX_FACTOR, MEAN_FACTOR = 2.0, 1.5
ABS_FLOOR = 1e-05
# --- end of what is written with the case ------------------------------------------------------

SM90_MODULE = "vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90"
#: vLLM's files run as they ship.
REAL_FILES = (
    "vllm/v1/attention/backends/mla/flashinfer_mla_sparse_sm90.py",
    "vllm/v1/attention/backends/mla/sparse_utils.py",
    "vllm/model_executor/warmup/jit_warmup.py",
    "vllm/model_executor/warmup/jit_warmup_triton_helper.py",
    "vllm/utils/math_utils.py",
)
LAYER_NAME = "model.layers.0.self_attn.attn"
#: Fields of FlashInfer's MLAPlanInfo (``scheduler.cuh``): clusters, and the byte offsets of the
#: per-work q_indptr, kv_indptr, kv_start, kv_end and of work_indptr in the int workspace.
PLAN_INFO_LEN = 18
NUM_CLUSTERS, Q_INDPTR, KV_INDPTR, KV_START, KV_END, WORK_INDPTR = 1, 2, 3, 13, 14, 15


# --- stand-ins for the vLLM modules the backend imports but does not run --------------------


class _Generic:
    """A base class that takes ``Base[T]``."""

    def __class_getitem__(cls, item):
        return cls


@dataclasses.dataclass
class SparseMetadata:
    """``FlashInferMLASparseMetadata``: the fields the SM90 backend reads."""

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


class SparseBuilder(_Generic):
    """``FlashInferMLASparseMetadataBuilder``: keeps its arguments; ``build`` fills the metadata
    from the step's common metadata (request ids per token row and the dense-MHA routing as the
    case recorded them)."""

    metadata_cls = SparseMetadata

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        self.kv_cache_spec, self.layer_names, self.vllm_config, self.device = (kv_cache_spec, layer_names,
                                                                               vllm_config, device)

    def build(self, common_prefix_len, cam, fast_build=False):
        return self.metadata_cls(
            num_reqs=cam.num_reqs, num_actual_tokens=cam.num_actual_tokens, num_decodes=cam.num_decodes,
            num_decode_tokens=cam.num_decode_tokens, num_prefills=cam.num_prefills,
            query_start_loc=cam.query_start_loc, seq_lens=cam.seq_lens, block_table=cam.block_table_tensor,
            block_size=self.kv_cache_spec.block_size, req_id_per_token=cam.req_id_per_token,
            prefill_use_dense_mha=cam.prefill_use_dense_mha)


class SparseImpl(_Generic):
    """``SparseMLACommonImpl``: keeps shapes, scale, cache dtype and the top-k buffer; one rank;
    its convert step is vLLM's own convert kernel on the step's rows."""

    is_sparse = True
    supports_dense_mha_prefill = True

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap, attn_type, kv_sharing_target_layer_name, indexer=None, topk_indices_buffer=None,
                 **mla_args):
        self.num_heads, self.head_size, self.scale, self.num_kv_heads = num_heads, head_size, scale, num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.topk_indices_buffer = topk_indices_buffer
        self.kv_lora_rank = mla_args["kv_lora_rank"]
        self.qk_rope_head_dim = mla_args["qk_rope_head_dim"]
        self.qk_nope_head_dim = mla_args.get("qk_nope_head_dim")
        self.v_head_dim = mla_args.get("v_head_dim")
        self.dcp_world_size, self.dcp_rank, self.pcp_world_size = 1, 0, 1
        self.need_to_return_lse_for_decode = False
        self.index_group, self.index_group_index, self.use_shardq = None, 0, False

    def _convert_logical_to_physical_topk(self, logical_topk_indices, attn_metadata, *, block_stride_rows,
                                          return_valid_counts):
        convert = sys.modules["vllm.v1.attention.backends.mla.sparse_utils"].triton_convert_req_index_to_global_index
        return convert(attn_metadata.req_id_per_token[: logical_topk_indices.shape[0]], attn_metadata.block_table,
                       logical_topk_indices, BLOCK_SIZE=attn_metadata.block_size, BLOCK_STRIDE_ROWS=block_stride_rows,
                       NUM_TOPK_TOKENS=logical_topk_indices.shape[1], return_valid_counts=return_valid_counts)


class _Capability(tuple):
    def __new__(cls, major, minor):
        obj = super().__new__(cls, (major, minor))
        obj.major, obj.minor = major, minor
        return obj


class _Platform:
    """``current_platform``: CUDA where torch sees a GPU."""

    @property
    def device_type(self):
        return "cuda" if torch.cuda.is_available() else "cpu"

    def is_cuda(self):
        return torch.cuda.is_available()

    def is_rocm(self):
        return False

    def get_device_capability(self, device_id=0):
        return _Capability(*torch.cuda.get_device_capability(device_id))

    def is_device_capability_family(self, capability, device_id=0):
        return self.get_device_capability(device_id)[0] == capability // 10


class _CGSupport(enum.Enum):
    ALWAYS = 3
    UNIFORM_BATCH = 2
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    NEVER = 0


class _KVQuantMode(enum.IntEnum):
    NONE = 0
    FP8_PER_TENSOR = 1


class _MultipleOf(int):
    pass


class _AttentionSpec:
    pass


class _DcpGroup:
    rank_in_group = 0
    world_size = 1


@contextlib.contextmanager
def _config_in_force(config):
    yield config


def _logger(name):
    log = logging.getLogger(name)
    for method in ("info_once", "warning_once", "debug_once"):
        if not hasattr(log, method):
            setattr(log, method, getattr(log, method.split("_")[0]))
    return log


def _triton_utils():
    import triton
    import triton.language as tl

    return {"triton": triton, "tl": tl, "HAS_TRITON": True}


def _block_table_width(blocks, block_size):
    return blocks


def stand_ins():
    """Module name -> the attributes of its stand-in."""
    return {
        "vllm.envs": {"VLLM_TRITON_JIT_WARMUP_NUM_THREADS": 1, "VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE": 394 << 20,
                      "is_set": lambda name: False},
        "vllm.config": {"VllmConfig": object, "get_current_vllm_config": lambda: SimpleNamespace(model_config=None),
                        "set_current_vllm_config": _config_in_force},
        "vllm.config.cache": {"CacheDType": str},
        "vllm.logger": {"init_logger": _logger},
        "vllm.platforms": {"current_platform": _Platform()},
        "vllm.platforms.interface": {"DeviceCapability": _Capability},
        "vllm.distributed": {"get_dcp_group": _DcpGroup, "is_global_first_rank": lambda: True},
        "vllm.triton_utils": _triton_utils(),
        "vllm.utils.flashinfer": {"has_flashinfer_sm90_nope_mla": lambda: True},
        "vllm.v1.worker.block_table": {"get_block_table_width": _block_table_width},
        "vllm.v1.kv_cache_interface": {"AttentionSpec": _AttentionSpec, "KVCacheSpec": object, "KVCacheLayout": object,
                                       "KVQuantMode": _KVQuantMode, "get_block_table_width": _block_table_width,
                                       "is_quantized_kv_cache": lambda dtype: dtype != "auto"},
        "vllm.v1.attention.backend": {"AttentionBackend": object, "AttentionLayer": object,
                                      "CommonAttentionMetadata": object, "MLAAttentionImpl": SparseImpl,
                                      "MultipleOf": _MultipleOf, "AttentionCGSupport": _CGSupport},
        "vllm.v1.attention.backends.mla.flashinfer_mla_sparse": {"FlashInferMLASparseMetadata": SparseMetadata,
                                                                 "FlashInferMLASparseMetadataBuilder": SparseBuilder},
        "vllm.model_executor.layers.attention.sparse_mla_attention": {"SparseMLACommonImpl": SparseImpl},
    }


class VllmFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every ``vllm`` import: REAL_FILES from the release's folder, the stand-ins, and the
    packages between them; any other vllm module is an ImportError naming it."""

    def __init__(self, root: Path):
        self.root = root
        self.real = {f[: -len(".py")].replace("/", "."): root / f for f in REAL_FILES}
        self.shims = stand_ins()
        names = [*self.real, *self.shims]
        self.parents = {".".join(n.split(".")[:i]) for n in names for i in range(1, n.count(".") + 1)}

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "vllm" and not fullname.startswith("vllm."):
            return None
        if fullname in self.real:
            return importlib.util.spec_from_file_location(fullname, self.real[fullname])
        if fullname in self.shims or fullname in self.parents:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        raise ImportError(f"vLLM's code imports {fullname}, which this reproducer neither loads from {self.root} nor "
                          "stands in")

    def create_module(self, spec):
        module = types.ModuleType(spec.name, "stand-in" if spec.name in self.shims else None)
        module.__path__ = []
        if spec.name in self.shims:
            module.__dict__.update(self.shims[spec.name])

            def missing(attr, name=spec.name):
                if attr.startswith("__"):
                    raise AttributeError(attr)
                raise AttributeError(f"vLLM's code reads {name}.{attr}, which this reproducer's stand-in lacks")

            module.__getattr__ = missing
        return module

    def exec_module(self, module):
        pass


def load_sm90_module(root: Path):
    """vLLM's SM90 backend module from ``root`` (no other vllm may be imported already)."""
    if "vllm" in sys.modules:
        raise SystemExit("a vllm package is imported already: run the reproducer in a fresh process")
    sys.meta_path.insert(0, VllmFinder(root))
    return importlib.import_module(SM90_MODULE)


# --- the layer and its steps -------------------------------------------------------------------


class Layer:
    """vLLM's impl and builder for the case's layer; its steps share one state."""

    def __init__(self, module, layer: dict, device):
        self.device, self.layer = device, layer
        self.cache_dtype = torch.uint8 if layer["kv_dtype"] == "float8_e4m3fn" else torch.bfloat16
        self.topk_buffer = torch.full((layer["max_tokens"], layer["width"]), -1, dtype=torch.int32, device=device)
        rope, rank = layer["rope_dim"], layer["kv_lora_rank"]
        self.impl = module.FlashInferMLASparseSM90Impl(
            layer["num_heads"], rank + rope, layer["sm_scale"], 1, None, None,
            "fp8" if self.cache_dtype == torch.uint8 else "auto", None, "decoder", None,
            topk_indices_buffer=self.topk_buffer, indexer=None, q_lora_rank=None, kv_lora_rank=rank,
            qk_nope_head_dim=128, qk_rope_head_dim=rope, qk_head_dim=128 + rope, v_head_dim=128, kv_b_proj=None)
        self.attention_layer = SimpleNamespace(impl=self.impl, _k_scale_float=layer["k_scale"],
                                               _use_sparse_mha=lambda metadata: bool(metadata.prefill_use_dense_mha))
        hf = SimpleNamespace(index_topk=layer["topk"], index_kpool=layer["kpool"], kv_lora_rank=rank,
                             qk_rope_head_dim=rope)
        config = SimpleNamespace(
            compilation_config=SimpleNamespace(static_forward_context={LAYER_NAME: self.attention_layer}),
            model_config=SimpleNamespace(hf_text_config=hf),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=layer["max_tokens"],
                                             async_scheduling=layer["async_scheduling"]),
            speculative_config=SimpleNamespace(enable_adaptive_verification=layer["adaptive_verification"]))
        spec = SimpleNamespace(dtype=self.cache_dtype, block_size=layer["block_size"], tokens_per_state=layer["kpool"])
        self.builder = module.FlashInferMLASparseSM90Builder(spec, [LAYER_NAME], config, device)
        self.state = self.builder.state
        self.reads_block_stride = "BLOCK_STRIDE_ROWS" in inspect.getsource(
            module.FlashInferMLASparseSM90Impl.forward_mqa)
        self.plans, self.host = 0, None
        plan, kv_lens_host = self.state.wrapper.plan, self.builder._kv_lens_host

        def counted_plan(*args, **kwargs):
            self.plans += 1
            return plan(*args, **kwargs)

        def noted_kv_lens_host(cam):
            self.host = kv_lens_host(cam)
            return self.host

        self.state.wrapper.plan = counted_plan
        self.builder._kv_lens_host = noted_kv_lens_host

    def build(self, step: dict):
        m, d = step["meta"], self.device
        cam = SimpleNamespace(
            num_reqs=m["num_reqs"], num_actual_tokens=m["num_actual_tokens"],
            query_start_loc=m["query_start_loc"].to(d), query_start_loc_cpu=m["query_start_loc_cpu"],
            seq_lens=m["seq_lens"].to(d),
            seq_lens_cpu_upper_bound=m["seq_lens_cpu_upper_bound"],
            positions=None if m["positions"] is None else m["positions"].to(d),
            block_table_tensor=m["block_table"].to(d), num_decodes=m["num_decodes"],
            num_decode_tokens=m["num_decode_tokens"], num_prefills=m["num_prefills"], req_id_rows=m["req_id_rows"],
            req_id_per_token=m["req_id_per_token"].to(d), prefill_use_dense_mha=m["prefill_use_dense_mha"])
        return self.builder.build(0, cam)

    def forward(self, step: dict, metadata, cache: torch.Tensor) -> torch.Tensor:
        topk = step["topk_indices"]
        self.topk_buffer[: topk.shape[0]].copy_(topk.to(self.device))
        q_nope, q_pe = step["q_nope"].to(self.device), step["q_pe"].to(self.device)
        out, _ = self.impl.forward_mqa((q_nope, q_pe), cache.view(self.cache_dtype), metadata, self.attention_layer)
        return out

    def planned_lengths(self, rows: int) -> list[int]:
        lens = getattr(self.state, "_lens_cpu", None)
        return [] if lens is None else lens[:rows].tolist()


# --- FlashInfer's schedule, read back ----------------------------------------------------------


def read_works(wrapper) -> list[tuple[int, int, int]]:
    """(row, kv_start, kv_end) of every work item the plan (and any clamp since) left in the
    wrapper's int workspace."""
    info = [int(x) for x in wrapper._plan_info]
    if len(info) != PLAN_INFO_LEN:
        raise SystemExit(f"FlashInfer's _plan_info has {len(info)} fields, this reproducer reads {PLAN_INFO_LEN}")
    holder = getattr(wrapper, "_planned_backend", None) or wrapper
    ws = holder._int_workspace_buffer.view(torch.int32).cpu()
    total = int(ws[info[WORK_INDPTR] // 4 + info[NUM_CLUSTERS]])

    def array(field):
        return ws[info[field] // 4 : info[field] // 4 + total].tolist()

    return list(zip(array(Q_INDPTR), array(KV_START), array(KV_END), strict=True))


def row_spans(works, rows: int) -> tuple[list[list[tuple[int, int]]], list[str]]:
    """Per row, the distinct KV ranges its work items read (merged), and the problems: a row whose
    ranges do not cover one span from 0, work items naming rows past the planned ones."""
    ranges = [set() for _ in range(rows)]
    stray = sorted({r for r, _, _ in works if not 0 <= r < rows})
    for r, s, e in works:
        if 0 <= r < rows and e > s:
            ranges[r].add((s, e))
    spans, problems = [], [f"work items name rows {stray[:8]} past the {rows} planned rows"] if stray else []
    for r, row_ranges in enumerate(ranges):
        merged = []
        for s, e in sorted(row_ranges):
            if merged and s <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], e))
            else:
                merged.append((s, e))
        if len(merged) > 1 or (merged and merged[0][0] != 0):
            problems.append(f"row {r}: its work items read {merged}, not one span from 0")
        spans.append(merged)
    return spans, problems


def part_starts(works, row: int) -> list[int]:
    """Where the kernel splits a row: the distinct kv_start of its work items past 0."""
    return sorted({s for r, s, e in works if r == row and e > s and s > 0})


# --- the KV cache --------------------------------------------------------------------------------


def new_cache(layout: dict, device) -> torch.Tensor:
    """The layer's cache buffer ``[num_blocks, block_stride, D]``: every byte between blocks
    ``between_byte``, every row of a block the NaN row ``fill``."""
    nb, stride, bs = layout["num_blocks"], layout["block_stride"], layout["block_size"]
    base = torch.empty((nb, stride, layout["dim"]), dtype=layout["fill"].dtype, device=device)
    base.view(torch.uint8).fill_(layout["between_byte"])
    base[:, :bs] = layout["fill"].to(device)
    return base


def apply_writes(base: torch.Tensor, writes: dict, fill: torch.Tensor) -> None:
    """The step's writes into the cache buffer (rows of its flat view): the NaN row ``fill`` into
    ``fill_rows``, ``values`` into ``rows``."""
    flat = base.view(-1, base.shape[-1])
    flat[writes["fill_rows"].to(base.device)] = fill.to(base.device)
    flat[writes["rows"].to(base.device)] = writes["values"].to(base.device)


def slot_rows(slots: torch.Tensor, layout: dict) -> torch.Tensor:
    """The buffer rows of slot ids (``block * block_size + offset``)."""
    bs, stride = layout["block_size"], layout["block_stride"]
    return torch.where(slots >= 0, slots // bs * stride + slots % bs, slots)


# --- the references and the budget ---------------------------------------------------------------


def float64_attention(q: torch.Tensor, kv: torch.Tensor, rank: int, sm_scale: float, k_scale: float) -> torch.Tensor:
    """One row's output ``[H, rank]``: a float64 softmax over the rows ``kv [K, D]`` (their stored
    value times k_scale); no row: 0."""
    if kv.shape[0] == 0:
        return torch.zeros(q.shape[0], rank, dtype=torch.float64)
    k = kv.double() * k_scale
    p = torch.softmax((q.double() @ k.T) * sm_scale, dim=-1)
    return p @ k[:, :rank]


def working_precision(q: torch.Tensor, kv: torch.Tensor, starts: list[int], rank: int, sm_scale: float,
                      k_scale: float) -> torch.Tensor:
    """One row's output as working precision alone computes it: bf16 operands, float32 scores and
    sums, ``exp(s - max)`` rounded to bf16 before the P.V product, the output rounded to bf16; a
    row the kernel split at ``starts`` is computed part by part and the bf16 parts merged by their
    LSEs in float32, rounded to bf16 again."""
    if kv.shape[0] == 0:
        return torch.zeros(q.shape[0], rank, dtype=torch.bfloat16)
    k = kv.float()
    scores = (q.to(torch.bfloat16).float() @ k.T) * (sm_scale * k_scale)
    bounds = [0, *starts, kv.shape[0]]
    outs, lses = [], []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        part = scores[:, a:b]
        top = part.amax(dim=-1, keepdim=True)
        p = (part - top).exp()
        total = p.sum(dim=-1)
        acc = p.to(torch.bfloat16).float() @ k[a:b, :rank]
        outs.append((acc / total.unsqueeze(-1) * k_scale).to(torch.bfloat16))
        lses.append(top.squeeze(-1) + total.log())
    if len(outs) == 1:
        return outs[0]
    lse = torch.logsumexp(torch.stack(lses, dim=-1), dim=-1)
    merged = sum(torch.exp(part_lse - lse).unsqueeze(-1) * part.float()
                 for part_lse, part in zip(lses, outs, strict=True))
    return merged.to(torch.bfloat16)


def budget_problems(out: torch.Tensor, truth: torch.Tensor, lowp: torch.Tensor) -> tuple[list[str], str]:
    """The tolerance policy on the step's output: max and mean error against float64 within
    MAX_FACTOR and MEAN_FACTOR times working precision's, plus ABS_FLOOR; no NaN; infinities where
    the truth has them. Returns the problems and a line of the numbers."""
    a, t, lo = out.double().cpu(), truth, lowp.double().cpu()
    both = torch.isfinite(a) & torch.isfinite(t)
    err = torch.where(both, (a - t).abs(), 0.0)
    err_l = torch.where(torch.isfinite(t) & torch.isfinite(lo), (lo - t).abs(), 0.0)
    n = max(int(both.sum()), 1)
    max_err, mean_err = float(err.max()) if err.numel() else 0.0, float(err.sum()) / n
    max_l, mean_l = float(err_l.max()) if err_l.numel() else 0.0, float(err_l.sum()) / n
    problems = []
    nans = int(torch.isnan(a).sum())
    if nans:
        problems.append(f"{nans} NaN in the output")
    bad_inf = int(((torch.isinf(a) | torch.isinf(t)) & (a != t)).sum())
    if bad_inf:
        problems.append(f"{bad_inf} infinities where the truth has none or another")
    if max_err > MAX_FACTOR * max_l + ABS_FLOOR:
        problems.append(f"max err {max_err:.3g} > {MAX_FACTOR} x working precision's {max_l:.3g} + {ABS_FLOOR}")
    if mean_err > MEAN_FACTOR * mean_l + ABS_FLOOR:
        problems.append(f"mean err {mean_err:.3g} > {MEAN_FACTOR} x working precision's {mean_l:.3g} + {ABS_FLOOR}")
    ratio = max_err / max_l if max_l > 0 else 0.0
    return problems, f"max err {max_err:.3g} ({ratio:.2f}x working precision's), mean err {mean_err:.3g}"


def max_error(out: torch.Tensor, truth: torch.Tensor) -> float:
    """Max |out - truth| (NaN where either holds a NaN)."""
    diff = (out.double().cpu() - truth).abs()
    return float("nan") if bool(torch.isnan(diff).any()) else float(diff.max()) if diff.numel() else 0.0


def same_multiset(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() == b.numel() and torch.equal(a.sort().values, b.sort().values)


# --- one step, judged ----------------------------------------------------------------------------


@dataclasses.dataclass
class StepVerdict:
    off: str | None  # None, "plan" (vLLM's plan/clamp) or "kernel" (FlashInfer's kernel)
    lines: list


def judge_step(i: int, count: int, step: dict, layer: Layer, base: torch.Tensor | None, data: dict) -> StepVerdict:
    """Step ``i`` through the layer (its KV cache: the buffer ``base``), judged."""
    name = f"step {i} of {count}"
    n, lay = step["rows"], data["layer"]
    try:
        metadata = layer.build(step)
    except Exception as exc:  # the step's verdict names it
        return StepVerdict("plan", [f"{name}: vLLM's build() raised {type(exc).__name__}: {exc}"])
    works = read_works(layer.state.wrapper)
    spans, problems = row_spans(works, n)
    executed = [s[-1][1] if s and s[0][0] == 0 else 0 for s in spans]
    planned = layer.planned_lengths(n)
    host = [] if layer.host is None else layer.host[1].tolist()
    intended = step["intended"]
    valid = (intended >= 0).sum(dim=1).tolist()
    off_rows = {r for r in range(n) if executed[r] != valid[r]}
    off_rows |= {int(p.split()[1].rstrip(":")) for p in problems if p.startswith("row ")}
    out = handed = None
    if step["q_nope"] is not None:
        try:
            out = layer.forward(step, metadata, base[:, : data["cache"]["block_size"]])[:n]
        except Exception as exc:  # the step's verdict names it
            qo_rows = int(step["q_nope"].shape[0])
            who = "plan" if qo_rows != n else "kernel"
            return StepVerdict(who, [f"{name}: forward_mqa raised {type(exc).__name__}: {exc} (vLLM planned {n} rows, "
                                     f"handed run() {qo_rows})"])
        if layer.device.type == "cuda":
            torch.cuda.synchronize()
        indptr = layer.state.wrapper._kv_indptr_buf[: n + 1].cpu().to(torch.int64).tolist()
        indices = layer.state.kv_indices.cpu().to(torch.int64)
        handed = []
        for r in range(n):
            entries = torch.cat([indices[indptr[r] + s : indptr[r] + e] for s, e in spans[r]]) if spans[r] \
                else torch.zeros(0, dtype=torch.int64)
            handed.append(entries if layer.reads_block_stride else slot_rows(entries, data["cache"]))
        intended_rows = [slot_rows(intended[r][intended[r] >= 0], data["cache"]) for r in range(n)]
        off_rows |= {r for r in range(n) if not same_multiset(handed[r], intended_rows[r])}
    lines = [f"{name}: {n} planned rows, {layer.plans} FlashInfer plans so far"] + [f"  {p}" for p in problems]
    if out is None:
        lines += [row_line(step, r, valid, host, planned, executed) for r in sorted(off_rows)]
        return StepVerdict("plan" if off_rows or problems else None, lines)
    flat = base.view(-1, base.shape[-1])
    q = torch.cat([step["q_nope"], step["q_pe"]], dim=-1)[:n]
    rank, sm, ks = lay["kv_lora_rank"], lay["sm_scale"], lay["k_scale"]
    contract = [float64_attention(q[r], flat[intended_rows[r]].cpu(), rank, sm, ks) for r in range(n)]
    given = [float64_attention(q[r], flat[handed[r].clamp(min=0)].cpu(), rank, sm, ks) for r in range(n)]
    if off_rows or problems:
        lines += [row_line(step, r, valid, host, planned, executed, max_error(out[r], contract[r]),
                           max_error(out[r], given[r])) for r in sorted(off_rows)]
        return StepVerdict("plan", lines)
    if n == 0:
        lines.append("  no row planned")
        return StepVerdict(None, lines)
    lowp = [working_precision(q[r], flat[handed[r]].cpu(), part_starts(works, r), rank, sm, ks) for r in range(n)]
    failed, numbers = budget_problems(out, torch.stack(given), torch.stack(lowp))
    if not failed:
        lines.append(f"  every row executes its valid count over its valid slots; out within the budget ({numbers})")
        return StepVerdict(None, lines)
    lines.append("  every row executes its valid count over its valid slots; out beyond the budget: "
                 + "; ".join(failed))
    errors = sorted(((max_error(out[r], given[r]), r) for r in range(n)), reverse=True,
                    key=lambda x: float("inf") if x[0] != x[0] else x[0])
    lines += [row_line(step, r, valid, host, planned, executed, max_error(out[r], contract[r]), err)
              for err, r in errors[:5]]
    return StepVerdict("kernel", lines)


def row_line(step, r, valid, host, planned, executed, vs_contract=None, vs_handed=None) -> str:
    where = f"row {r} (regime {step['regimes'][r]}, ctx {step['row_ctx'][r]})"
    lengths = [f"valid {valid[r]}"]
    if r < len(host):
        lengths.append(f"host length {host[r]}")
    if r < len(planned):
        lengths.append(f"planned {planned[r]}")
    lengths.append(f"executed {executed[r]}")
    line = f"  {where}: {', '.join(lengths)}"
    if vs_contract is not None:
        line += f"; out max |err| vs its valid slots {vs_contract:.3g}, vs the slots handed {vs_handed:.3g}"
    return line


VERDICTS = {"plan": "vLLM's plan/clamp", "kernel": "FlashInfer's kernel"}


def verdict_line(verdicts: list[StepVerdict]) -> str:
    for off in ("plan", "kernel"):
        steps = [i for i, v in enumerate(verdicts) if v.off == off]
        if steps:
            return f"verdict: {VERDICTS[off]} is off (steps {steps})"
    return "verdict: nothing: the step is right on this install" if len(verdicts) == 1 else \
        f"verdict: nothing: the steps ({len(verdicts)}) are right on this install"


def installed_flashinfer() -> str:
    wrapper = getattr(sys.modules.get("flashinfer.mla"), "BatchMLAPagedAttentionWrapper", None)
    module = getattr(wrapper, "__module__", "")
    if wrapper is not None and not module.startswith("flashinfer"):
        return f"{module}:{wrapper.__qualname__} (not FlashInfer)"
    return f"FlashInfer {getattr(sys.modules.get('flashinfer'), '__version__', '?')}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("vllm_root", help="a folder holding vllm/ (a wheel unpacked, a slice, a checkout)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--data", default=str(Path(__file__).with_name("case.pt")))
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        return cannot_run_here(f"no CUDA device (--device {args.device})")
    root = Path(args.vllm_root)
    module_file = root / REAL_FILES[0]
    if not module_file.is_file():
        print(f"{root} holds no {REAL_FILES[0]}", file=sys.stderr)
        return 2
    data = torch.load(args.data, weights_only=True)
    module = load_sm90_module(root)
    device = torch.device(args.device)
    digest = hashlib.sha256(module_file.read_bytes()).hexdigest()
    written = CASE.get("module_digest") or "?"
    same = "the module the case was written on" if digest == written else f"the case was written on {written[:16]}"
    count = len(data["steps"])
    print(f"case {CASE.get('name')}: {count} step{'s' if count != 1 else ''} through vLLM's SM90 backend "
          f"({CASE.get('nodeid') or 'no test id'})")
    print(f"vLLM files: {root}; module sha256 {digest[:16]} ({same})")
    print(f"in the sparse-MLA tester that wrote it: {CASE.get('replay')}")
    layer = Layer(module, data["layer"], device)
    print(f"kernel: {installed_flashinfer()}; the case ran on {CASE.get('flashinfer')}")
    base, verdicts = None, []
    for i, step in enumerate(data["steps"]):
        if step["cache"] is not None:
            if step["cache"]["fresh"] or base is None:
                base = new_cache(data["cache"], device)
            apply_writes(base, step["cache"], data["cache"]["fill"])
        verdict = judge_step(i, len(data["steps"]), step, layer, base, data)
        verdicts.append(verdict)
        print("\n".join(verdict.lines))
    print(verdict_line(verdicts))
    return 1 if any(v.off for v in verdicts) else 0


def main_here(argv=None) -> int:
    """:func:`main`, with a dependency this machine lacks (torch, Triton, FlashInfer) or a device
    it does not have said in one line and exit status :data:`CANNOT_RUN_HERE`, never as a
    verdict on the code under test."""
    try:
        return main(argv)
    except ImportError as missing:
        return cannot_run_here(f"{missing.name or missing} is not importable (this reproducer needs torch with "
                               "Triton, FlashInfer and a vLLM release's files)")


if __name__ == "__main__":
    sys.exit(main_here())
