"""GPU-tier fixtures: the installed FlashInfer's features (its checks probed on the GPU), what a
GPU test works with (``gpu``), and the FlashInfer warnings each test raised attached to its report
(summed up by ``pytest_sparse_mla.gpus``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from pytest_sparse_mla.keys import WARNING_KEY


@pytest.fixture(scope="session")
def features():
    """Features of the installed FlashInfer (backends.flashinfer.compat.Features), its checks
    before launch probed on this process's GPU."""
    from backends.flashinfer.compat import detect_features
    from harness.port.launch import DEVICE

    return detect_features(DEVICE)


@dataclass(frozen=True)
class GpuTest:
    """What a GPU test launches with and reports to: the implementation under test, the
    installed FlashInfer's features, the test's request and its regime log (where its launches
    are counted)."""

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
    from backends.flashinfer.compat import distinct_warnings, recorded_warnings

    start = len(recorded_warnings())
    yield
    new = distinct_warnings(start)
    if new:
        request.node.user_properties.append((WARNING_KEY, new))


#: GPU memory a worker's allocator may keep cached between two cases that are not ``gpu_large``:
#: past it the cache goes back to the driver. Under ``--jobs 3`` on an 80 GB H100, workers that
#: kept what their largest case had reserved (3.5 to 8 GiB each) left too little for a
#: ``gpu_large`` case's 8 GiB allocation and for a drawn input-space case's 4.5 GiB.
IDLE_CACHE_BYTES = 1 << 30


def release_a_large_cache() -> None:
    """This worker's cached GPU memory back to the driver where it holds more than
    :data:`IDLE_CACHE_BYTES`."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.memory_reserved() > IDLE_CACHE_BYTES:
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def large_cases_give_their_memory_back(request):
    """A case marked ``gpu_large`` runs in one of its GPU's machine-wide slots
    (``harness.gpu_slots``: the processes of every session on the machine run only as many at
    once as the GPU's memory holds), and the GPU memory this worker's allocator cached for it goes
    back to the driver after: under xdist every worker shares the GPU, and the other workers'
    largest cases (children of their own) need it while this worker runs small ones. After any
    other case, the cache goes back where it holds more than :data:`IDLE_CACHE_BYTES`."""
    if not request.node.get_closest_marker("gpu_large"):
        yield
        release_a_large_cache()
        return
    import torch

    if not torch.cuda.is_available():  # the simulated SM90 machine: nothing to share
        yield
        return
    from harness.gpu_slots import SLOTS_ENV, current_gpu, gpu_slot, slots_for

    key, total = current_gpu()
    with gpu_slot(key, slots_for(total, os.environ.get(SLOTS_ENV))) as waited:
        if waited >= 1:
            request.node.user_properties.append(("gpu_slot_wait_s", round(waited, 1)))
        yield
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def vllm_pairing(vllm_backend) -> str | None:
    """Why the vLLM release under test cannot run on the installed FlashInfer, or None
    (``backends.vllm.source.incompatibility``)."""
    import flashinfer

    from backends.flashinfer.compat import parse_version
    from backends.vllm.source import incompatibility

    return incompatibility(vllm_backend.design, parse_version(flashinfer.__version__))


@pytest.fixture(scope="module")
def vllm_on_gpu(vllm_backend, vllm_pairing):
    """The vLLM release under test (``--vllm``), skipped where it cannot run on the installed
    FlashInfer (``test_vllm_release_runs_on_this_flashinfer`` fails with the reason)."""
    if vllm_pairing:
        pytest.skip(f"not run: {vllm_pairing} (test_vllm_release_runs_on_this_flashinfer fails with it)")
    return vllm_backend


@pytest.fixture(scope="module")
def flashmla_load(flashmla_source):
    """``(backend, None)``, or ``(None, why)`` where FlashMLA's kernels cannot be opened here."""
    from backends.vllm.flashmla import FlashMLABackend, FlashMLAUnavailable

    try:
        return FlashMLABackend(flashmla_source), None
    except FlashMLAUnavailable as exc:
        return None, str(exc)


@pytest.fixture(scope="module")
def flashmla_on_gpu(flashmla_load):
    """FlashMLA's backend of the release under test, skipped where its kernels cannot be opened
    (``test_flashmla_kernels_load_here`` fails with the reason)."""
    backend, why = flashmla_load
    if backend is None:
        pytest.skip(f"not run: {why} (test_flashmla_kernels_load_here fails with it)")
    return backend
