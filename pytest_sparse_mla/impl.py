"""The implementation under test (``--impl module:factory``, the ``impl`` fixture) and the GPU
gating of ``gpu``-marked tests: skipped with the reason where no SM90 GPU with FlashInfer is
usable."""

from __future__ import annotations

import pytest

from fast.impl import DEFAULT_IMPL_SPEC, load_impl

from .keys import GROUP

IMPL_SPEC = pytest.StashKey[str]()
GPU_REASON = pytest.StashKey[str]()  # why the GPU tier is skipped ("" when it runs)


def pytest_addoption(parser):
    parser.getgroup(*GROUP).addoption(
        "--impl",
        default=DEFAULT_IMPL_SPEC,
        metavar="MODULE:FACTORY",
        help="implementation under test: a factory returning an object with the fast.impl.SparseMLAImpl "
        f"methods (default: {DEFAULT_IMPL_SPEC})",
    )


def pytest_configure(config):
    config.stash[IMPL_SPEC] = config.getoption("--impl")


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    from harness.availability import sm90_flashinfer_unavailable_reason

    reason = sm90_flashinfer_unavailable_reason()
    config.stash[GPU_REASON] = reason or ""
    if reason:
        skip = pytest.mark.skip(reason=f"GPU tier: {reason}")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def impl(pytestconfig):
    """The implementation under test (``--impl module:factory``; default: fast/)."""
    return load_impl(pytestconfig.stash[IMPL_SPEC])


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput"):
        return
    reason = config.stash.get(GPU_REASON, None)
    if reason:
        terminalreporter.write_line(f"GPU tier skipped: {reason}")
    impl_spec = config.stash.get(IMPL_SPEC, None)
    if impl_spec:
        terminalreporter.write_line(f"implementation under test: {impl_spec}")
