"""Plan hygiene on every backend the run has that plans on FlashInfer (docs/input-space.md#plan-hygiene):
the port on the run's kernel and vLLM's SM90 backend (``--vllm``). Each FlashInfer ``plan()``'s
device synchronisations are counted over decode steps of 1, 16 and 128 rows, each step judged
(``harness.plan_hygiene``); the counts go to the run's junit report (property ``plan_syncs``).
Counting needs CUDA (torch's sync debug mode): elsewhere the test skips with that reason.

A correct step after one whose slot ids ran past the cache, through vLLM's SM90 backend, where
the installed FlashInfer records the planned page range at plan() (probed:
``coverage_from_plan_slots``): the finding ``CoverageJudgedOnStaleIds`` (strict xfail). Where
it does not, the kernel could load those ids past a row's executed length, outside the cache, so
the step is not run there (skipped with that reason; the stand-in runs both on CPU:
``tests/cpu/test_plan_hygiene.py``)."""

from __future__ import annotations

import pytest
import torch

from backends.registry import flashinfer_features
from harness.plan_hygiene import (
    STALE_IDS_FINDING,
    CoverageJudgedOnStaleIds,
    check_stale_ids_at_plan,
    check_syncs_per_plan,
)
from harness.port.launch import DEVICE
from pytest_sparse_mla.backend import open_run_backend

pytestmark = pytest.mark.gpu

BACKENDS = ["port-fa3", pytest.param("vllm", marks=pytest.mark.vllm)]


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param == "port-fa3":
        return open_run_backend(request.config, "port-fa3")
    return request.getfixturevalue("vllm_on_gpu")


def test_device_syncs_per_plan_do_not_grow_with_the_step(backend, judge, record_property):
    if torch.device(DEVICE).type != "cuda":
        pytest.skip("device synchronisations are counted on CUDA only (torch.cuda.set_sync_debug_mode)")
    counts = check_syncs_per_plan(judge, backend, DEVICE)
    record_property("plan_syncs", {rows: syncs[0] for rows, syncs in counts.items()})


@pytest.mark.vllm
def test_a_correct_step_after_one_whose_slot_ids_ran_past_the_cache(vllm_on_gpu, judge, request):
    if not flashinfer_features(DEVICE).coverage_from_plan_slots:
        pytest.skip("the installed FlashInfer records no page range at plan() (probed): the kernel could load the "
                    "stale ids past a row's executed length, outside the cache")
    request.applymarker(pytest.mark.xfail(strict=True, raises=CoverageJudgedOnStaleIds, reason=STALE_IDS_FINDING))
    check_stale_ids_at_plan(judge, vllm_on_gpu, DEVICE)
