"""MTP with shared top-k indices through every backend the run has
(docs/findings.md#mtp-shared-top-k-rows-executed-by-the-drafts-context): draft steps 1 to 3 whose
decode rows hand the backend the top-k row draft step 0 kept at an earlier context
(``tests.shared_mtp_cases``), through the project's port on fa3 and fa2, vLLM's SM90 backend
(``--vllm``) and vLLM's FLASHMLA_SPARSE on FlashMLA's kernels (where the release has them).

Every step goes through ``harness.judge``: a backend that runs each row with the length rule's
count at the draft's context (the port and vLLM's SM90 backend) is a strict xfail raising
:class:`~harness.findings.SharedMtpRowsByContext`, and only where exactly the rows whose kept row
holds another count of valid entries run the rule's count and every other row is right. The
port's compacted layout leaves a -1 in the planned span of a row run past its kept entries, which
FlashInfer would read as slot -1: it is judged on its plan. FlashMLA, handed each row's valid
count as its length, must be right.
"""

from __future__ import annotations

import pytest

from backends.registry import open_backend
from harness.case_runner import run_case
from harness.port.launch import DEVICE
from mla_constants import TOPK
from tests.shared_mtp_cases import shared_mtp_params

pytestmark = pytest.mark.gpu

SEED = 3


@pytest.mark.parametrize("kernel", ["fa3", "fa2"])
@pytest.mark.parametrize(("case", "step"), shared_mtp_params(TOPK))
def test_port_plans_the_rule_for_shared_rows(kernel, case, step, judge):
    run_case(judge, open_backend(f"port-{kernel}"), case.spec, DEVICE, seed=SEED, mtp_draft_step=step)


@pytest.mark.vllm
@pytest.mark.parametrize(("case", "step"), shared_mtp_params(TOPK))
def test_vllm_executes_the_rule_for_shared_rows(vllm_on_gpu, case, step, judge):
    run_case(judge, vllm_on_gpu, case.spec, DEVICE, seed=SEED, mtp_draft_step=step)


@pytest.mark.vllm
@pytest.mark.flashmla
@pytest.mark.parametrize(("case", "step"), shared_mtp_params(TOPK))
def test_flashmla_executes_each_shared_rows_valid_count(flashmla_on_gpu, case, step, judge):
    """FlashMLA is handed each row's valid count (``topk_length``) and its valid entries: the
    contract's semantics, right on every row."""
    run_case(judge, flashmla_on_gpu, case.spec, DEVICE, seed=SEED, mtp_draft_step=step)
