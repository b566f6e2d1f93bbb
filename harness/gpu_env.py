"""GPU discovery and per-worker pinning that never initialises CUDA (safe to import first).

Under pytest-xdist each worker gets ``CUDA_VISIBLE_DEVICES`` = one GPU, worker index mod GPU
count, among the devices the user already made visible; this has to happen before anything
touches CUDA, which is why this module imports neither torch nor triton.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path


def worker_index(worker_id: str | None) -> int | None:
    """``gw3`` -> 3; None (no xdist) -> None."""
    if not worker_id or not worker_id.startswith("gw"):
        return None
    return int(worker_id[2:])


def pick_gpu(worker_id: str | None, visible_devices: str | None, gpu_count: int) -> str | None:
    """The CUDA_VISIBLE_DEVICES value for one xdist worker: worker index mod the number of
    GPUs, chosen among the devices the user already made visible. None: leave it as is."""
    index = worker_index(worker_id)
    if index is None:
        return None
    if visible_devices is not None and visible_devices.strip() != "":
        devices = [d.strip() for d in visible_devices.split(",") if d.strip()]
    else:
        devices = [str(i) for i in range(gpu_count)]
    if len(devices) <= 1:
        return None
    return devices[index % len(devices)]


def ask_nvml(query):
    """``query(pynvml)`` between NVML's init and shutdown; None where NVML cannot answer: pynvml
    not installed, or NVML's own error (no driver, no library, a GPU it cannot read), which the
    callers answer by asking nvidia-smi. Any other exception is a bug in the query or in pynvml:
    it is reported as a warning naming it, and the callers fall back alike."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            return query(pynvml)
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None
    except Exception as exc:  # reported, then nvidia-smi answers instead
        warnings.warn(f"NVML query failed unexpectedly ({type(exc).__name__}: {exc}); asking nvidia-smi instead",
                      RuntimeWarning, stacklevel=2)
        return None


def nvml_gpus(nvml) -> list[tuple[str, str]]:
    """``(name, compute capability)`` of each GPU NVML lists."""
    gpus = []
    for i in range(int(nvml.nvmlDeviceGetCount())):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        name = nvml.nvmlDeviceGetName(handle)
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
        gpus.append((name.decode() if isinstance(name, bytes) else str(name), f"{major}.{minor}"))
    return gpus


def count_gpus_without_cuda() -> int:
    """Number of NVIDIA GPUs, asked of NVML or nvidia-smi so that CUDA stays uninitialised."""
    count = ask_nvml(lambda nvml: int(nvml.nvmlDeviceGetCount()))
    if count is not None:
        return count
    if shutil.which("nvidia-smi"):
        try:
            listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
            return sum(1 for line in listing.splitlines() if line.startswith("GPU "))
        except (OSError, subprocess.SubprocessError):
            return 0
    return 0


def pin_worker_gpu(worker_id: str | None) -> None:
    """In an xdist worker (``worker_id`` from its config), before CUDA starts: pin one GPU."""
    if worker_index(worker_id) is None:
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = 0 if visible else count_gpus_without_cuda()
    choice = pick_gpu(worker_id, visible, count)
    if choice is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = choice



def gpus_without_cuda() -> list[tuple[str, str]]:
    """``(name, compute capability such as "9.0")`` of each NVIDIA GPU, asked of NVML or
    nvidia-smi so that CUDA stays uninitialised; the capability is "" where the driver does
    not report it."""
    gpus = ask_nvml(nvml_gpus)
    if gpus is not None:
        return gpus
    if not shutil.which("nvidia-smi"):
        return []
    for fields in ("name,compute_cap", "name"):  # older drivers do not know compute_cap
        try:
            done = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            return []
        if done.returncode == 0:
            rows = [[part.strip() for part in line.split(",")] for line in done.stdout.splitlines() if line.strip()]
            return [(row[0], row[1] if len(row) > 1 else "") for row in rows]
    return []


def torch_build() -> tuple[str, str | None]:
    """``torch.__version__`` and ``torch.version.cuda`` (None: a build without CUDA), read from
    torch's ``version.py`` where torch is not imported yet: importing it takes seconds, which
    a process that only decides (the controller of an xdist run, before its workers start)
    need not pay."""
    torch = sys.modules.get("torch")
    if torch is None:
        spec = importlib.util.find_spec("torch")
        path = Path(spec.origin).with_name("version.py") if spec is not None and spec.origin else None
        if path is not None and path.is_file():
            namespace: dict = {}
            exec(compile(path.read_text(), str(path), "exec"), namespace)  # plain assignments only
            return str(namespace.get("__version__")), namespace.get("cuda")
        import torch
    return torch.__version__, torch.version.cuda


def torch_can_use_an_nvidia_gpu() -> bool:
    """Without initialising CUDA (nor importing torch): a CUDA build of torch, a GPU not hidden
    by CUDA_VISIBLE_DEVICES, and an NVIDIA GPU found by NVML or nvidia-smi."""
    if torch_build()[1] is None:
        return False
    return not every_gpu_hidden() and count_gpus_without_cuda() > 0


def every_gpu_hidden() -> bool:
    """CUDA_VISIBLE_DEVICES is set to hide every GPU ("" or "-1")."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible is not None and visible.strip() in ("", "-1")
