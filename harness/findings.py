"""The known production findings the suite keeps visible: the reason strings of its strict
xfails (short, each linking its section of docs/findings.md, and shown in the run's short
summary), and the exceptions those xfails expect, so that no other error can pass for a
finding. A finding that gets fixed turns its xfails into failures that ask for the marker to go."""

from __future__ import annotations

import torch

from mla_constants import FA3_WORK_CAPACITY

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


class WorkCapacityExceeded(AssertionError):
    """A plan beyond the scheduler's work capacity was refused, or was accepted and then gave
    wrong rows or crashed (the finding, whichever the release does)."""


class RegimeCPlannedAsPrefix(AssertionError):
    """The plan reads a regime C row's hole instead of its tail, on regime C rows and no other
    (raised before launch)."""


def only_regime_c_rows(rows: set, regimes) -> bool:
    """Whether the rows a plan gets wrong (``None`` for a fault of no row) are regime C rows
    alone, and there is one: what the regime C finding explains."""
    return bool(rows) and None not in rows and all(r < len(regimes) and regimes[r] == "C" for r in rows)


def regime_c_finding(step) -> str | None:
    """What a step shows of the regime C finding: a description when its invariant violations
    and selection mismatches are all on regime C rows (and there is at least one), else None
    (a clean step, or one that fails on other rows too: not this finding)."""
    from .pipeline import describe_rows, selection_mismatches

    bad = {v.row for v in step.violations} | set(selection_mismatches(step))
    if not only_regime_c_rows(bad, step.scenario.row_regime):
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


def is_vllm_backend(backend) -> bool:
    """A vLLM release's own SM90 backend (``backends.vllm_sm90``): it has a design."""
    return getattr(backend, "design", None) is not None


#: vLLM dequantises the kpe part of an fp8 cache with 1.0, not the layer's k_scale.
KPE_SCALE_FINDING = "vLLM's fp8 kpe read without k_scale: " + FINDINGS_DOC + "#vllm-fp8-kpe-scale"
#: vLLM plans an fp8 cache with its storage dtype (its cache spec's uint8), which FlashInfer refuses.
FP8_AS_UINT8_FINDING = "vLLM plans an fp8 cache as uint8: " + FINDINGS_DOC + "#vllm-fp8-planned-as-uint8"
#: What FlashInfer's plan() raises on a kv_data_type of uint8.
UINT8_REFUSAL = "kv_data_type torch.uint8 is not supported"
#: vLLM 0.31.0 packs a -1 inside a row's planned length as slot 0, which FlashInfer's fa3 kernel
#: loads past the row's executed length with weight 0: a non-finite slot 0 makes the row NaN.
SLOT_ZERO_FINDING = ("vLLM's -1 packed as slot 0, loaded past a row's length: " + FINDINGS_DOC
                     + "#vllm-slot-0-loaded-past-a-rows-length")


class Fp8PlannedAsUint8(AssertionError):
    """FlashInfer refused vLLM's plan of an fp8 cache with kv_data_type uint8."""


class KpeScaleIgnored(AssertionError):
    """vLLM's output is beyond the budget on an fp8 cache with rope and k_scale != 1, and only
    there (its forward_mqa passes kpe_scale=1.0)."""


class SlotZeroLoaded(AssertionError):
    """The output rows that are not finite are exactly those whose kernel tiles load a non-finite
    slot 0 past their executed length."""


def kpe_scale_ignored(config) -> bool:
    """A configuration (a ``KernelConfig`` or a ``BatchSpec``) where vLLM's fp8 kpe finding decides
    the output: an fp8 cache with rope and k_scale != 1."""
    return config.kv_dtype == "float8_e4m3fn" and bool(config.rope) and config.k_scale != 1.0


#: Rows whose indexer top-k wrote -1 inside their valid prefix (tied, infinite or NaN scores),
#: executed with the length rule's count, not their valid count: the holes are attended.
TOPK_HOLES_FINDING = ("top-k holes executed with the length rule's count: " + FINDINGS_DOC
                      + "#top-k-holes-attended")


class TopkHolesAttended(AssertionError):
    """Exactly the rows with holes in their top-k execute past their valid count (the length
    rule's count), and no other row has a problem."""


def valid_and_rule_counts(scenario, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of the first ``rows`` query rows' count of valid entries in its intended selection,
    and the count the length rule gives its context (int64)."""
    from reference.rules import kv_len_rule, valid_counts

    valid = valid_counts(scenario.intended_slots()[:rows]).to(torch.int64)
    return valid, kv_len_rule(scenario.row_ctx[:rows], scenario.spec.topk, scenario.spec.kpool)


def run_lengths(outcome) -> torch.Tensor | None:
    """The length each planned row runs (int64): the executed one where the backend read it back,
    else the planned one; None where it shows neither."""
    lengths = outcome.executed_lengths if outcome.executed_lengths is not None else outcome.planned_lengths
    return None if lengths is None else lengths.to(torch.int64)[: outcome.planned_rows]


def topk_hole_rows(scenario, rows: int | None = None) -> list[int]:
    """The first ``rows`` query rows (default: the planned rows) with fewer valid entries than
    the length rule gives their context: rows whose top-k holds -1 inside its valid prefix."""
    valid, rule = valid_and_rule_counts(scenario, scenario.planned_rows if rows is None else rows)
    return (valid < rule).nonzero().flatten().tolist()


def rows_past_valid(outcome, scenario) -> list[int]:
    """The planned rows whose executed length (the planned one where nothing was read back)
    exceeds their valid count."""
    lengths = run_lengths(outcome)
    if lengths is None:
        return []
    valid, _ = valid_and_rule_counts(scenario, outcome.planned_rows)
    return (lengths > valid).nonzero().flatten().tolist()


def rows_off_the_rule(outcome, scenario) -> list[int]:
    """The planned rows whose executed length (the planned one where nothing was read back) is
    neither their valid count nor, for a row with holes in its top-k, the length rule's count:
    lengths the top-k holes finding does not explain (a row cut short, or run past the rule)."""
    lengths = run_lengths(outcome)
    if lengths is None:
        return []
    valid, rule = valid_and_rule_counts(scenario, outcome.planned_rows)
    explained = (lengths == valid) | ((valid < rule) & (lengths == rule))
    return (~explained).nonzero().flatten().tolist()


def topk_holes_finding(outcome, scenario, problems: list[str]) -> str | None:
    """What a step shows of the top-k holes finding: a description when the rows its
    ``problems`` name (each starting ``row N ``) are exactly its rows with holes that execute
    past their valid count (and there is one), else None (a clean step, a backend that executes
    each row's valid count, or one that fails on other rows too: not this finding)."""
    from .backend_step import problem_rows

    past = set(rows_past_valid(outcome, scenario)) & set(topk_hole_rows(scenario, outcome.planned_rows))
    named = set(problem_rows(problems, outcome.planned_rows))
    unnamed = [p for p in problems if not any(p.startswith(f"row {r} ") for r in named)]
    if not past or named != past or unnamed:
        return None
    return (f"{len(past)} rows with top-k holes execute past their valid count; {outcome.backend}; "
            f"{scenario.describe()}\n" + "\n".join(problems[:12]))
