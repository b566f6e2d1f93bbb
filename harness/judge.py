"""The one judge of a step any backend ran behind the seam (``backends.seam``).

:func:`judge_step` runs one step and returns a :class:`Verdict`: the backend's
:class:`~backends.seam.StepOutcome`, the problems of the rows it served (routing, executed lengths
against valid counts, executed slots against the intended selection (a), what the read-back of
the schedule found malformed: ``harness.backend_step``; a layer mode's comparison of the step
with its other run: ``harness.layer_modes``), the output (and LSE) against the
float64 oracle over (a) within the error budget, the known findings the step is expected to show
(``harness.findings``), and the failure, if any, as the exception the test raises: a known
finding's own exception where the finding decides the step, else an ``AssertionError`` naming the
backend, the rows, their regimes and lengths.

Cases and sequences are built, run and their verdicts reported by the case runner
(``harness.case_runner``), which calls :func:`judge_step` once per step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from backends.seam import StepInput, StepOutcome, declares, runs_in_parts
from reference import Comparison
from reference.rules import valid_counts

from .backend_step import (
    context,
    describe_row,
    executed_length_problems,
    laid_out_step,
    offset_comparisons,
    output_comparisons,
    problem_rows,
    routing_problems,
    run_step,
    selection_problems,
    step_input,
)
from .case_log import note_step
from .device_inputs import AttentionInputs
from .findings import (
    SHARED_MTP,
    TOPK_HOLES,
    KnownFinding,
    RegimeCPlannedAsPrefix,
    SharedMtpRowsByContext,
    TopkHolesAttended,
    for_backend,
    regime_c_finding,
    rows_by_rule_and_off,
    rows_off_the_rule,
    rows_past_valid,
    topk_hole_rows,
    topk_holes_finding,
    valid_and_rule_counts,
)
from .layer_modes import mode_problems
from .pipeline import describe_rows, selection_mismatches
from .spec import Scenario
from .topk_holes import measure_hole_rows


@dataclass
class Verdict:
    """What the judge found of one step. ``failure``: the exception the test raises (None: the
    step passed); ``kernel_rounding``: the output is beyond the budget and bit for bit the twin's
    (the kernel's own rounding on these inputs, not the backend's doing: it passes, counted)."""

    backend: str
    where: str
    outcome: StepOutcome | None = None  # None: the backend refused the step as a known finding
    problems: list[str] = field(default_factory=list)
    comparisons: list[Comparison] = field(default_factory=list)
    expected: list[KnownFinding] = field(default_factory=list)
    failure: AssertionError | None = None
    kernel_rounding: bool = False
    # the rows the checks before launch found wrong (the kernel was not launched)
    before_launch_rows: list[int] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.failure is None

    @property
    def refused(self) -> bool:
        """The release refused the step's plan as it is expected to: nothing launched, nothing failed."""
        return self.outcome is not None and self.outcome.refusal is not None and self.failure is None

    @property
    def problem_rows(self) -> list[int]:
        return problem_rows(self.problems, self.outcome.planned_rows) if self.outcome is not None else []

    @property
    def rows_at_fault(self) -> list[int]:
        """The planned rows a failed check names: the checks before launch, the row checks, and
        the worst positions of the comparisons beyond the budget."""
        if self.outcome is None:
            return []
        n = self.outcome.planned_rows
        worst = {r for c in self.comparisons if not c.ok for r, _, _ in c.worst if r < n}
        return sorted(set(self.before_launch_rows) | set(self.problem_rows) | worst)


def never() -> bool:
    return False


def executes_the_length_rule(backend) -> bool:
    """A backend that plans and executes each row with the length rule's count (the port and
    vLLM's SM90 backend), not with the count of the row's valid entries (one that declares
    ``executes_valid_counts``): a row with holes in its top-k executes past its valid count."""
    return not declares(backend, "executes_valid_counts")


def kernel_reads_a_hole(backend) -> bool:
    """A backend whose layout leaves a -1 inside a planned span (it declares
    ``hands_holes_to_the_kernel``), which its kernel would read as slot -1: a step with holes runs
    its plan only there."""
    return declares(backend, "hands_holes_to_the_kernel")


def rows_without_entries(scenario: Scenario, rows: int) -> list[int]:
    """The first ``rows`` rows whose top-k holds no valid entry (each candidate a hole): out 0 and
    LSE -inf under the contract."""
    return (valid_counts(scenario.intended_slots()[:rows]) == 0).nonzero().flatten().tolist()


def empty_row_problems(outcome: StepOutcome, rows: list[int]) -> list[str]:
    """Rows the holes emptied, against FlashMLA's convention for an empty row: out 0 (as the
    contract says) and LSE +inf (where the contract says -inf, docs/computation.md#empty-rows)."""
    if not rows or outcome.out is None:
        return []
    out = outcome.out[rows]
    lse = outcome.lse[rows] if outcome.lse is not None else None
    if bool((out == 0).all()) and (lse is None or bool((lse == float("inf")).all())):
        return []
    text = f"rows {rows} have no valid entry and are not out 0 / LSE +inf: out max |{float(out.abs().max()):.3g}|"
    if lse is not None:
        text += f", lse from {float(lse.min()):.3g} to {float(lse.max()):.3g}"
    return [text]


def runs_neither_count(verdict: Verdict, scenario: Scenario, rows: list[int]) -> AssertionError:
    """The failure of a step whose ``rows`` run neither their valid count nor the length rule's:
    a fault of their own, which no finding explains."""
    return AssertionError(f"{verdict.where}\n" + "\n".join(
        f"{describe_row(verdict.outcome, scenario, r)}: the length it runs is neither its valid count nor the "
        "length rule's count" for r in rows[:12]))


def judge_holes(verdict: Verdict, backend, scenario: Scenario, inputs: AttentionInputs | None,
                spared: list[int]) -> None:
    """The verdict of a step whose top-k has holes: where exactly its rows with holes execute past
    their valid count, the finding (with each row's lengths and its error against the contract and
    the implementation oracle), every other row judged as always; a row the holes emptied on a
    backend that executes valid counts, FlashMLA's convention for an empty row."""
    outcome = verdict.outcome
    n = outcome.planned_rows
    off = rows_off_the_rule(outcome, scenario)
    if off:  # neither the valid count nor the rule's: a fault of its own, never the finding
        verdict.failure = runs_neither_count(verdict, scenario, off)
        return
    if outcome.executed_lengths is None:
        verdict.problems += [f"{describe_row(outcome, scenario, r)}: planned past its valid count"
                             for r in rows_past_valid(outcome, scenario)]
    finding = topk_holes_finding(outcome, scenario, verdict.problems)
    if verdict.problems and finding is None:
        verdict.failure = AssertionError(f"{verdict.where}\n" + "\n".join(verdict.problems[:12]))
        return
    attended = set(rows_past_valid(outcome, scenario)) if finding is not None else set()
    empty = [] if finding is not None else rows_without_entries(scenario, n)
    others = [r for r in range(n) if r not in attended and r not in empty and r not in spared]
    if inputs is not None and n:
        kernel = getattr(backend, "kernel", None)
        verdict.comparisons = output_comparisons(outcome, scenario, inputs, kernel, rows=others) if others else []
        bad = [c for c in verdict.comparisons if not c.ok]
        problems = empty_row_problems(outcome, empty)
        if bad or problems:
            verdict.failure = AssertionError(f"rows that attend no hole are off; {verdict.where}\n"
                                             + "\n".join(problems + [c.summary() for c in bad]))
            return
    if finding is not None:
        filler = for_backend(backend).hole_filler(backend, inputs.q_nope.device) if inputs is not None else None
        rows = measure_hole_rows(outcome, scenario, sorted(attended), inputs, filler)
        verdict.failure = TopkHolesAttended(f"{verdict.where}\n{finding}\n" + "\n".join(row.describe() for row in rows))


def judge_shared_mtp(verdict: Verdict, backend, scenario: Scenario, inputs: AttentionInputs | None,
                     spared: list[int]) -> None:
    """The verdict of a draft step of MTP with shared top-k indices: where exactly the rows whose
    kept top-k row holds another count of valid entries than the rule gives the draft's context
    run the rule's count, the finding (each row with its contexts and lengths); every other row
    judged as always, a row that runs neither count a failure of its own."""
    outcome = verdict.outcome
    n = outcome.planned_rows
    by_rule, off = rows_by_rule_and_off(outcome, scenario)
    if off:
        verdict.failure = runs_neither_count(verdict, scenario, off)
        return
    explained = set(by_rule)
    others = [p for p in verdict.problems if not any(p.startswith(f"row {r} ") for r in explained)]
    if others:
        verdict.failure = AssertionError(f"{verdict.where}\n" + "\n".join(others[:12]))
        return
    rows = [r for r in range(n) if r not in explained and r not in spared]
    if inputs is not None and rows:
        verdict.comparisons = output_comparisons(outcome, scenario, inputs, getattr(backend, "kernel", None), rows=rows)
        bad = [c for c in verdict.comparisons if not c.ok]
        if bad:
            verdict.failure = AssertionError(f"rows that run their valid count are off; {verdict.where}\n"
                                             + "\n".join(c.summary() for c in bad))
            return
    if by_rule:
        step = scenario.extra["mtp_draft_step"]
        lines = [f"{describe_row(outcome, scenario, r)}: kept from draft step 0 at context "
                 f"{int(scenario.row_ctx[r]) - step}, runs the rule's count at the draft's context"
                 for r in by_rule[:12]]
        verdict.failure = SharedMtpRowsByContext(
            f"{len(by_rule)} rows of draft step {step} run the length rule's count at the draft's context, not "
            f"their kept row's valid count; {verdict.where}\n" + "\n".join(lines))


def nonfinite_rows(out: torch.Tensor) -> list[int]:
    return (~torch.isfinite(out.float())).flatten(1).any(1).nonzero().flatten().tolist()


def measured(comparisons: list[Comparison]) -> str:
    return ", ".join(f"{c.name} max {c.max_ratio:.2f}x lowp, mean {c.mean_ratio:.2f}x, rel L2 {c.rel_l2:.3g}"
                     for c in comparisons)


def before_launch(verdict: Verdict, scenario: Scenario, outcome: StepOutcome) -> None:
    """The checks before launch of a plan-only outcome that shows its layout (``laid_out``):
    the invariants (docs/invariants.md#before-launch), the planned selection (b) against the
    intended one (a), and what the plan itself found wrong (a plan accepted where a refusal was
    expected). A violation is the verdict's failure, the kernel not launched; the regime C
    finding where every wrong row is a regime C row."""
    step = laid_out_step(scenario, outcome)
    # what a failing test dumps where it noted no backend case (run_sequence: case_rebuilds)
    note_step(step)
    n = step.num_planned
    mismatching = selection_mismatches(step)
    verdict.before_launch_rows = sorted({v.row for v in step.violations if v.row is not None and v.row < n}
                                        | {r for r in mismatching if r < n})
    finding = regime_c_finding(step)
    if finding:
        verdict.failure = RegimeCPlannedAsPrefix(f"{finding}; {verdict.where}\n(kernel not launched)")
    elif step.violations:
        verdict.failure = AssertionError(f"invariant violations (kernel not launched); {verdict.where}\n"
                                         + "\n".join(map(str, step.violations[:8])))
    elif mismatching:
        verdict.failure = AssertionError(
            f"plan/layout bug: planned slots (b) != intended slots (a) on {len(mismatching)} rows (kernel not "
            f"launched); {verdict.where}\n" + describe_rows(step, mismatching))
    elif outcome.schedule_problems:
        verdict.failure = AssertionError(f"{'; '.join(outcome.schedule_problems)} (kernel not launched); "
                                         f"{verdict.where}")


def rerun_problems(layer, step: StepInput, outcome: StepOutcome) -> list[str]:
    """Where the layer's class promises bitwise repeatability within one plan (its ``rerun``; a
    wrapper that hands it on to another layer promises nothing of its own step), the rows whose
    output or LSE a second run on the same plan changes."""
    rerun = getattr(type(layer), "rerun", None)
    if not callable(rerun) or outcome.out is None or not outcome.planned_rows:
        return []
    out, lse = rerun(layer, step, outcome)
    same = (out == outcome.out).flatten(1).all(1)
    if outcome.lse is not None:
        same &= (lse == outcome.lse).flatten(1).all(1)
    rows = (~same).nonzero().flatten().tolist()
    return [f"rerun not bitwise equal on the same plan: rows {rows[:12]}"] if rows else []


def run_judged(layer, scenario: Scenario, inputs: AttentionInputs | None,
               verdict_of) -> tuple[StepOutcome, Verdict | None]:
    """The step through ``layer``: in its three parts where its class has the plan/launch/finish
    split (:func:`backends.seam.runs_in_parts`), ``verdict_of(outcome)`` asked of the plan-only
    outcome before anything launches (a verdict returned ends the step there), else in one
    ``step``."""
    if not runs_in_parts(layer):
        return run_step(layer, scenario, inputs), None
    step = step_input(scenario, inputs)
    outcome = layer.plan_step(step)
    verdict = verdict_of(outcome)
    if verdict is not None or not step.runs_kernel or outcome.refusal is not None:
        return outcome, verdict
    layer.launch(step, outcome)
    return layer.finish(step, outcome), None


#: ``twin(scenario, inputs)``: the output of the same step through another path (the project's
#: own, ``port-fa3``) on the same inputs.
Twin = Callable[[Scenario, AttentionInputs], torch.Tensor]


def judge_step(backend, layer, scenario: Scenario, inputs: AttentionInputs | None, *, compare: bool = True,
               twin: Twin | None = None, query_shape_checked: Callable[[], bool] = never,
               context_of_step: str = "") -> Verdict:
    """Run one step of ``scenario`` on ``layer`` (plan only where ``inputs`` is None) and judge it.

    An output beyond the budget passes where it is bit for bit ``twin``'s on the same inputs
    (``Verdict.kernel_rounding``): the kernel's rounding, which the kernel's own tests judge.
    ``context_of_step`` (a sequence's ``step i of n``) leads every failure message. A layer in a
    mode of ``harness.layer_modes`` (poisoned workspaces, graphed, against a fresh layer) adds
    what its comparison of the step with its other run found to the step's problems."""
    # the backend family's findings (harness.findings.for_backend); query_shape_checked(): whether
    # the installed FlashInfer refuses q rows other than the planned ones at run
    family = for_backend(backend)
    expected = family.expected(backend, scenario.spec, query_shape_checked)
    lead = f"{context_of_step}: " if context_of_step else ""
    where = f"{lead}{scenario.describe()}; {backend.describe()}"
    # a step with holes in its top-k, or a draft step of MTP's shared rows, is judged after the run
    holes = scenario.extra.get("topk_holes") is not None or scenario.extra.get("mtp_draft_step") is not None

    def before(outcome: StepOutcome) -> Verdict | None:
        if outcome.laid_out is None or holes:  # a step with holes is judged by judge_holes
            return None
        verdict = Verdict(backend.name, f"{lead}{context(outcome, scenario)}; {backend.describe()}", outcome,
                          expected=expected)
        before_launch(verdict, scenario, outcome)
        return verdict if verdict.failure is not None or outcome.refusal is not None else None

    try:
        outcome, ended = run_judged(layer, scenario, inputs, before)
    except ValueError as exc:
        finding = family.refusal(backend, scenario, exc)
        if finding is None:
            raise
        return Verdict(backend.name, where, expected=expected, failure=finding)
    if ended is not None:
        return ended
    where = f"{lead}{context(outcome, scenario)}; {backend.describe()}"
    verdict = Verdict(backend.name, where, outcome, expected=expected)
    if outcome.refusal is not None:
        return verdict
    bad_slot_rows = family.rows_loading_a_bad_slot(backend, layer, outcome, inputs)
    verdict.problems = (routing_problems(outcome, scenario) + executed_length_problems(outcome, scenario)
                        + selection_problems(outcome, scenario)
                        + (rerun_problems(layer, step_input(scenario, inputs), outcome) if inputs is not None else [])
                        + mode_problems(layer))
    if scenario.extra.get("mtp_draft_step") is not None:
        valid, rule = valid_and_rule_counts(scenario, outcome.planned_rows)
        if executes_the_length_rule(backend) and bool((valid != rule).any()):
            verdict.expected.append(SHARED_MTP)
        judge_shared_mtp(verdict, backend, scenario, inputs if compare else None, bad_slot_rows)
        return verdict
    if scenario.extra.get("topk_holes") is not None:
        # rows that load a bad slot (their family's finding) are left out of the output check here
        if executes_the_length_rule(backend) and topk_hole_rows(scenario, outcome.planned_rows):
            verdict.expected.append(TOPK_HOLES)
        judge_holes(verdict, backend, scenario, inputs if compare else None, bad_slot_rows)
        return verdict
    if compare and inputs is not None and outcome.planned_rows:
        kernel = getattr(backend, "kernel", None)
        by_offset = offset_comparisons if scenario.spec.score_offsets else output_comparisons
        verdict.comparisons = by_offset(outcome, scenario, inputs, kernel=kernel)
    if verdict.problems:
        verdict.failure = AssertionError(f"{where}\n" + "\n".join(verdict.problems[:12]))
        return verdict
    bad = [c for c in verdict.comparisons if not c.ok]
    if not bad:
        return verdict
    summary = "\n".join(c.summary(scenario.row_regime) for c in bad)
    n = outcome.planned_rows
    decided = [f for f in expected if f.decides_output]
    if decided:
        verdict.failure = decided[0].exception(f"{where}\n{summary}")
    elif bad_slot_rows and nonfinite_rows(outcome.out[:n]) == bad_slot_rows:
        verdict.failure = family.bad_slot_verdict(verdict, layer, scenario, inputs, bad_slot_rows, by_offset, kernel,
                                                  summary)
    elif twin is not None and torch.equal(outcome.out[:n], twin(scenario, inputs)[:n]):
        verdict.kernel_rounding = True
    else:
        verdict.failure = AssertionError(f"{outcome.backend}'s output vs (a) beyond the error budget (measured: "
                                         f"{measured(verdict.comparisons)}); {where}\n{summary}")
    return verdict


