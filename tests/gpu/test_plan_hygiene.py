"""Plan hygiene on every backend the run has that plans on FlashInfer (docs/input-space.md#plan-hygiene):
the port on the run's kernel and vLLM's SM90 backend (``--vllm``). Each FlashInfer ``plan()``'s
device synchronisations are counted over decode steps of 1, 16 and 128 rows, each step judged
(``harness.plan_hygiene``); the counts go to the run's junit report (property ``plan_syncs``).
Counting needs CUDA (torch's sync debug mode): elsewhere the test skips with that reason."""

from __future__ import annotations

import pytest
import torch

from harness.plan_hygiene import check_syncs_per_plan
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
