"""The one judge of a step any backend ran behind the seam (``backends.seam``), and the one way a
test runs a case or a sequence through a backend.

:func:`judge_step` runs one step and returns a :class:`Verdict`: the backend's
:class:`~backends.seam.StepOutcome`, the problems of the rows it served (routing, executed lengths
against valid counts, executed slots against the intended selection (a), what the read-back of
the schedule found malformed: ``harness.backend_step``; a layer mode's comparison of the step
with its other run: ``harness.layer_modes``), the output (and LSE) against the
float64 oracle over (a) within the error budget, the known findings the step is expected to show
(``harness.findings``), and the failure, if any, as the exception the test raises: a known
finding's own exception where the finding decides the step, else an ``AssertionError`` naming the
backend, the rows, their regimes and lengths.

:func:`run_case` and :func:`run_sequence` build the scenarios from their specs and seeds, open
one layer, and hand each step to a *judge*: any object with ``admit(backend, config)`` (raise
where the test should not run the configuration) and ``step(backend, layer, scenario, inputs,
...)`` (judge, report, raise the verdict's failure). The pytest
plugin's ``judge`` fixture is that object for every test and for the replay of a written case;
what it records for ``--dump-failures`` is noted here, before each step
(:func:`harness.case_log.note_backend_case`), so a failing case is written as the steps that ran.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from backends.registry import PORT_KERNELS, family_and_release
from backends.seam import StepInput, StepOutcome, declares, runs_in_parts
from reference import Comparison
from reference.rules import valid_counts

from .backend_step import (
    context,
    describe_row,
    executed_length_problems,
    laid_out_step,
    layer_config,
    offset_comparisons,
    output_comparisons,
    problem_rows,
    routing_problems,
    run_step,
    selection_problems,
    step_input,
)
from .builder import (
    build_scenario,
    host_split_of,
    with_host_query_split,
    with_rejected_drafts,
    with_shared_mtp_indices,
)
from .case_log import note_backend_case, note_step
from .device_inputs import AttentionInputs, build_attention_inputs, nan_kv_buffer, with_blocks_apart
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
from .layer_modes import layer_mode_of, mode_problems
from .pipeline import describe_rows, selection_mismatches
from .spec import Scenario
from .topk_holes import TopkHoles, measure_hole_rows, with_topk_holes


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
    return [f"rows {rows} have no valid entry and are not out 0 / LSE +inf: out max |{float(out.abs().max()):.3g}|"]


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
        verdict.failure = TopkHolesAttended(finding + "\n" + "\n".join(row.describe() for row in rows))


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


def port_twin(device) -> Twin:
    """The project's own path on FlashInfer's fa3 (``port-fa3``: an exact plan of the intended
    selection, the compacted layout) as a twin."""
    from backends.registry import open_backend

    port = open_backend("port-fa3")

    def twin(scenario: Scenario, inputs: AttentionInputs) -> torch.Tensor:
        layer = port.open_layer(layer_config(scenario.spec, max(scenario.topk_indices.shape[0], 1)), device)
        return run_step(layer, scenario, inputs).out

    return twin


# --- running cases -------------------------------------------------------------------------------


def module_digest(backend) -> str | None:
    """sha256 of the text of the code under test that the backend loaded (``backend.module``'s
    file: a vLLM release's SM90 module or FLASHMLA_SPARSE); None for the project's own port."""
    path = getattr(getattr(backend, "module", None), "__file__", None)
    return file_digest(path) if path else None


@functools.lru_cache(maxsize=16)
def file_digest(path: str) -> str:
    """sha256 of a file's bytes (a loaded module's file does not change while the process runs)."""
    with open(path, "rb") as source:
        return hashlib.sha256(source.read()).hexdigest()


def flashinfer_in_use() -> str:
    """The FlashInfer MLA wrapper the process runs: ``flashinfer X.Y.Z``, or the stand-in class
    (``module:Class``) a CPU run installed as ``flashinfer.mla``; "none" where there is neither."""
    mla = sys.modules.get("flashinfer.mla")
    wrapper = getattr(mla, "BatchMLAPagedAttentionWrapper", None)
    if wrapper is None:
        return "none"
    module = getattr(wrapper, "__module__", "")
    if not module.startswith("flashinfer"):
        return f"{module}:{wrapper.__qualname__}"
    return f"flashinfer {getattr(sys.modules.get('flashinfer'), '__version__', '?')}"


def port_layer(backend) -> dict:
    """What reopens a port's layer as it ran (``backends.port.PortBackend``): its kv_indices layout
    and whether it keeps its plans where rows and lengths repeat; nothing for any other backend."""
    if family_and_release(backend.name)[0] not in PORT_KERNELS:
        return {}
    return {"layout": backend.layout, "reuse_plan": bool(backend.reuse_plan)}


def backend_identity(backend) -> dict:
    """What a written case records of the backend it failed on (for a port, its layer too:
    :func:`port_layer`)."""
    return {"name": backend.name, "kernel": getattr(backend, "kernel", None),
            "release": getattr(backend, "version", None), "module_digest": module_digest(backend),
            **port_layer(backend)}


def in_one_cache(inputs: AttentionInputs, cache: torch.Tensor) -> AttentionInputs:
    """The step's inputs with its KV cache written into the front of ``cache``, the one cache
    every step of a sequence shares (as the engine's does; the rest stays NaN)."""
    flat = cache.view(-1, cache.shape[-1])
    own = inputs.kv_cache.view(-1, cache.shape[-1])
    flat[: own.shape[0]] = own
    return AttentionInputs(inputs.q_nope, inputs.q_pe, cache)


def scenario_of_step(spec, seed: int, holes: TopkHoles | None = None, host_q_lens: list[int] | None = None, *,
                     rejected_drafts: int = 0, mtp_draft_step: int = 0) -> Scenario:
    """The scenario of one step: ``spec`` built with ``seed``, its single-token decodes' host
    bounds counting ``rejected_drafts`` rejected drafts (``harness.builder.with_rejected_drafts``),
    their top-k rows those MTP's draft step 0 kept for draft step ``mtp_draft_step`` where it is
    not 0 (``harness.builder.with_shared_mtp_indices``),
    the host holding the query split ``host_q_lens`` where given, the spec's own split the device's
    (``harness.builder.with_host_query_split``), its top-k rows written from the scores of
    ``holes`` where given (``harness.topk_holes``)."""
    scenario = build_scenario(spec, seed)
    if rejected_drafts:
        scenario = with_rejected_drafts(scenario, rejected_drafts)
    if mtp_draft_step:
        scenario = with_shared_mtp_indices(scenario, mtp_draft_step)
    if host_q_lens is not None:
        scenario = with_host_query_split(scenario, host_q_lens)
    return scenario if holes is None else with_topk_holes(scenario, holes)


def run_case(judge, backend, spec, device, *, seed: int = 0, twin: Twin | None = None, compare: bool = True,
             adaptive_verification: bool = False, holes: TopkHoles | None = None,
             host_q_lens: list[int] | None = None, rejected_drafts: int = 0, kv_block_stride: int | None = None,
             mtp_draft_step: int = 0, scenario: Scenario | None = None, label: str = "",
             what: str = "") -> StepOutcome:
    """One step of ``spec`` (built with ``seed``, its top-k written with ``holes`` where given, the
    host holding the query split ``host_q_lens`` where given; or ``scenario`` as given, built from
    them and changed by the test) through a fresh layer of ``backend``, judged
    (``rejected_drafts``, ``kv_block_stride`` and ``mtp_draft_step``: as :func:`run_sequence` takes them; ``label``:
    what the step's reports are named with; ``what``: leads its failure message)."""
    step = (spec, seed, holes, host_q_lens) if scenario is None else scenario
    return run_sequence(judge, backend, [step], device, twin=twin, compare=compare, kind="step",
                        adaptive_verification=adaptive_verification, rejected_drafts=rejected_drafts,
                        kv_block_stride=kv_block_stride, mtp_draft_step=mtp_draft_step, label=label,
                        what=what)[1][0]


def case_rebuilds(steps, after_step: Callable | None) -> bool:
    """Whether a written case rebuilds what its test ran: every step built from its spec and seed
    (none a scenario the test changed by hand) and no check of the test's own after a step
    (``after_step``), which a case does not record. Where it does not, no backend case is noted: a
    failure before launch is written as the laid-out step the checks before launch noted
    (:func:`before_launch`), a sequence as the one its test noted (``harness.case_log.note_sequence``)."""
    return after_step is None and not any(isinstance(step, Scenario) for step in steps)


def scenario_of(step, rejected_drafts: int, mtp_draft_step: int = 0) -> Scenario:
    """A step of :func:`run_sequence`: ``(spec, seed[, holes[, host_q_lens]])`` built, or a
    scenario as given."""
    if isinstance(step, Scenario):
        return step
    return scenario_of_step(*(tuple(step) + (None,) * (4 - len(step))), rejected_drafts=rejected_drafts,
                            mtp_draft_step=mtp_draft_step)


def run_sequence(judge, backend, steps, device, *, with_inputs: bool = True, twin: Twin | None = None,
                 compare: bool = True, kind: str = "sequence", adaptive_verification: bool = False,
                 rejected_drafts: int = 0, kv_block_stride: int | None = None, mtp_draft_step: int = 0,
                 label: str = "", after_step: Callable | None = None, what: str = ""):
    """``steps`` (``(spec, seed)``, ``(spec, seed, holes)`` or ``(spec, seed, holes, host_q_lens)``:
    :func:`scenario_of_step`'s arguments, in order; or a scenario a test changed, which a written
    case cannot rebuild) through one layer and, with ``with_inputs``, one KV cache they share; each
    step judged. A step with holes in its top-k, or a draft step of MTP's shared rows, runs its plan
    only on a backend whose kernel would read a hole (:func:`kernel_reads_a_hole`).
    ``rejected_drafts``: every step's single-token decodes had that many drafts rejected, which
    the host bound still counts (``harness.builder.with_rejected_drafts``); ``kv_block_stride``:
    the layer's cache has its blocks that many rows apart, NaN between them
    (``harness.device_inputs.with_blocks_apart``); ``mtp_draft_step``: every step is that draft step
    of MTP with shared top-k indices (``harness.builder.with_shared_mtp_indices``). A step whose
    plan the release refused as it is expected to (``StepOutcome.refusal``) ends the sequence.
    ``after_step(index, layer, scenario, inputs, outcome)``: called after each judged step that ran;
    ``what``: leads every failure message (the test's family). Returns ``(layer, outcomes)``."""
    scenarios = [scenario_of(step, rejected_drafts, mtp_draft_step) for step in steps]
    rebuilds = case_rebuilds(steps, after_step)
    specs = [s.spec for s in scenarios]
    max_tokens = max(max(s.topk_indices.shape[0] for s in scenarios), 1)
    config = dataclasses.replace(layer_config(specs[0], max_tokens, adaptive_verification=adaptive_verification),
                                 kv_block_stride=kv_block_stride)
    judge.admit(backend, config)
    layer = backend.open_layer(config, device)
    cache = None
    if with_inputs and kind == "sequence":
        blocks = max(s.num_blocks for s in scenarios)
        cache = nan_kv_buffer((blocks, specs[0].block_size, specs[0].head_dim), specs[0].kv_dtype, device)
    case = {"kind": kind, "backend": backend_identity(backend), "max_tokens": max_tokens, "twin": twin is not None,
            "compare": compare, "with_inputs": with_inputs, "adaptive_verification": adaptive_verification,
            "rejected_drafts": rejected_drafts, "kv_block_stride": kv_block_stride, "mtp_draft_step": mtp_draft_step,
            "steps": [],
            "flashinfer": flashinfer_in_use(), "layer_mode": layer_mode_of(backend)}
    outcomes, found = [], None
    if not rebuilds:
        note_backend_case(None)  # an earlier case of the same test is not this one
    for i, scenario in enumerate(scenarios):
        holes = scenario.extra.get("topk_holes")
        case["steps"].append({"spec": scenario.spec, "seed": scenario.seed, "holes": holes,
                              "host_q_lens": host_split_of(scenario)})
        if rebuilds:
            note_backend_case(case)
        inputs = None
        past_selection = holes is not None or scenario.extra.get("mtp_draft_step") is not None
        if with_inputs and not (past_selection and kernel_reads_a_hole(backend)):
            inputs = build_attention_inputs(scenario, device)
            inputs = in_one_cache(inputs, cache) if cache is not None else inputs
            inputs = with_blocks_apart(inputs, kv_block_stride) if kv_block_stride is not None else inputs
        named, of = (f"_step{i}", f"step {i} of the sequence's {len(scenarios)}") if kind == "sequence" else ("", "")
        of = ", ".join(part for part in (what, of) if part)
        verdict = judge.verdict(backend, layer, scenario, inputs, twin=twin, compare=compare, label=label + named,
                                context_of_step=of)
        outcome = verdict.outcome
        if verdict.failure is not None:
            if not (i + 1 < len(scenarios) and launched_finding(verdict)):
                raise verdict.failure
            found = found or verdict.failure
        outcomes.append(outcome)
        if outcome is not None and outcome.refusal is not None:
            break
        if after_step is not None and verdict.failure is None:
            after_step(i, layer, scenario, inputs, outcome)
    if found is not None:
        raise found
    return layer, outcomes


def launched_finding(verdict: Verdict) -> bool:
    """A step that ran its kernel and failed as one of the findings expected of it: the sequence
    goes on, so that a later step's failure of another kind is not hidden behind it (the finding
    is raised at the end, where nothing else failed)."""
    expected = tuple(f.exception for f in verdict.expected)
    return bool(expected) and isinstance(verdict.failure, expected) and verdict.outcome is not None \
        and verdict.outcome.out is not None
