"""What the tests, the benchmark and the scripts share: the scenario builder (input
generation), the case catalogue, one production step and its checks, launch and compare on
the GPU, timing, GPU discovery and availability, and the known findings.

The scenario names are re-exported here (``from harness import batch, build_scenario``); they
load on first use, so ``harness.gpu_env`` stays importable before torch and CUDA.
"""

from __future__ import annotations

import importlib

_SCENARIO = ("AttentionInputs", "BatchSpec", "Request", "Scenario", "StepMetadata", "batch", "build_attention_inputs",
             "build_scenario")

__all__ = list(_SCENARIO)


def __getattr__(name: str):
    if name in _SCENARIO:
        return getattr(importlib.import_module(".scenario", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
