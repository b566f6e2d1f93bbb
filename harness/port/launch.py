"""What the GPU tests of the port's attention state (CUDA graphs, kept plans, captures, the
input-space cases on one state) use to drive that state themselves: the state's configuration of
a scenario, its static step inputs, NaN-filled outputs, the checks before launch, the plan or the
refusal the installed FlashInfer is expected to make, what the state hands the kernel against
(b), and the comparison with the references over (b). A test that judges a backend step by step
runs it through ``harness.judge`` instead (the port under any layout: ``backends.flashinfer.port.PortBackend``).

:func:`plan_or_refusal` tells the test's log whether the plan was refused as expected
(``expected_refusal(why)``: the ``regime_log`` fixture), so the run counts refusals apart from
kernel checks; a test logs its launches (``kernel_ran()``) itself.

Order matters: invariants and (b) == (a) are checked first and a violation fails the case
without launching; the kernel runs on NaN-filled output buffers before any reference is
allocated; the references are the float64 truth and the low-precision yardstick over the
as-implemented selection (b), compared by the one tolerance policy (reference.budget).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Protocol

import torch

from backends.flashinfer.port import PLAN_REFUSAL as PAGE_COUNT_REFUSAL
from backends.flashinfer.port import AttentionConfig, kernel_parts, plan_refused, state_problems
from mla_constants import GPU_TIER_DEFAULT_DEVICE, GPU_TIER_DEVICE_ENV, KV_LORA_RANK
from reference import Comparison, sparse_mla_reference
from reference.budget import compare_attention

from ..case_log import note_step
from ..pipeline import Step, as_planned, describe_rows, prepare_step, selection_mismatches
from ..scenario import AttentionInputs, Scenario

DEVICE = os.environ.get(GPU_TIER_DEVICE_ENV, GPU_TIER_DEFAULT_DEVICE)


def attention_config(scenario: Scenario, layout: str, max_rows: int | None = None) -> AttentionConfig:
    spec = scenario.spec
    return AttentionConfig(
        num_heads=spec.num_heads,
        max_rows=max(max_rows if max_rows is not None else scenario.topk_indices.shape[0], 1),
        width=spec.resolved_width,
        layout=layout,
        block_size=spec.block_size,
        sm_scale=spec.sm_scale,
        rope_dim=spec.rope_dim,
        kv_dtype=spec.torch_kv_dtype,
        k_scale=spec.k_scale,
    )


def strided_plan_refused(features, step: Step) -> bool:
    """Whether the installed FlashInfer refuses ``step``'s plan (``backends.flashinfer.port.plan_refused``)."""
    return plan_refused(features, step.layout, step.planned_lens, step.scenario.spec.resolved_width)


def failure_context(step: Step, version: str) -> str:
    return f"flashinfer {version}; {step.context()}"


def assert_launchable(step: Step, version: str) -> None:
    """The invariants before launch (docs/invariants.md#before-launch), then (b) == (a): a
    violation fails here, nothing launched."""
    note_step(step)
    ctx = failure_context(step, version)
    assert not step.violations, f"invariant violations (kernel not launched); {ctx}\n" + "\n".join(
        map(str, step.violations[:8])
    )
    bad = selection_mismatches(step)
    assert not bad, (
        f"plan/layout bug: planned slots (b) != intended slots (a) on {len(bad)} rows (kernel not launched); {ctx}\n"
        + describe_rows(step, bad)
    )


def nan_buffers(rows: int, num_heads: int, device=DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.full((rows, num_heads, KV_LORA_RANK), float("nan"), dtype=torch.bfloat16, device=device)
    lse = torch.full((rows, num_heads), float("nan"), dtype=torch.float32, device=device)
    return out, lse


@dataclass
class Launch:
    """A scenario's device inputs and static per-step tensors for one state."""

    topk_indices: torch.Tensor  # [max_rows, W] int32, padded rows -1
    block_table: torch.Tensor
    req_id: torch.Tensor  # [max_rows]
    inputs: AttentionInputs

    def step_args(self, out, lse):
        i = self.inputs
        return (self.topk_indices, self.block_table, self.req_id, i.q_nope, i.q_pe, i.ckv, i.kpe, out, lse)


def launch_inputs(impl, scenario: Scenario, inputs: AttentionInputs, max_rows: int) -> Launch:
    rows = scenario.topk_indices.shape[0]
    if rows > max_rows:
        raise ValueError(f"scenario has {rows} rows > max_rows {max_rows}")
    topk = torch.full((max_rows, scenario.spec.resolved_width), -1, dtype=torch.int32, device=DEVICE)
    topk[:rows] = scenario.topk_indices.to(DEVICE)
    req = impl.request_ids(scenario.meta.query_start_loc_cpu.to(DEVICE), max_rows)
    return Launch(topk, block_table_buffer(scenario), req, inputs)


def block_table_buffer(scenario: Scenario, min_rows: int = 1) -> torch.Tensor:
    """The scenario's block table on the device with at least one row (padded rows read
    request 0's row, as the engine's persistent table always has one)."""
    table = scenario.block_table
    out = torch.zeros((max(table.shape[0], min_rows), table.shape[1]), dtype=torch.int32, device=DEVICE)
    out[: table.shape[0]] = table.to(DEVICE)
    return out


def state_matches_step(state, step: Step) -> list[str]:
    """Differences between what the state hands the kernel and what (b) was computed from
    (``backends.flashinfer.port.state_problems``)."""
    note_step(step)
    return state_problems(state, step.kv_indptr, step.kv_indices, step.planned_lens)


def planned_references(
    step: Step, inputs: AttentionInputs, state=None
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(truth, lowp) over (b) for the planned rows: each ``(out, lse)``; the lowp with the parts
    the kernel split each row into where ``state`` shows them (:func:`backends.flashinfer.port.kernel_parts`)."""
    n = step.num_planned
    slots, mask = as_planned(step)
    parts = kernel_parts(state, n, slots.shape[1]) if state is not None else None
    slots, mask = slots.to(DEVICE), mask.to(DEVICE)
    spec = step.scenario.spec
    args = (inputs.q_nope[:n], inputs.q_pe[:n], inputs.ckv, inputs.kpe, slots)
    kw = dict(mask=mask, sm_scale=spec.sm_scale, k_scale=spec.k_scale)
    return sparse_mla_reference(*args, mode="float64", **kw), sparse_mla_reference(
        *args, mode="lowp", parts=None if parts is None else parts.to(DEVICE), **kw)


def compare_with_references(
    step: Step, inputs: AttentionInputs, out: torch.Tensor, lse: torch.Tensor, state=None
) -> list[Comparison]:
    """The kernel's ``out`` and ``lse`` of the planned rows against the references over (b).
    ``state``: the attention state that ran the step, whose schedule says where the kernel split
    each row (the yardstick rounds the split rows' partial outputs as the kernel does)."""
    note_step(step, inputs, out, lse)
    n = step.num_planned
    truth, lowp = planned_references(step, inputs, state)
    return compare_attention(out[:n], lse[:n], truth, lowp, step.scenario.spec.kv_dtype)


def assert_within_budget(step: Step, comparisons: list[Comparison], version: str, what: str = "kernel vs (b)") -> None:
    note_step(step)
    bad = [c for c in comparisons if not c.ok]
    assert not bad, f"{what} beyond the error budget; {failure_context(step, version)}\n" + "\n".join(
        c.summary(step.scenario.row_regime) for c in bad
    )


def eager_step(state, launch: Launch, step: Step, out, lse) -> None:
    """plan (host) -> convert -> layout -> run, outside any graph."""
    state.plan(step.num_planned, step.planned_lens)
    state.step(*launch.step_args(out, lse))


def prepared(impl, scenario: Scenario, layout: str, max_rows: int | None = None) -> Step:
    return prepare_step(impl, scenario, layout, device=DEVICE, max_rows=max_rows)


def sync() -> None:
    if torch.device(DEVICE).type == "cuda":
        torch.cuda.synchronize()


class StaticStep:
    """Fixed-address buffers a captured step reads: every batch is copied into them. Sized for
    the largest of ``scenarios``, or for ``max_rows`` rows where that is more (the row capacity
    a sequence was run with, whose largest steps may have been left out of it)."""

    def __init__(self, scenarios, impl, max_rows: int = 0):
        self.impl = impl
        first = scenarios[0]
        spec = first.spec
        self.max_rows = max([max_rows] + [s.topk_indices.shape[0] for s in scenarios])
        self.max_reqs = max(max(s.meta.num_reqs for s in scenarios), 1)
        table_width = max(s.block_table.shape[1] for s in scenarios)
        self.num_blocks = max(s.num_blocks for s in scenarios)
        width = spec.resolved_width
        self.topk = torch.full((self.max_rows, width), -1, dtype=torch.int32, device=DEVICE)
        self.table = torch.zeros((self.max_reqs, table_width), dtype=torch.int32, device=DEVICE)
        self.req = torch.zeros(self.max_rows, dtype=torch.int32, device=DEVICE)
        self.q = torch.zeros((self.max_rows, spec.num_heads, spec.head_dim), dtype=torch.bfloat16, device=DEVICE)
        self.cache = torch.empty(
            (self.num_blocks, spec.block_size, spec.head_dim), dtype=spec.torch_kv_dtype, device=DEVICE
        )
        self.out, self.lse = nan_buffers(self.max_rows, spec.num_heads)

    @property
    def ckv(self):
        return self.cache.view(-1, 1, self.cache.shape[-1])[..., :KV_LORA_RANK]

    @property
    def kpe(self):
        return self.cache.view(-1, 1, self.cache.shape[-1])[..., KV_LORA_RANK:]

    def load(self, scenario, inputs) -> None:
        rows = scenario.topk_indices.shape[0]
        self.topk.fill_(-1)
        self.topk[:rows] = scenario.topk_indices.to(DEVICE)
        self.table.zero_()
        t = scenario.block_table
        self.table[: t.shape[0], : t.shape[1]] = t.to(DEVICE)
        self.req.copy_(self.impl.request_ids(scenario.meta.query_start_loc_cpu.to(DEVICE), self.max_rows))
        self.q.zero_()
        if rows:
            self.q[:rows] = torch.cat([inputs.q_nope, inputs.q_pe], dim=-1)
        self.cache.view(torch.uint8).fill_(0xFF)  # NaN in bf16 and in e4m3
        self.cache[: scenario.num_blocks] = inputs.kv_cache
        self.out.fill_(float("nan"))
        self.lse.fill_(float("nan"))

    def args(self):
        return (
            self.topk,
            self.table,
            self.req,
            self.q[..., :KV_LORA_RANK],
            self.q[..., KV_LORA_RANK:],
            self.ckv,
            self.kpe,
            self.out,
            self.lse,
        )


# --- one launch ---------------------------------------------------------------------------------


class LaunchLog(Protocol):
    """Where a test's launch outcomes go (the ``regime_log`` fixture)."""

    def kernel_ran(self) -> None: ...

    def expected_refusal(self, why: str) -> None: ...


def plan_or_refusal(features, state, step: Step, log: LaunchLog) -> str | None:
    """``state.plan`` for ``step``. Where the installed FlashInfer is expected to refuse this plan
    (:func:`strided_plan_refused`), the refusal is checked (a ValueError with
    ``PAGE_COUNT_REFUSAL``; any other error propagates), logged and returned; a plan accepted
    there fails."""
    if not strided_plan_refused(features, step):
        state.plan(step.num_planned, step.planned_lens)
        return None
    try:
        state.plan(step.num_planned, step.planned_lens)
    except ValueError as exc:
        if not re.search(re.escape(PAGE_COUNT_REFUSAL), str(exc)):
            raise
        why = f"ValueError at plan: {exc}"[:300]
        log.expected_refusal(why)
        return why
    raise AssertionError(f"plan() accepted a strided plan with rows shorter than W, where the probe found that "
                         f"this FlashInfer checks page counts (Features.plan_checks_page_counts); "
                         f"{failure_context(step, features.version)}")
