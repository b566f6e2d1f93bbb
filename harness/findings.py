"""The known production findings the suite keeps visible: the reason strings of its strict
xfails (short, each linking its section of docs/findings.md, and shown in the run's short
summary), and the exceptions those xfails expect, so that no other error can pass for a
finding. A finding that gets fixed turns its xfails into failures that ask for the marker to go."""

from __future__ import annotations

from backends.port import WORK_CAPACITY as FA3_WORK_CAPACITY

FINDINGS_DOC = "docs/findings.md"

#: Regime C rows under the strided and packed layouts (format with ``layout=``).
REGIME_C_FINDING = "regime C rows planned as a prefix under {layout}: " + FINDINGS_DOC + "#regime-c-planned-as-a-prefix"

#: A CUDA graph replayed after a plan whose cluster size differs from the captured one.
STALE_CLUSTER_FINDING = (
    "graph replay keeps the captured cluster size: " + FINDINGS_DOC + "#graph-replay-with-stale-plan-state"
)

#: Plans of more work items than FlashInfer's fa3 scheduler holds (rows, at page size 1).
WORK_CAPACITY_FINDING = (
    f"a plan of more than {FA3_WORK_CAPACITY} work items (rows, at page size 1): "
    + FINDINGS_DOC + "#plans-beyond-the-schedulers-work-capacity"
)


#: The kernel's error on rows whose raw scores carry one product of 2**15.
SCORE_PRECISION_FINDING = "raw score offsets of 2**15 exceed the budget: " + FINDINGS_DOC + "#score-precision-at-2-15"


class ScorePrecisionAt2To15(AssertionError):
    """Only rows at raw score offsets of +-2**15 are beyond the budget, and within a few times it."""


class WorkCapacityExceeded(AssertionError):
    """A plan beyond the scheduler's work capacity was refused, or was accepted and then gave
    wrong rows or crashed (the finding, whichever the release does)."""


class RegimeCPlannedAsPrefix(AssertionError):
    """The plan reads a regime C row's hole instead of its tail, on regime C rows and no other
    (raised before launch)."""


def regime_c_finding(step) -> str | None:
    """What a step shows of the regime C finding: a description when its invariant violations
    and selection mismatches are all on regime C rows (and there is at least one), else None
    (a clean step, or one that fails on other rows too: not this finding)."""
    from .pipeline import describe_rows, selection_mismatches

    regimes = step.scenario.row_regime
    violating = {v.row for v in step.violations}
    mismatching = set(selection_mismatches(step))
    bad = violating | mismatching
    if not bad or None in bad or any(r >= len(regimes) or regimes[r] != "C" for r in bad):
        return None
    return (
        f"regime C rows planned as a prefix: planned slots != intended slots on {len(bad)} rows; "
        f"{step.context()}\n" + describe_rows(step, sorted(bad))
    )


#: vLLM's builder plans a FULL graph step's query rows (``query_start_loc_cpu[-1]``) while its
#: forward_mqa runs the padded token count; a FlashInfer that checks the query shape at run refuses.
PADDED_GRAPH_ROWS_FINDING = (
    "vLLM plans a padded FULL graph step's query rows and runs its padded rows: "
    + FINDINGS_DOC + "#vllm-padded-graph-rows-unplanned"
)
#: What FlashInfer 0.7.4's run() raises on q rows other than the planned ones.
QUERY_SHAPE_REFUSAL = "q_nope rows and heads must match the planned query shape"


class PaddedGraphRowsUnplanned(AssertionError):
    """FlashInfer's run() refused a padded FULL graph step of vLLM's backend: the plan has the
    step's query rows, q the padded token count."""


def padded_graph_step(spec) -> bool:
    """A FULL CUDA graph step with padded token rows (``harness.spec.graph_padded``)."""
    return bool(spec.full_graph) and spec.padded_rows > 0
