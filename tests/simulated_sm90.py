"""A pytest plugin (``-p tests.simulated_sm90``) that makes a process without a GPU run the GPU
tier's tests as if on an SM90 machine with FlashInfer: the GPU gate opens, FlashInfer's wrapper
is the CPU stand-in of ``tests/cpu/test_rerun.py`` (plans like FlashInfer under CUDA graphs, reads
kv_indices at run, computes with the low-precision reference) and returns base-2 LSE where the
state asks for FlashInfer's own, and the features are the stand-in's. Run it with
``SPARSE_MLA_DEVICE=cpu TRITON_INTERPRET=1``. It checks what the tests do around the kernel
(plans, buffers, comparisons, the re-created bugs of the attention state), never FlashInfer.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

import fast.flashinfer_compat as compat
import fast.sm90 as sm90
import harness.availability
from reference.oracle import LOG2_E
from tests.cpu.test_rerun import ReferenceWrapper

FEATURES = SimpleNamespace(version="simulated-sm90", plan_checks_page_counts=False, run_checks_cache_coverage=False,
                           run_checks_query_shape=False, describe=lambda: "simulated SM90 (reference stand-in)")


class StandInWrapper(ReferenceWrapper):
    """The stand-in, with FlashInfer's base-2 LSE where natural log is not asked for."""

    def __init__(self, *args, lse_base_e: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.lse_base_e = lse_base_e
        self.features = FEATURES

    def run(self, q_nope, q_pe, ckv, kpe, *, out, lse, k_scale=1.0):
        super().run(q_nope, q_pe, ckv, kpe, out=out, lse=lse, k_scale=k_scale)
        if not self.lse_base_e:
            lse.mul_(LOG2_E)


def pytest_configure(config):
    harness.availability.sm90_flashinfer_unavailable_reason = lambda: None
    sm90.MLAWrapper = StandInWrapper
    compat.MLAWrapper = StandInWrapper
    compat.detect_features = lambda device=None: FEATURES
    sm90.WORKSPACE_BYTES = 1024
    torch.cuda.is_current_stream_capturing = lambda: False  # a CPU-only torch build
