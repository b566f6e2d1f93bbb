"""Every regime case and batch situation through the project's port on each of FlashInfer's MLA
kernels (``backend`` as an axis: fa3, what production runs on SM90, and fa2), behind the same
seam as vLLM's backend and FlashMLA (``backends.seam``).

Each step plans the port's exact lengths (compacted layout), converts, lays out and runs; the
rows' kv_len and kv_indices spans handed to the kernel are read back and must equal every row's
valid count and intended selection (a); output and LSE must be within the error budget of the
float64 oracle over (a), by each kernel's budget (``reference.budget``: fa2's LSE has a floor of
its own, measured). The regime table's "rows checked per backend" line counts the rows each
kernel served.
"""

from __future__ import annotations

import pytest

from backends.port import KERNELS
from backends.registry import open_backend
from harness.judge import run_case
from harness.launch import DEVICE
from tests.vllm_cases import step_params

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=[f"port-{k}" for k in KERNELS])
def port_backend(request):
    return open_backend(request.param)


@pytest.mark.parametrize("case, config", step_params())
def test_step_on_each_flashinfer_kernel(port_backend, judge, case, config):
    run_case(judge, port_backend, config.apply(case.spec), DEVICE)
