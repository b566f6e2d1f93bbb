"""One step of a scenario through a vLLM release's SM90 backend, and its checks.

:func:`run_step` drives vLLM's code as the engine does (``backends.vllm_sm90``: build, the
indexer's rows into the shared buffer, forward) and keeps everything a check needs in a
:class:`VllmStepOutcome`: vLLM's host lengths (exact or upper bounds), the lengths of the plan
in force, FlashInfer's schedule read back after the plan and the clamp, the kv_indices the
kernel reads, and the output.

The checks, each naming the row, its regime and its lengths when it fails:

- :func:`executed_length_problems`: every planned row's executed KV length (the end of its
  work items' coverage, read from the schedule) equals the row's valid count (the count of
  valid entries in its converted indexer row); no work item reaches past it; no work item
  names a row that is not planned; host bounds are bounds (``bound >= valid``);
- :func:`selection_problems`: the slots inside each row's executed span are exactly the row's
  intended selection (a), as a multiset;
- :func:`output_comparison`: the output of the planned rows against the float64 oracle over
  (a), within the error budget of ``reference.budget``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends import fa3_schedule
from backends.vllm_sm90 import LayerConfig, VllmLayer, common_metadata
from reference import Comparison, sparse_mla_reference
from reference.budget import compare_to_budget
from reference.invariants import intended_selection, same_multisets
from reference.rules import valid_counts

from .device_inputs import AttentionInputs
from .spec import BatchSpec, Scenario


def layer_config(spec: BatchSpec, max_tokens: int, *, adaptive_verification: bool = False) -> LayerConfig:
    """The vLLM layer configuration of a batch spec (one layer serves every step of a sequence
    with the same kernel variant and model)."""
    return LayerConfig(
        num_heads=spec.num_heads, rope_dim=spec.rope_dim, kv_dtype=spec.kv_dtype, k_scale=spec.k_scale,
        sm_scale=spec.sm_scale, topk=spec.topk, kpool=spec.kpool, width=spec.resolved_width,
        block_size=spec.block_size, max_tokens=max_tokens, async_scheduling=spec.async_scheduling,
        adaptive_verification=adaptive_verification,
    )


@dataclass
class VllmStepOutcome:
    scenario: Scenario
    version: str
    design: str
    planned_rows: int
    host_lengths: torch.Tensor  # vLLM's _kv_lens_host, all rows
    host_exact: bool
    planned_lengths: torch.Tensor  # the plan in force, planned rows (before the clamp)
    schedule: fa3_schedule.Schedule
    extents: list[fa3_schedule.RowExtent]
    kv_indptr: torch.Tensor  # host, planned rows + 1
    kv_indices: torch.Tensor  # host
    out: torch.Tensor | None
    plans: int  # FlashInfer plans made so far by the layer

    @property
    def valid(self) -> torch.Tensor:
        return valid_counts(self.scenario.intended_slots()[: self.planned_rows]).to(torch.int64)

    def executed_lengths(self) -> torch.Tensor:
        return torch.tensor([e.length for e in self.extents], dtype=torch.int64)

    def describe_row(self, row: int) -> str:
        s = self.scenario
        bound = int(self.host_lengths[row]) if row < self.host_lengths.numel() else None
        planned = int(self.planned_lengths[row]) if row < self.planned_lengths.numel() else None
        kind = "exact" if self.host_exact else "bound"
        return (f"row {row} (regime {s.row_regime[row]}, ctx {int(s.row_ctx[row])}): host {kind} {bound}, "
                f"planned {planned}, executed {self.extents[row].length}, valid {int(self.valid[row])}")

    def context(self) -> str:
        return (f"vLLM {self.version} ({self.design} design), {self.planned_rows} planned rows; "
                f"{self.scenario.describe()}")


def run_step(layer: VllmLayer, scenario: Scenario, inputs: AttentionInputs | None) -> VllmStepOutcome:
    """Build, plan (and clamp), then forward one step; ``inputs`` None stops before forward."""
    device = layer.device
    rows_with_padding = scenario.topk_indices.shape[0]
    cam = common_metadata(scenario.meta, scenario.block_table, rows_with_padding, device)
    metadata = layer.build(cam)
    _, host, exact = layer.host_lengths
    planned_rows = scenario.planned_rows
    planned = layer.planned_lengths(planned_rows).to(torch.int64)
    schedule = layer.schedule()
    out = None
    if inputs is not None:
        layer.write_topk(scenario.topk_indices)
        q_rows = scenario.meta.num_decode_tokens if scenario.prefills_to_mha else rows_with_padding
        out = layer.forward(inputs.q_nope[:q_rows], inputs.q_pe[:q_rows], inputs.kv_cache, metadata)
    state = layer.state
    return VllmStepOutcome(
        scenario=scenario, version=layer.backend.version, design=layer.backend.design, planned_rows=planned_rows,
        host_lengths=host.to(torch.int64), host_exact=bool(exact), planned_lengths=planned, schedule=schedule,
        extents=fa3_schedule.row_extents(schedule, planned_rows),
        kv_indptr=_kv_indptr(state, planned_rows),
        kv_indices=state.kv_indices.detach().to("cpu"), out=out,
        plans=layer.plans,
    )


def _kv_indptr(state, planned_rows: int) -> torch.Tensor:
    """The kv_indptr the plan copied into the wrapper's reserved device buffer."""
    buffer = state.wrapper._kv_indptr_buf
    return buffer[: planned_rows + 1].detach().to("cpu").to(torch.int64)


def executed_length_problems(outcome: VllmStepOutcome) -> list[str]:
    """Rows whose executed KV length is not their valid count, work items past a row's valid
    prefix, stray work items, host bounds below the valid count."""
    problems = []
    valid = outcome.valid
    for row, extent in enumerate(outcome.extents):
        v = int(valid[row])
        if extent.problems:
            problems.append(f"{outcome.describe_row(row)}: {'; '.join(extent.problems)}")
        if extent.length != v:
            what = "reads past its valid prefix" if extent.length > v else "is cut short"
            problems.append(f"{outcome.describe_row(row)}: executed length {what}")
        if not outcome.host_exact and row < outcome.host_lengths.numel() and int(outcome.host_lengths[row]) < v:
            problems.append(f"{outcome.describe_row(row)}: the host bound is below the valid count")
    stray = fa3_schedule.stray_works(outcome.schedule, outcome.planned_rows)
    if stray:
        problems.append(f"work items name rows {stray[:8]} past the {outcome.planned_rows} planned rows")
    return problems


def executed_selection(outcome: VllmStepOutcome) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slots [planned rows, max executed], mask)``: the kv_indices entries each row's work
    items read."""
    n = outcome.planned_rows
    lengths = outcome.executed_lengths()
    width = int(lengths.max()) if n else 0
    cols = torch.arange(width)
    mask = cols.unsqueeze(0) < lengths.unsqueeze(1)
    pos = outcome.kv_indptr[:n].unsqueeze(1) + cols.unsqueeze(0)
    flat = outcome.kv_indices.to(torch.int64)
    pos = torch.where(mask, pos, torch.zeros_like(pos)).clamp(max=max(flat.numel() - 1, 0))
    slots = flat[pos] if flat.numel() else torch.zeros_like(pos)
    return torch.where(mask, slots, torch.full_like(slots, -1)), mask


def selection_problems(outcome: VllmStepOutcome) -> list[str]:
    """Rows whose executed slots are not their intended selection (a)."""
    n = outcome.planned_rows
    if n == 0:
        return []
    a_slots, a_mask = intended_selection(outcome.scenario.intended_slots(), n)
    b_slots, b_mask = executed_selection(outcome)
    same = same_multisets(a_slots, a_mask, b_slots, b_mask)
    return [f"{outcome.describe_row(r)}: executes slots other than its selection (a)"
            for r in (~same).nonzero().flatten().tolist()]


def output_comparison(outcome: VllmStepOutcome, inputs: AttentionInputs) -> Comparison:
    """vLLM's output of the planned rows against the float64 oracle over (a)."""
    n = outcome.planned_rows
    spec = outcome.scenario.spec
    device = inputs.q_nope.device
    slots, mask = intended_selection(outcome.scenario.intended_slots(), n)
    args = (inputs.q_nope[:n], inputs.q_pe[:n], inputs.ckv, inputs.kpe, slots.to(device))
    kw = dict(mask=mask.to(device), sm_scale=spec.sm_scale, k_scale=spec.k_scale)
    truth, _ = sparse_mla_reference(*args, mode="float64", **kw)
    lowp, _ = sparse_mla_reference(*args, mode="lowp", **kw)
    return compare_to_budget("out", outcome.out[:n], truth, lowp, spec.kv_dtype)
