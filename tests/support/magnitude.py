"""The magnitude edge's cases: raw scores far from zero, mixed in a row and across the batch
(``tests/gpu/test_edges.py`` runs them on the port, ``tests/vllm_cases.py`` and
``tests/flashmla_cases.py`` on vLLM's and FlashMLA's backends)."""

from __future__ import annotations

from harness import batch
from harness.cases import LONG_CTX, Case
from mla_constants import TOPK

#: Raw score offsets (bf16-exact q values, see harness.scenario.score_offset_problem):
#: 0 is the rows as the other tests see them. +-1024 puts |s| = 1024 * sm_scale past float32's
#: exp range at DeepSeek's scale (138 > 88.7: exp of an unshifted score overflows or underflows)
#: while float32 still holds a raw score to 2**-14; +-32768 is past it at every scale (4430 at
#: DeepSeek's, 2048 at GLM's 1/16) and at the edge of what a float32 score can resolve (2**-8 of
#: a raw score, about 1e-3 after sm_scale, the size of the kernel's working-precision error).
OFFSETS = (-32768.0, -1024.0, 0.0, 1024.0, 32768.0)
FAR_BELOW = -32768.0


def magnitude_cases() -> list[Case]:
    """Ten rows per batch so that each offset judges more than one row."""
    across_kpool1 = [9, 700, TOPK - 1, TOPK + 5, 3 * TOPK + 1, LONG_CTX, 40, 1500, TOPK, 5000]
    across_kpool4 = [8, 700, TOPK, TOPK + 3, LONG_CTX, 12, 1200, TOPK + 4, 3 * TOPK + 2, 5001]  # regimes B D E F G
    mixed = [1500, TOPK + 40, 4 * TOPK, LONG_CTX, 600, 2000, TOPK + 1, 9000, 300, 3000]
    return [
        Case("offsets-across-batch-kpool1", batch(*[(c, 1) for c in across_kpool1], kpool=1, score_offsets=OFFSETS)),
        Case("offsets-across-batch-kpool4", batch(*[(c, 1) for c in across_kpool4], kpool=4, score_offsets=OFFSETS)),
        Case(
            "offsets-mixed-within-rows-kpool1",
            batch(
                *[(c, 1) for c in mixed],
                kpool=1,
                split_score_signs=True,
                score_offsets=(32768.0, -32768.0, 1024.0, -1024.0, 0.0),
            ),
        ),
        # every fourth row (each request's newest token) far below the rest of the batch
        Case(
            "rows-far-below-the-rest-spec-decode",
            batch(
                (TOPK + 3, 4),
                (900, 4),
                (LONG_CTX, 4),
                (3000, 4),
                kpool=1,
                decode_threshold=4,
                score_offsets=(0.0, 0.0, 0.0, FAR_BELOW),
            ),
        ),
    ]
