"""Loads the suite's pytest plugin (``pytest_sparse_mla``: options, fixtures, summaries) and,
where torch cannot use an NVIDIA GPU, runs the Triton convert kernel in Triton's interpreter."""

import os

from harness.gpu_env import torch_can_use_an_nvidia_gpu

# The interpreter has to be chosen before the kernel is defined (on import of fast.convert,
# which the plugin imports through fast.impl).
if "TRITON_INTERPRET" not in os.environ and not torch_can_use_an_nvidia_gpu():
    os.environ["TRITON_INTERPRET"] = "1"

pytest_plugins = ("pytest_sparse_mla", "pytester")
