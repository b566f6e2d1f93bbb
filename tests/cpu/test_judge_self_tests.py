"""Each check of the one judge (``harness.judge``, ``harness.backend_step``, ``harness.layer_modes``,
``harness.findings``) shown red on a backend stand-in with the fault it exists for planted, and
green on the same step without it where that is cheap. docs/judge-checks.md lists every check with
the self-tests that plant its fault.

The stand-in (:class:`StandInBackend`, :class:`RightLayer`) computes each step from what the seam
hands it, as a backend does: it serves the rows the routing rule gives the sparse kernel, converts
the indexer rows with the convert rule, executes each row's valid entries and returns the
working-precision oracle's output and LSE over them. Each fault is a subclass that changes one
thing of that (a row cut short, a slot from another row, a stale workspace read, ...); the verdicts
asserted are the judge's. Every draw is seeded (the scenarios' seeds); nothing here skips.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from backends.flashinfer.port import REFUSAL_EXPECTED, lay_out
from backends.seam import StepOutcome, planned_then_run, poison, query_rows
from fast.impl import FastImpl
from harness import layer_modes
from harness.backend_step import layer_config
from harness.builder import build_scenario, with_shared_mtp_indices
from harness.case_runner import Reporter, run_sequence
from harness.device_inputs import AttentionInputs, build_attention_inputs
from harness.findings import (
    SHARED_MTP,
    TOPK_HOLES,
    RegimeCPlannedAsPrefix,
    SharedMtpRowsByContext,
    TopkHolesAttended,
    valid_and_rule_counts,
)
from harness.findings.vllm import (
    FP8_AS_UINT8,
    KPE_SCALE,
    PADDED_GRAPH_ROWS,
    QUERY_SHAPE_REFUSAL,
    SLOT_ZERO,
    UINT8_REFUSAL,
    Fp8PlannedAsUint8,
    KpeScaleIgnored,
    PaddedGraphRowsUnplanned,
    SlotZeroLoaded,
)
from harness.judge import judge_step
from harness.layer_modes import PLAN_HISTORY_ULPS, in_layer_mode
from harness.spec import batch, device_query_start_loc, graph_padded, with_empty_rows
from harness.topk_holes import TopkHoles, with_topk_holes
from mla_constants import FIRST_SLOT, INVALID, KV_LORA_RANK
from mla_constants import SLOT_ZERO as SLOT_ZERO_FILLER
from reference import sparse_mla_reference
from reference.budget import FLOAT32_EPS
from reference.rules import convert_rule, request_ids_per_row, valid_counts, valid_first
from tests.bugs import CompactionPlansPrefix, KpoolFromWrongSpec

DEVICE = "cpu"
SEED = 3
TOPK = 128
#: Decodes in regimes B, F, G (kpool 4): rows 0..3, request 2 two rows.
DECODES = batch((40, 1), (300, 1), (1000, 2), topk=TOPK, kpool=4)
#: The row a fault of one row is planted in (regime F, ctx 300).
ROW = 1


# --- the stand-in --------------------------------------------------------------------------------


class StandInBackend:
    """A backend as the judge sees one: its layers are ``layer_class``'s; ``facts`` what a
    release declares of itself (a vLLM stand-in is named ``vllm-...`` and declares its facts)."""

    kernel = None
    returns_lse = True

    def __init__(self, layer_class, name: str = "stand-in", **facts):
        self.layer_class, self.name = layer_class, name
        self.__dict__.update(facts)

    def describe(self) -> str:
        return f"{self.name} ({self.layer_class.__name__})"

    def unsupported(self, config) -> None:
        return None

    def open_layer(self, config, device):
        return self.layer_class(self, config, device)


def converted_rows(step, block_size: int) -> torch.Tensor:
    """The step's indexer rows through the convert rule (every row, padding included)."""
    req = request_ids_per_row(device_query_start_loc(step.meta), step.topk_indices.shape[0])
    return convert_rule(step.topk_indices, step.block_table, req, block_size)


def executed_selection(slots: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slots, mask)`` a kernel reads that runs each row's first ``lengths`` entries of its
    compacted row (valid entries first), a -1 read as slot 0 (as a pack that clamps it)."""
    front = valid_first(slots).to(torch.int64)
    width = int(lengths.max()) if lengths.numel() else 0
    if width > front.shape[1]:
        front = torch.cat([front, torch.full((front.shape[0], width - front.shape[1]), INVALID)], dim=1)
    mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    read = front[:, :width]
    return torch.where(read == INVALID, torch.zeros_like(read), read), mask


class RightLayer:
    """A layer that does every step right, in the seam's three parts (``plan_step``, ``launch``,
    ``finish``): the rows of the routing rule (every query row where it has no dense-MHA path),
    each row's valid count over its converted row, the working-precision oracle's output and LSE
    written into the layer's own buffers at launch. Its float workspace is zero and never read."""

    dense_prefill = True

    def __init__(self, backend, config, device):
        self.backend, self.config, self.device = backend, config, device
        self.workspace = torch.zeros(8, dtype=torch.float32)
        self.steps = 0  # steps finished

    def float_workspaces(self) -> list[torch.Tensor]:
        return [self.workspace]

    def step(self, step):
        return planned_then_run(self, step)

    # what a fault changes
    def rows(self, step) -> int:
        return step.planned_rows if self.dense_prefill else query_rows(step.meta)

    def lengths(self, step, slots: torch.Tensor) -> torch.Tensor:
        return valid_counts(slots).to(torch.int64)

    def host_lengths(self, step, valid: torch.Tensor) -> tuple[torch.Tensor, bool]:
        return valid.clone(), True

    def read(self, slots: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return executed_selection(slots, lengths)

    def attend(self, step, rows: int, read: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv = AttentionInputs(step.q_nope, step.q_pe, step.kv_cache)
        return sparse_mla_reference(step.q_nope[:rows], step.q_pe[:rows], kv.ckv, kv.kpe, read, mask=mask,
                                    sm_scale=self.config.sm_scale, k_scale=self.config.k_scale, mode="lowp")

    # the three parts
    def plan_step(self, step) -> StepOutcome:
        n = self.rows(step)
        slots = converted_rows(step, self.config.block_size)[:n]
        lengths = self.lengths(step, slots)
        read, mask = self.read(slots, lengths)
        host, exact = self.host_lengths(step, valid_counts(slots).to(torch.int64))
        self.staged = (n, read, mask)
        if step.runs_kernel:
            heads = self.config.num_heads
            self.out = torch.full((n, heads, KV_LORA_RANK), float("nan"), dtype=torch.bfloat16)
            self.lse = torch.full((n, heads), float("nan"), dtype=torch.float32)
        return StepOutcome(self.backend.name, n, executed_lengths=lengths,
                           executed_slots=(torch.where(mask, read, torch.full_like(read, INVALID)), mask),
                           host_lengths=host, host_exact=exact, planned_lengths=lengths.clone(),
                           dense_prefill=self.dense_prefill, plans=self.steps + 1)

    def launch(self, step, outcome) -> None:
        capture = StandInGraph.capturing
        if capture is not None:
            capture.launches.append(lambda: self.launched(step, capture=True))
        else:
            self.launched(step)

    def launched(self, step, capture: bool = False) -> None:
        """The device part: the kernel's output and LSE written into the layer's buffers (``capture``:
        replayed from a captured graph)."""
        out, lse = self.attend(step, *self.staged)
        self.out.copy_(out)
        self.lse.copy_(lse)
        self.read_workspace(self.workspace[0])

    def read_workspace(self, partial: torch.Tensor) -> None:
        """What a kernel that merges a split's partial from the float workspace does with it (nothing here)."""

    def finish(self, step, outcome) -> StepOutcome:
        outcome.out, outcome.lse = self.out, self.lse
        self.steps += 1
        return outcome


def scenario_and_inputs(spec=DECODES, seed: int = SEED, holes: TopkHoles | None = None):
    scenario = build_scenario(spec, seed)
    if holes is not None:
        scenario = with_topk_holes(scenario, holes)
    return scenario, build_attention_inputs(scenario, DEVICE)


def open_layer(backend, scenario):
    return backend.open_layer(layer_config(scenario.spec, max(scenario.topk_indices.shape[0], 1)), DEVICE)


def verdict_of(layer_class, spec=DECODES, *, seed: int = SEED, holes=None, scenario=None, **facts):
    """The judge's verdict of one step of ``spec`` through a fresh layer of ``layer_class``."""
    backend = StandInBackend(layer_class, **facts)
    if scenario is None:
        scenario, inputs = scenario_and_inputs(spec, seed, holes)
    else:
        inputs = build_attention_inputs(scenario, DEVICE)
    return judge_step(backend, open_layer(backend, scenario), scenario, inputs)


def failure_text(verdict) -> str:
    """The failure's message, which names the step it failed: the verdict's place (the step's
    rows and regimes, the backend as it describes itself, led by a sequence's step) is in it."""
    assert verdict.failure is not None, "the judge passed the step"
    text = str(verdict.failure)
    assert verdict.backend and f"; {verdict.backend} (" in verdict.where, (verdict.backend, verdict.where)
    assert verdict.where in text, f"the failure does not name its step ({verdict.where}):\n{text}"
    return text


def test_the_right_stand_in_passes_every_step_the_faults_are_planted_in():
    for spec in (DECODES, PREFILLS_TO_MHA, OFFSETS, KPE_SCALED, PADDED_GRAPH):
        verdict = verdict_of(RightLayer, spec)
        assert verdict.failure is None and verdict.comparisons, (spec, verdict.failure)
        assert not verdict.problems


# --- routing: the rows the sparse kernel serves ----------------------------------------------------

#: Two decodes and one prefill at or below topk: the prefill goes to dense MHA.
PREFILLS_TO_MHA = batch((60, 1), (90, 1), (100, 4), topk=TOPK, kpool=4)


class PrefillsStillServed(RightLayer):
    """Serves every query row though the step routes its prefills to dense MHA."""

    def rows(self, step):
        return query_rows(step.meta)


class NoDensePath(RightLayer):
    dense_prefill = False


class NoDensePathServesDecodesOnly(NoDensePath):
    """Has no dense-MHA path, yet serves the decode prefix alone: the prefill rows are served by no one."""

    def rows(self, step):
        return step.planned_rows


def test_routing_catches_prefills_served_by_the_sparse_kernel():
    assert "the backend serves 6 rows with the sparse kernel, the routing rule 2" in failure_text(
        verdict_of(PrefillsStillServed, PREFILLS_TO_MHA))


def test_routing_catches_a_layer_without_a_dense_path_that_leaves_the_prefills_out():
    assert verdict_of(NoDensePath, PREFILLS_TO_MHA).failure is None
    assert ("the backend serves 2 rows with the sparse kernel, the routing rule 6 (the layer has no dense-MHA "
            "path: every query row)") in failure_text(verdict_of(NoDensePathServesDecodesOnly, PREFILLS_TO_MHA))


# --- executed lengths, host bounds, the read-back ----------------------------------------------------


def one_row_changed(lengths: torch.Tensor, by: int) -> torch.Tensor:
    lengths = lengths.clone()
    lengths[ROW] += by
    return lengths


class RowCutShort(RightLayer):
    """Executes row ROW one entry short of its valid count."""

    def lengths(self, step, slots):
        return one_row_changed(super().lengths(step, slots), -1)


class RowReadsPastItsValidPrefix(RightLayer):
    """Executes row ROW one entry past its valid count (the -1 after it read as slot 0)."""

    def lengths(self, step, slots):
        return one_row_changed(super().lengths(step, slots), 1)


class HostBound(RightLayer):
    """Host lengths that are bounds, ``slack`` past each row's valid count (row ROW's)."""

    slack = 3

    def host_lengths(self, step, valid):
        return one_row_changed(valid, self.slack), False


class HostBoundBelowValid(HostBound):
    slack = -1


class WorkItemPastARow(RightLayer):
    """Its read-back of the kernel's schedule finds a work item that reads past row ROW's end."""

    def finish(self, step, outcome):
        outcome.schedule_problems.append(f"row {ROW} : a work item reads past the row's end")
        return super().finish(step, outcome)


def test_executed_length_catches_a_row_cut_short():
    text = failure_text(verdict_of(RowCutShort))
    assert f"row {ROW} (regime F, ctx 300)" in text and "executed length is cut short" in text, text


def test_executed_length_catches_a_row_read_past_its_valid_prefix():
    text = failure_text(verdict_of(RowReadsPastItsValidPrefix))
    assert f"row {ROW} (regime F, ctx 300)" in text and "executed length reads past its valid prefix" in text, text


def test_host_bound_catches_a_bound_below_the_valid_count():
    assert verdict_of(HostBound).failure is None
    text = failure_text(verdict_of(HostBoundBelowValid))
    assert f"row {ROW} (regime F, ctx 300), host bound 127" in text, text
    assert "the host bound is below the valid count" in text


def test_read_back_problems_fail_the_step_with_the_rows_context():
    text = failure_text(verdict_of(WorkItemPastARow))
    assert f"row {ROW} (regime F, ctx 300), host exact 128, planned 128, executed 128, valid 128: a work " \
           "item reads past the row's end" in text, text


# --- the executed selection ------------------------------------------------------------------------


def foreign_slot(read: torch.Tensor, mask: torch.Tensor, row: int = ROW) -> torch.Tensor:
    """``read`` with row ``row``'s first executed slot replaced by one of another row's that it does not select."""
    read = read.clone()
    mine = set(read[row][mask[row]].tolist())
    read[row, 0] = next(int(s) for r in range(read.shape[0]) for s in read[r][mask[r]].tolist() if int(s) not in mine)
    return read


class ReadsAnotherRowsSlot(RightLayer):
    """Row ROW's executed span holds a slot of another row in place of one of its own (its length right)."""

    def read(self, slots, lengths):
        read, mask = super().read(slots, lengths)
        return foreign_slot(read, mask), mask


def test_selection_catches_a_slot_of_another_row():
    text = failure_text(verdict_of(ReadsAnotherRowsSlot))
    assert f"row {ROW} (regime F, ctx 300)" in text and "executes slots other than its selection (a)" in text, text


# --- the output and LSE against the oracle -------------------------------------------------------------


class OneRowOff:
    """Mixed in before a layer class: row ``off_row``'s output 1.5 times what the layer gives."""

    off_row = ROW

    def attend(self, step, rows, read, mask):
        out, lse = super().attend(step, rows, read, mask)
        out[self.off_row] *= 1.5
        return out, lse


class OutputOff(OneRowOff, RightLayer):
    """Row ROW's output 1.5 times what it should be."""


class LseOff(RightLayer):
    """Row ROW's LSE 0.5 above what it should be."""

    def attend(self, step, rows, read, mask):
        out, lse = super().attend(step, rows, read, mask)
        lse[ROW] += 0.5
        return out, lse


def test_output_comparison_catches_an_output_off():
    verdict = verdict_of(OutputOff)
    text = failure_text(verdict)
    assert "stand-in's output vs (a) beyond the error budget" in text and "\nout: max err" in text, text
    assert [c.name for c in verdict.comparisons if not c.ok] == ["out"] and verdict.rows_at_fault == [ROW]


def test_output_comparison_catches_an_lse_off():
    verdict = verdict_of(LseOff)
    text = failure_text(verdict)
    assert "stand-in's output vs (a) beyond the error budget" in text and "\nlse: max err" in text, text
    assert [c.name for c in verdict.comparisons if not c.ok] == ["lse"]


class LseInsideFa2sFloor(RightLayer):
    """Row ROW's LSE 300 float32 ulps of the largest |LSE| above what it should be: beyond the LSE
    floor of an attention kernel without its own (32 ulps), inside fa2's (2048)."""

    def attend(self, step, rows, read, mask):
        out, lse = super().attend(step, rows, read, mask)
        lse[ROW] += 300 * FLOAT32_EPS * float(lse[:rows].abs().max())
        return out, lse


def test_the_lse_is_judged_by_the_floor_of_the_kernel_the_backend_declares():
    assert verdict_of(LseInsideFa2sFloor, kernel="fa2").passed
    verdict = verdict_of(LseInsideFa2sFloor)
    assert "\nlse: max err" in failure_text(verdict) and verdict.rows_at_fault == [ROW]


#: Decodes whose raw scores sit 0 and 4096 from zero, row by row.
OFFSETS = batch((40, 1), (300, 1), (700, 1), (1000, 1), topk=TOPK, kpool=4, score_offsets=(0.0, 4096.0))


class LseThroughExp(RightLayer):
    """The LSE turned from base 2 to natural through the sum it stands for, ``log(exp2(lse2))``: right
    while the sum fits float32, infinite once |lse| passes about 88."""

    def attend(self, step, rows, read, mask):
        out, lse = super().attend(step, rows, read, mask)
        return out, torch.log(torch.exp2(lse / torch.log(torch.tensor(2.0))))


def test_offset_comparison_names_the_offset_whose_rows_are_off():
    verdict = verdict_of(LseThroughExp, OFFSETS)
    assert "\nlse[offset 4096]: " in failure_text(verdict) and "inf mismatches" in failure_text(verdict)
    assert [c.name for c in verdict.comparisons if not c.ok] == ["lse[offset 4096]"]


# --- a rerun on the same plan ------------------------------------------------------------------------


class Reruns(RightLayer):
    """Promises bitwise repeatability within one plan (``rerun``) and keeps it."""

    def rerun(self, step, outcome):
        return self.attend(step, *self.staged)


class RerunsOtherwise(Reruns):
    """Its second run on the same plan gives row ROW other bits (a split that depends on timing)."""

    def rerun(self, step, outcome):
        out, lse = super().rerun(step, outcome)
        out = out.clone()
        out.view(torch.int16)[ROW, 0, 0] += 1
        return out, lse


def test_rerun_catches_other_bits_on_the_same_plan():
    assert verdict_of(Reruns).failure is None
    assert f"rerun not bitwise equal on the same plan: rows [{ROW}]" in failure_text(verdict_of(RerunsOtherwise))


# --- the twin: the kernel's own rounding ---------------------------------------------------------------


def test_an_output_off_passes_only_where_it_is_the_twins_bit_for_bit():
    """An output beyond the budget that the twin gives too is the kernel's rounding; one the twin
    does not give is the backend's."""
    backend = StandInBackend(OutputOff)
    scenario, inputs = scenario_and_inputs()
    twin_of_same = judge_step(backend, open_layer(backend, scenario), scenario, inputs).outcome.out.clone()
    rounding = judge_step(backend, open_layer(backend, scenario), scenario, inputs, twin=lambda s, i: twin_of_same)
    assert rounding.failure is None and rounding.kernel_rounding
    right = StandInBackend(RightLayer)
    right_out = judge_step(right, open_layer(right, scenario), scenario, inputs).outcome.out.clone()
    verdict = judge_step(backend, open_layer(backend, scenario), scenario, inputs, twin=lambda s, i: right_out)
    assert not verdict.kernel_rounding and "beyond the error budget" in failure_text(verdict)


# --- before launch: invariants, the planned selection, the plan -------------------------------------------


class LaysOut(RightLayer):
    """Its plan-only outcome shows what its host stages (``impl``) lay out before launch: their
    host and planned lengths and the compacted layout of their convert (``laid_out``)."""

    impl = FastImpl()

    def plan_step(self, step):
        outcome = super().plan_step(step)
        cfg, meta = self.config, step.meta
        host = self.impl.kv_lens(meta, topk=cfg.topk, kpool=cfg.kpool, async_scheduling=cfg.async_scheduling)
        planned = self.impl.planned_lens(meta, host, topk=cfg.topk).to(torch.int32)
        outcome.host_lengths, outcome.planned_lengths = host.to(torch.int64), planned.to(torch.int64)
        outcome.laid_out = lay_out(self.impl, "compacted", step, planned, block_size=cfg.block_size,
                                   max_rows=max(cfg.max_tokens, 1), width=cfg.width, device=self.device)
        return outcome


class LayoutSwapsTwoRowsFirstSlots(FastImpl):
    """A layout that writes the first slot of row 0's span into row 1's and the other way round:
    every length and every converted row right, the spans the kernel reads wrong."""

    def write_kv_indices(self, layout, slots, lens, indptr, out):
        super().write_kv_indices(layout, slots, lens, indptr, out)
        first, second = int(indptr[0]), int(indptr[1])
        out[first], out[second] = out[second].clone(), out[first].clone()


def laying_out(impl):
    return type(f"LaysOut{type(impl).__name__}", (LaysOut,), {"impl": impl})


class AcceptsAPlanItsReleaseRefuses(LaysOut):
    """Its plan is accepted where the release is known to refuse it (a probe that found the refusal)."""

    def plan_step(self, step):
        outcome = super().plan_step(step)
        outcome.schedule_problems.append(REFUSAL_EXPECTED)
        return outcome


#: Decodes of regimes B, F and G (kpool 4): row 2 (ctx 1001) is planned topk + 1.
PAST_TOPK = batch((40, 1), (300, 1), (1001, 1), topk=TOPK, kpool=4)
#: A regime C row (ctx 41, kpool 4: its valid entries are not a prefix) beside a regime F row.
REGIME_C = batch((41, 1), (300, 1), topk=TOPK, kpool=4)


@pytest.mark.interpreter  # the port's convert takes CPU tensors
def test_before_launch_catches_an_invariant_violation_and_launches_nothing():
    assert verdict_of(LaysOut, PAST_TOPK).failure is None
    verdict = verdict_of(laying_out(KpoolFromWrongSpec()), PAST_TOPK)
    text = failure_text(verdict)
    assert "invariant violations (kernel not launched)" in text and "[len==valid] row 2: planned len 128 != 129 " \
           "valid entries (regime G)" in text, text
    assert verdict.outcome.out is None and verdict.before_launch_rows == [2]


@pytest.mark.interpreter  # the port's convert takes CPU tensors
def test_before_launch_catches_a_planned_selection_other_than_the_intended_one():
    verdict = verdict_of(laying_out(LayoutSwapsTwoRowsFirstSlots()), PAST_TOPK)
    text = failure_text(verdict)
    assert "plan/layout bug: planned slots (b) != intended slots (a) on 2 rows (kernel not launched)" in text, text
    assert verdict.outcome.out is None and verdict.before_launch_rows == [0, 1]


@pytest.mark.interpreter  # the port's convert takes CPU tensors
def test_before_launch_names_regime_c_rows_planned_as_a_prefix_as_the_finding():
    assert verdict_of(LaysOut, REGIME_C).failure is None
    verdict = verdict_of(laying_out(CompactionPlansPrefix()), REGIME_C)
    assert isinstance(verdict.failure, RegimeCPlannedAsPrefix), verdict.failure
    assert "regime C rows planned as a prefix" in str(verdict.failure) and "(kernel not launched)" in str(
        verdict.failure)


@pytest.mark.interpreter  # the port's convert takes CPU tensors
def test_before_launch_catches_a_plan_accepted_where_a_refusal_was_expected():
    verdict = verdict_of(AcceptsAPlanItsReleaseRefuses)
    assert f"{REFUSAL_EXPECTED} (kernel not launched)" in failure_text(verdict)
    assert verdict.outcome.out is None


# --- top-k holes ---------------------------------------------------------------------------------------

#: Ties in the indexer's scores: rows 1..3 (ctx past topk) have holes in their top-k, row 0 (ctx 40) none.
TIES = TopkHoles("ties")
NO_HOLE_ROW = 0


class AttendsHoles(RightLayer):
    """Executes each row with the length rule's count (the host rule of the project's own stages):
    a row with holes past its valid count, its -1 entries read as slot 0."""

    def lengths(self, step, slots):
        cfg = self.config
        rule = FastImpl().kv_lens(step.meta, topk=cfg.topk, kpool=cfg.kpool, async_scheduling=cfg.async_scheduling)
        return rule.to(torch.int64)[: slots.shape[0]]


class ShowsItsPlanOnly(AttendsHoles):
    """:class:`AttendsHoles` without a read-back: the outcome shows the planned lengths alone."""

    def finish(self, step, outcome):
        outcome.executed_lengths = outcome.executed_slots = None
        return super().finish(step, outcome)


class HoleRowCutShort(RightLayer):
    """Executes row ROW (it has holes) one entry short of its valid count: neither count the finding explains."""

    def lengths(self, step, slots):
        return one_row_changed(super().lengths(step, slots), -1)


class NoHoleRowOff(OneRowOff, AttendsHoles):
    """:class:`AttendsHoles`, its row without holes 1.5 times what it should be."""

    off_row = NO_HOLE_ROW


class ShowsItsPlanOnlyWithABoundBelowValid(ShowsItsPlanOnly):
    """:class:`ShowsItsPlanOnly`, its host bound of the row without holes one below its valid count."""

    def host_lengths(self, step, valid):
        valid = valid.clone()
        valid[NO_HOLE_ROW] -= 1
        return valid, False


class ValidCounts(RightLayer):
    """A kernel handed each row's valid count (FlashMLA's): a row with no valid entry gives out 0
    and LSE +inf (its convention for an empty row)."""

    def attend(self, step, rows, read, mask):
        out, lse = super().attend(step, rows, read, mask)
        empty = ~mask.any(dim=1) if mask.shape[1] else torch.ones(rows, dtype=torch.bool)
        out[empty], lse[empty] = 0, float("inf")
        return out, lse


class EmptyRowNaN(ValidCounts):
    """Divides a row with no valid entry by its zero sum: NaN."""

    def attend(self, step, rows, read, mask):
        out, lse = super().attend(step, rows, read, mask)
        out[~mask.any(dim=1)] = float("nan")
        return out, lse


def test_holes_executed_with_the_length_rule_are_the_finding_and_only_they():
    scenario, _ = scenario_and_inputs(holes=TIES)
    verdict = verdict_of(AttendsHoles, scenario=scenario)
    assert isinstance(verdict.failure, TopkHolesAttended) and TOPK_HOLES in verdict.expected, verdict.failure
    assert "3 rows with top-k holes execute past their valid count" in str(verdict.failure)
    off = verdict_of(NoHoleRowOff, scenario=scenario)
    assert type(off.failure) is AssertionError and "rows that attend no hole are off" in failure_text(off)
    assert f"worst: row {NO_HOLE_ROW} " in failure_text(off)


def test_the_holes_finding_measures_its_rows_against_the_contract_and_a_declared_filler():
    """Each row of the finding is measured against the contract oracle; where the backend's family
    declares how it packs a -1 inside a row's length (vLLM's filler), against the implementation
    oracle too."""
    scenario, _ = scenario_and_inputs(holes=TIES)
    plain = failure_text(verdict_of(AttendsHoles, scenario=scenario))
    declared = failure_text(verdict_of(AttendsHoles, scenario=scenario, name="vllm-0.33.0",
                                       minus_one_filler=SLOT_ZERO_FILLER))
    line = "row 1 (regime F, ctx 300): executed 128, length rule 128, valid 84 (44 holes); out max |err| vs contract "
    assert line in plain and ", vs implementation" not in plain, plain
    assert line in declared and "the budget), vs implementation " in declared, declared


def test_holes_planned_past_the_valid_count_without_a_read_back_are_named_as_planned():
    scenario, _ = scenario_and_inputs(holes=TIES)
    verdict = verdict_of(ShowsItsPlanOnly, scenario=scenario)
    assert isinstance(verdict.failure, TopkHolesAttended), verdict.failure
    assert f"row {ROW} (regime F, ctx 300), host exact 84, planned 128, valid 84: planned past its valid count" in \
        str(verdict.failure)
    other = verdict_of(ShowsItsPlanOnlyWithABoundBelowValid, scenario=scenario)
    text = failure_text(other)
    assert type(other.failure) is AssertionError and "planned past its valid count" in text, text
    assert f"row {NO_HOLE_ROW} (regime B, ctx 40), host bound 39" in text and "the host bound is below the valid " \
        "count" in text, text


def test_holes_catch_a_row_run_with_neither_its_valid_count_nor_the_rules():
    scenario, _ = scenario_and_inputs(holes=TIES)
    assert verdict_of(ValidCounts, scenario=scenario, executes_valid_counts=True).failure is None
    verdict = verdict_of(HoleRowCutShort, scenario=scenario)
    text = failure_text(verdict)
    assert type(verdict.failure) is AssertionError and f"row {ROW} (regime F, ctx 300)" in text, text
    assert "the length it runs is neither its valid count nor the length rule's count" in text


def test_holes_catch_an_empty_row_that_is_not_out_0_and_lse_inf():
    scenario = with_empty_rows(with_topk_holes(build_scenario(DECODES, SEED), TIES), [3])
    assert verdict_of(ValidCounts, scenario=scenario, executes_valid_counts=True).failure is None
    text = failure_text(verdict_of(EmptyRowNaN, scenario=scenario, executes_valid_counts=True))
    assert "rows that attend no hole are off" in text and "rows [3] have no valid entry and are not out 0 / LSE " \
           "+inf: out max |nan|" in text, text


class EmptyRowLseNotInf(ValidCounts):
    """Writes out 0 for a row with no valid entry but leaves its LSE at -inf (the oracle's value, not
    the convention of a kernel handed valid counts)."""

    def attend(self, step, rows, read, mask):
        out, lse = super().attend(step, rows, read, mask)
        lse[~mask.any(dim=1)] = float("-inf")
        return out, lse


def test_holes_catch_an_empty_row_whose_lse_is_not_inf():
    scenario = with_empty_rows(with_topk_holes(build_scenario(DECODES, SEED), TIES), [3])
    text = failure_text(verdict_of(EmptyRowLseNotInf, scenario=scenario, executes_valid_counts=True))
    assert "rows [3] have no valid entry and are not out 0 / LSE +inf: out max |0|, lse from -inf to -inf" in text, \
        text


# --- MTP's shared top-k rows: a draft step that reuses the rows draft step 0 kept --------------------

#: Draft step 2 of vLLM's speculator with shared top-k indices, kpool 1: rows 0 to 3 (step-0
#: contexts 1, 2, 126, 127) hold fewer valid entries than the length rule gives their draft's
#: context (3, 4, 128, 128); rows 4 to 7 (past topk) the same count either way.
MTP_STEP = 2
MTP_DECODES = batch(*[(ctx + MTP_STEP, 1) for ctx in (1, 2, 126, 127, 128, 129, 256, 100003)], topk=TOPK, kpool=1)
MTP_BY_RULE, MTP_ALIKE = [0, 1, 2, 3], [4, 5, 6, 7]


def mtp_scenario():
    return with_shared_mtp_indices(build_scenario(MTP_DECODES, SEED), MTP_STEP)


class RuleCountsThenReadsAnotherRowsSlot(AttendsHoles):
    """:class:`AttendsHoles`; row 5 (whose counts agree) reads a slot of another row."""

    def read(self, slots, lengths):
        read, mask = super().read(slots, lengths)
        return foreign_slot(read, mask, row=MTP_ALIKE[1]), mask


class RuleCountsWithARowAlikeOff(OneRowOff, AttendsHoles):
    """:class:`AttendsHoles`, row 6 (whose counts agree) 1.5 times what it should be."""

    off_row = MTP_ALIKE[2]


def test_the_shared_mtp_step_is_drawn_as_its_self_tests_say():
    valid, rule = valid_and_rule_counts(mtp_scenario(), len(MTP_BY_RULE + MTP_ALIKE))
    assert (valid != rule).nonzero().flatten().tolist() == MTP_BY_RULE


def test_shared_mtp_rows_run_by_the_rule_are_the_finding_and_only_they():
    scenario = mtp_scenario()
    assert verdict_of(ValidCounts, scenario=scenario, executes_valid_counts=True).failure is None
    verdict = verdict_of(AttendsHoles, scenario=scenario)
    assert isinstance(verdict.failure, SharedMtpRowsByContext) and SHARED_MTP in verdict.expected, verdict.failure
    text = str(verdict.failure)
    assert text.startswith(f"4 rows of draft step {MTP_STEP} run the length rule's count at the draft's context"), \
        text
    assert "row 1 (regime H, ctx 4), host exact 2, planned 4, executed 4, valid 2: kept from draft step 0 at " \
           "context 2, runs the rule's count at the draft's context" in text, text
    assert "row 4 " not in text, text


def test_shared_mtp_catches_what_the_finding_does_not_explain():
    scenario = mtp_scenario()
    neither = verdict_of(HoleRowCutShort, scenario=scenario)
    text = failure_text(neither)
    assert type(neither.failure) is AssertionError and "row 1 (regime H, ctx 4)" in text and \
        "the length it runs is neither its valid count nor the length rule's count" in text, text
    off = verdict_of(RuleCountsWithARowAlikeOff, scenario=scenario)
    text = failure_text(off)
    assert type(off.failure) is AssertionError and text.startswith("rows that run their valid count are off") and \
        f"worst: row {MTP_ALIKE[2]} " in text, text
    foreign = verdict_of(RuleCountsThenReadsAnotherRowsSlot, scenario=scenario)
    text = failure_text(foreign)
    assert type(foreign.failure) is AssertionError and \
        f"row {MTP_ALIKE[1]} (regime H, ctx 131)" in text and "executes slots other than its selection" in text, text


class AttendsHolesThenReadsAnotherRowsSlot(AttendsHoles):
    """:class:`AttendsHoles`; from its second step on, row ROW reads a slot of another row."""

    def read(self, slots, lengths):
        read, mask = super().read(slots, lengths)
        return (foreign_slot(read, mask) if self.steps else read), mask


@pytest.mark.parametrize(("layer_class", "raised"), [(AttendsHoles, TopkHolesAttended),
                                                     (AttendsHolesThenReadsAnotherRowsSlot, AssertionError)],
                         ids=["finding-then-right", "finding-then-a-bug"])
def test_a_finding_of_an_early_step_does_not_hide_a_later_failure(layer_class, raised):
    """Step 0 shows the top-k holes finding; the sequence goes on, so step 1's own fault is the failure."""
    steps = [(DECODES, SEED, TIES), (DECODES, SEED + 1)]
    with pytest.raises(AssertionError) as caught:
        run_sequence(Reporter(), StandInBackend(layer_class), steps, DEVICE)
    assert type(caught.value) is raised, caught.value
    if raised is AssertionError:
        assert "step 1 of the sequence's 2" in str(caught.value) and "executes slots other than its selection" in \
            str(caught.value)


# --- layer modes ---------------------------------------------------------------------------------------


def mode_verdicts(layer_class, mode: str, steps: int = 1, spec=DECODES):
    """The verdicts of ``steps`` runs of one step through one layer of ``layer_class`` in ``mode``."""
    backend = in_layer_mode(StandInBackend(layer_class), mode)
    scenario, inputs = scenario_and_inputs(spec)
    layer = open_layer(backend, scenario)
    return [judge_step(backend, layer, scenario, inputs) for _ in range(steps)]


class MergesAStalePartial(RightLayer):
    """Merges an empty split's partial from its float workspace with weight 0 into its output
    (0 x a NaN partial is NaN); its workspace is zero when opened, so a clean run is right."""

    def read_workspace(self, partial):
        self.out.copy_((self.out.float() + 0.0 * partial).to(self.out.dtype))


class MergesAStalePartialIntoTheLse(RightLayer):
    def read_workspace(self, partial):
        self.lse.add_(0.0 * partial)


@pytest.mark.parametrize(("layer_class", "what"), [(MergesAStalePartial, "output"),
                                                   (MergesAStalePartialIntoTheLse, "LSE")], ids=["out", "lse"])
def test_poisoned_workspaces_catch_a_read_of_a_stale_partial(layer_class, what):
    assert mode_verdicts(RightLayer, "poisoned")[0].failure is None
    assert verdict_of(layer_class).failure is None, "a clean run is right"
    text = failure_text(mode_verdicts(layer_class, "poisoned")[0])
    assert f"the poisoned run's {what} is not the clean run's bit for bit" in text, text


class StandInGraph:
    """``torch.cuda.CUDAGraph`` on the CPU: a capture (:func:`stand_in_capture`) launches nothing
    and keeps the launches made in it; :meth:`replay` runs them again."""

    capturing: StandInGraph | None = None

    def __init__(self):
        self.launches = []

    @staticmethod
    def capture_problem(layer) -> None:
        return None

    def replay(self) -> None:
        for launch in self.launches:
            launch()


@contextmanager
def stand_in_capture(graph: StandInGraph, **kwargs):
    StandInGraph.capturing = graph
    try:
        yield graph
    finally:
        StandInGraph.capturing = None


@pytest.fixture
def stand_in_graphs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", StandInGraph)
    monkeypatch.setattr(torch.cuda, "graph", stand_in_capture)


class CaptureLeavesItsOutputOut(RightLayer):
    """A captured launch writes its output into buffers of its own, which no one reads: a replay
    leaves the step's output as it was."""

    def launched(self, step, capture=False):
        if not capture:
            super().launched(step)


class CaptureLeavesItsLseOut(RightLayer):
    def launched(self, step, capture=False):
        lse = self.lse.clone()
        super().launched(step)
        if capture:
            self.lse.copy_(lse)


@pytest.mark.parametrize(("layer_class", "what"), [(CaptureLeavesItsOutputOut, "output"),
                                                   (CaptureLeavesItsLseOut, "LSE")], ids=["out", "lse"])
def test_graph_against_eager_catches_a_replay_that_leaves_its_results_out(stand_in_graphs, layer_class, what):
    assert mode_verdicts(RightLayer, "graphed")[0].failure is None
    text = failure_text(mode_verdicts(layer_class, "graphed")[0])
    assert f"the graph replay's {what} is not the eager run's bit for bit" in text, text


class StandInAllocator:
    """A caching allocator on the CPU: the buffers a layer lets go are its free blocks, and
    :meth:`occupy_freed_memory` (in place of ``harness.layer_modes.occupy_freed_memory``) poisons
    them as the real one has every free block taken and poisoned."""

    def __init__(self):
        self.free = []

    def let_go(self, buffer: torch.Tensor) -> None:
        self.free.append(buffer)

    def occupy_freed_memory(self, device) -> list[torch.Tensor]:
        poison(self.free)
        return list(self.free)


@pytest.fixture
def stand_in_allocator(monkeypatch):
    allocator = StandInAllocator()
    monkeypatch.setattr(layer_modes, "occupy_freed_memory", allocator.occupy_freed_memory)
    return allocator


class CaptureReadsAQueryItLetGo(RightLayer):
    """Stages the step's query in a buffer of its own at plan time and lets it go (the allocator
    may hand it out again) while the captured launch still reads it: right until other
    allocations take that memory."""

    allocator: StandInAllocator | None = None  # set by the test

    def plan_step(self, step):
        outcome = super().plan_step(step)
        self.staged_q = step.q_nope.clone()
        self.allocator.let_go(self.staged_q)
        return outcome

    def attend(self, step, rows, read, mask):
        kv = AttentionInputs(step.q_nope, step.q_pe, step.kv_cache)
        return sparse_mla_reference(self.staged_q[:rows], step.q_pe[:rows], kv.ckv, kv.kpe, read, mask=mask,
                                    sm_scale=self.config.sm_scale, k_scale=self.config.k_scale, mode="lowp")


def test_graph_against_eager_catches_a_replay_that_reads_memory_let_go_since_capture(
        stand_in_graphs, stand_in_allocator, monkeypatch):
    monkeypatch.setattr(CaptureReadsAQueryItLetGo, "allocator", stand_in_allocator)
    assert mode_verdicts(RightLayer, "graphed")[0].failure is None
    text = failure_text(mode_verdicts(CaptureReadsAQueryItLetGo, "graphed")[0])
    assert "the graph replay after allocation churn's output is not the eager run's bit for bit" in text, text
    assert "the graph replay's output" not in text, "right after the capture the buffer still holds the query"


def test_no_memory_is_occupied_off_cuda():
    assert layer_modes.occupy_freed_memory(torch.device("cpu")) == []


def snapshot_segment(kind: str, blocks: list[tuple[int, str]], *, device=0, stream=0, pool=(0, 0)) -> dict:
    """One segment as ``torch.cuda.memory_snapshot()`` lists it: its blocks as (bytes, state)."""
    return {"device": device, "stream": stream, "segment_type": kind, "segment_pool_id": pool,
            "blocks": [{"size": size, "state": state} for size, state in blocks]}


def test_the_churn_asks_for_each_free_block_of_the_streams_default_pool_from_the_pool_that_serves_it():
    mib = 1 << 20
    segments = [
        snapshot_segment("large", [(3 * mib, "inactive"), (5 * mib, "active_allocated"), (12 * mib, "inactive")]),
        snapshot_segment("small", [(2 * mib, "inactive")]),
        snapshot_segment("small", [(4096, "active_allocated"), (mib + 512, "inactive"), (512, "inactive")]),
        snapshot_segment("large", [(20 * mib, "inactive")], stream=77),
        snapshot_segment("large", [(20 * mib, "inactive")], device=1),
        snapshot_segment("large", [(20 * mib, "inactive")], pool=(1, 3)),
    ]
    assert layer_modes.requests_taking_free_blocks(segments, 0, 0) == [12 * mib, 3 * mib, mib, mib, mib, 512, 512]
    assert layer_modes.requests_taking_free_blocks(segments, 0, 77) == [20 * mib]
    assert layer_modes.requests_taking_free_blocks(segments, 2, 0) == []


def nudged(out: torch.Tensor, ulps: int) -> torch.Tensor:
    """``out`` with its first element ``ulps`` bf16 values further from zero."""
    out = out.clone()
    out.view(torch.int16).view(-1)[0] += ulps
    return out


class DriftsAfterAStep(RightLayer):
    """After an earlier step, the same step on the same plan 2 bf16 ULPs off in one element."""

    def finish(self, step, outcome):
        outcome = super().finish(step, outcome)
        if self.steps > 1:
            outcome.out = nudged(outcome.out, PLAN_HISTORY_ULPS + 1)
        return outcome


class KeptPlanDrifts(RightLayer):
    """After an earlier step, keeps its plan (planned lengths one past fresh's) and the output is
    ``ulps`` bf16 ULPs off in one element."""

    ulps = PLAN_HISTORY_ULPS + 1

    def finish(self, step, outcome):
        outcome = super().finish(step, outcome)
        if self.steps > 1:
            outcome.planned_lengths = outcome.planned_lengths + 1
            outcome.out = nudged(outcome.out, self.ulps)
        return outcome


class KeptPlanWithinTheBound(KeptPlanDrifts):
    ulps = PLAN_HISTORY_ULPS


def test_against_fresh_catches_other_bits_on_the_same_planned_lengths():
    first, second = mode_verdicts(DriftsAfterAStep, "against-fresh", steps=2)
    assert first.failure is None
    text = failure_text(second)
    assert "the same planned lengths as fresh, output not bit for bit fresh's (max 2 bf16 ULPs apart)" in text, text


def test_against_fresh_catches_a_kept_plan_beyond_the_plan_history_bound():
    assert [v.failure for v in mode_verdicts(KeptPlanWithinTheBound, "against-fresh", steps=2)] == [None, None]
    first, second = mode_verdicts(KeptPlanDrifts, "against-fresh", steps=2)
    assert first.failure is None
    text = failure_text(second)
    assert f"output 2 bf16 ULPs from fresh's, beyond the plan-history bound of {PLAN_HISTORY_ULPS} (planned " \
           "[41, 129, 132, 129] vs fresh [40, 128, 131, 128])" in text, text


# --- vLLM's findings (a backend of the vllm family, as the judge asks its findings) --------------------

VLLM = dict(name="vllm-stand-in", version="0.31.0", plans_fp8_as_storage_dtype=False,
            minus_one_filler=SLOT_ZERO_FILLER)
FP8 = dict(kv_dtype="float8_e4m3fn")
#: An fp8 cache with rope and k_scale 2 (a power of two: q_pe / k_scale is exact in bf16).
KPE_SCALED = DECODES.replace(kv_dtype="float8_e4m3fn", k_scale=2.0)
#: Three decodes in the FULL CUDA graph of 4 tokens: one padded row and request.
PADDED_GRAPH = graph_padded(batch((100, 1), (140, 1), (300, 1), topk=TOPK, kpool=4), 4)


class PlansFp8AsUint8(RightLayer):
    """Plans an fp8 cache with its storage dtype, which FlashInfer's plan() refuses."""

    def plan_step(self, step):
        if self.config.kv_dtype == "float8_e4m3fn":
            raise ValueError(f"{UINT8_REFUSAL} (kv_data_type uint8)")
        return super().plan_step(step)


def test_an_fp8_plan_refused_as_uint8_is_the_finding_only_where_the_release_plans_it_so():
    verdict = verdict_of(PlansFp8AsUint8, DECODES.replace(**FP8), **dict(VLLM, plans_fp8_as_storage_dtype=True))
    assert isinstance(verdict.failure, Fp8PlannedAsUint8) and FP8_AS_UINT8 in verdict.expected, verdict.failure
    with pytest.raises(ValueError, match=UINT8_REFUSAL):  # a release whose facts plan fp8 as e4m3: not the finding
        verdict_of(PlansFp8AsUint8, DECODES.replace(**FP8), **VLLM)


class RunsThePaddedRows(RightLayer):
    """Plans the step's query rows and hands the kernel q with the padded rows, which a FlashInfer
    that checks the query shape refuses at run."""

    message = QUERY_SHAPE_REFUSAL

    def launch(self, step, outcome):
        if step.q_nope.shape[0] != outcome.planned_rows:
            raise ValueError(f"{self.message}: q {step.q_nope.shape[0]} rows, planned {outcome.planned_rows}")
        super().launch(step, outcome)


class FailsOtherwiseAtRun(RunsThePaddedRows):
    message = "an error of another kind"


def test_a_padded_graph_step_refused_at_run_is_the_finding_and_no_other_error_is():
    backend = StandInBackend(RunsThePaddedRows, **VLLM)
    scenario, inputs = scenario_and_inputs(PADDED_GRAPH)
    verdict = judge_step(backend, open_layer(backend, scenario), scenario, inputs, query_shape_checked=lambda: True)
    assert isinstance(verdict.failure, PaddedGraphRowsUnplanned) and PADDED_GRAPH_ROWS in verdict.expected
    assert "planned the 3 query rows" in str(verdict.failure) and "ran 4 rows" in str(verdict.failure)
    other = StandInBackend(FailsOtherwiseAtRun, **VLLM)
    with pytest.raises(ValueError, match="an error of another kind"):
        judge_step(other, open_layer(other, scenario), scenario, inputs, query_shape_checked=lambda: True)


class KpeWithoutScale(RightLayer):
    """Dequantises the kpe part of an fp8 cache with 1.0, not the layer's k_scale."""

    def attend(self, step, rows, read, mask):
        k_scale = self.config.k_scale
        q_pe = (step.q_pe.float() / k_scale).to(step.q_pe.dtype)  # q_pe . kpe * k_scale / k_scale
        kv = AttentionInputs(step.q_nope, q_pe, step.kv_cache)
        return sparse_mla_reference(step.q_nope[:rows], q_pe[:rows], kv.ckv, kv.kpe, read, mask=mask,
                                    sm_scale=self.config.sm_scale, k_scale=k_scale, mode="lowp")


def test_kpe_read_without_k_scale_is_the_finding_only_where_the_finding_is_expected():
    verdict = verdict_of(KpeWithoutScale, KPE_SCALED, **VLLM)
    assert isinstance(verdict.failure, KpeScaleIgnored) and verdict.expected == [KPE_SCALE], verdict.failure
    assert "beyond the error budget" not in str(verdict.failure) and "\nout: max err" in str(verdict.failure)
    other = verdict_of(KpeWithoutScale, KPE_SCALED)  # a backend of no family with that finding: its own failure
    assert type(other.failure) is AssertionError and "beyond the error budget" in failure_text(other)


class LoadsSlotZero(RightLayer):
    """FlashInfer's fa3 kernel as vLLM 0.31.0 drives it: rows ``loads`` load slot 0 past their
    length with weight 0, NaN where slot 0 is not finite; rows ``off`` 1.5 times what they should be."""

    on_flashinfer = True
    loads, off = [1, 2], []

    def attend(self, step, rows, read, mask):
        out, lse = super().attend(step, rows, read, mask)
        out[self.off] *= 1.5
        if not bool(torch.isfinite(step.kv_cache[0, 0].float()).all()):
            out[self.loads] = float("nan")
        return out, lse

    def slots_loaded_past_length(self, outcome):
        return {row: [0] for row in self.loads}

    def forward_again(self, step, outcome):
        return self.attend(step, *self.staged)[0]


class LoadsSlotZeroAndIsOff(LoadsSlotZero):
    off = [2]


class LoadsSlotZeroAndCannotRunAgain(LoadsSlotZero):
    forward_again = None


def test_rows_nan_only_through_slot_zero_are_the_finding():
    scenario, inputs = scenario_and_inputs()
    assert not bool(torch.isfinite(inputs.kv_cache[0, 0].float()).all()), "slot 0 holds NaN in these inputs"
    verdict = verdict_of(LoadsSlotZero, **VLLM)
    assert isinstance(verdict.failure, SlotZeroLoaded) and SLOT_ZERO in verdict.expected, verdict.failure
    assert "with slot 0 finite the same plan is within the budget" in str(verdict.failure)


@pytest.mark.parametrize(("layer_class", "facts", "message"), [
    (LoadsSlotZeroAndIsOff, {}, "with slot 0 finite the same plan is still off"),
    (LoadsSlotZeroAndCannotRunAgain, {}, "the layer cannot run its plan again with slot 0 finite"),
    (LoadsSlotZero, {"minus_one_filler": FIRST_SLOT}, "stand-in's output vs (a) beyond the error budget"),
], ids=["off-as-well", "cannot-run-again", "release-packs-the-first-slot"])
def test_rows_nan_through_slot_zero_are_not_the_finding_where_nothing_shows_slot_zero_alone_did_it(
        layer_class, facts, message):
    verdict = verdict_of(layer_class, **dict(VLLM, **facts))
    assert type(verdict.failure) is AssertionError and SLOT_ZERO not in verdict.expected, verdict.failure
    assert message in failure_text(verdict)
