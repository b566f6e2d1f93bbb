"""GPU-tier fixtures: the installed FlashInfer's features (its checks probed on the GPU), and
the FlashInfer warnings each test raised attached to its report (summed up by
``pytest_sparse_mla.gpus``)."""

from __future__ import annotations

import pytest

from pytest_sparse_mla.keys import WARNING_KEY


@pytest.fixture(scope="session")
def features():
    """Features of the installed FlashInfer (fast.flashinfer_compat.Features), its checks
    before launch probed on this process's GPU."""
    from fast.flashinfer_compat import detect_features
    from harness.launch import DEVICE

    return detect_features(DEVICE)


@pytest.fixture(autouse=True)
def flashinfer_warnings(request):
    """Record the warnings FlashInfer raised during the test into its report."""
    from fast.flashinfer_compat import distinct_warnings, recorded_warnings

    start = len(recorded_warnings())
    yield
    new = distinct_warnings(start)
    if new:
        request.node.user_properties.append((WARNING_KEY, new))
