"""Replaying a fixture through the reference: the diagnostics a debugging engineer wants.

For each recorded fast output (one per FlashInfer version) and, where the installed FlashInfer
re-ran the fixture (:mod:`recording.rerun`), the new one (which then decides the verdict on the
kernel: the recorded outputs are history, shown beside it): the kernel against the as-planned
reference (b) within the error budget, (b) against the intended reference (a), kv_len
against each row's valid count, the invariants, and the worst rows and heads with their
regimes. A re-run adds the drift of its output against every recorded version's (share of
bitwise-equal elements, max abs, worst rows), which releases agree, and a refusal (the
exception FlashInfer raised) as an outcome of its own. Everything here is pure: the GPU glue
hands in a :class:`Rerun`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from reference.budget import Comparison, compare_attention
from reference.invariants import check_row_invariants, planned_selection, same_multisets
from reference.oracle import sparse_mla_reference

from .case_log import note_fixture
from .fixture import Fixture, bitwise_equal, same_bits

#: The version label of a re-run of the host stages only (recording.restage): no kernel ran.
HOST_STAGES = "host stages"


@dataclass
class Rerun:
    """One fresh plan + run of a fixture on the installed FlashInfer."""

    version: str  # the installed FlashInfer
    how: str  # what ran: "pipeline through <impl>" or "as captured"
    out: torch.Tensor | None = None  # [rows, H, 512] (None when refused)
    lse: torch.Tensor | None = None  # [rows, H], natural log
    plan: dict[str, torch.Tensor] | None = (
        None  # kv_indptr / kv_indices / kv_len (local ids) it planned; None: as recorded
    )
    refused: str | None = None  # "ExceptionType: message" FlashInfer raised
    impl: str | None = None  # the implementation under test it ran through, if any
    # why the kernel was not launched on the plan the implementation laid out (its plan is
    # judged all the same): a plan that would read outside the KV cache
    withheld: str | None = None

    @property
    def label(self) -> str:
        return self.version if self.version == HOST_STAGES else f"{self.version} re-run"


@dataclass
class Drift:
    """A re-run output against one recorded output."""

    against: str
    equal: int  # bitwise-equal elements
    total: int
    max_abs: float
    worst_rows: list[tuple[int, float]]  # (row, max abs diff), largest first
    what: str = "out"  # which output: "out" or "lse"

    @property
    def equal_share(self) -> float:
        return self.equal / self.total if self.total else 1.0

    def summary(self, regimes: list[str] | None = None) -> str:
        worst = ", ".join(
            f"row {r} {d:.3g}" + (f" (regime {regimes[r]})" if regimes and r < len(regimes) else "")
            for r, d in self.worst_rows
        )
        text = (
            f"of {self.what} vs [{self.against}]: {self.equal}/{self.total} elements bitwise equal "
            f"({100 * self.equal_share:.4f}%), "
            f"max abs {self.max_abs:.3g}"
        )
        return text + (f", worst rows {worst}" if worst else "")


@dataclass
class ReplayReport:
    fixture: Fixture
    violations: list = field(default_factory=list)
    plan_mismatch_rows: list[int] = field(default_factory=list)  # (b) != (a)
    bad_inputs: dict[int, str] = field(default_factory=dict)  # row -> what is not finite in its inputs
    poisoned_rows: list[int] = field(default_factory=list)  # (b) reads a NaN slot (a) does not: not a kernel check
    kernel: dict[str, tuple[Comparison, Comparison]] = field(default_factory=dict)  # version -> (out, lse)
    rerun: Rerun | None = None
    rerun_violations: list = field(default_factory=list)
    rerun_plan_mismatch_rows: list[int] = field(default_factory=list)
    drift: list[Drift] = field(default_factory=list)
    agreement: list[list[str]] = field(default_factory=list)  # groups of bitwise-identical outputs
    judged_rows: dict[str, int] = field(default_factory=dict)  # version -> rows the kernel check judged

    @property
    def regimes(self) -> list[str]:
        return self.fixture.meta.get("regimes") or []

    @property
    def refusals(self) -> dict[str, str]:
        """Versions that refused the case when it was recorded: version -> exception."""
        return dict(self.fixture.meta.get("refused") or {})

    @property
    def inputs_ok(self) -> bool:
        return not self.bad_inputs

    @property
    def rerun_decides(self) -> bool:
        """The installed FlashInfer re-ran the fixture and its output was judged: the verdict on
        the kernel is the re-run's, and the recorded outputs are history, shown beside it (a bug
        fixed since the recording turns its replay green)."""
        return self.rerun is not None and self.rerun.out is not None and not self.rerun.refused \
            and self.rerun.label in self.kernel

    @property
    def judged_versions(self) -> list[str]:
        """The outputs the kernel verdict rests on: the re-run's where it decides, else every
        recorded one (``--replay-recorded-only``, or no kernel here)."""
        return [self.rerun.label] if self.rerun_decides else list(self.kernel)

    @property
    def kernel_ok(self) -> bool:
        return all(self.kernel[v][0].ok and self.kernel[v][1].ok for v in self.judged_versions)

    @property
    def plan_ok(self) -> bool:
        """The plan that ran matches the intent: the re-run's where it planned anew, and the
        fixture's own too where it was made now (a recipe's step, planned through the
        implementation under test on the step's own block table when rebuilt)."""
        own_ok = not self.violations and not self.plan_mismatch_rows
        if self.rerun is not None and self.rerun.plan is not None and not self.rerun.refused:
            rerun_ok = not self.rerun_violations and not self.rerun_plan_mismatch_rows
            return rerun_ok and (own_ok or not planned_now(self.fixture))
        return own_ok

    @property
    def refusal_expected(self) -> bool:
        """The re-run's refusal is one a recorded version raised too (or there was none)."""
        if self.rerun is None or not self.rerun.refused:
            return True
        return any(first_line(self.rerun.refused) == first_line(r) for r in self.refusals.values())

    def failures(self) -> list[str]:
        """Why the replay fails (empty: it passes); the heatmaps never enter here."""
        reasons = []
        if self.bad_inputs:
            reasons.append(f"bad inputs (not finite) on rows {list(self.bad_inputs)[:12]}: nothing can be judged there")
        if self.rerun is not None and self.rerun.out is None and self.rerun.refused and self.rerun.plan is None \
                and self.rerun.version == HOST_STAGES:
            reasons.append(f"the implementation under test raised in the host stages: {self.rerun.refused}")
        elif self.rerun is not None and not self.refusal_expected:
            reasons.append(f"flashinfer {self.rerun.version} refused the re-run: {self.rerun.refused}")
        if self.rerun is not None and self.rerun.withheld and self.plan_ok:
            reasons.append(f"the re-run's plan matches the intent, yet it was not launched: {self.rerun.withheld}")
        if not self.kernel_ok:
            bad = [v for v in self.judged_versions if not (self.kernel[v][0].ok and self.kernel[v][1].ok)]
            reasons.append(f"kernel != as-planned reference beyond the error budget ({', '.join(bad)})")
        unjudged = self.unjudged_reason()
        if unjudged:
            reasons.append(unjudged)
        finding = self.fixture.meta.get("expect_finding")
        if finding and self.plan_ok:
            reasons.append(f"the recorded finding no longer shows ({finding}); update the fixture")
        elif not finding and not self.plan_ok and self.known_finding() is None:
            reasons.append("plan != intent")
        return reasons

    def known_finding(self) -> str | None:
        """The known finding the plan shows where the fixture declares none: the regime C finding
        (:data:`harness.findings.REGIME_C_FINDING`) where every row the plan gets wrong is a
        regime C row of a packed or strided layout, as the tests that wrote the case expected it;
        else None."""
        from harness.findings import REGIME_C_FINDING, only_regime_c_rows

        layout = self.fixture.meta.get("layout")
        if self.fixture.meta.get("expect_finding") or self.plan_ok or layout not in ("packed", "strided"):
            return None
        wrong = {v.row for v in [*self.violations, *self.rerun_violations]} | set(self.plan_mismatch_rows) \
            | set(self.rerun_plan_mismatch_rows)
        return REGIME_C_FINDING.format(layout=layout) if only_regime_c_rows(wrong, self.regimes) else None

    def unjudged_reason(self) -> str | None:
        """Why the kernel verdict rests on no row, where it does and neither bad inputs nor a plan
        other than the intent explain it (None: some row was judged, or none needed to be)."""
        n = self.fixture.num_rows
        for version in self.judged_versions if n else ():
            if self.judged_rows.get(version, n):
                continue
            rerun_planned = self.rerun is not None and version == self.rerun.label and self.rerun.plan is not None
            wrong_plan = self.rerun_plan_mismatch_rows if rerun_planned else self.plan_mismatch_rows
            if not set(range(n)) <= set(wrong_plan) | set(self.bad_inputs):
                return (f"no row judged: the kernel check of [{version}] left out all {n} rows (poisoned: "
                        f"{self.poisoned_rows[:12]}) though their plan is the intended selection; a replay that "
                        "judges no row is not a pass")
        return None

    def render(self, command: str | None = None) -> str:
        fx = self.fixture
        meta = fx.meta
        lines = [
            f"fixture {fx.name} ({fx.path}): layout={meta.get('layout')} rows={fx.num_rows} H={meta['num_heads']} "
            f"R={meta['head_dim_kpe']} kv={meta.get('kv_dtype')} seed={meta.get('seed')}",
        ]
        if meta.get("source") == "capture" or meta.get("layout") == "captured":
            lines.append("  recorded by capture_mla")
        elif meta.get("impl"):
            lines.append(f"  recorded through --impl {meta['impl']} ({meta.get('nodeid', 'no test id')})")
        if meta.get("expect_finding"):
            lines.append(f"  expected finding: {meta['expect_finding']}")
        elif self.known_finding():
            lines.append(f"  expected finding (the plan is off on regime C rows only): {self.known_finding()}")
        for r, why in list(self.bad_inputs.items())[:8]:
            lines.append(f"  bad input at row {r} (regime {self._regime(r)}): {why}")
        lines += self._plan_lines(self.violations, self.plan_mismatch_rows, fx, "")
        if self.poisoned_rows:
            lines.append(
                f"  rows whose planned slots hold poison (NaN), left out of the kernel check: {self.poisoned_rows[:12]}"
            )
        for version, why in self.refusals.items():
            lines.append(f"  [{version}] refused when recorded: {why}")
        rerun_label = self.rerun.label if self.rerun is not None else None
        lines += self._kernel_lines([v for v in self.kernel if v != rerun_label])
        if not self.fixture.outputs:
            lines.append("  no kernel outputs recorded: plan checks only")
        lines += self._rerun_lines()
        if command:
            lines.append(f"  reproduce: {command}")
        return "\n".join(lines)

    def _kernel_lines(self, versions) -> list[str]:
        lines = []
        judged = set(self.judged_versions)
        for version in versions:
            out_cmp, lse_cmp = self.kernel[version]
            tag = f"[{version}]" if version in judged else f"[{version}, recorded: history, the re-run decides]"
            lines.append(f"  {tag} {out_cmp.summary(self.regimes)}")
            lines.append(f"  {tag} {lse_cmp.summary(self.regimes)}")
        return lines

    def _regime(self, row: int) -> str:
        return self.regimes[row] if row < len(self.regimes) else "?"

    def _plan_lines(self, violations, mismatch_rows, fx: Fixture, tag: str) -> list[str]:
        counts = (fx["intended"] != -1).sum(dim=1)
        lines = [f"  {tag}invariant {v}" for v in violations[:8]]
        batch_rows = fx.meta.get("rows")
        for r in mismatch_rows[:8]:
            where = (
                f", row {batch_rows[r]} of the failing batch"
                if isinstance(batch_rows, list) and r < len(batch_rows)
                else ""
            )
            lines.append(
                f"  {tag}plan != intent at row {r} (regime {self._regime(r)}{where}): kv_len {int(fx['kv_len'][r])}, "
                f"valid {int(counts[r])}"
            )
        return lines

    def _rerun_lines(self) -> list[str]:
        rerun = self.rerun
        if rerun is None:
            return []
        tag = f"[{rerun.label}] "
        lines = [f"  {tag}{rerun.how}" + (f"; implementation under test: {rerun.impl}" if rerun.impl else "")]
        if rerun.refused:
            seen = [v for v, r in self.refusals.items() if first_line(r) == first_line(rerun.refused)]
            lines.append(
                f"  {tag}REFUSED: {rerun.refused}" + (f" (as {', '.join(seen)} did when recorded)" if seen else "")
            )
            return lines
        if rerun.withheld:
            lines.append(f"  {tag}NOT LAUNCHED: {rerun.withheld}")
        if rerun.plan is not None:
            lines += self._plan_lines(
                self.rerun_violations, self.rerun_plan_mismatch_rows, with_plan(self.fixture, rerun.plan), tag
            )
        lines += self._kernel_lines([rerun.label] if rerun.label in self.kernel else [])
        lines += [f"  {tag}drift {d.summary(self.regimes)}" for d in self.drift]
        if self.agreement:
            lines.append("  releases agreeing bitwise: " + " | ".join("{" + ", ".join(g) + "}" for g in self.agreement))
        return lines


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text and text.strip() else ""


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


def bad_input_rows(fx: Fixture) -> dict[int, str]:
    """Rows whose own inputs are not finite: q, or a KV slot of the intended selection (a).
    Their outputs mean nothing, whatever the kernel does."""
    bad: dict[int, list[str]] = {}
    for name in ("q_nope", "q_pe"):
        q = fx[name].float()
        if q.numel():
            for r in (~torch.isfinite(q)).flatten(1).any(dim=1).nonzero().flatten().tolist():
                bad.setdefault(r, []).append(f"{name} holds NaN/Inf")
    slot_bad = ~(_finite_slots(fx["ckv"]) & _finite_slots(fx["kpe"]))
    intended = fx["intended"].to(torch.int64)
    reads_bad = (
        (intended >= 0) & slot_bad[intended.clamp(min=0)]
        if slot_bad.numel()
        else torch.zeros_like(intended, dtype=torch.bool)
    )
    for r in reads_bad.any(dim=1).nonzero().flatten().tolist():
        slot = int(intended[r][reads_bad[r]][0])
        bad.setdefault(r, []).append(f"intended KV slot {slot} (original id {int(fx['slot_ids'][slot])}) holds NaN/Inf")
    return {r: "; ".join(why) for r, why in sorted(bad.items())}


def _finite_slots(kv: torch.Tensor) -> torch.Tensor:
    """Per KV slot: every value finite (raw uint8 storage read as e4m3)."""
    values = kv.view(torch.float8_e4m3fn) if kv.dtype == torch.uint8 else kv
    return torch.isfinite(values.float()).all(dim=1) if kv.shape[1] else torch.ones(kv.shape[0], dtype=torch.bool)


def with_plan(fx: Fixture, plan: dict[str, torch.Tensor]) -> Fixture:
    """The fixture with another plan (kv_indptr / kv_indices / kv_len, local ids)."""
    return dataclasses.replace(fx, tensors=dict(fx.tensors, **{k: v.cpu() for k, v in plan.items()}))


def plan_checks(fx: Fixture, regimes: list[str] | None) -> tuple[list, list[int]]:
    """Invariant violations of the rows as the plan reads them, and the rows whose (b) != (a)."""
    b_slots, b_mask = as_planned_selection(fx)
    violations = check_row_invariants(_rows_as_read(fx), fx["kv_len"], regimes or None)
    same = same_multisets(fx["intended"], fx["intended"] != -1, b_slots, b_mask)
    return violations, (~same).nonzero().flatten().tolist()


def kernel_checks(
    fx: Fixture, outputs: dict, excluded: torch.Tensor, device="cpu"
) -> dict[str, tuple[Comparison, Comparison]]:
    """Each ``(out, lse)`` against the reference over (b) within the budget; rows in
    ``excluded`` are zeroed on every side, so row numbers stay the fixture's."""
    truth_out, truth_lse = reference_outputs(fx, "planned", "float64", device)
    lowp_out, lowp_lse = reference_outputs(fx, "planned", "lowp", device)
    kv_dtype = fx.meta.get("kv_dtype", "bfloat16")
    truth = (_zero_rows(truth_out, excluded), _zero_rows(truth_lse, excluded))
    lowp = (_zero_rows(lowp_out, excluded), _zero_rows(lowp_lse, excluded))
    result = {}
    for version, (out, lse) in outputs.items():
        if not fx.meta.get("lse_recorded", True):
            lse = truth_lse.float()  # the program did not ask FlashInfer for LSE: nothing to check
        result[version] = tuple(compare_attention(
            _zero_rows(out, excluded), _zero_rows(lse, excluded), truth, lowp, kv_dtype, suffix=" vs (b)",
        ))
    return result


def output_drift(new: torch.Tensor, old: torch.Tensor, against: str, k: int = 3, what: str = "out") -> Drift:
    """Bitwise-equal share, max abs difference and worst rows of ``new`` against ``old``
    (NaN against NaN counts as equal when the bits are; any other NaN is an infinite diff)."""
    if new.shape != old.shape:
        return Drift(against, 0, max(new.numel(), old.numel()), float("inf"), [], what)
    same = same_bits(new, old)
    diff = (new.double() - old.double()).abs()
    diff = torch.where(same, torch.zeros_like(diff), diff.nan_to_num(nan=float("inf")))
    per_row = diff.flatten(1).amax(dim=1) if diff.numel() else torch.zeros(new.shape[0], dtype=torch.float64)
    top = torch.topk(per_row, min(k, per_row.numel())) if per_row.numel() else None
    worst = (
        [(int(i), float(v)) for v, i in zip(top.values, top.indices, strict=True) if v > 0] if top is not None else []
    )
    return Drift(against, int(same.sum()), same.numel(), float(diff.max()) if diff.numel() else 0.0, worst, what)


def agreeing_groups(outputs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> list[list[str]]:
    """The outputs grouped by bitwise identity (out and lse), in the order given."""
    groups: list[list[str]] = []
    for label, (out, lse) in outputs.items():
        for group in groups:
            first_out, first_lse = outputs[group[0]]
            if bitwise_equal(out, first_out) and bitwise_equal(lse, first_lse):
                group.append(label)
                break
        else:
            groups.append([label])
    return groups


def planned_now(fx: Fixture) -> bool:
    """The fixture's plan was made in this run: a recipe rebuilt through the implementation
    under test (recording.recipe.rebuild_fixture), not a plan recorded when the file was written."""
    return fx.meta.get("source") == "recipe"


def replay(fx: Fixture, extra_outputs: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
           rerun: Rerun | None = None, device="cpu") -> ReplayReport:
    """Check the recorded outputs (and ``extra_outputs``) of one fixture against the reference,
    and a re-run's output, plan and refusal where one is given."""
    note_fixture(fx)
    report = ReplayReport(fixture=fx, rerun=rerun)
    report.bad_inputs = bad_input_rows(fx)
    report.violations, report.plan_mismatch_rows = plan_checks(fx, report.regimes)
    bad = _row_mask(report.bad_inputs, fx.num_rows)
    outputs = dict(fx.outputs, **(extra_outputs or {}))
    if outputs:
        report.poisoned_rows = _poisoned(fx, bad, device)
        excluded = bad | _row_mask(report.poisoned_rows, fx.num_rows)
        report.kernel = kernel_checks(fx, outputs, excluded, device)
        report.judged_rows = dict.fromkeys(outputs, int((~excluded).sum()))
    if rerun is not None and not rerun.refused and rerun.plan is not None:
        report.rerun_violations, report.rerun_plan_mismatch_rows = plan_checks(
            with_plan(fx, rerun.plan), report.regimes
        )
    if rerun is not None and not rerun.refused and rerun.out is not None:
        planned = with_plan(fx, rerun.plan) if rerun.plan is not None else fx
        excluded = bad | _row_mask(_poisoned(planned, bad, device), fx.num_rows)
        report.kernel.update(
            kernel_checks(planned, {rerun.label: (rerun.out.cpu(), rerun.lse.cpu())}, excluded, device)
        )
        report.judged_rows[rerun.label] = int((~excluded).sum())
        report.drift = [d for version, (out, lse) in fx.outputs.items()
                        for d in (output_drift(rerun.out.cpu(), out, version),
                                  output_drift(rerun.lse.cpu().float(), lse, version, what="lse"))]
        report.agreement = agreeing_groups(
            dict(fx.outputs, **{rerun.label: (rerun.out.cpu(), rerun.lse.cpu().float())})
        )
    elif len(fx.outputs) > 1:
        report.agreement = agreeing_groups(fx.outputs)
    return report


def _poisoned(fx: Fixture, bad_inputs: torch.Tensor, device="cpu") -> list[int]:
    """Rows (with finite inputs) whose planned selection reads a NaN slot."""
    truth_out, _ = reference_outputs(fx, "planned", "float64", device)
    nan_rows = (
        torch.isnan(truth_out).flatten(1).any(dim=1).cpu()
        if truth_out.numel()
        else torch.zeros(fx.num_rows, dtype=torch.bool)
    )
    return (nan_rows & ~bad_inputs).nonzero().flatten().tolist()


def _row_mask(rows, n: int) -> torch.Tensor:
    mask = torch.zeros(n, dtype=torch.bool)
    mask[list(rows)] = True
    return mask


def _zero_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return x.masked_fill(rows.view(-1, *([1] * (x.dim() - 1))).to(x.device), 0)


def _rows_as_read(fx: Fixture) -> torch.Tensor:
    """The rows the plan's layout reads, for the invariant check: the intended rows as laid
    out (compacted: valid entries first), as the production layouts read them."""
    from reference.rules import valid_first

    rows = fx["intended"]
    return valid_first(rows) if fx.meta.get("layout") == "compacted" else rows
