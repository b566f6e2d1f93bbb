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
    from backends.flashmla import FlashMLABackend
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
