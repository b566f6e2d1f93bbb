"""Every regime case and batch situation through each backend under test, behind the seam
(``backends.seam``): by default the project's port on each of FlashInfer's MLA kernels (fa3, what
production runs on SM90, and fa2), its host stages those of ``--impl``; ``--backend
NAME|module:factory`` names others instead (vLLM's, FlashMLA's, or a user's own whole backend).

Each step plans the port's exact lengths (compacted layout), converts, lays out and runs; the
rows' kv_len and kv_indices spans handed to the kernel are read back and must equal every row's
valid count and intended selection (a); output and LSE must be within the error budget of the
float64 oracle over (a), by each kernel's budget (``reference.budget``: fa2's LSE has a floor of
its own, measured). Every backend is judged alike (``harness.judge``). The regime table's "rows
checked per backend" line counts the rows each backend served.
"""

from __future__ import annotations

import pytest

from harness.case_runner import run_case
from harness.port.launch import DEVICE
from tests.vllm_cases import step_params

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("case, config", step_params())
def test_step_on_each_flashinfer_kernel(backend_under_test, judge, case, config):
    """``backend_under_test``: the port on fa3 and on fa2, or each backend ``--backend`` names
    (``pytest_sparse_mla.backend``)."""
    run_case(judge, backend_under_test, config.apply(case.spec), DEVICE)
