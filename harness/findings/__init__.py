"""The known production findings the suite keeps visible: the reason strings of its strict
xfails (short, each linking its section of docs/findings.md, and shown in the run's short
summary), and the exceptions those xfails expect, so that no other error can pass for a
finding. A finding that gets fixed turns its xfails into failures that ask for the marker to go.

This module holds the findings of no one family (the plan's regime C rows, FlashInfer's graph
replay and work capacity, the top-k holes, MTP's shared top-k rows); each family's own live in a module of this package
(``vllm``), found through :func:`for_backend` so that the judge names no vendor."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

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
    from ..pipeline import describe_rows, selection_mismatches

    bad = {v.row for v in step.violations} | set(selection_mismatches(step))
    if not only_regime_c_rows(bad, step.scenario.row_regime):
        return None
    return (
        f"regime C rows planned as a prefix: planned slots != intended slots on {len(bad)} rows; "
        f"{step.context()}\n" + describe_rows(step, sorted(bad))
    )


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
    return rows_by_rule_and_off(outcome, scenario, short_too=False)[1]


def topk_holes_finding(outcome, scenario, problems: list[str]) -> str | None:
    """What a step shows of the top-k holes finding: a description when the rows its
    ``problems`` name (each starting ``row N ``) are exactly its rows with holes that execute
    past their valid count (and there is one), else None (a clean step, a backend that executes
    each row's valid count, or one that fails on other rows too: not this finding)."""
    from ..backend_step import problem_rows

    past = set(rows_past_valid(outcome, scenario)) & set(topk_hole_rows(scenario, outcome.planned_rows))
    named = set(problem_rows(problems, outcome.planned_rows))
    unnamed = [p for p in problems if not any(p.startswith(f"row {r} ") for r in named)]
    if not past or named != past or unnamed:
        return None
    return (f"{len(past)} rows with top-k holes execute past their valid count; {outcome.backend}; "
            f"{scenario.describe()}\n" + "\n".join(problems[:12]))


#: MTP with shared top-k indices (``harness.builder.with_shared_mtp_indices``): draft step k hands
#: the backend rows selected at draft step 0's context L; each row's length comes from L + k.
SHARED_MTP_FINDING = ("MTP's shared top-k rows executed with the length rule of the draft's context: "
                      + FINDINGS_DOC + "#mtp-shared-top-k-rows-executed-by-the-drafts-context")


class SharedMtpRowsByContext(AssertionError):
    """Exactly the rows whose kept top-k row (selected at draft step 0) holds another count of
    valid entries than the length rule gives the draft's context execute the rule's count, and no
    other row has a problem."""


def rows_by_rule_and_off(outcome, scenario, *, short_too: bool = True) -> tuple[list[int], list[int]]:
    """The planned rows that run the length rule's count where their valid count differs (with
    ``short_too`` False only where it is the larger: a row with holes), and those that run
    neither their valid count nor such a rule's count (what no finding explains)."""
    lengths = run_lengths(outcome)
    if lengths is None:
        return [], []
    valid, rule = valid_and_rule_counts(scenario, outcome.planned_rows)
    by_rule = (lengths == rule) & ((valid != rule) if short_too else (valid < rule))
    off = (lengths != valid) & ~by_rule
    return by_rule.nonzero().flatten().tolist(), off.nonzero().flatten().tolist()


@dataclass(frozen=True)
class KnownFinding:
    """A finding that decides a step's outcome: the test is a strict xfail expecting ``exception``.
    ``decides_output``: expected before the outputs are seen, it is the step's failure where they
    are beyond the budget (what the finding does to them), not a failure of their own."""

    exception: type[AssertionError]
    reason: str
    decides_output: bool = False


TOPK_HOLES = KnownFinding(TopkHolesAttended, TOPK_HOLES_FINDING)
SHARED_MTP = KnownFinding(SharedMtpRowsByContext, SHARED_MTP_FINDING)


class FamilyFindings:
    """What the judge asks a backend's family about its known findings; this base knows none (a
    family with findings overrides what it has). Each method gets the backend it judges."""

    def expected(self, backend, spec, query_shape_checked) -> list[KnownFinding]:
        """The findings a step of ``spec`` shows before its outputs are seen."""
        return []

    def refusal(self, backend, scenario, exc: ValueError) -> AssertionError | None:
        """A refusal of the step (raised while it ran) that is a finding, as its exception."""
        return None

    def rows_loading_a_bad_slot(self, backend, layer, outcome, inputs) -> list[int]:
        """Rows whose kernel tiles load, past their executed length, a slot that is not finite."""
        return []

    def bad_slot_verdict(self, verdict, layer, scenario, inputs, rows: list[int], compare, kernel,
                         summary: str) -> AssertionError:
        """The failure of a step whose non-finite rows are exactly ``rows``."""
        return AssertionError(f"{verdict.where}\n{summary}")

    def hole_filler(self, backend, device) -> str | None:
        """What the backend packs a -1 inside a row's planned length as (``reference.contract``),
        None where it hands the kernel no such entry."""
        return None


NO_FINDINGS = FamilyFindings()

#: The module (``FINDINGS``, a :class:`FamilyFindings`) of each backend family that has findings
#: of its own, by the family's name in ``backends.registry.FAMILIES``.
FAMILY_MODULES = {"vllm": "harness.findings.vllm"}


def for_backend(backend) -> FamilyFindings:
    """The findings of ``backend``'s family (none for a family without any, or a user's backend)."""
    from backends.registry import family_and_release

    module = FAMILY_MODULES.get(family_and_release(getattr(backend, "name", ""))[0])
    return importlib.import_module(module).FINDINGS if module else NO_FINDINGS
