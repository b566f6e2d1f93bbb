"""Row-by-row checks for batches of production size (docs/edges.md#scale), on the device.

The tolerance policy is the one of ``reference/budget.py`` (docs/error-budget.md), applied to
every row on its own instead of to the whole output: row r passes when

    max|err_kernel[r]|  <= MAX_FACTOR  * max|err_lowp[r]|  + floor[r]
    mean|err_kernel[r]| <= MEAN_FACTOR * mean|err_lowp[r]| + floor[r]

with the same factors and floors (the LSE floor from the row's own largest ``|lse|``), no NaN
in the row and its infinities where the truth has them. A whole-output number (a relative L2,
or one max over 10^4 rows) cannot be moved by a single wrong row; a row's own budget can.

The references (float64 truth and the low-precision yardstick over the as-planned selection)
are computed a chunk of rows at a time, so that 32768 rows x 128 heads never hold more than
one chunk's float64 outputs. The selections themselves are compared on the device as well
(:func:`selection_mismatches_on`): on the host the same work takes tens of seconds at these
sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_constants import INVALID
from reference import sparse_mla_reference
from reference.budget import LSE_ULPS, allowed_errors, check_same_shapes, element_errors, finite_mismatch

#: Output elements (rows x heads x 512) whose references one chunk computes: 2**26 float64
#: values are 512 MiB, and the comparison holds a few tensors of that size at once.
CHUNK_ELEMENTS = 1 << 26
#: Memory budget handed to the oracle for each chunk (it chunks again inside, by rows).
ORACLE_BUDGET_BYTES = 2 << 30


@dataclass
class RowErrors:
    """One quantity (out or lse) of every row, against its references, on the host."""

    name: str
    nan: torch.Tensor  # int64 [N]: NaN elements in the row
    inf_bad: torch.Tensor  # int64 [N]: positions where the row and the truth disagree on +-inf
    max_err: torch.Tensor  # float64 [N]
    max_budget: torch.Tensor  # float64 [N]: MAX_FACTOR * max|err_lowp| + floor
    mean_err: torch.Tensor  # float64 [N]
    mean_budget: torch.Tensor  # float64 [N]
    worst_head: torch.Tensor  # int64 [N]: the head holding the row's largest error

    @property
    def bad(self) -> torch.Tensor:
        return (
            (self.nan > 0) | (self.inf_bad > 0) | (self.max_err > self.max_budget) | (self.mean_err > self.mean_budget)
        )

    @property
    def severity(self) -> torch.Tensor:
        """How far past its budget each row is (max of the two ratios; inf with NaN or a wrong inf)."""
        ratio = torch.maximum(self.max_err / self.max_budget, self.mean_err / self.mean_budget)
        return torch.where((self.nan > 0) | (self.inf_bad > 0), torch.full_like(ratio, float("inf")), ratio)

    def describe(self, r: int) -> str:
        parts = [
            f"{self.name} max err {float(self.max_err[r]):.3g} vs budget {float(self.max_budget[r]):.3g}",
            f"mean err {float(self.mean_err[r]):.3g} vs {float(self.mean_budget[r]):.3g}",
            f"worst head {int(self.worst_head[r])}",
        ]
        if int(self.nan[r]):
            parts.append(f"{int(self.nan[r])} NaN")
        if int(self.inf_bad[r]):
            parts.append(f"{int(self.inf_bad[r])} inf mismatches")
        return ", ".join(parts)

    @staticmethod
    def empty(name: str) -> RowErrors:
        ints, floats = torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float64)
        return RowErrors(name, ints, ints, floats, floats, floats, floats, ints)

    @staticmethod
    def cat(parts: list[RowErrors]) -> RowErrors:
        fields = ("nan", "inf_bad", "max_err", "max_budget", "mean_err", "mean_budget", "worst_head")
        return RowErrors(parts[0].name, *(torch.cat([getattr(p, f) for p in parts]).cpu() for f in fields))


def row_errors(
    name: str,
    actual: torch.Tensor,
    truth: torch.Tensor,
    lowp: torch.Tensor,
    kv_dtype: str = "bfloat16",
    ulps: float = 0.0,
) -> RowErrors:
    """The policy of :func:`reference.budget.compare_to_budget` for every row (dim 0) of
    ``actual [N, H, ...]`` on its own, computed in float64 on ``truth``'s device; ``ulps`` raises
    the row's floor by that many float32 ulps of the row's largest finite ``|truth|``."""
    check_same_shapes(name, actual, truth, lowp)
    n = truth.shape[0]
    a, t, lo = (
        x.detach().to(device=truth.device, dtype=torch.float64).reshape(n, truth.shape[1] if truth.dim() > 1 else 1, -1)
        for x in (actual, truth, lowp)
    )
    err, err_l, both = element_errors(a, t, lo)
    count = both.flatten(1).sum(dim=1).clamp(min=1).to(torch.float64)
    per_head = err.amax(dim=2)  # [N, H]
    max_err = per_head.amax(dim=1)
    max_abs_t = (
        torch.where(torch.isfinite(t), t.abs(), torch.zeros((), dtype=t.dtype, device=t.device)).flatten(1).amax(dim=1)
    )
    max_budget, mean_budget = allowed_errors(
        err_l.flatten(1).amax(dim=1), err_l.flatten(1).sum(dim=1) / count, max_abs_t, kv_dtype, ulps
    )
    return RowErrors(
        name=name,
        nan=torch.isnan(a).flatten(1).sum(dim=1),
        inf_bad=finite_mismatch(a, t).flatten(1).sum(dim=1),
        max_err=max_err,
        max_budget=max_budget,
        mean_err=err.flatten(1).sum(dim=1) / count,
        mean_budget=mean_budget,
        worst_head=per_head.argmax(dim=1),
    )


@dataclass
class RowReport:
    """Every row's out and LSE against its own budget."""

    out: RowErrors
    lse: RowErrors

    @property
    def num_rows(self) -> int:
        return int(self.out.max_err.numel())

    @property
    def bad(self) -> torch.Tensor:
        return self.out.bad | self.lse.bad

    @property
    def ok(self) -> bool:
        return not bool(self.bad.any())

    def bad_rows(self) -> list[int]:
        """Failing rows, worst first (by how far past the budget)."""
        rows = self.bad.nonzero().flatten()
        if rows.numel() == 0:
            return []
        severity = torch.maximum(self.out.severity, self.lse.severity)[rows]
        order = torch.argsort(severity, descending=True, stable=True)
        return rows[order].tolist()

    def worst_ratio(self) -> float:
        """The largest error / budget of any row (out or lse, max or mean): above 1 fails."""
        if not self.num_rows:
            return 0.0
        return float(torch.maximum(self.out.severity, self.lse.severity).max())

    def summary(self) -> dict:
        bad = self.bad_rows()
        return {"rows": self.num_rows, "bad_rows": len(bad), "worst_ratio": self.worst_ratio(), "first_bad": bad[:8]}

    def describe(self, label=lambda r: "", limit: int = 8) -> str:
        """One line per failing row (worst first, ``limit`` of them): the row, ``label(row)``
        (its request, regime, context, length), its worst head and its errors against the budget."""
        bad = self.bad_rows()
        lines = [f"{len(bad)} of {self.num_rows} rows beyond the error budget (worst first):"]
        for r in bad[:limit]:
            where = label(r)
            lines.append(
                f"  row {r}{' (' + where + ')' if where else ''}: {self.out.describe(r)}; {self.lse.describe(r)}"
            )
        if len(bad) > limit:
            lines.append(f"  ... and {len(bad) - limit} more rows")
        return "\n".join(lines)


def rows_per_chunk(num_heads: int, head_dim: int = 512, elements: int = CHUNK_ELEMENTS) -> int:
    return max(1, elements // max(1, num_heads * head_dim))


def judge_rows(
    out,
    lse,
    q_nope,
    q_pe,
    ckv,
    kpe,
    slots,
    mask,
    *,
    sm_scale: float,
    k_scale: float = 1.0,
    kv_dtype: str = "bfloat16",
    chunk_rows: int | None = None,
) -> RowReport:
    """Every row of the kernel's ``out [N,H,512]`` and ``lse [N,H]`` against the float64 truth and
    the low-precision yardstick over ``slots``/``mask`` (the as-planned selection), a chunk of
    rows at a time on the tensors' device; a chunk the GPU has no memory for right now is tried
    again in halves."""
    n, h = out.shape[0], out.shape[1]
    chunk = chunk_rows or rows_per_chunk(h, out.shape[2])
    parts_out, parts_lse = [], []
    start = 0
    while start < n:
        rows = slice(start, min(n, start + chunk))
        args = (q_nope[rows], q_pe[rows], ckv, kpe, slots[rows])
        kw = dict(mask=mask[rows], sm_scale=sm_scale, k_scale=k_scale, memory_budget_bytes=ORACLE_BUDGET_BYTES)
        try:
            truth = sparse_mla_reference(*args, mode="float64", **kw)
            lowp = sparse_mla_reference(*args, mode="lowp", **kw)
        except torch.cuda.OutOfMemoryError:
            # Other processes (the suite's other workers) hold the memory now: the verdict does
            # not depend on the chunk, so a smaller one, after what this process cached is freed.
            if chunk == 1:
                raise
            truth = lowp = None
            torch.cuda.empty_cache()
            chunk = max(1, chunk // 2)
            continue
        parts_out.append(row_errors("out", out[rows], truth[0], lowp[0], kv_dtype))
        parts_lse.append(row_errors("lse", lse[rows], truth[1], lowp[1], kv_dtype, ulps=LSE_ULPS))
        del truth, lowp
        start = rows.stop
    if not parts_out:
        return RowReport(RowErrors.empty("out"), RowErrors.empty("lse"))
    return RowReport(RowErrors.cat(parts_out), RowErrors.cat(parts_lse))


# --- selections on the device ------------------------------------------------------------------


def planned_selection_on(
    kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_len: torch.Tensor, num_rows: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(b) as :func:`reference.invariants.planned_selection` computes it, on ``device``: ``(slots
    [num_rows, max_len] int64, mask)``, the first ``kv_len[t]`` entries from ``kv_indptr[t]`` on."""
    indptr = kv_indptr[:num_rows].to(device=device, dtype=torch.int64)
    lens = kv_len[:num_rows].to(device=device, dtype=torch.int64)
    width = int(lens.max()) if num_rows else 0
    cols = torch.arange(width, device=device)
    mask = cols.unsqueeze(0) < lens.unsqueeze(1)
    flat = kv_indices.to(device)
    pos = torch.where(mask, indptr.unsqueeze(1) + cols.unsqueeze(0), torch.zeros((), dtype=torch.int64, device=device))
    if bool(mask.any()) and int(pos.max()) >= flat.numel():
        raise ValueError(f"plan reads kv_indices past its end ({flat.numel()} entries)")
    slots = torch.where(mask, flat[pos].to(torch.int64), torch.full((), INVALID, dtype=torch.int64, device=device))
    return slots, mask


def same_multisets_on(a_slots, a_mask, b_slots, b_mask) -> torch.Tensor:
    """Per row, on the tensors' device: the two selections hold the same multiset of slot ids
    (:func:`reference.invariants.same_multisets`)."""
    big = torch.iinfo(torch.int64).max
    width = max(a_slots.shape[1], b_slots.shape[1])

    def canonical(slots, mask):
        out = torch.full((slots.shape[0], width), big, dtype=torch.int64, device=slots.device)
        out[:, : slots.shape[1]] = torch.where(mask, slots.to(torch.int64), big)
        return out.sort(dim=1).values

    return (canonical(a_slots, a_mask) == canonical(b_slots, b_mask.to(a_slots.device))).all(dim=1)


def selection_mismatches_on(step, device) -> list[int]:
    """Rows whose planned selection (b) is not the intended multiset (a), computed on ``device``
    (:func:`harness.pipeline.selection_mismatches` at production batch sizes)."""
    from .scenario import intended_slots_on

    n = step.num_planned
    a_slots = intended_slots_on(step.scenario, device)[: step.scenario.planned_rows]
    b_slots, b_mask = planned_selection_on(step.kv_indptr, step.kv_indices, step.planned_lens, n, device)
    m = min(a_slots.shape[0], n)
    same = same_multisets_on(a_slots[:m], a_slots[:m] != INVALID, b_slots[:m].to(a_slots.device), b_mask[:m])
    rows = (~same).nonzero().flatten().tolist()
    if a_slots.shape[0] != n:
        rows.append(m)
    return rows
