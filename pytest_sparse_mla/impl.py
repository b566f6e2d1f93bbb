"""The implementation under test (``--impl module:factory``, the ``impl`` fixture), the device
production code runs on (``--device``, the ``device`` fixture), and the GPU gating of
``gpu``-marked tests: skipped with the reason where no SM90 GPU with FlashInfer is usable, and
said plainly (header and summary) where an NVIDIA GPU is visible but the GPU tier cannot run;
``--require-gpu-tier`` makes that a failure. Options that name something to load or write are
checked when the run starts, each a usage error of one line before any test runs: ``--impl`` is
loaded and checked against the seam by the controlling process.

Who decides what: the controlling process (the only one under plain pytest) never touches
CUDA nor imports FlashInfer; it asks NVML / nvidia-smi and ``importlib`` for the header and for
``--require-gpu-tier``. The processes that run tests (xdist workers, after their GPU pinning)
make the full check (CUDA, the FlashInfer import) when they collect ``gpu`` tests, and hand
its result to the controller (``workeroutput``) for the summary.

The controller of an xdist run loads and checks an ``--impl`` other than the default before
xdist starts any worker, so a bad one is the run's only output, at once (the import of the
user's module, and of torch where it imports it, delays the workers by that long). The default
implementation is the project's own: with it the controller imports no torch before its workers
start (seconds each worker would otherwise wait) and checks it once they are started.
"""

from __future__ import annotations

import os
import sys

import pytest

from harness import availability, gpu_env
from mla_constants import DEFAULT_IMPL_SPEC

from .keys import GROUP

IMPL_SPEC = pytest.StashKey[str]()
IMPL = pytest.StashKey[object]()  # the implementation this process loaded and checked
GPU_REASON = pytest.StashKey[str]()  # why the GPU tier is skipped ("" when it runs), per test process
WORKER_GPU_REASONS = pytest.StashKey[set]()  # the workers' GPU_REASON (controller)
GPU_STATUS = pytest.StashKey["GpuTierStatus"]()  # the controller's CUDA-free view
GPU_REASON_KEY = "sparse_mla_gpu_tier"  # workeroutput: a worker's GPU_REASON
DEVICE_CHOICES = ("auto", "cpu", "cuda")


def pytest_addoption(parser):
    group = parser.getgroup(*GROUP)
    group.addoption(
        "--impl",
        default=DEFAULT_IMPL_SPEC,
        metavar="MODULE:FACTORY",
        help="implementation under test: a factory returning an object with the fast.impl.SparseMLAImpl "
        f"methods (default: {DEFAULT_IMPL_SPEC})",
    )
    group.addoption(
        "--device",
        default="auto",
        choices=DEVICE_CHOICES,
        help="device the tests hand the implementation under test its inputs on (default auto: cuda where "
        "torch sees a CUDA GPU and TRITON_INTERPRET is not 1, else cpu)",
    )
    group.addoption(
        "--require-gpu-tier",
        action="store_true",
        default=False,
        help="fail the run, instead of skipping the gpu-marked tests, where the GPU tier cannot run "
        "(no NVIDIA GPU, not sm_90, FlashInfer missing or failing to import)",
    )


# --- device ------------------------------------------------------------------------------------


def resolve_device(choice: str, *, cuda_available: bool, interpreted: bool) -> str:
    """The device type: ``auto`` is cuda where CUDA is usable and the convert kernel is
    compiled, else cpu."""
    if choice == "auto":
        return "cuda" if cuda_available and not interpreted else "cpu"
    return choice


def convert_interpreted() -> bool:
    """Whether the convert kernel runs in Triton's interpreter (``fast.convert.INTERPRETED``,
    asked of the environment where that module, which imports torch and Triton, is not loaded)."""
    convert = sys.modules.get("fast.convert")
    return convert.INTERPRETED if convert is not None else os.environ.get("TRITON_INTERPRET") == "1"


def run_device(config):
    """The ``torch.device`` the run hands the implementation under test its inputs on
    (``--device`` resolved here; call it in a test process, after its GPU pinning)."""
    import torch

    from fast import convert

    return torch.device(resolve_device(config.getoption("--device"), cuda_available=torch.cuda.is_available(),
                                       interpreted=convert.INTERPRETED))


def device_problem(device: str, *, cuda_available: bool, interpreted: bool, default_impl: bool) -> str | None:
    """Why production code cannot run on ``device`` (a device type) here, or None."""
    if device == "cuda" and not cuda_available:
        return "--device=cuda, but torch sees no CUDA GPU here"
    if device == "cpu" and not interpreted and default_impl:
        return ("the convert kernel is compiled (TRITON_INTERPRET is not 1) and takes CUDA tensors only; "
                "for --device=cpu on a GPU machine set TRITON_INTERPRET=1")
    return None


def kernel_line(device: str, gpu_name: str | None, *, interpreted: bool) -> str:
    """Where the project's convert kernel runs (``device``: a device type), for the header."""
    if device == "cpu":
        return "convert kernel: Triton interpreter on CPU" if interpreted else "convert kernel: compiled Triton on CPU"
    where = f"cuda:0 ({gpu_name})" if gpu_name else "cuda:0"
    return f"convert kernel: {'Triton interpreter' if interpreted else 'compiled Triton'} on {where}"


def checked_impl(spec: str):
    """The implementation ``spec`` names, loaded and checked against the seam; a bad spec (no
    colon, a module or factory that cannot be loaded, a factory that raises, an object without
    the seam's methods) is one usage error naming it."""
    from fast.impl import load_impl

    try:
        return load_impl(spec)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def active_impl(config):
    """The implementation under test (``--impl module:factory``; default: fast/): loaded at
    start-up by the controlling process, by each xdist worker when it is first asked for, once
    per process."""
    if IMPL not in config.stash:
        config.stash[IMPL] = checked_impl(config.stash[IMPL_SPEC])
    return config.stash[IMPL]


@pytest.fixture(scope="session")
def impl(pytestconfig):
    """The implementation under test (:func:`active_impl`)."""
    return active_impl(pytestconfig)


@pytest.fixture(scope="session")
def device(pytestconfig):
    """The ``torch.device`` of the inputs every test hands the implementation under test
    (``--device``). Inputs are built on the host (identical on every machine) and moved here;
    references may run on the host and compare after ``.cpu()``."""
    import torch

    from fast import convert

    cuda_available = torch.cuda.is_available()  # after this worker's GPU pinning
    chosen = run_device(pytestconfig)
    problem = device_problem(chosen.type, cuda_available=cuda_available, interpreted=convert.INTERPRETED,
                             default_impl=pytestconfig.stash[IMPL_SPEC] == DEFAULT_IMPL_SPEC)
    if problem:
        pytest.fail(f"device {chosen}: {problem}", pytrace=False)
    return chosen


# --- GPU tier status ------------------------------------------------------------------------------


class GpuTierStatus:
    """The controller's view, without CUDA: the NVIDIA GPUs found and why the tier cannot run."""

    def __init__(self, gpus: list[tuple[str, str]], reason: str | None):
        self.gpus = gpus
        self.reason = reason

    @property
    def gpu_name(self) -> str | None:
        return self.gpus[0][0] if self.gpus else None

    def machine(self) -> str:
        return f"{len(self.gpus)} NVIDIA GPU{'s' if len(self.gpus) != 1 else ''} ({self.gpu_name})"

    def header_line(self) -> str:
        if not self.gpus:
            return "GPU tier: not run here (no NVIDIA GPU found)"
        if self.reason:
            return f"GPU tier: NOT RUN on this machine with {self.machine()}: {self.reason}"
        return (
            f"GPU tier: runs on {self.machine()}, sm_90, flashinfer installed "
            "(its import is checked when the GPU tests are collected)"
        )


def not_run_line(reason: str, status: GpuTierStatus | None) -> str:
    """The summary's line on a GPU tier that did not run: plain where a GPU is visible."""
    if status is not None and status.gpus:
        return f"GPU tier NOT RUN on a machine with {status.machine()}: {reason}"
    return f"GPU tier skipped: {reason}"


def require_gpu_tier_error(status: GpuTierStatus) -> str:
    return f"--require-gpu-tier: the GPU tier cannot run here: {status.reason}"


def cuda_seen_without_cuda(gpus: list[tuple[str, str]]) -> bool:
    """What ``torch.cuda.is_available()`` will say, asked without initialising CUDA."""
    return bool(gpus) and gpu_env.torch_build()[1] is not None and not gpu_env.every_gpu_hidden()


def is_controller(config) -> bool:
    return not hasattr(config, "workerinput")


def runs_tests_in_workers(config) -> bool:
    """Whether xdist will hand the tests to worker processes (its own test of the options)."""
    return (not config.getoption("collectonly") and config.getoption("dist", "no") != "no"
            and bool(config.getoption("tx", None)))


def pytest_configure(config):
    config.stash[IMPL_SPEC] = config.getoption("--impl")
    if not is_controller(config):
        return  # a worker loads the implementation after its GPU pinning (pytest_sparse_mla.gpus)
    if not runs_tests_in_workers(config) or config.stash[IMPL_SPEC] != DEFAULT_IMPL_SPEC:
        config.stash[IMPL] = checked_impl(config.stash[IMPL_SPEC])  # before xdist starts any worker
    gpus = gpu_env.gpus_without_cuda()
    status = GpuTierStatus(gpus, availability.reason_without_cuda(gpus))
    config.stash[GPU_STATUS] = status
    if config.getoption("--require-gpu-tier") and status.reason:
        raise pytest.UsageError(require_gpu_tier_error(status))
    cuda_seen = cuda_seen_without_cuda(gpus)
    interpreted = convert_interpreted()
    chosen = resolve_device(config.getoption("--device"), cuda_available=cuda_seen, interpreted=interpreted)
    problem = device_problem(chosen, cuda_available=cuda_seen, interpreted=interpreted,
                             default_impl=config.stash[IMPL_SPEC] == DEFAULT_IMPL_SPEC)
    if problem:
        raise pytest.UsageError(problem)


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    """The controller of an xdist run with the default ``--impl`` loads and checks it once xdist
    has started the workers (at the start of the session), before it hands them tests, so that
    the workers do not wait for torch to load here first (any other ``--impl`` was checked at
    configure, before the workers started)."""
    config = session.config
    if is_controller(config) and IMPL not in config.stash:
        config.stash[IMPL] = checked_impl(config.stash[IMPL_SPEC])


def pytest_report_header(config):
    if not is_controller(config):
        return []
    status = config.stash[GPU_STATUS]
    cuda_seen = cuda_seen_without_cuda(status.gpus)
    interpreted = convert_interpreted()
    chosen = resolve_device(config.getoption("--device"), cuda_available=cuda_seen, interpreted=interpreted)
    spec = config.stash[IMPL_SPEC]
    lines = []
    if spec == DEFAULT_IMPL_SPEC:
        lines.append(kernel_line(chosen, status.gpu_name, interpreted=interpreted))
    else:
        lines.append(f"implementation under test: {spec}, inputs on {chosen}")
    lines.append(status.header_line())
    return lines


#: Why a ``gpu_stand_in`` test is skipped where the GPU tier runs.
STAND_IN_REPLACED = ("stands in for the GPU tier on machines without one; here the GPU tier runs the same "
                     "families on the real FlashInfer")


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    stand_ins = [item for item in items if item.get_closest_marker("gpu_stand_in")]
    if not (gpu_items or stand_ins):
        return
    reason = availability.sm90_flashinfer_unavailable_reason()
    config.stash[GPU_REASON] = reason or ""
    if not reason:
        for item in stand_ins:
            item.add_marker(pytest.mark.skip(reason=STAND_IN_REPLACED))
    if reason and not config.getoption("--require-gpu-tier"):
        skip = pytest.mark.skip(reason=f"GPU tier: {reason}")
        for item in gpu_items:
            item.add_marker(skip)


def pytest_runtest_setup(item):
    """Under ``--require-gpu-tier`` a GPU test that cannot run fails with the reason."""
    reason = item.config.stash.get(GPU_REASON, "")
    if reason and item.config.getoption("--require-gpu-tier") and item.get_closest_marker("gpu"):
        pytest.fail(f"--require-gpu-tier: the GPU tier cannot run: {reason}", pytrace=False)


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if not is_controller(config) and GPU_REASON in config.stash:
        config.workeroutput[GPU_REASON_KEY] = config.stash[GPU_REASON]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    reason = getattr(node, "workeroutput", {}).get(GPU_REASON_KEY)
    if reason is not None:
        node.config.stash.setdefault(WORKER_GPU_REASONS, set()).add(reason)


def gpu_tier_reasons(config) -> list[str]:
    """Why the GPU tier did not run: what the test processes found where they collected GPU
    tests, else the controller's CUDA-free view where a GPU is visible."""
    found = set(config.stash.get(WORKER_GPU_REASONS, set()))
    if GPU_REASON in config.stash:
        found.add(config.stash[GPU_REASON])
    if found:
        return sorted(r for r in found if r)
    status = config.stash.get(GPU_STATUS, None)
    return [status.reason] if status is not None and status.gpus and status.reason else []


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not is_controller(config):
        return
    status = config.stash.get(GPU_STATUS, None)
    for reason in gpu_tier_reasons(config):
        visible = status is not None and bool(status.gpus)
        terminalreporter.write_line(not_run_line(reason, status), red=visible, bold=visible)
    impl_spec = config.stash.get(IMPL_SPEC, None)
    if impl_spec:
        terminalreporter.write_line(f"implementation under test: {impl_spec}")
