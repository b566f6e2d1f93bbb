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

import ast
import bisect
import collections.abc
import contextlib
import enum
import itertools
import os
import sys
import types
from collections import defaultdict
from dataclasses import dataclass
from dataclasses import replace as dataclasses_replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from .shims import async_tensor_h2d, cdiv, run_release_nodes, triton_utils
from .source import V2_RUNNER_FILES, VllmSource

INPUT_BATCH_FILE, MODEL_RUNNER_FILE, MODEL_STATE_FILE, CUDAGRAPH_FILE, COMPILATION_FILE = V2_RUNNER_FILES
#: The runtime graph modes a step's attention metadata is built under (names of the release's
#: ``CUDAGraphMode``).
RUNTIME_MODES = ("NONE", "PIECEWISE", "FULL")
#: The model length ``prepare_attn`` reads (a capture's ``max_seq_len``; the steps here are not captures).
MAX_MODEL_LEN = 1 << 20


class RunnerGap(ImportError):
    """The release's runner code needs something the stand-ins do not give."""


class _Unserved:
    """An imported name no stand-in serves: using it raises :class:`RunnerGap` naming it."""

    def __init__(self, module: str, name: str):
        self._what = f"{module}.{name}"

    def __getattr__(self, attr):
        raise RunnerGap(f"vLLM's V2 runner code uses {self._what} (.{attr}), which no stand-in serves")

    def __call__(self, *args, **kwargs):
        raise RunnerGap(f"vLLM's V2 runner code calls {self._what}, which no stand-in serves")


def _served_imports() -> dict[tuple[str, str], Any]:
    """What ``input_batch.py`` imports that the stand-ins serve, by (module, name)."""
    t = triton_utils()
    return {
        ("vllm.triton_utils", "triton"): t["triton"], ("vllm.triton_utils", "tl"): t["tl"],
        ("vllm.utils", "random_uuid"): lambda: "stand-in-request",
        ("vllm.utils.math_utils", "cdiv"): cdiv,
    }


def _module(source: VllmSource, part: str) -> dict[str, Any]:
    """A fresh module for one load of this release's runner parts, registered in ``sys.modules``
    (dataclasses look their module up while they are made): its namespace. Each load gets its
    own, so that a second load (another copy of the release's files) never rebinds the names an
    earlier load's functions read."""
    name = f"sparse_mla_vllm_{source.version.replace('.', '_')}_v2_runner_{part}"
    module = types.ModuleType(name)
    sys.modules[name] = module
    return module.__dict__


def _module_namespace(path: Path, namespace: dict[str, Any]) -> dict[str, Any]:
    """The names ``path`` defines, run in ``namespace`` without its import lines: the standard
    library's and numpy's and torch's imports as they are, vLLM's served by
    :func:`_served_imports` or left :class:`_Unserved`."""
    tree = ast.parse(path.read_text(), str(path))
    served = _served_imports()
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
    return run_release_nodes(path, body, namespace)


def _method(path: Path, class_name: str, name: str, namespace: dict[str, Any]):
    """``class_name.name`` of the file ``path`` compiled as a function of ``self`` in ``namespace``."""
    tree = ast.parse(path.read_text(), str(path))
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    method = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None) if cls else None
    if method is None:
        raise RunnerGap(f"{path.name}: no {class_name}.{name}")
    method.decorator_list = []
    return run_release_nodes(path, [method], namespace)[name]


@dataclass(frozen=True)
class ReleaseDispatcher:
    version: str
    graph_mode: type  # the release's CUDAGraphMode
    manager_type: type  # a stand-in CudaGraphManager holding the release's methods


@dataclass(frozen=True)
class ReleaseRunner:
    version: str
    device: torch.device  # where the stand-in runner's tensors live and the release's kernels run
    graph_mode: type  # the release's CUDAGraphMode (config/compilation.py)
    input_batch: dict[str, Any]  # input_batch.py's names
    prepare_inputs: Any  # GPUModelRunner.prepare_inputs(self, scheduler_output, batch_req_state, batch_desc[, loras])
    prepare_attn: Any  # DefaultModelState.prepare_attn(self, input_batch, cudagraph_mode, ...)
    dispatcher: ReleaseDispatcher  # CudaGraphManager's dispatch (cudagraph_utils.py)
    handed: list  # what each call of the stand-in build_attn_metadata was handed


#: The dispatcher's methods run from the release (``CudaGraphManager`` of ``cudagraph_utils.py``).
DISPATCHER_METHODS = ("_init_candidates", "_maybe_ubatch_twin", "_resolve_effective_loras", "dispatch")


def load_runner(source: VllmSource) -> ReleaseRunner:
    """The release's ``prepare_inputs``, ``prepare_attn`` and CUDA-graph dispatcher with
    ``input_batch.py`` and ``CUDAGraphMode``, compiled from its files (:data:`V2_RUNNER_FILES`),
    its Triton kernels defined for :func:`runner_device`; a source without
    those files, or a part its files lack, is a :class:`RunnerGap` naming it."""
    missing = [f for f in V2_RUNNER_FILES if not source.path_of(f).is_file()]
    if missing:
        raise RunnerGap(f"{source.describe()} has no {', '.join(missing)}: a slice written before the V2 runner's "
                        "files were sliced; write it again (python -m backends.vllm.source slice WHEEL -o DIR)")
    device = runner_device()
    with kernels_for(device):
        return _loaded_runner(source, device)


def runner_device() -> torch.device:
    """Where the stand-in runner holds its tensors and the release's Triton kernels run: the GPU
    where one is visible (the kernels compiled for it, as the release runs them), else the host
    under Triton's interpreter."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@contextlib.contextmanager
def kernels_for(device: torch.device):
    """``TRITON_INTERPRET`` set for ``device`` while the block runs, then as it was: ``1`` for the
    host (Triton's interpreter), ``0`` for a GPU (kernels compiled for it). Triton reads the
    variable as a kernel is defined and as it is launched, so it is set while the runner's files
    run and while its methods are called, whatever the process was started with."""
    held = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if torch.device(device).type == "cpu" else "0"
    try:
        yield
    finally:
        if held is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = held


def _loaded_runner(source: VllmSource, device: torch.device) -> ReleaseRunner:
    graphs = _module(source, "graphs")
    graphs.update({"enum": enum, "bisect": bisect, "Iterable": collections.abc.Iterable,
                   "Mapping": collections.abc.Mapping, "Callable": collections.abc.Callable, "torch": torch,
                   "dataclass": dataclass, "replace": dataclasses_replace, "defaultdict": defaultdict,
                   "groupby": itertools.groupby, "product": itertools.product, "cdiv": cdiv,
                   "round_up": lambda a, b: cdiv(a, b) * b,
                   "build_dynamic_sd_schedule_lookup": _Unserved("vllm.v1.spec_decode",
                                                                 "build_dynamic_sd_schedule_lookup")})
    _top_level(source.path_of(COMPILATION_FILE), ("CUDAGraphMode",), graphs,
               optional=("decode_cudagraph_capture_shapes", "decode_cudagraph_capture_max_tokens"))
    _top_level(source.path_of(CUDAGRAPH_FILE), ("BatchExecutionDescriptor", "_is_compatible"), graphs)
    methods = {m: _method(source.path_of(CUDAGRAPH_FILE), "CudaGraphManager", m, graphs) for m in DISPATCHER_METHODS}
    graph_mode = graphs["CUDAGraphMode"]

    input_batch = _module_namespace(source.path_of(INPUT_BATCH_FILE), _module(source, "input_batch"))
    handed: list = []

    def build_attn_metadata(**kwargs):
        handed.append(kwargs)
        return {}

    runner_ns = {**{k: v for k, v in input_batch.items() if not k.startswith("__")}, "np": np, "torch": torch,
                 "envs": SimpleNamespace(VLLM_MOE_SKIP_PADDING=False), "async_tensor_h2d": async_tensor_h2d,
                 "pcp": SimpleNamespace(maybe_partition_pcp_batch=_without_pcp)}
    state_ns = {"torch": torch, "CUDAGraphMode": graph_mode, "build_attn_metadata": build_attn_metadata,
                "compute_mm_prefix_ranges": _Unserved("vllm.v1.attention.backends.utils", "compute_mm_prefix_ranges")}
    return ReleaseRunner(
        version=source.version,
        device=device,
        graph_mode=graph_mode,
        input_batch=input_batch,
        prepare_inputs=_method(source.path_of(MODEL_RUNNER_FILE), "GPUModelRunner", "prepare_inputs", runner_ns),
        prepare_attn=_method(source.path_of(MODEL_STATE_FILE), "DefaultModelState", "prepare_attn", state_ns),
        dispatcher=ReleaseDispatcher(source.version, graph_mode, type("StandInCudaGraphManager", (), methods)),
        handed=handed,
    )


def _without_pcp(manager, input_batch, batch_desc):
    """vLLM 0.30.0's ``pcp_manager.maybe_partition_pcp_batch`` on one rank (no manager): the batch
    as it is."""
    if manager is not None:
        raise RunnerGap("prefill context parallelism: the stand-in runner has no PCP manager")
    return input_batch


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


def _request_state(q_lens: list[int], computed: list[int], prefill_lens: list[int], max_reqs: int,
                   device: torch.device):
    """The stand-in ``req_states``: request ``i`` in row ``i``, ``computed[i]`` tokens computed,
    a prompt of ``prefill_lens[i]`` tokens, no drafts; its ``gpu`` tensors on ``device``."""
    n = len(q_lens)
    computed_np = np.zeros(max_reqs, dtype=np.int32)
    computed_np[:n] = computed
    prefill = torch.zeros(max_reqs, dtype=torch.int32)
    prefill[:n] = torch.tensor(prefill_lens, dtype=torch.int32)
    prefill = prefill.to(device)
    return SimpleNamespace(
        num_computed_tokens=SimpleNamespace(gpu=torch.from_numpy(computed_np.copy()).to(device)),
        num_computed_tokens_np=computed_np,
        prefill_len=SimpleNamespace(gpu=prefill),
        next_prefill_tokens=torch.zeros((1, max_reqs), dtype=torch.int32, device=device),
        all_token_ids=SimpleNamespace(gpu=torch.zeros((max_reqs, max(prefill_lens + [1]) + 1), dtype=torch.int32,
                                                      device=device)),
        last_sampled_tokens=torch.zeros(max_reqs, dtype=torch.int64, device=device),
        draft_tokens=torch.zeros((max_reqs, 1), dtype=torch.int64, device=device),
        prompt_len=SimpleNamespace(gpu=prefill.clone()),
    )


def runner_step(runner: ReleaseRunner, q_lens: list[int], seq_lens: list[int], prefill_lens: list[int], *,
                mode: str, graph_tokens: int | None = None, graph_reqs: int | None = None) -> RunnerStep:
    """One step of live requests (``q_lens`` query tokens each, ``seq_lens`` tokens in context
    after them, prompts of ``prefill_lens``) through the release's ``prepare_inputs`` under the
    batch descriptor ``(graph_tokens, graph_reqs)`` (a graph's padded sizes; None: the live ones)
    and its ``prepare_attn`` under ``mode`` (:data:`RUNTIME_MODES`): what the builders are handed."""
    if mode not in RUNTIME_MODES:
        raise ValueError(f"mode: one of {RUNTIME_MODES}, got {mode!r}")
    n, num_tokens = len(q_lens), sum(q_lens)
    max_reqs = max(n, graph_reqs or 0) + 1
    max_tokens = max(num_tokens, graph_tokens or 0) + 1
    computed = [s - q for s, q in zip(seq_lens, q_lens, strict=True)]
    prefilling = np.array([c < p for c, p in zip(computed, prefill_lens, strict=True)], dtype=bool)
    ib = runner.input_batch
    runner_self = SimpleNamespace(
        input_buffers=ib["InputBuffers"](max_reqs, max_tokens, runner.device),
        req_states=_request_state(q_lens, computed, prefill_lens, max_reqs, runner.device),
        model_state=SimpleNamespace(num_new_sampled_tokens_per_step=1),
        device=runner.device, max_num_reqs=max_reqs, adaptive_verification=None, decode_query_len=1,
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
        with kernels_for(runner.device):
            input_batch = runner.prepare_inputs(runner_self, scheduler_output, batch_req_state, batch_desc, *extra)
    except AttributeError as exc:
        raise RunnerGap(f"vLLM {runner.version}'s prepare_inputs reads what the stand-in runner lacks: {exc}") from None
    state_self = SimpleNamespace(max_model_len=MAX_MODEL_LEN, supports_mm_inputs=False, encoder_cache=None)
    del runner.handed[:]
    try:
        with kernels_for(runner.device):
            runner.prepare_attn(state_self, input_batch, runner.graph_mode[mode], (),
                                torch.zeros(1, 0, device=runner.device), [[]],
                                SimpleNamespace(kv_cache_groups=[]))
    except AttributeError as exc:
        raise RunnerGap(f"vLLM {runner.version}'s prepare_attn reads what the stand-in state lacks: {exc}") from None
    (handed,) = runner.handed
    return RunnerStep(
        mode=mode,
        num_reqs=int(handed["num_reqs"]),
        num_actual_tokens=int(handed["num_tokens"]),
        query_start_loc_cpu=handed["query_start_loc_cpu"].cpu(),
        seq_lens=handed["seq_lens"][: handed["num_reqs"]].cpu(),
        seq_lens_cpu_upper_bound=None if handed.get("seq_lens_cpu_upper_bound") is None
        else handed["seq_lens_cpu_upper_bound"][: handed["num_reqs"]].cpu(),
        positions=handed["positions"].cpu(),
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
    return run_release_nodes(path, picked, namespace)


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


__all__ = ["COMPARED_FIELDS", "DISPATCHER_METHODS", "RUNTIME_MODES", "ReleaseDispatcher", "ReleaseRunner", "RunnerGap",
           "RunnerStep", "field_differences", "graph_descriptor", "kernels_for", "load_runner", "runner_device",
           "runner_step"]
