"""One step of a scenario through any backend behind the seam (``backends.seam``), and the checks
every backend answers to.

:func:`run_step` hands the layer the scenario's step (:func:`step_input`) and returns the
backend's :class:`~backends.seam.StepOutcome`. The checks, each naming the row, its regime, its
context and its lengths when it fails:

- :func:`routing_problems`: the backend serves the rows the reference's routing rule gives the
  sparse kernel (all rows, or the decode prefix when prefills go to dense MHA and the layer has
  a dense path);
- :func:`executed_length_problems`: every planned row's executed KV length equals its valid
  count (the count of valid entries of its converted indexer row); host bounds are bounds; what
  the backend's read-back found malformed (work items past a row, stray rows);
- :func:`selection_problems`: the slots each row's executed span holds are exactly its intended
  selection (a), as a multiset;
- :func:`output_comparisons`: the output (and the LSE where the kernel returns one) of the
  planned rows against the float64 oracle over (a), within the error budget of
  ``reference.budget``.
"""

from __future__ import annotations

import dataclasses
import re
import weakref

import torch

from backends.seam import LayerConfig, StepInput, StepOutcome
from reference import Comparison, sparse_mla_reference
from reference.budget import compare_attention, compare_to_budget
from reference.invariants import intended_selection, same_multisets
from reference.rules import valid_counts

from .device_inputs import AttentionInputs
from .pipeline import Step, plan_violations
from .spec import BatchSpec, Scenario


def layer_config(spec: BatchSpec, max_tokens: int, *, adaptive_verification: bool = False) -> LayerConfig:
    """The layer configuration of a batch spec (one layer serves every step of a sequence with
    the same kernel variant and model)."""
    return LayerConfig(
        num_heads=spec.num_heads, rope_dim=spec.rope_dim, kv_dtype=spec.kv_dtype, k_scale=spec.k_scale,
        sm_scale=spec.sm_scale, topk=spec.topk, kpool=spec.kpool, width=spec.resolved_width,
        block_size=spec.block_size, max_tokens=max_tokens, async_scheduling=spec.async_scheduling,
        adaptive_verification=adaptive_verification,
    )


def step_input(scenario: Scenario, inputs: AttentionInputs | None) -> StepInput:
    """The scenario's step as the seam hands it to a backend; ``inputs`` None: plan only."""
    return StepInput(
        meta=scenario.meta, block_table=scenario.block_table, topk_indices=scenario.topk_indices,
        prefills_to_mha=scenario.prefills_to_mha,
        q_nope=None if inputs is None else inputs.q_nope,
        q_pe=None if inputs is None else inputs.q_pe,
        kv_cache=None if inputs is None else inputs.kv_cache,
    )


def run_step(layer, scenario: Scenario, inputs: AttentionInputs | None) -> StepOutcome:
    return layer.step(step_input(scenario, inputs))


def valid_lengths(scenario: Scenario, rows: int) -> torch.Tensor:
    """Each of the first ``rows`` rows' valid count (int64)."""
    return valid_counts(scenario.intended_slots()[:rows]).to(torch.int64)


def describe_row(outcome: StepOutcome, scenario: Scenario, row: int) -> str:
    valid = valid_lengths(scenario, outcome.planned_rows)
    where = f"regime {scenario.row_regime[row]}, ctx {int(scenario.row_ctx[row])}" if row < scenario.num_rows else "?"
    return outcome.describe_row(row, int(valid[row])).replace(f"row {row}", f"row {row} ({where})", 1)


def context(outcome: StepOutcome, scenario: Scenario) -> str:
    return f"{outcome.backend}, {outcome.planned_rows} planned rows; {scenario.describe()}"


def routing_problems(outcome: StepOutcome, scenario: Scenario) -> list[str]:
    """The rows served against the routing rule: the decode prefix where the step routes its
    prefills to dense MHA and the layer has that path, else every query row."""
    expected = scenario.planned_rows if outcome.dense_prefill else scenario.num_rows
    if outcome.planned_rows == expected:
        return []
    why = "" if outcome.dense_prefill else " (the layer has no dense-MHA path: every query row)"
    return [f"the backend serves {outcome.planned_rows} rows with the sparse kernel, the routing rule {expected}{why}"]


def executed_length_problems(outcome: StepOutcome, scenario: Scenario) -> list[str]:
    """Rows whose executed KV length is not their valid count, host bounds below it, and what
    the read-back found malformed."""
    n = outcome.planned_rows
    valid = valid_lengths(scenario, n)
    problems = [_with_row_context(p, outcome, scenario) for p in outcome.schedule_problems]
    if outcome.executed_lengths is not None:
        for row in range(n):
            executed, v = int(outcome.executed_lengths[row]), int(valid[row])
            if executed != v:
                what = "reads past its valid prefix" if executed > v else "is cut short"
                problems.append(f"{describe_row(outcome, scenario, row)}: executed length {what}")
    if not outcome.host_exact and outcome.host_lengths is not None:
        for row in range(min(n, outcome.host_lengths.numel())):
            if int(outcome.host_lengths[row]) < int(valid[row]):
                problems.append(f"{describe_row(outcome, scenario, row)}: the host bound is below the valid count")
    return problems


def _with_row_context(problem: str, outcome: StepOutcome, scenario: Scenario) -> str:
    """A read-back problem ``row N : what`` with the row's regime, context and lengths."""
    match = re.match(r"row (\d+) : (.*)", problem)
    if not match or int(match.group(1)) >= outcome.planned_rows:
        return problem
    return f"{describe_row(outcome, scenario, int(match.group(1)))}: {match.group(2)}"


def selection_problems(outcome: StepOutcome, scenario: Scenario) -> list[str]:
    """Rows whose executed slots are not their intended selection (a)."""
    n = outcome.planned_rows
    if n == 0 or outcome.executed_slots is None:
        return []
    a_slots, a_mask = intended_selection(scenario.intended_slots(), n)
    b_slots, b_mask = outcome.executed_slots
    same = same_multisets(a_slots, a_mask, b_slots, b_mask)
    return [f"{describe_row(outcome, scenario, r)}: executes slots other than its selection (a)"
            for r in (~same).nonzero().flatten().tolist()]


def problem_rows(problems: list[str], rows: int) -> list[int]:
    """The rows the problems name (each problem of a row starts with ``row N ``)."""
    return [r for r in range(rows) if any(p.startswith(f"row {r} ") for p in problems)]


def parts_in_selection_order(slots: torch.Tensor, mask: torch.Tensor, executed_slots: torch.Tensor,
                             executed_mask: torch.Tensor, executed_parts: torch.Tensor) -> torch.Tensor:
    """The kernel's part of each column of the selection ``(slots, mask)`` (host tensors), read
    from the executed columns holding the same slot: ``executed_parts`` is aligned with
    ``executed_slots``. A selected slot the kernel did not execute (a selection problem reported
    on its own) is given part 0."""
    parts = torch.zeros(slots.shape, dtype=torch.int64)
    if executed_slots.shape[1] == 0 or slots.shape[1] == 0:
        return parts
    past = int(max(int(slots.max()), int(executed_slots.max()))) + 1
    keys, order = torch.where(executed_mask, executed_slots.long(), past).sort(dim=1)
    sorted_parts = executed_parts.gather(1, order)
    wanted = torch.where(mask, slots.long(), past).contiguous()
    at = torch.searchsorted(keys.contiguous(), wanted).clamp(max=keys.shape[1] - 1)
    found = mask & (keys.gather(1, at) == wanted)
    return torch.where(found, sorted_parts.gather(1, at), parts)


def intended_references(outcome: StepOutcome, scenario: Scenario, inputs: AttentionInputs):
    """(truth, lowp) ``(out, lse)`` pairs over (a) for the planned rows; the lowp reads each row
    in the parts the kernel split it into where the backend shows them (``executed_parts``)."""
    n = outcome.planned_rows
    spec = scenario.spec
    device = inputs.q_nope.device
    slots, mask = intended_selection(scenario.intended_slots(), n)
    parts = None
    if outcome.executed_parts is not None and outcome.executed_slots is not None:
        parts = parts_in_selection_order(slots, mask, *outcome.executed_slots, outcome.executed_parts).to(device)
    args = (inputs.q_nope[:n], inputs.q_pe[:n], inputs.ckv, inputs.kpe, slots.to(device))
    kw = dict(mask=mask.to(device), sm_scale=spec.sm_scale, k_scale=spec.k_scale)
    truth = _KEPT_TRUTH.get(inputs, slots, mask, kw)
    if truth is None:
        truth = sparse_mla_reference(*args, mode="float64", **kw)
        _KEPT_TRUTH.keep(inputs, slots, mask, kw, truth)
    return truth, sparse_mla_reference(*args, mode="lowp", parts=parts, **kw)


class KeptTruth:
    """The float64 truth of the last selection judged, for the next backend judged on the same
    inputs (a case judged on several backends computes it once). It serves only the same inputs
    object, while it lives, with its tensors and the truth's own unchanged since (their version
    counters), for the same selection (compared by value) and scales; a truth of more than
    ``max_bytes``, or of inputs that cannot be referenced weakly, is not kept."""

    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes = max_bytes
        self._kept = None  # (weakref to the inputs, versions, slots, mask, scales, truth)

    @staticmethod
    def _versions(inputs: AttentionInputs) -> tuple[int, ...]:
        """The version counters of the inputs' tensors: the cache's (its ``ckv``/``kpe`` may be
        copies made at each read), or the parts' where the inputs hold only those."""
        cache = (inputs.kv_cache,) if hasattr(inputs, "kv_cache") else (inputs.ckv, inputs.kpe)
        return tuple(t._version for t in (inputs.q_nope, inputs.q_pe, *cache))

    def get(self, inputs: AttentionInputs, slots: torch.Tensor, mask: torch.Tensor, kw: dict):
        if self._kept is None:
            return None
        ref, versions, kept_slots, kept_mask, scales, truth = self._kept
        same = (ref() is inputs and versions == self._versions(inputs) + tuple(t._version for t in truth)
                and scales == (kw["sm_scale"], kw["k_scale"]) and kept_slots.shape == slots.shape
                and torch.equal(kept_slots, slots) and torch.equal(kept_mask, mask))
        return truth if same else None

    def keep(self, inputs: AttentionInputs, slots: torch.Tensor, mask: torch.Tensor, kw: dict, truth) -> None:
        self._kept = None
        if sum(t.numel() * t.element_size() for t in truth) > self.max_bytes:
            return
        try:
            ref = weakref.ref(inputs, self._forget_if_kept)
        except TypeError:  # inputs that cannot be referenced weakly (a SimpleNamespace): not kept
            return
        versions = self._versions(inputs) + tuple(t._version for t in truth)
        self._kept = (ref, versions, slots.clone(), mask.clone(), (kw["sm_scale"], kw["k_scale"]), truth)

    def _forget_if_kept(self, dead: weakref.ReferenceType) -> None:
        if self._kept is not None and self._kept[0] is dead:
            self._kept = None


_KEPT_TRUTH = KeptTruth()


def output_comparisons(outcome: StepOutcome, scenario: Scenario, inputs: AttentionInputs,
                       kernel: str | None = None, rows: list[int] | None = None) -> list[Comparison]:
    """The output of the planned rows (``rows`` of them only, where given) and the LSE where the
    backend returns one, against the float64 oracle over (a), by the budget of ``kernel``."""
    truth, lowp = intended_references(outcome, scenario, inputs)
    return compared_rows(outcome, scenario, truth, lowp, kernel, rows)


def compared_rows(outcome: StepOutcome, scenario: Scenario, truth, lowp, kernel: str | None,
                  rows: list[int] | None = None, suffix: str = "") -> list[Comparison]:
    """The comparisons of the planned rows (``rows`` of them only, where given, their worst
    positions numbered as rows of the step) against the references ``truth`` and ``lowp``, each
    named with ``suffix``."""
    n = outcome.planned_rows
    pick = slice(0, n) if rows is None else torch.tensor(rows, dtype=torch.int64, device=outcome.out.device)
    out = outcome.out[pick]
    if rows is not None:
        truth, lowp = tuple(t[pick] for t in truth), tuple(t[pick] for t in lowp)
    kv_dtype = scenario.spec.kv_dtype
    if outcome.lse is None:
        comparisons = [compare_to_budget("out" + suffix, out, truth[0], lowp[0], kv_dtype)]
    else:
        comparisons = compare_attention(out, outcome.lse[pick], truth, lowp, kv_dtype, kernel=kernel, suffix=suffix)
    if rows is None:
        return comparisons
    return [dataclasses.replace(c, worst=[(rows[r], h, e) for r, h, e in c.worst]) for c in comparisons]


def offset_groups(scenario: Scenario, rows: int) -> dict[float, list[int]]:
    """The first ``rows`` rows by their raw score offset (``BatchSpec.score_offsets``), in order of offset."""
    groups: dict[float, list[int]] = {}
    for row, offset in enumerate(scenario.row_score_offsets()[:rows].tolist()):
        groups.setdefault(offset, []).append(row)
    return dict(sorted(groups.items()))


def offset_comparisons(outcome: StepOutcome, scenario: Scenario, inputs: AttentionInputs,
                       kernel: str | None = None) -> list[Comparison]:
    """Each raw score offset's rows against the oracle on their own (named ``out[offset X]``,
    ``lse[offset X]``), so that the LSE floor of a row at |lse| ~ 4000 is not that of a row at
    |lse| ~ 10 (docs/edges.md#magnitude)."""
    truth, lowp = intended_references(outcome, scenario, inputs)
    return [c for offset, rows in offset_groups(scenario, outcome.planned_rows).items()
            for c in compared_rows(outcome, scenario, truth, lowp, kernel, rows, suffix=f"[offset {offset:g}]")]


def laid_out_step(scenario: Scenario, outcome: StepOutcome) -> Step:
    """The layout a plan-only outcome shows (``StepOutcome.laid_out``) as the pipeline's step of
    ``scenario``, its invariants before launch checked (``harness.pipeline.plan_violations``)."""
    laid = outcome.laid_out
    planned = outcome.planned_lengths.to(torch.int32)
    violations = plan_violations(scenario, laid.layout, laid.slots, planned, laid.max_rows)
    return Step(scenario, laid.layout, laid.max_rows, laid.slots, laid.counts, outcome.host_lengths.to(torch.int32),
                planned, laid.kv_indptr, laid.kv_indices, violations)
