"""The GPUs of a run: FlashInfer's kernel variants built in the background from the start of a
run on a GPU machine (``python3 -m harness.port.prebuild --parallel --only-missing``: nothing where
the JIT cache holds them), each xdist worker pinned to one GPU at configure time (before anything
touches CUDA) and given its share of the CPU cores for intra-op threads, the device each worker
used, and on the controlling process a summary of the
kernel error ratios and the FlashInfer warnings the GPU tests attached to their reports (a
terminal section, and a JSON file when ``SPARSE_MLA_GPU_REPORT`` names one)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest

from harness.gpu_env import pin_worker_gpu, torch_can_use_an_nvidia_gpu

from .keys import ERROR_KEY, WARNING_KEY

GPU_USED_KEY = "sparse_mla_gpu"  # workeroutput: the device a worker used
GPUS_USED = pytest.StashKey[dict]()  # worker id -> the device it used (controller)
REPORT_ENV = "SPARSE_MLA_GPU_REPORT"


THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


#: "0" turns the background build off. The outermost run sets it to what it decided ("started"
#: or "not started"), so that nested sessions, which inherit it, start none of their own.
PREBUILD_ENV = "SPARSE_MLA_JIT_PREBUILD"
PREBUILD_LOG = Path(tempfile.gettempdir()) / "sparse-mla-jit-prebuild.log"
PREBUILD_STARTED = pytest.StashKey[Path]()


def wants_background_build(env_value: str | None, collect_only: bool, gpu_usable, flashinfer_found) -> bool:
    """Whether a run starts the background build: not turned off or started already, not a
    collection only, a GPU torch can use and FlashInfer installed (the last two asked only when
    the first allow it, and without initialising CUDA)."""
    return env_value is None and not collect_only and gpu_usable() and flashinfer_found()


def flashinfer_installed() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def start_background_build(cwd: Path) -> Path:
    """``python3 -m harness.port.prebuild --parallel --only-missing`` in a session of its own, writing
    to ``PREBUILD_LOG``; it outlives a run that ends first and leaves the cache built."""
    with open(PREBUILD_LOG, "w") as log:
        subprocess.Popen([sys.executable, "-m", "harness.port.prebuild", "--parallel", "--only-missing"], cwd=cwd,
                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    return PREBUILD_LOG


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    workerinput = getattr(config, "workerinput", None)
    pin_worker_gpu((workerinput or {}).get("workerid"))
    if workerinput is None:
        config.pluginmanager.register(GpuReport())
        decided = os.environ.get(PREBUILD_ENV)
        if wants_background_build(decided, config.option.collectonly, torch_can_use_an_nvidia_gpu,
                                  flashinfer_installed):
            config.stash[PREBUILD_STARTED] = start_background_build(config.rootpath)
        if decided is None:
            os.environ[PREBUILD_ENV] = "started" if PREBUILD_STARTED in config.stash else "not started"
    else:
        share_cores(workerinput.get("workercount"))


def pytest_report_header(config):
    log = config.stash.get(PREBUILD_STARTED, None)
    if log is not None:
        return [f"FlashInfer JIT: kernel variants missing from the cache build in the background (log: {log})"]
    return []


# --- CPU threads per xdist worker --------------------------------------------------------------


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def threads_per_worker(cores: int, workers: int) -> int:
    """Each worker's share of the cores: torch's default of one intra-op thread per core in
    every worker oversubscribes the machine ``workers`` times over."""
    return max(1, cores // max(workers, 1))


def share_cores(workers: int | None) -> None:
    """In an xdist worker: intra-op threads limited to the worker's share of the cores, unless
    the user set ``OMP_NUM_THREADS``. The environment covers a torch imported later and the
    processes the tests start; a torch already imported is told directly."""
    if not workers or "OMP_NUM_THREADS" in os.environ:
        return
    threads = threads_per_worker(available_cores(), workers)
    for name in THREAD_ENV:
        os.environ.setdefault(name, str(threads))
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)


# --- which GPU each xdist worker used ---------------------------------------------------------


def gpu_identity() -> str:
    """The visible devices and, where CUDA was initialised by the tests, the device's bus id;
    then the worker's intra-op threads."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<all>")
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else os.environ.get("OMP_NUM_THREADS")
    threads = f"; {threads} intra-op threads" if threads is not None else ""
    if torch is not None and torch.cuda.is_initialized():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        bus = getattr(props, "pci_bus_id", None)
        return (
            f"CUDA_VISIBLE_DEVICES={visible} -> {props.name}"
            + (f" (PCI bus {bus})" if bus is not None else "")
            + threads
        )
    return f"CUDA_VISIBLE_DEVICES={visible} (CUDA not used)" + threads


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):
        session.config.workeroutput[GPU_USED_KEY] = gpu_identity()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    used = getattr(node, "workeroutput", {}).get(GPU_USED_KEY)
    if used:
        node.config.stash.setdefault(GPUS_USED, {})[node.workerinput["workerid"]] = used


@pytest.hookimpl(tryfirst=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput"):
        return
    used = config.stash.get(GPUS_USED, {})
    if len(set(used.values())) > 1 or any("CUDA not used" not in v for v in used.values()):
        terminalreporter.section("GPU per xdist worker")
        for worker in sorted(used, key=lambda w: int(w[2:]) if w[2:].isdigit() else 0):
            terminalreporter.write_line(f"{worker}: {used[worker]}")


# --- kernel error ratios and FlashInfer warnings ------------------------------------------------


def ratio_summary(errors: list[dict]) -> dict[str, dict[str, float]]:
    """Per backend and kv dtype (and rope): worst and mean of each measured ratio."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for e in errors:
        groups[f"{e.get('backend', 'port-fa3')} {e['kv_dtype']} R={e['rope']}"].append(e)
    out = {}
    for name, rows in sorted(groups.items()):
        summary = {"cases": len(rows)}
        for metric in ("out_max_ratio", "out_mean_ratio", "lse_max_ratio", "lse_mean_ratio", "out_rel_l2"):
            values = [r[metric] for r in rows if metric in r]
            if values:
                summary[f"{metric}_worst"] = max(values)
                summary[f"{metric}_mean"] = sum(values) / len(values)
        out[name] = summary
    return out


class GpuReport:
    """Registered on the controlling process, one per session: what the GPU tests attached."""

    def __init__(self):
        self.errors: list[dict] = []
        self.warnings: dict[str, int] = defaultdict(int)

    def pytest_runtest_logreport(self, report):
        # Errors are attached during the call; warnings at teardown (so only its report has them).
        for key, value in report.user_properties:
            if key == ERROR_KEY and report.when == "call":
                self.errors.append({"test": report.nodeid, **value})
            elif key == WARNING_KEY and report.when == "teardown":
                for message in value:
                    self.warnings[message] += 1

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter, exitstatus, config):
        summary = ratio_summary(self.errors)
        if summary:
            terminalreporter.section("kernel error / working-precision error (compare_to_budget ratios)")
            terminalreporter.write_line(
                f"{'backend, kv':<36}{'cases':>6}{'out max':>10}{'(mean)':>9}{'out mean':>10}{'(mean)':>9}"
                f"{'lse max':>10}{'(mean)':>9}{'rel L2':>10}"
            )
            for name, s in summary.items():
                terminalreporter.write_line(
                    f"{name:<36}{s['cases']:>6}"
                    f"{s.get('out_max_ratio_worst', 0):>10.2f}{s.get('out_max_ratio_mean', 0):>9.2f}"
                    f"{s.get('out_mean_ratio_worst', 0):>10.2f}{s.get('out_mean_ratio_mean', 0):>9.2f}"
                    f"{s.get('lse_max_ratio_worst', 0):>10.2f}{s.get('lse_max_ratio_mean', 0):>9.2f}"
                    f"{s.get('out_rel_l2_worst', 0):>10.2e}"
                )
        if self.warnings:
            terminalreporter.section("warnings raised by FlashInfer")
            for message, count in sorted(self.warnings.items(), key=lambda kv: -kv[1]):
                terminalreporter.write_line(f"{count:>5} tests: {message[:300]}")
        path = os.environ.get(REPORT_ENV)
        if path:
            with open(path, "w") as f:
                json.dump({"ratios": summary, "errors": self.errors, "warnings": dict(self.warnings)}, f, indent=1,
                          default=str)
