"""What a recording ran on: FlashInfer, torch, CUDA, driver, GPU (for fixtures and reports)."""

from __future__ import annotations

import platform
import subprocess

import torch


def flashinfer_version() -> str | None:
    from backends.registry import installed_flashinfer_version

    return installed_flashinfer_version()


def driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        ).stdout.strip()
        return out.splitlines()[0] if out else None
    except (OSError, subprocess.SubprocessError):
        return None


def runtime_environment() -> dict:
    """Versions and device of this process (GPU fields are None without CUDA)."""
    cuda = torch.cuda.is_available()
    return {
        "flashinfer": flashinfer_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": driver_version() if cuda else None,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "python": platform.python_version(),
    }
