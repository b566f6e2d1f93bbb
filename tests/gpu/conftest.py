"""GPU-tier fixtures: the installed FlashInfer's features (its checks probed on the GPU), what a
GPU test works with (``gpu``), and the FlashInfer warnings each test raised attached to its report
(summed up by ``pytest_sparse_mla.gpus``)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pytest_sparse_mla.keys import WARNING_KEY


@pytest.fixture(scope="session")
def features():
    """Features of the installed FlashInfer (fast.flashinfer_compat.Features), its checks
    before launch probed on this process's GPU."""
    from fast.flashinfer_compat import detect_features
    from harness.launch import DEVICE

    return detect_features(DEVICE)


@dataclass(frozen=True)
class GpuTest:
    """What a GPU test launches with and reports to: the implementation under test, the
    installed FlashInfer's features, the test's request and its regime log (where its launches
    are counted, ``harness.launch.launch_step``)."""

    impl: object
    features: object
    request: object
    regime_log: object


@pytest.fixture
def gpu(impl, features, request, regime_log) -> GpuTest:
    return GpuTest(impl, features, request, regime_log)


@pytest.fixture(autouse=True)
def flashinfer_warnings(request):
    """Record the warnings FlashInfer raised during the test into its report."""
    from fast.flashinfer_compat import distinct_warnings, recorded_warnings

    start = len(recorded_warnings())
    yield
    new = distinct_warnings(start)
    if new:
        request.node.user_properties.append((WARNING_KEY, new))


@pytest.fixture(autouse=True)
def large_cases_give_their_memory_back(request):
    """After a case marked ``gpu_large``, the GPU memory this worker's allocator cached for it
    goes back to the driver: under xdist every worker shares the GPU, and the other workers'
    largest cases (children of their own) need it while this worker runs small ones."""
    yield
    if request.node.get_closest_marker("gpu_large"):
        import torch

        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
