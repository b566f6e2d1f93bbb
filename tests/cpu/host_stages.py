"""The implementation under test for CPU modules whose tests call its host stages directly."""

from __future__ import annotations


def host_stages_apart(impl, device, pytestconfig):
    """The implementation under test for a module whose tests call its host stages directly (not
    through the pipeline's stages, which run apart): one that is not the project's own runs
    them in a process of its own where the inputs are on the host (``harness.isolation``), so a
    stage that kills its process fails its test, naming the stage, and the session goes on. A
    module takes it as its ``impl``: ``impl = pytest.fixture(scope="module", name="impl")(host_stages_apart)``."""
    from harness.isolation import IsolatedImpl
    from mla_constants import DEFAULT_IMPL_SPEC
    from pytest_sparse_mla.impl import IMPL_SPEC

    spec = pytestconfig.stash[IMPL_SPEC]
    if spec == DEFAULT_IMPL_SPEC or device.type != "cpu":
        yield impl
        return
    isolated = IsolatedImpl(spec)
    yield isolated
    isolated.close()
