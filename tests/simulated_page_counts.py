"""A pytest plugin for use after ``-p tests.simulated_sm90``: the simulated SM90 machine's FlashInfer
checks page counts at plan() as 0.7.x does (``Features.plan_checks_page_counts``): a plan whose
kv_indptr spans differ from its rows' kv_len (page size 1) is refused with FlashInfer's
``PAGE_COUNT_REFUSAL``. It lets a machine without a GPU run the GPU tier's strided cases down
their expected-refusal path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import backends.flashinfer.compat as compat
import backends.flashinfer.sm90_state as sm90
from backends.flashinfer.compat import PAGE_COUNT_REFUSAL
from tests import simulated_sm90

FEATURES = SimpleNamespace(**{**vars(simulated_sm90.FEATURES), "version": "simulated-sm90-page-counts",
                              "plan_checks_page_counts": True,
                              "describe": lambda: "simulated SM90 (reference stand-in) checking page counts at plan"})


class PageCountingWrapper(simulated_sm90.StandInWrapper):
    """The stand-in, refusing plans whose page counts differ from kv_len."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.features = FEATURES

    def plan(self, *, kv_indptr, kv_len_arr, **kwargs):
        spans = (kv_indptr[1:] - kv_indptr[:-1]).cpu()
        lens = kv_len_arr[: spans.numel()].cpu()
        if bool((spans != lens).any()):
            raise ValueError(f"{PAGE_COUNT_REFUSAL}(kv_len / page_size): spans {spans[:4].tolist()}, "
                             f"kv_len {lens[:4].tolist()}")
        super().plan(kv_indptr=kv_indptr, kv_len_arr=kv_len_arr, **kwargs)


def patches() -> list[tuple[object, str, object]]:
    """``(module, attribute, value)`` of what this machine replaces on top of the simulated one."""
    return [
        (sm90, "MLAWrapper", PageCountingWrapper),
        (compat, "MLAWrapper", PageCountingWrapper),
        (compat, "detect_features", lambda device=None: FEATURES),
    ]


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    for module, name, value in patches():
        setattr(module, name, value)
