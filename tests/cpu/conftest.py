"""CPU-tier fixtures."""

import pytest


@pytest.fixture(autouse=True)
def single_intra_op_thread():
    """The tensors here are tiny: intra-op threads only add synchronisation, and under xdist
    they oversubscribe the cores."""
    import torch  # here, not at the top: the controller of an xdist run loads this file too

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def vllm_on_stand_in(vllm_backend, monkeypatch):
    """vLLM's SM90 backend (``--vllm``) on the fa3 stand-in FlashInfer its design plans on
    (``tests.fa3_stand_in``: the bounded design's ``_planned_backend``, or 0.6's wrapper)."""
    from tests import fa3_stand_in

    bounded = vllm_backend.design == "bounded"
    fa3_stand_in.install(monkeypatch, fa3_stand_in.StandInWrapper if bounded else fa3_stand_in.StandIn06Wrapper)
    return vllm_backend


@pytest.fixture(scope="module")
def flashmla_backend(flashmla_source):
    """The release's FLASHMLA_SPARSE on the stand-in kernels (loaded once per test module, on a
    platform that says SM90 as the engine's would)."""
    from backends.vllm.flashmla import FlashMLABackend
    from tests import flashmla_stand_in

    flashmla_stand_in.register(flashmla_source)
    with pytest.MonkeyPatch.context() as mp:
        flashmla_stand_in.hopper(mp)
        return FlashMLABackend(flashmla_source)


@pytest.fixture
def flashmla_on_stand_in(flashmla_backend, monkeypatch):
    """:func:`flashmla_backend` with the stand-in kernels in place of FlashMLA's for the test."""
    from tests import flashmla_stand_in

    flashmla_stand_in.hopper(monkeypatch)
    flashmla_stand_in.interpreter_bool_masks(monkeypatch)
    flashmla_stand_in.in_place_of_the_kernels(monkeypatch)
    return flashmla_backend


@pytest.fixture
def stand_in(monkeypatch):
    """The port's attention state on :class:`tests.support.reference_wrapper.ReferenceWrapper`
    (plans as FlashInfer does under CUDA graphs, runs the low-precision reference) in place of
    FlashInfer's wrapper; the class, its refusal and plans reset."""
    import torch

    import backends.flashinfer.compat as compat
    import backends.flashinfer.sm90_state as sm90
    from tests.support.reference_wrapper import ReferenceWrapper

    monkeypatch.setattr(sm90, "MLAWrapper", ReferenceWrapper)
    monkeypatch.setattr(compat, "MLAWrapper", ReferenceWrapper)
    monkeypatch.setattr(sm90, "WORKSPACE_BYTES", 1024)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # CPU-only torch
    monkeypatch.setattr(ReferenceWrapper, "refuse", None)
    monkeypatch.setattr(ReferenceWrapper, "plans", [])
    return ReferenceWrapper


@pytest.fixture
def gpu_tier_may_run(monkeypatch):
    """The controller's start-up check sees a machine where the GPU tier may run."""
    import pytest_sparse_mla.baselines as plugin

    monkeypatch.setattr(plugin, "gpu_tier_unavailable_reason", lambda: None)
