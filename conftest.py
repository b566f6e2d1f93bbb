"""Loads the suite's pytest plugin (``pytest_sparse_mla``: options, fixtures, summaries) and,
where torch cannot use an NVIDIA GPU, runs the Triton convert kernel in Triton's interpreter."""

import os

import torch

from harness.gpu_env import count_gpus_without_cuda, every_gpu_hidden


def torch_can_use_an_nvidia_gpu() -> bool:
    """Without initialising CUDA: a CUDA build of torch, a GPU not hidden by
    CUDA_VISIBLE_DEVICES, and an NVIDIA GPU found by NVML or nvidia-smi."""
    if torch.version.cuda is None:
        return False
    return not every_gpu_hidden() and count_gpus_without_cuda() > 0


# The interpreter has to be chosen before the kernel is defined (on import of fast.convert,
# which the plugin imports through fast.impl).
if "TRITON_INTERPRET" not in os.environ and not torch_can_use_an_nvidia_gpu():
    os.environ["TRITON_INTERPRET"] = "1"

pytest_plugins = ("pytest_sparse_mla", "pytester")
