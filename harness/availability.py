"""Whether the SM90 FlashInfer path can run in this process (the GPU tier's and the benchmark's
gate). :func:`sm90_flashinfer_unavailable_reason` touches CUDA and imports FlashInfer: call it
after any per-process GPU pinning (harness.gpu_env). :func:`reason_without_cuda` is the part
that needs neither (for a process that must leave CUDA alone, such as the xdist controller)."""

from __future__ import annotations

import importlib.util
import os

from .gpu_env import every_gpu_hidden, torch_build


def sm90_flashinfer_unavailable_reason() -> str | None:
    """Why the SM90 FlashInfer path cannot run here, or None when it can (SM90 GPU + an
    importable FlashInfer). Touches CUDA: call it after any per-process GPU pinning."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return f"GPU is sm_{major}{minor} ({torch.cuda.get_device_name()}), the fa3 path needs sm_90"
    from backends.registry import flashinfer_import_problem

    return flashinfer_import_problem()


def reason_without_cuda(gpus: list[tuple[str, str]]) -> str | None:
    """Why the SM90 FlashInfer path cannot run, as far as it is known without CUDA or importing
    FlashInfer, given ``gpus`` (``harness.gpu_env.gpus_without_cuda()``); None: it may run (an
    import failure shows only in :func:`sm90_flashinfer_unavailable_reason`)."""
    if not gpus:
        return "no NVIDIA GPU found"
    version, cuda = torch_build()
    if cuda is None:
        return f"torch {version} is a build without CUDA"
    if every_gpu_hidden():
        return f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r} hides every GPU"
    name, capability = gpus[0]
    if capability and capability != "9.0":
        return f"GPU is sm_{capability.replace('.', '')} ({name}), the fa3 path needs sm_90"
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer is not installed (pip install -e '.[gpu]')"
    return None
