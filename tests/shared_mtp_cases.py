"""The cases both tiers run as draft steps of MTP with shared top-k indices
(docs/input-space.md#mtp-with-shared-top-k-indices, ``harness.builder.with_shared_mtp_indices``):
one decode row per regime context ``L`` at draft step 0, run at draft steps k = 1 to 3 (each row
at context ``L + k``, its top-k row the one step 0 kept at ``L``), beside a long request so that
every row is the indexer's top-k. Each runs through ``harness.judge`` (the ``judge`` fixture),
which judges a draft step as docs/findings.md#mtp-shared-top-k-rows-executed-by-the-drafts-context
says."""

from __future__ import annotations

import pytest

from harness.builder import MTP_DRAFT_STEPS
from harness.cases import Case, KernelConfig, regime_contexts
from harness.spec import batch

#: The kernel configurations the cases cycle (bf16: every release plans it).
CONFIGS = (KernelConfig("bfloat16", True, 16), KernelConfig("bfloat16", False, 32))


def shared_mtp_cases(topk: int) -> list[tuple[Case, int]]:
    """``(case, draft step)`` per kpool (1 and 4) and draft step: the step-0 contexts of
    ``harness.cases.regime_contexts`` (within topk and past it), each run at ``L + k``."""
    cases = []
    for kpool in (1, 4):
        for step in MTP_DRAFT_STEPS:
            spec = batch(*[(ctx + step, 1) for ctx in regime_contexts(topk, kpool)], topk=topk, kpool=kpool)
            config = CONFIGS[len(cases) % len(CONFIGS)]
            cases.append((Case(f"mtp-draft{step}-kpool{kpool}-topk{topk}", config.apply(spec)), step))
    return cases


def shared_mtp_params(topk: int):
    return [pytest.param(case, step, id=f"{case.name}-{case.spec.kv_dtype}") for case, step in shared_mtp_cases(topk)]
