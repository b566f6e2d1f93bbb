"""The cases both tiers run with holes in the top-k (docs/findings.md#top-k-holes-attended): decode
rows at every regime context beside a long request, their top-k rows written from tied, infinite
or NaN scores (``harness.topk_holes``). Each runs through ``harness.judge`` (the ``judge``
fixture), which judges a step with holes as docs/findings.md#top-k-holes-attended says.
"""

from __future__ import annotations

import pytest

from harness.cases import LONG_CTX, Case, KernelConfig, regime_contexts
from harness.spec import batch
from harness.topk_holes import TopkHoles
from reference.indexer import HOLE_KINDS

#: The kernel configurations the cases cycle (bf16: every release plans it).
CONFIGS = (KernelConfig("bfloat16", True, 16), KernelConfig("bfloat16", False, 32))
#: FlashMLA's on the GPU: DeepSeek-V3.2's, rope 64.
ROPE_CONFIGS = (KernelConfig("bfloat16", True, 16), KernelConfig("bfloat16", True, 64))


def hole_cases(topk: int, configs=CONFIGS) -> list[tuple[Case, TopkHoles, KernelConfig]]:
    """Per kpool and score pattern: one decode row at each regime context and a long request (so
    every row is the indexer's top-k, not the identity fill), in a configuration of ``configs``
    (cycled)."""
    cases = []
    for kpool in (1, 4):
        contexts = [c for c in regime_contexts(topk, kpool) if c != LONG_CTX]
        spec = batch(*[(ctx, 1) for ctx in contexts], (LONG_CTX, 1), topk=topk, kpool=kpool)
        for kind in HOLE_KINDS:
            holes = TopkHoles(kind, 1 if kind == "nan" else 3)
            config = configs[len(cases) % len(configs)]
            cases.append((Case(f"every-context-kpool{kpool}-topk{topk}", config.apply(spec), holes=holes), holes,
                          config))
    return cases


def hole_params(topk: int, configs=CONFIGS):
    return [pytest.param(case, id=f"{case.name}-{holes.id}-{config.id}")
            for case, holes, config in hole_cases(topk, configs)]
