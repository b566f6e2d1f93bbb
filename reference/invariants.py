"""What must hold before a launch (docs/invariants.md#before-launch), and the two selections the references attend.

- (a) intended: the set of valid entries of each converted indexer row;
- (b) as-implemented: exactly the slots a plan tells the kernel to read, i.e. the first
  ``kv_len[t]`` entries of row t of the laid-out ``kv_indices`` starting at ``kv_indptr[t]``.

A kernel bug is fast != (b); a plan or layout bug is (b) != (a).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_constants import INVALID


@dataclass(frozen=True)
class Violation:
    rule: str
    row: int | None
    detail: str

    def __str__(self) -> str:
        where = f"row {self.row}: " if self.row is not None else ""
        return f"[{self.rule}] {where}{self.detail}"


def _first_rows(mask: torch.Tensor, limit: int = 8) -> list[int]:
    return mask.nonzero().flatten()[:limit].tolist()


def check_row_invariants(
    converted: torch.Tensor, lens: torch.Tensor, regimes: list[str] | None = None
) -> list[Violation]:
    """Per planned row: valid count == len, and the valid entries are the first len columns."""
    n = lens.numel()
    rows = converted[:n].cpu()
    lens = lens.to(torch.int64).cpu()
    valid = rows != INVALID
    counts = valid.sum(dim=1)
    cols = torch.arange(rows.shape[1]).unsqueeze(0)
    in_span = cols < lens.unsqueeze(1)
    out: list[Violation] = []
    def label(r: int) -> str:
        if not regimes:
            return ""
        return f" (regime {regimes[r]})" if r < len(regimes) else f" (past the {len(regimes)} query rows)"

    for r in _first_rows(counts != lens):
        out.append(
            Violation("len==valid", r, f"planned len {int(lens[r])} != {int(counts[r])} valid entries{label(r)}")
        )
    hole = in_span & ~valid
    for r in _first_rows(hole.any(dim=1)):
        col = int(hole[r].nonzero()[0])
        out.append(Violation("prefix", r, f"-1 at column {col} inside the planned span of {int(lens[r])}{label(r)}"))
    return out


def check_plan_invariants(
    *,
    converted: torch.Tensor,
    lens: torch.Tensor,
    q_rows: int,
    num_slots: int,
    max_tokens: int,
    width: int,
    regimes: list[str] | None = None,
) -> list[Violation]:
    """All of docs/invariants.md#before-launch that the host can check: row invariants, planned rows == q
    rows, every planned slot < num_slots, and sum(lens) <= max_tokens * W."""
    out = check_row_invariants(converted, lens, regimes)
    if lens.numel() != q_rows:
        out.append(Violation("rows", None, f"{lens.numel()} planned rows != {q_rows} rows of q"))
    span = converted[: lens.numel()].cpu()
    in_span = torch.arange(span.shape[1]).unsqueeze(0) < lens.cpu().unsqueeze(1)
    too_big = in_span & (span >= num_slots)
    for r in _first_rows(too_big.any(dim=1)):
        out.append(Violation("slot<num_slots", r, f"slot {int(span[r][too_big[r]][0])} >= num_slots {num_slots}"))
    total = int(lens.to(torch.int64).sum())
    if total > max_tokens * width:
        out.append(Violation("capacity", None, f"sum(lens)={total} > max_tokens*W={max_tokens * width}"))
    return out


def intended_selection(converted: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a): ``(slots, mask)`` of the valid entries of the first ``num_rows`` converted rows."""
    slots = converted[:num_rows]
    return slots, slots != INVALID


def planned_selection(
    kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_len: torch.Tensor, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(b): ``(slots [num_rows, max_len], lens)`` the plan makes the kernel read."""
    indptr = kv_indptr[:num_rows].to(torch.int64).cpu()
    lens = kv_len[:num_rows].to(torch.int64).cpu()
    width = int(lens.max()) if num_rows else 0
    cols = torch.arange(width)
    pos = indptr.unsqueeze(1) + cols.unsqueeze(0)
    in_span = cols.unsqueeze(0) < lens.unsqueeze(1)
    flat = kv_indices.cpu()
    if bool(in_span.any()) and int(pos[in_span].max()) >= flat.numel():
        raise ValueError(f"plan reads kv_indices past its end ({flat.numel()} entries)")
    gathered = flat[torch.where(in_span, pos, torch.zeros_like(pos))]
    slots = torch.where(in_span, gathered, torch.full_like(gathered, INVALID))
    return slots.to(torch.int64), lens


def same_multisets(
    a_slots: torch.Tensor, a_mask: torch.Tensor, b_slots: torch.Tensor, b_mask: torch.Tensor
) -> torch.Tensor:
    """Per row: the two selections hold the same multiset of slot ids."""
    big = torch.iinfo(torch.int64).max
    width = max(a_slots.shape[1], b_slots.shape[1])

    def canonical(slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = torch.full((slots.shape[0], width), big, dtype=torch.int64)
        out[:, : slots.shape[1]] = torch.where(mask, slots.to(torch.int64), big).cpu()
        return out.sort(dim=1).values

    return (canonical(a_slots, a_mask) == canonical(b_slots, b_mask)).all(dim=1)
