"""A simulated SM90 machine: a process without a GPU runs the GPU tier's tests as if on an SM90
machine with FlashInfer: the GPU gate opens, FlashInfer's wrapper is the CPU stand-in of
``tests/cpu/test_rerun.py`` (plans like FlashInfer under CUDA graphs, reads kv_indices at run,
computes with the low-precision reference) and returns base-2 LSE where the state asks for
FlashInfer's own, and the features are the stand-in's. It checks what the tests do around the
kernel (plans, buffers, comparisons, the re-created bugs of the attention state), never
FlashInfer.

Two ways in:

- as a pytest plugin of a process of its own (``-p tests.simulated_sm90``, with
  ``SPARSE_MLA_DEVICE=cpu TRITON_INTERPRET=1``): the patches are made at configure time and
  stay for the process. With a vLLM under test (``--vllm``) the machine also has the stand-ins
  its backends need (:func:`install_vllm_stand_ins`): FlashInfer's ``flashinfer.mla`` for
  vLLM's SM90 backend is the fa3 stand-in of ``tests/fa3_stand_in.py`` (it keeps fa3's schedule,
  so executed lengths are read back as on FlashInfer), and FlashMLA's kernels are those of
  ``tests/flashmla_stand_in.py`` on a platform that says SM90; the GPU tier's tests run on the
  machine's device (``harness.launch.DEVICE``). So the vLLM, FlashMLA and port GPU tests run
  there with the GPU runner's flags;
- in a running process whose convert kernel runs in Triton's interpreter (a nested in-process
  session, ``tests/cpu/test_suite_catches_bugs.py``): :func:`simulate_in_process` makes the
  same patches through pytest's ``monkeypatch``, so they are undone after the test, and points
  the tests at the CPU (``SPARSE_MLA_DEVICE=cpu``, read where ``harness.launch`` is imported:
  it and the GPU tier's test modules are imported afresh by the nested session).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
import sys
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

import fast.convert
import fast.flashinfer_compat as compat
import fast.sm90 as sm90
import harness.availability
from reference.oracle import LOG2_E
from tests.cpu.test_rerun import ReferenceWrapper

FEATURES = SimpleNamespace(version="simulated-sm90", plan_checks_page_counts=False, run_checks_cache_coverage=False,
                           run_checks_query_shape=False, describe=lambda: "simulated SM90 (reference stand-in)")

#: Modules that read the device at import (``harness.launch.DEVICE``, and the GPU tier's tests
#: that import it by name): imported afresh by a nested session on the simulated machine.
DEVICE_BOUND_MODULES = ("harness.launch", "tests.gpu")


class StandInWrapper(ReferenceWrapper):
    """The stand-in, with FlashInfer's base-2 LSE where natural log is not asked for."""

    def __init__(self, *args, lse_base_e: bool = True, kernel: str = "fa3", **kwargs):
        super().__init__(*args, **kwargs)
        self.lse_base_e = lse_base_e
        self.kernel = kernel
        self.features = FEATURES

    def run(self, q_nope, q_pe, ckv, kpe, *, out, lse, k_scale=1.0):
        super().run(q_nope, q_pe, ckv, kpe, out=out, lse=lse, k_scale=k_scale)
        if not self.lse_base_e:
            lse.mul_(LOG2_E)


def patches() -> list[tuple[object, str, object]]:
    """``(module, attribute, value)`` of everything the simulated machine replaces."""
    return [
        (harness.availability, "sm90_flashinfer_unavailable_reason", lambda: None),
        (sm90, "MLAWrapper", StandInWrapper),
        (compat, "MLAWrapper", StandInWrapper),
        (compat, "detect_features", lambda device=None: FEATURES),
        (sm90, "WORKSPACE_BYTES", 1024),
        (torch.cuda, "is_current_stream_capturing", lambda: False),  # a CPU-only torch build
    ]


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
    from backends.vllm_source import flashinfer_pin

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
    from backends.flashmla import FlashMLABackend, FlashMLAUnavailable
    from backends.vllm_source import design_of, missing_flashmla_files
    from tests import fa3_stand_in, flashmla_stand_in

    wrapper = fa3_stand_in.StandInWrapper if design_of(source) == "bounded" else fa3_stand_in.StandIn06Wrapper
    fa3_stand_in.install(monkeypatch, wrapper)
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
            # `import harness.launch` gets one copy through each.
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
