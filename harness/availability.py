"""Whether the SM90 FlashInfer path can run in this process (the GPU tier's and the benchmark's
gate). Touches CUDA: call it after any per-process GPU pinning (harness.gpu_env)."""

from __future__ import annotations

import torch


def sm90_flashinfer_unavailable_reason() -> str | None:
    """Why the SM90 FlashInfer path cannot run here, or None when it can (SM90 GPU + an
    importable FlashInfer). Touches CUDA: call it after any per-process GPU pinning."""
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return f"GPU is sm_{major}{minor} ({torch.cuda.get_device_name()}), the fa3 path needs sm_90"
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # ImportError and broken installs alike
        return f"flashinfer is not importable: {exc!r}"
    return None
