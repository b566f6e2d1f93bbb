"""vLLM's V2 model runner (``vllm/v1/worker/gpu/``) building one step's attention metadata, run
from the release's own files.

Two methods and one module of the release run as they ship:

- ``GPUModelRunner.prepare_inputs`` (``model_runner.py``): the step's request and token counts,
  padded to the graph's batch descriptor, ``query_start_loc`` (flat past the live requests),
  positions and ``seq_lens`` (through ``input_batch.py``'s Triton kernels), the host bound;
- ``DefaultModelState.prepare_attn`` (``model_states/default.py``): which of those counts each
  graph mode hands the attention builders (FULL the padded ones, piecewise and eager the live);
- ``input_batch.py``: ``InputBatch``, ``InputBuffers`` and the kernels ``prepare_inputs`` launches.

and the graph a step runs in, from the runner's CUDA-graph dispatcher: ``CudaGraphManager``'s
``_init_candidates`` and ``dispatch`` (``cudagraph_utils.py``, with ``CUDAGraphMode`` of
``config/compilation.py``), giving the padded token and request counts (:func:`graph_descriptor`).

Each method is compiled from the release's source as a function (the rest of the file and its
imports left out); a module is run without its import lines. What they read of the engine comes
from the stand-ins below (one request per batch row, no drafts, no LoRA, no context parallelism,
no multimodal inputs, one rank); a name they need that no stand-in gives is a :class:`RunnerGap`
naming it. ``build_attn_metadata`` is the stand-in that records what the builders would be handed.
"""

from __future__ import annotations
import __future__

import ast
import collections.abc
import enum
import sys
import types
from dataclasses import dataclass
from dataclasses import replace as dataclasses_replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from .source import V2_DISPATCHER_FILES, V2_RUNNER_FILES, VllmSource

INPUT_BATCH_FILE, MODEL_RUNNER_FILE, MODEL_STATE_FILE = V2_RUNNER_FILES
#: The graph modes of ``CUDAGraphMode`` the step is built under (vLLM's names).
GRAPH_MODES = ("NONE", "PIECEWISE", "FULL")
#: The model length ``prepare_attn`` reads (a capture's ``max_seq_len``; the steps here are not captures).
MAX_MODEL_LEN = 1 << 20


class RunnerGap(ImportError):
    """The release's runner code needs something the stand-ins do not give."""


class _CUDAGraphMode(enum.Enum):
    NONE = 0
    PIECEWISE = 1
    FULL = 2


class _Unserved:
    """An imported name no stand-in serves: using it raises :class:`RunnerGap` naming it."""

    def __init__(self, module: str, name: str):
        self._what = f"{module}.{name}"

    def __getattr__(self, attr):
        raise RunnerGap(f"vLLM's V2 runner code uses {self._what} (.{attr}), which no stand-in serves")

    def __call__(self, *args, **kwargs):
        raise RunnerGap(f"vLLM's V2 runner code calls {self._what}, which no stand-in serves")


def _triton() -> dict[str, Any]:
    import triton
    import triton.language as tl

    return {"triton": triton, "tl": tl}


def _served_imports() -> dict[tuple[str, str], Any]:
    """What the three files import that the stand-ins serve, by (module, name)."""
    t = _triton()
    return {
        ("vllm.triton_utils", "triton"): t["triton"], ("vllm.triton_utils", "tl"): t["tl"],
        ("vllm.utils", "random_uuid"): lambda: "stand-in-request",
        ("vllm.utils.math_utils", "cdiv"): lambda a, b: -(a // -b),
        ("vllm.config.compilation", "CUDAGraphMode"): _CUDAGraphMode,
    }


def _module_namespace(path: Path, module_name: str) -> dict[str, Any]:
    """The names ``path`` defines, run without its import lines: the standard library's and
    numpy's and torch's imports as they are, vLLM's served by :func:`_served_imports` or left
    :class:`_Unserved`."""
    tree = ast.parse(path.read_text(), str(path))
    served = _served_imports()
    module = sys.modules.get(module_name) or types.ModuleType(module_name)
    sys.modules[module_name] = module  # dataclasses look their module up
    namespace: dict[str, Any] = module.__dict__
    namespace.update({"np": np, "torch": torch, "dataclass": dataclass, "TYPE_CHECKING": False})
    body = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
            for alias in node.names:
                namespace[alias.asname or alias.name] = served.get((node.module, alias.name),
                                                                  _Unserved(node.module, alias.name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            body.append(node)  # standard library, numpy, torch
        elif isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            continue
        else:
            body.append(node)
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec",
                 flags=__future__.annotations.compiler_flag, dont_inherit=True), namespace)
    return namespace


def _method(path: Path, class_name: str, name: str, namespace: dict[str, Any]):
    """``class_name.name`` of the file ``path`` compiled as a function of ``self`` in ``namespace``."""
    tree = ast.parse(path.read_text(), str(path))
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    method = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None) if cls else None
    if method is None:
        raise RunnerGap(f"{path.name}: no {class_name}.{name}")
    method.decorator_list = []
    exec(compile(ast.Module(body=[method], type_ignores=[]), str(path), "exec",
                 flags=__future__.annotations.compiler_flag, dont_inherit=True), namespace)
    return namespace[name]


@dataclass(frozen=True)
class ReleaseRunner:
    version: str
    input_batch: dict[str, Any]  # input_batch.py's names
    prepare_inputs: Any  # GPUModelRunner.prepare_inputs(self, scheduler_output, batch_req_state, batch_desc[, loras])
    prepare_attn: Any  # DefaultModelState.prepare_attn(self, input_batch, cudagraph_mode, ...)
    handed: list  # what each call of the stand-in build_attn_metadata was handed


def load_runner(source: VllmSource) -> ReleaseRunner:
    """The release's ``prepare_inputs`` and ``prepare_attn`` with ``input_batch.py``, compiled from
    its files (:data:`V2_RUNNER_FILES`); a source without them is a :class:`RunnerGap`."""
    missing = [f for f in V2_RUNNER_FILES if not source.path_of(f).is_file()]
    if missing:
        raise RunnerGap(f"{source.describe()} has no {', '.join(missing)}: a slice written before the V2 runner's "
                        "files were sliced; write it again (python -m backends.vllm.source slice WHEEL -o DIR)")
    input_batch = _module_namespace(source.path_of(INPUT_BATCH_FILE),
                                    f"sparse_mla_vllm_{source.version.replace('.', '_')}_v2_runner_input_batch")
    handed: list = []

    def build_attn_metadata(**kwargs):
        handed.append(kwargs)
        return {}

    runner_ns = {**{k: v for k, v in input_batch.items() if not k.startswith("__")}, "np": np, "torch": torch,
                 "envs": SimpleNamespace(VLLM_MOE_SKIP_PADDING=False), "async_tensor_h2d": _async_tensor_h2d,
                 "pcp": SimpleNamespace(maybe_partition_pcp_batch=_without_pcp)}
    state_ns = {"torch": torch, "CUDAGraphMode": _CUDAGraphMode, "build_attn_metadata": build_attn_metadata,
                "compute_mm_prefix_ranges": _Unserved("vllm.v1.attention.backends.utils", "compute_mm_prefix_ranges")}
    return ReleaseRunner(
        version=source.version,
        input_batch=input_batch,
        prepare_inputs=_method(source.path_of(MODEL_RUNNER_FILE), "GPUModelRunner", "prepare_inputs", runner_ns),
        prepare_attn=_method(source.path_of(MODEL_STATE_FILE), "DefaultModelState", "prepare_attn", state_ns),
        handed=handed,
    )


def _without_pcp(manager, input_batch, batch_desc):
    """vLLM 0.30.0's ``pcp_manager.maybe_partition_pcp_batch`` on one rank (no manager): the batch
    as it is."""
    if manager is not None:
        raise RunnerGap("prefill context parallelism: the stand-in runner has no PCP manager")
    return input_batch


def _async_tensor_h2d(data, dtype=None, target_device=None, pin_memory=False, device=None, out=None):
    """vLLM's host-to-device copy, on the host: into ``out``'s first entries where given."""
    values = torch.as_tensor(np.asarray(data), dtype=dtype if out is None else out.dtype)
    if out is None:
        return values.to(target_device or device or "cpu")
    out[: values.numel()].copy_(values.reshape(-1))
    return out


@dataclass(frozen=True)
class RunnerStep:
    """What the release's runner hands the attention builders for one step (the fields of the
    suite's ``StepMetadata`` it sets, under their names there)."""

    mode: str
    num_reqs: int
    num_actual_tokens: int
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu_upper_bound: torch.Tensor | None
    positions: torch.Tensor
    max_query_len: int
    max_seq_len: int


def _request_state(q_lens: list[int], computed: list[int], prefill_lens: list[int], max_reqs: int):
    """The stand-in ``req_states``: request ``i`` in row ``i``, ``computed[i]`` tokens computed,
    a prompt of ``prefill_lens[i]`` tokens, no drafts."""
    n = len(q_lens)
    computed_np = np.zeros(max_reqs, dtype=np.int32)
    computed_np[:n] = computed
    prefill = torch.zeros(max_reqs, dtype=torch.int32)
    prefill[:n] = torch.tensor(prefill_lens, dtype=torch.int32)
    return SimpleNamespace(
        num_computed_tokens=SimpleNamespace(gpu=torch.from_numpy(computed_np.copy())),
        num_computed_tokens_np=computed_np,
        prefill_len=SimpleNamespace(gpu=prefill),
        next_prefill_tokens=torch.zeros((1, max_reqs), dtype=torch.int32),
        all_token_ids=SimpleNamespace(gpu=torch.zeros((max_reqs, max(prefill_lens + [1]) + 1), dtype=torch.int32)),
        last_sampled_tokens=torch.zeros(max_reqs, dtype=torch.int64),
        draft_tokens=torch.zeros((max_reqs, 1), dtype=torch.int64),
        prompt_len=SimpleNamespace(gpu=prefill.clone()),
    )


def runner_step(runner: ReleaseRunner, q_lens: list[int], seq_lens: list[int], prefill_lens: list[int], *,
                mode: str, graph_tokens: int | None = None, graph_reqs: int | None = None) -> RunnerStep:
    """One step of live requests (``q_lens`` query tokens each, ``seq_lens`` tokens in context
    after them, prompts of ``prefill_lens``) through the release's ``prepare_inputs`` under the
    batch descriptor ``(graph_tokens, graph_reqs)`` (a graph's padded sizes; None: the live ones)
    and its ``prepare_attn`` under ``mode`` (:data:`GRAPH_MODES`): what the builders are handed."""
    if mode not in GRAPH_MODES:
        raise ValueError(f"mode: one of {GRAPH_MODES}, got {mode!r}")
    n, num_tokens = len(q_lens), sum(q_lens)
    max_reqs = max(n, graph_reqs or 0) + 1
    max_tokens = max(num_tokens, graph_tokens or 0) + 1
    computed = [s - q for s, q in zip(seq_lens, q_lens, strict=True)]
    prefilling = np.array([c < p for c, p in zip(computed, prefill_lens, strict=True)], dtype=bool)
    ib = runner.input_batch
    runner_self = SimpleNamespace(
        input_buffers=ib["InputBuffers"](max_reqs, max_tokens, torch.device("cpu")),
        req_states=_request_state(q_lens, computed, prefill_lens, max_reqs),
        model_state=SimpleNamespace(num_new_sampled_tokens_per_step=1),
        device=torch.device("cpu"), max_num_reqs=max_reqs, adaptive_verification=None, decode_query_len=1,
        fast_prefill=None, model_config=SimpleNamespace(rswa_window=None), pcp_manager=None,
    )
    batch_req_state = SimpleNamespace(
        num_tokens=num_tokens, req_ids=[f"req-{i}" for i in range(n)],
        num_scheduled_tokens=np.array(q_lens, dtype=np.int32), idx_mapping_np=np.arange(n, dtype=np.int32),
        has_prefill=bool(prefilling.any()), num_draft_tokens_np=None, prefill_len_np=np.array(prefill_lens, np.int32),
        num_computed_prefill_tokens_np=np.minimum(np.array(computed, np.int32), np.array(prefill_lens, np.int32)),
        is_prefilling_np=prefilling, prefill_runs_as_decode_np=None, decode_graph_eligible=not prefilling.any(),
        max_seq_len_np=None,
    )
    batch_desc = SimpleNamespace(num_tokens=graph_tokens or num_tokens, num_reqs=graph_reqs)
    scheduler_output = SimpleNamespace(scheduled_spec_decode_tokens={}, has_structured_output_requests=False)
    extra = (0,) if "num_active_loras" in runner.prepare_inputs.__code__.co_varnames else ()
    try:
        input_batch = runner.prepare_inputs(runner_self, scheduler_output, batch_req_state, batch_desc, *extra)
    except AttributeError as exc:
        raise RunnerGap(f"vLLM {runner.version}'s prepare_inputs reads what the stand-in runner lacks: {exc}") from None
    state_self = SimpleNamespace(max_model_len=MAX_MODEL_LEN, supports_mm_inputs=False, encoder_cache=None)
    del runner.handed[:]
    try:
        runner.prepare_attn(state_self, input_batch, getattr(_CUDAGraphMode, mode), (), torch.zeros(1, 0), [[]],
                            SimpleNamespace(kv_cache_groups=[]))
    except AttributeError as exc:
        raise RunnerGap(f"vLLM {runner.version}'s prepare_attn reads what the stand-in state lacks: {exc}") from None
    (handed,) = runner.handed
    return RunnerStep(
        mode=mode,
        num_reqs=int(handed["num_reqs"]),
        num_actual_tokens=int(handed["num_tokens"]),
        query_start_loc_cpu=handed["query_start_loc_cpu"].clone(),
        seq_lens=handed["seq_lens"][: handed["num_reqs"]].clone(),
        seq_lens_cpu_upper_bound=None if handed.get("seq_lens_cpu_upper_bound") is None
        else handed["seq_lens_cpu_upper_bound"][: handed["num_reqs"]].clone(),
        positions=handed["positions"].clone(),
        max_query_len=int(handed["max_query_len"]),
        max_seq_len=int(handed["max_seq_len"]),
    )


#: The fields :func:`runner_step` compares, as the suite's ``StepMetadata`` names them.
COMPARED_FIELDS = ("num_reqs", "num_actual_tokens", "query_start_loc_cpu", "seq_lens", "seq_lens_cpu_upper_bound")


def field_differences(model, step: RunnerStep, fields: collections.abc.Iterable[str] = COMPARED_FIELDS) -> list[str]:
    """Each field of ``model`` (a ``StepMetadata``: the suite's model of the runner) that differs
    from what the release's runner hands the builders in ``step``, one line each naming both."""
    lines = []
    for name in fields:
        ours, theirs = getattr(model, name), getattr(step, name)
        if ours is None or theirs is None:
            same = ours is None and theirs is None
        elif isinstance(ours, torch.Tensor) or isinstance(theirs, torch.Tensor):
            a, b = torch.as_tensor(ours).flatten(), torch.as_tensor(theirs).flatten()
            same = a.shape == b.shape and bool(torch.equal(a, b))  # equal values of int32 and int64 are equal
        else:
            same = int(ours) == int(theirs)
        if not same:
            lines.append(f"{name}: the suite's model {_shown(ours)}, vLLM's {step.mode} runner {_shown(theirs)}")
    return lines


def _shown(value) -> str:
    if isinstance(value, torch.Tensor):
        return str(value.tolist())
    return str(value)


__all__ = ["COMPARED_FIELDS", "GRAPH_MODES", "ReleaseDispatcher", "ReleaseRunner", "RunnerGap", "RunnerStep",
           "field_differences", "graph_descriptor", "load_dispatcher", "load_runner", "runner_step"]


# --- the CUDA-graph dispatcher: which graph a step runs in, and its padded counts ---------------

#: The dispatcher's methods run from the release (``CudaGraphManager`` of ``cudagraph_utils.py``).
DISPATCHER_METHODS = ("_init_candidates", "_maybe_ubatch_twin", "_resolve_effective_loras", "dispatch")


@dataclass(frozen=True)
class ReleaseDispatcher:
    version: str
    graph_mode: type  # the release's CUDAGraphMode
    manager_type: type  # a stand-in CudaGraphManager holding the release's methods


def _top_level(path: Path, names: tuple[str, ...], namespace: dict[str, Any], optional: tuple[str, ...] = ()):
    """The top-level classes and functions ``names`` (and those of ``optional`` the file has) of
    ``path`` run in ``namespace`` (a module's dict registered in ``sys.modules``); a name of
    ``names`` the file lacks is a :class:`RunnerGap`."""
    tree = ast.parse(path.read_text(), str(path))
    wanted = set(names) | set(optional)
    picked = [n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name in wanted]
    missing = sorted(set(names) - {n.name for n in picked})
    if missing:
        raise RunnerGap(f"{path.name}: no {', '.join(missing)}")
    for node in picked:
        if isinstance(node, ast.ClassDef):  # the config decorator and pydantic are not loaded
            node.decorator_list = [d for d in node.decorator_list if ast.unparse(d).startswith("dataclass")]
    exec(compile(ast.Module(body=picked, type_ignores=[]), str(path), "exec",
                 flags=__future__.annotations.compiler_flag, dont_inherit=True), namespace)
    return namespace


def load_dispatcher(source: VllmSource) -> ReleaseDispatcher:
    """The release's CUDA-graph dispatcher: ``CudaGraphManager``'s ``_init_candidates`` and
    ``dispatch`` (with the descriptor type, ``_is_compatible``, ``CUDAGraphMode`` and, where the
    release has them, the decode capture shapes of ``config/compilation.py``), compiled from its
    files; a part the release lacks is a :class:`RunnerGap` naming it."""
    missing = [f for f in V2_DISPATCHER_FILES if not source.path_of(f).is_file()]
    if missing:
        raise RunnerGap(f"{source.describe()} has no {', '.join(missing)}: a slice written before the dispatcher's "
                        "files were sliced; write it again (python -m backends.vllm.source slice WHEEL -o DIR)")
    import bisect
    import itertools
    from collections import defaultdict

    name = f"sparse_mla_vllm_{source.version.replace('.', '_')}_v2_dispatcher"
    module = sys.modules.get(name) or types.ModuleType(name)
    sys.modules[name] = module  # dataclasses look their module up
    ns = module.__dict__
    ns.update({"enum": enum, "bisect": bisect, "Iterable": collections.abc.Iterable,
               "Mapping": collections.abc.Mapping, "Callable": collections.abc.Callable, "torch": torch,
               "dataclass": dataclass, "replace": dataclasses_replace, "defaultdict": defaultdict,
               "groupby": itertools.groupby, "product": itertools.product, "cdiv": lambda a, b: -(a // -b),
               "round_up": lambda a, b: -(a // -b) * b,
               "build_dynamic_sd_schedule_lookup": _Unserved("vllm.v1.spec_decode",
                                                             "build_dynamic_sd_schedule_lookup")})
    _top_level(source.path_of(V2_DISPATCHER_FILES[1]), ("CUDAGraphMode",), ns,
               optional=("decode_cudagraph_capture_shapes", "decode_cudagraph_capture_max_tokens"))
    _top_level(source.path_of(V2_DISPATCHER_FILES[0]), ("BatchExecutionDescriptor", "_is_compatible"), ns)
    path = source.path_of(V2_DISPATCHER_FILES[0])
    methods = {m: _method(path, "CudaGraphManager", m, ns) for m in DISPATCHER_METHODS}
    return ReleaseDispatcher(source.version, ns["CUDAGraphMode"], type("StandInCudaGraphManager", (), methods))


def graph_descriptor(dispatcher: ReleaseDispatcher, cudagraph_mode: str, *, num_reqs: int, num_tokens: int,
                     uniform_query_len: int | None, decode_request_sizes: list[int], token_sizes: list[int],
                     max_num_reqs: int = 256):
    """The batch descriptor the release's dispatcher gives a step of ``num_reqs`` requests and
    ``num_tokens`` tokens (a uniform decode batch of ``uniform_query_len`` tokens each, or None)
    under ``cudagraph_mode`` (a name of the release's ``CUDAGraphMode``: ``FULL_AND_PIECEWISE``,
    ``FULL``, ``PIECEWISE``, ...), with graphs captured for ``decode_request_sizes`` (decode
    graphs, per query length, where the release keeps them apart: vLLM 0.34.0; earlier releases
    derive their decode graphs from ``token_sizes``) and ``token_sizes`` (token-keyed graphs): one
    rank, no LoRA, no microbatches, no varlen decode graphs, no dynamic speculative decoding."""
    q = uniform_query_len or 1
    manager = dispatcher.manager_type()
    manager.__dict__.update(
        cudagraph_mode=dispatcher.graph_mode[cudagraph_mode], decode_request_sizes=None, max_num_reqs=max_num_reqs,
        compilation_config=SimpleNamespace(prefill_cudagraph_capture_token_sizes=token_sizes,
                                           cudagraph_capture_sizes=token_sizes,
                                           decode_cudagraph_capture_request_sizes=decode_request_sizes,
                                           max_cudagraph_capture_size=max(token_sizes + [n * q for n in
                                                                                        decode_request_sizes]),
                                           max_decode_cudagraph_capture_tokens=None),
        vllm_config=SimpleNamespace(uniform_decode_query_len=q, cache_config=SimpleNamespace(use_kda_recoverssm=False),
                                    speculative_config=None),
        decode_max_reqs={q: max_num_reqs}, decode_query_len=q, varlen_decode=False, lora_capture_cases=[0],
        ubatch_runner=None, _lora_dispatch_map={}, _max_lora_case=0, _graphs_captured=True, _capture_descs={},
        _decode_descs={}, _candidates={},
    )
    try:
        manager._init_candidates()
        return manager.dispatch(num_reqs, num_tokens, uniform_query_len, num_active_loras=0,
                                max_query_len=uniform_query_len)
    except AttributeError as exc:
        raise RunnerGap(f"vLLM {dispatcher.version}'s CUDA-graph dispatcher reads what the stand-in manager "
                        f"lacks: {exc}") from None
