"""Holes in the top-k through every backend the run has (docs/findings.md#top-k-holes-attended):
decode rows at every regime context whose top-k rows hold -1 inside their valid prefix (tied,
infinite or NaN indexer scores, ``tests.topk_hole_cases``), through the project's port on fa3 and
fa2, vLLM's SM90 backend (``--vllm``) and vLLM's FLASHMLA_SPARSE on FlashMLA's kernels (where the
release has them).

Every step goes through ``harness.judge``: a backend that executes each such row with the length
rule's count (the port and vLLM's SM90 backend) is a strict xfail raising
:class:`~harness.findings.TopkHolesAttended`, and only where exactly the rows with holes read past
their valid count and every other row is right. The port is checked before launch: its compacted
layout leaves the -1 in the planned span, which FlashInfer would read as slot -1. FlashMLA,
handed each row's valid count as its length, must be right; a row the holes emptied gets out 0
and LSE +inf, FlashMLA's convention for an empty row.
"""

from __future__ import annotations

import pytest

from backends.registry import open_backend
from harness.case_runner import run_case
from harness.port.launch import DEVICE
from mla_constants import TOPK
from tests.topk_hole_cases import ROPE_CONFIGS, hole_params

pytestmark = pytest.mark.gpu

SEED = 3


@pytest.mark.parametrize("kernel", ["fa3", "fa2"])
@pytest.mark.parametrize("case", hole_params(TOPK))
def test_port_plans_the_length_rule_over_holes(kernel, case, judge):
    run_case(judge, open_backend(f"port-{kernel}"), case.spec, DEVICE, seed=SEED, holes=case.holes)


@pytest.mark.vllm
@pytest.mark.parametrize("case", hole_params(TOPK))
def test_vllm_executes_the_length_rule_over_holes(vllm_on_gpu, case, judge):
    run_case(judge, vllm_on_gpu, case.spec, DEVICE, seed=SEED, holes=case.holes)


@pytest.mark.vllm
@pytest.mark.flashmla
@pytest.mark.parametrize("case", hole_params(TOPK, ROPE_CONFIGS))
def test_flashmla_executes_each_rows_valid_count(flashmla_on_gpu, case, judge):
    """FlashMLA is handed each row's valid count (``topk_length``) and its valid entries: the
    contract's semantics, right on every row."""
    run_case(judge, flashmla_on_gpu, case.spec, DEVICE, seed=SEED, holes=case.holes)
