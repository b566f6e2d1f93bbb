"""A simulated SM90 machine: a process without a GPU runs the GPU tier's tests as if on an SM90
machine with FlashInfer: the GPU gate opens, FlashInfer's wrapper is the CPU stand-in of
``tests/support/reference_wrapper.py`` (plans like FlashInfer under CUDA graphs, reads kv_indices at run,
computes with the low-precision reference) and returns base-2 LSE where the state asks for
FlashInfer's own, and the features are the stand-in's. CUDA graphs are :class:`SimulatedGraph`:
a capture keeps the attention state's steps with what a captured launch fixes, and a replay runs
them again on the buffers and plan of the moment (FlashInfer's standing finding of graph replays
included). It checks what the tests do around the kernel (plans, buffers, graphs, comparisons,
the re-created bugs of the attention state), never FlashInfer.

Two ways in:

- as a pytest plugin of a process of its own (``-p tests.simulated_sm90``, with
  ``SPARSE_MLA_DEVICE=cpu TRITON_INTERPRET=1``): the patches are made at configure time and
  stay for the process. With a vLLM under test (``--vllm``) the machine also has the stand-ins
  its backends need (:func:`install_vllm_stand_ins`): FlashInfer's ``flashinfer.mla`` for
  vLLM's SM90 backend is the fa3 stand-in of ``tests/fa3_stand_in.py`` (it keeps fa3's schedule,
  so executed lengths are read back as on FlashInfer), and FlashMLA's kernels are those of
  ``tests/flashmla_stand_in.py`` on a platform that says SM90; the GPU tier's tests run on the
  machine's device (``harness.port.launch.DEVICE``). So the vLLM, FlashMLA and port GPU tests run
  there with the GPU runner's flags;
- in a running process whose convert kernel runs in Triton's interpreter (a nested in-process
  session, ``tests/cpu/test_suite_catches_bugs.py``): :func:`simulate_in_process` makes the
  same patches through pytest's ``monkeypatch``, so they are undone after the test, and points
  the tests at the CPU (``SPARSE_MLA_DEVICE=cpu``, read where ``harness.port.launch`` is imported:
  it and the GPU tier's test modules are imported afresh by the nested session).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

import backends.flashinfer.compat as compat
import backends.flashinfer.sm90_state as sm90
import fast.convert
import harness.availability
from reference.oracle import LOG2_E
from tests.support.reference_wrapper import ReferenceWrapper

FEATURES = SimpleNamespace(version="simulated-sm90", plan_checks_page_counts=False, run_checks_cache_coverage=False,
                           coverage_from_plan_slots=False, run_checks_query_shape=False,
                           describe=lambda: "simulated SM90 (reference stand-in)")

#: Modules that read the device at import (``harness.port.launch.DEVICE``, and the GPU tier's tests
#: that import it by name): imported afresh by a nested session on the simulated machine.
DEVICE_BOUND_MODULES = ("harness.port.launch", "tests.gpu")


#: Packed query rows (query row x head) one CTA of FlashInfer's fa3 MLA kernel computes.
CTA_TILE_Q = 64


class StandInWrapper(ReferenceWrapper):
    """The stand-in, with FlashInfer's base-2 LSE where natural log is not asked for. A launch
    captured in a graph runs with the cluster size of the plan it was captured after
    (``launch_cluster``); where the plan of the moment has another one, it leaves the last CTA
    tile of the plan's packed query rows unwritten, as FlashInfer's fa3 kernel leaves tiles of
    such a plan (docs/findings.md#graph-replay-with-stale-plan-state: on an H200, 32768 NaN
    outputs, one tile of 64 packed rows x 512, in a replay of 3 rows x 128 heads)."""

    launch_cluster: int | None = None  # set while a captured launch runs

    def __init__(self, *args, lse_base_e: bool = True, kernel: str = "fa3", **kwargs):
        super().__init__(*args, **kwargs)
        self.lse_base_e = lse_base_e
        self.kernel = kernel
        self.features = FEATURES
        self.num_heads = 0

    def plan(self, *, num_heads, **kwargs):
        super().plan(num_heads=num_heads, **kwargs)
        self.num_heads = num_heads

    @property
    def planned_rows(self) -> int:
        return int(self._plan[0][-1])

    @property
    def cluster(self) -> int:
        """The cluster size of the last plan (kv_len_arr's length is FlashInfer's batch size)."""
        return compat.fa3_mla_cluster_size(self.planned_rows, self.num_heads, self._plan[2].numel())

    def run(self, q_nope, q_pe, ckv, kpe, *, out, lse, k_scale=1.0):
        rows = min(q_nope.shape[0], self.planned_rows)
        stale = self.launch_cluster not in (None, self.cluster)
        kept = last_tile(out, lse, rows, self.num_heads) if stale else None
        super().run(q_nope, q_pe, ckv, kpe, out=out, lse=lse, k_scale=k_scale)
        if not self.lse_base_e:
            lse.mul_(LOG2_E)
        if kept is not None:
            restore_last_tile(out, lse, rows, kept)


def last_tile(out: torch.Tensor, lse: torch.Tensor, rows: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of what ``out`` and ``lse`` hold in the last CTA tile of ``rows`` query rows of
    ``heads`` heads (packed row = query row x heads + head)."""
    tile = min(CTA_TILE_Q, rows * heads)
    return out[:rows].flatten(0, 1)[-tile:].clone(), lse[:rows].flatten()[-tile:].clone()


def restore_last_tile(out: torch.Tensor, lse: torch.Tensor, rows: int, kept) -> None:
    tile = kept[1].numel()
    if tile:
        out[:rows].flatten(0, 1)[-tile:] = kept[0]
        lse[:rows].flatten()[-tile:] = kept[1]


# --- CUDA graphs ----------------------------------------------------------------------------


@dataclass
class CapturedLaunch:
    """An attention state's step launched during a capture, with what the capture fixes: the
    rows its run was shaped for (the state's ``num_rows`` then) and the plan's cluster size."""

    state: object
    args: tuple
    rows: int
    cluster: int | None


class SimulatedGraph:
    """``torch.cuda.CUDAGraph`` on the simulated machine: a capture (:func:`simulated_capture`) launches
    nothing and keeps the attention state's steps launched in it (:class:`CapturedLaunch`);
    :meth:`replay` runs them again on the buffers and with the plan of the moment, shaped as
    captured."""

    capturing: SimulatedGraph | None = None  # the graph being captured, if any

    def __init__(self):
        self.launches: list[CapturedLaunch] = []

    @staticmethod
    def capture_problem(layer) -> str | None:
        """Why this machine's graphs cannot capture ``layer``'s forward (read by
        ``harness.layer_modes.capture_problem``): they keep the port's attention state steps
        alone, so a forward through any other state would run outside the capture."""
        if isinstance(getattr(layer, "state", None), sm90.SM90AttentionState):
            return None
        return ("the simulated machine's CUDA graphs capture only the port's attention state step "
                "(tests.simulated_sm90.SimulatedGraph); this layer's forward would run outside the capture")

    def replay(self) -> None:
        for launch in self.launches:
            state, wrapper = launch.state, launch.state.wrapper
            rows = state.num_rows
            state.num_rows, wrapper.launch_cluster = launch.rows, launch.cluster
            try:
                ATTENTION_STEP(state, *launch.args)
            finally:
                state.num_rows, wrapper.launch_cluster = rows, None


@contextmanager
def simulated_capture(cuda_graph: SimulatedGraph, **kwargs):
    """``torch.cuda.graph`` on the simulated machine: the steps launched inside are captured."""
    SimulatedGraph.capturing = cuda_graph
    try:
        yield cuda_graph
    finally:
        SimulatedGraph.capturing = None


def capturing() -> bool:
    """``torch.cuda.is_current_stream_capturing`` on the simulated machine."""
    return SimulatedGraph.capturing is not None


#: The attention state's step as the project defines it (launched by a replay).
ATTENTION_STEP = sm90.SM90AttentionState.step


def step_or_capture(state, *args) -> None:
    """``SM90AttentionState.step`` on the simulated machine: kept by the graph being captured, if
    any (with the rows and cluster size the launch is captured with), else launched."""
    if SimulatedGraph.capturing is None:
        ATTENTION_STEP(state, *args)
        return
    launch = CapturedLaunch(state, args, state.num_rows, getattr(state.wrapper, "cluster", None))
    SimulatedGraph.capturing.launches.append(launch)


def patches() -> list[tuple[object, str, object]]:
    """``(module, attribute, value)`` of everything the simulated machine replaces."""
    return [
        (harness.availability, "sm90_flashinfer_unavailable_reason", lambda: None),
        (sm90, "MLAWrapper", StandInWrapper),
        (compat, "MLAWrapper", StandInWrapper),
        (compat, "detect_features", lambda device=None: FEATURES),
        (sm90, "WORKSPACE_BYTES", 1024),
        (sm90.SM90AttentionState, "step", step_or_capture),
        (torch.cuda, "CUDAGraph", SimulatedGraph),
        (torch.cuda, "graph", simulated_capture),
        (torch.cuda, "is_current_stream_capturing", capturing),
    ]


#: What this plugin is, as the upgrade check asks a stand-in machine
#: (``pytest_sparse_mla.baselines.STAND_IN_MACHINE_ATTRIBUTE``): it records and compares here,
#: without a timing pass.
SPARSE_MLA_STAND_IN_MACHINE = "the simulated SM90 machine (tests/simulated_sm90.py)"

#: The process's patches of the vLLM stand-ins (kept until the process's session is unconfigured).
PROCESS_PATCHES = pytest.MonkeyPatch()
#: The local version tag of the stand-in FlashInfer's ``__version__``.
STAND_IN_TAG = "+fa3.stand.in"


@pytest.hookimpl(trylast=True)  # after pytest_sparse_mla.vllm has resolved --vllm
def pytest_configure(config):
    # imported here: a module imported before the suite's plugin is registered escapes pytest's
    # assertion rewriting
    from pytest_sparse_mla.vllm import VLLM_SOURCE

    for module, name, value in patches():
        setattr(module, name, value)
    source = config.stash.get(VLLM_SOURCE, None)
    if source is not None:
        install_vllm_stand_ins(source, PROCESS_PATCHES)


def pytest_unconfigure(config):
    PROCESS_PATCHES.undo()


def stand_in_flashinfer_version(source, wrapper) -> str:
    """The FlashInfer release the stand-in answers as: the one the vLLM release pins where its
    series is the one whose schedule the stand-in keeps (``wrapper.release``), else that
    series' first release; tagged as the stand-in."""
    from backends.vllm.source import flashinfer_pin

    pin = flashinfer_pin(source)
    version = pin if pin and compat.parse_version(pin)[:2] == compat.parse_version(wrapper.release)[:2] \
        else f"{wrapper.release}.0"
    return version + STAND_IN_TAG


def install_vllm_stand_ins(source, monkeypatch) -> None:
    """What the release ``source``'s backends need on the simulated machine, until
    ``monkeypatch`` is undone:

    - ``flashinfer.mla`` (imported by vLLM's SM90 backend) is the fa3 stand-in of the release
      series its design runs on (bounded: 0.7.x, ``_planned_backend``; exact: 0.6.x), in a
      ``flashinfer`` package whose ``__version__`` names that series (what the GPU tier's
      pairing check reads);
    - where the release carries FlashMLA: the stand-in kernels registered under its op schemas
      and in place of its extensions, vLLM's platform an SM90 CUDA one, Triton's interpreter
      taking vLLM's 0/1 integer masks, FLASHMLA_SPARSE loaded (once per process) and FlashMLA's
      interface calling the stand-in kernels."""
    from backends.vllm.flashmla import FlashMLABackend, FlashMLAUnavailable
    from backends.vllm.source import design_of, missing_flashmla_files
    from tests import fa3_stand_in, flashmla_stand_in

    wrapper = fa3_stand_in.StandInWrapper if design_of(source) == "bounded" else fa3_stand_in.StandIn06Wrapper
    fa3_stand_in.install(monkeypatch, wrapper)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", capturing)  # the machine's graphs
    package = sys.modules["flashinfer"]
    monkeypatch.setattr(package, "__version__", stand_in_flashinfer_version(source, wrapper), raising=False)
    # importlib.util.find_spec("flashinfer") reads the spec of a module in sys.modules
    monkeypatch.setattr(package, "__spec__", importlib.machinery.ModuleSpec("flashinfer", None, is_package=True))
    if missing_flashmla_files(source):
        return  # test_flashmla.py skips with the reason (tests.flashmla_cases.flashmla_source)
    flashmla_stand_in.register(source)
    flashmla_stand_in.hopper(monkeypatch)
    flashmla_stand_in.interpreter_bool_masks(monkeypatch)
    try:
        FlashMLABackend(source)  # loads FLASHMLA_SPARSE and FlashMLA's interface
    except FlashMLAUnavailable:
        return  # test_flashmla_kernels_load_here fails with the reason
    flashmla_stand_in.in_place_of_the_kernels(monkeypatch)


def can_simulate_in_process() -> bool:
    """The convert kernel of this process runs on CPU tensors (Triton's interpreter was chosen
    when ``fast.convert`` was imported)."""
    return fast.convert.INTERPRETED


def simulate_in_process(monkeypatch) -> None:
    """This process becomes the simulated machine until ``monkeypatch`` is undone: the patches,
    the CPU as the tests' device, and the modules that read the device at import dropped, so
    that a nested session imports them afresh (the session's own module snapshot, and
    ``monkeypatch``, put the old ones back)."""
    if not can_simulate_in_process():
        raise RuntimeError(
            "the simulated machine runs in this process only with the convert kernel in Triton's interpreter"
        )
    for module, name, value in patches():
        monkeypatch.setattr(module, name, value)
    monkeypatch.setenv("SPARSE_MLA_DEVICE", "cpu")
    for name, module in list(sys.modules.items()):
        if any(name == m or name.startswith(m + ".") for m in DEVICE_BOUND_MODULES):
            # The nested session's fresh import sets the package attribute too: put this
            # process's module back there as well as in sys.modules, or a later
            # `import harness.port.launch` gets one copy through each.
            parent, _, child = name.rpartition(".")
            if getattr(sys.modules.get(parent), child, None) is module:
                monkeypatch.setattr(sys.modules[parent], child, module)
            monkeypatch.delitem(sys.modules, name)


# --- glibc's malloc: freed memory kept for reuse ---------------------------------------------

#: mallopt parameters (malloc.h) and the largest value an ``int`` takes.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
GLIBC_DEFAULT_THRESHOLD = 128 * 1024
KEEP_THRESHOLD = (1 << 31) - 1


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc
        return None


@contextmanager
def freed_memory_kept():
    """glibc's malloc keeps freed memory for reuse instead of returning it, so that the
    references' large temporaries are not mapped and zeroed afresh on every call (what
    ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` do for a process of its own); on
    exit glibc's default thresholds come back and the kept memory is returned. Elsewhere a no-op."""
    libc = _libc()
    if libc is None:
        yield
        return
    libc.mallopt(M_MMAP_THRESHOLD, KEEP_THRESHOLD)
    libc.mallopt(M_TRIM_THRESHOLD, KEEP_THRESHOLD)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, GLIBC_DEFAULT_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, GLIBC_DEFAULT_THRESHOLD)
        libc.malloc_trim(0)


#: Where pytest keeps the last failure (``sys.last_exc`` too from Python 3.12 on).
LAST_FAILURE = ("last_type", "last_value", "last_traceback", "last_exc")


@contextmanager
def nested_failures_released():
    """The last failure's traceback as it was before: pytest keeps the last failing test's in
    ``sys.last_traceback`` (for post-mortem debugging), and a nested in-process session's would
    keep that test's frames, with their tensors, alive in this process."""
    before = {name: getattr(sys, name) for name in LAST_FAILURE if hasattr(sys, name)}
    try:
        yield
    finally:
        for name in LAST_FAILURE:
            if name in before:
                setattr(sys, name, before[name])
            elif hasattr(sys, name):
                delattr(sys, name)


@contextmanager
def process_share_of_threads():
    """torch's intra-op threads set to this process's share of the cores (``OMP_NUM_THREADS``,
    which the suite's xdist workers get, else every core), as a process of its own would start
    with; the CPU tier's fixtures run tests with one."""
    before = torch.get_num_threads()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 0) or cores)
    try:
        yield
    finally:
        torch.set_num_threads(before)
