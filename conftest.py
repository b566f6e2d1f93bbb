"""Loads the suite's pytest plugin (``pytest_sparse_mla``: options, fixtures, summaries) and,
where torch cannot use an NVIDIA GPU, runs the Triton convert kernel in Triton's interpreter."""

import os

from harness.gpu_env import torch_can_use_an_nvidia_gpu

# The interpreter has to be chosen before the kernel is defined (on import of fast.convert,
# which the plugin imports through fast.impl).
if "TRITON_INTERPRET" not in os.environ and not torch_can_use_an_nvidia_gpu():
    os.environ["TRITON_INTERPRET"] = "1"

pytest_plugins = ("pytest_sparse_mla", "pytester")


def pytest_runtest_setup(item):
    """A test that runs a pytest session inside its own process (``pytester``) runs one kernel in
    Triton's interpreter first. The interpreter imports modules at its first kernel (which ones
    depends on the Triton release); imported inside the nested session, they would be taken out
    of ``sys.modules`` when it ends, and a second import of Triton's native module aborts the
    process. Whether an earlier test of the same worker had run a kernel would decide it."""
    if os.environ.get("TRITON_INTERPRET") == "1" and "pytester" in getattr(item, "fixturenames", ()):
        run_one_interpreted_kernel()


def run_one_interpreted_kernel() -> None:
    import torch

    from fast.impl import FastImpl

    topk = torch.zeros((1, 128), dtype=torch.int32)
    FastImpl().convert(topk, torch.zeros((1, 1), dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 1)
