"""Replaying a fixture through the reference: the diagnostics a debugging engineer wants.

For each recorded fast output (one per FlashInfer version) and, where given, a fresh one:
the kernel against the as-planned reference (b) within the error budget, (b) against the
intended reference (a), kv_len against each row's valid count, the invariants, and the worst
rows and heads with their regimes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from reference.budget import Comparison, compare_attention
from reference.invariants import check_row_invariants, planned_selection, same_multisets
from reference.oracle import sparse_mla_reference

from .fixture import Fixture


@dataclass
class ReplayReport:
    fixture: Fixture
    violations: list = field(default_factory=list)
    plan_mismatch_rows: list[int] = field(default_factory=list)  # (b) != (a)
    poisoned_rows: list[int] = field(default_factory=list)  # (b) reads a NaN slot: not a kernel check
    kernel: dict[str, tuple[Comparison, Comparison]] = field(default_factory=dict)  # version -> (out, lse)

    @property
    def regimes(self) -> list[str]:
        return self.fixture.meta.get("regimes") or []

    @property
    def kernel_ok(self) -> bool:
        return all(o.ok and l.ok for o, l in self.kernel.values())

    @property
    def plan_ok(self) -> bool:
        return not self.violations and not self.plan_mismatch_rows

    def render(self, command: str | None = None) -> str:
        fx = self.fixture
        meta = fx.meta
        lines = [
            f"fixture {fx.name} ({fx.path}): layout={meta.get('layout')} rows={fx.num_rows} H={meta['num_heads']} "
            f"R={meta['head_dim_kpe']} kv={meta.get('kv_dtype')} seed={meta.get('seed')}",
        ]
        if meta.get("expect_finding"):
            lines.append(f"  expected finding: {meta['expect_finding']}")
        counts = (fx["intended"] != -1).sum(dim=1)
        for v in self.violations[:8]:
            lines.append(f"  invariant {v}")
        for r in self.plan_mismatch_rows[:8]:
            regime = self.regimes[r] if r < len(self.regimes) else "?"
            lines.append(
                f"  plan != intent at row {r} (regime {regime}): kv_len {int(fx['kv_len'][r])}, valid {int(counts[r])}"
            )
        if self.poisoned_rows:
            lines.append(f"  rows whose planned slots hold poison (NaN), left out of the kernel check: {self.poisoned_rows[:12]}")
        for version, (out_cmp, lse_cmp) in self.kernel.items():
            lines.append(f"  [{version}] {out_cmp.summary(self.regimes)}")
            lines.append(f"  [{version}] {lse_cmp.summary(self.regimes)}")
        if not self.kernel:
            lines.append("  no kernel outputs recorded: plan checks only")
        if command:
            lines.append(f"  reproduce: {command}")
        return "\n".join(lines)


def as_planned_selection(fx: Fixture) -> tuple[torch.Tensor, torch.Tensor]:
    slots, lens = planned_selection(fx["kv_indptr"], fx["kv_indices"], fx["kv_len"], fx.num_rows)
    return slots, torch.arange(slots.shape[1]).unsqueeze(0) < lens.unsqueeze(1)


def reference_outputs(fx: Fixture, selection: str = "planned", mode: str = "float64", device="cpu"):
    """The reference over the planned spans (b) or the intended valid entries (a)."""
    if selection == "planned":
        slots, mask = as_planned_selection(fx)
    else:
        slots, mask = fx["intended"].to(torch.int64), fx["intended"] != -1
    # A -1 inside a planned span is an invariant violation; the reference cannot read it.
    mask = mask & (slots >= 0)
    return sparse_mla_reference(
        fx["q_nope"].to(device), fx["q_pe"].to(device), fx["ckv"].to(device), fx["kpe"].to(device),
        slots.to(device), mask=mask.to(device), sm_scale=float(fx.meta["sm_scale"]),
        k_scale=float(fx.meta["k_scale"]), mode=mode,
    )


def replay(fx: Fixture, extra_outputs: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> ReplayReport:
    """Check the recorded outputs (and ``extra_outputs``) of one fixture against the reference."""
    report = ReplayReport(fixture=fx)
    b_slots, b_mask = as_planned_selection(fx)
    report.violations = check_row_invariants(_rows_as_read(fx), fx["kv_len"], report.regimes or None)
    same = same_multisets(fx["intended"], fx["intended"] != -1, b_slots, b_mask)
    report.plan_mismatch_rows = (~same).nonzero().flatten().tolist()
    outputs = dict(fx.outputs, **(extra_outputs or {}))
    if outputs:
        truth_out, truth_lse = reference_outputs(fx, "planned", "float64")
        lowp_out, lowp_lse = reference_outputs(fx, "planned", "lowp")
        poisoned = torch.isnan(truth_out).flatten(1).any(dim=1)
        report.poisoned_rows = poisoned.nonzero().flatten().tolist()
        kv_dtype = fx.meta.get("kv_dtype", "bfloat16")
        truth = (_zero_rows(truth_out, poisoned), _zero_rows(truth_lse, poisoned))
        lowp = (_zero_rows(lowp_out, poisoned), _zero_rows(lowp_lse, poisoned))
        for version, (out, lse) in outputs.items():
            if not fx.meta.get("lse_recorded", True):
                lse = truth_lse.float()  # the program did not ask FlashInfer for LSE: nothing to check
            # Rows reading poison are zeroed on every side: row numbers in the report stay the fixture's.
            report.kernel[version] = tuple(compare_attention(
                _zero_rows(out, poisoned), _zero_rows(lse, poisoned), truth, lowp, kv_dtype, suffix=" vs (b)",
            ))
    return report


def _zero_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return x.masked_fill(rows.view(-1, *([1] * (x.dim() - 1))).to(x.device), 0)


def _rows_as_read(fx: Fixture) -> torch.Tensor:
    """The rows the plan's layout reads, for the invariant check: the intended rows as laid
    out (compacted: valid entries first), as the production layouts read them."""
    from reference.rules import valid_first

    rows = fx["intended"]
    return valid_first(rows) if fx.meta.get("layout") == "compacted" else rows
