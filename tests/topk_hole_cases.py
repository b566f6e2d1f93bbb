"""The cases both tiers run with holes in the top-k (docs/findings.md#top-k-holes-attended) and the
check of one step: decode rows at every regime context beside a long request, their top-k rows
written from tied, infinite or NaN scores (``harness.topk_holes``), through a backend.

:func:`check_hole_step` runs one step with the ``harness.backend_step`` checks: the rows with
holes that execute past their valid count, and only they, raise
:class:`~harness.findings.TopkHolesAttended` with each such row's lengths and its output's error
against the contract and the implementation oracle; every other row (a row with holes that
executes its valid count among them) must execute its valid count and its intended slots, and its
output must be within the error budget. A backend whose kernel would read a -1 inside a planned
span (the port's compacted layout) is checked before launch.
"""

from __future__ import annotations

import pytest
import torch

from harness.backend_step import (
    describe_row,
    executed_length_problems,
    references,
    routing_problems,
    run_step,
    selection_problems,
)
from harness.cases import LONG_CTX, Case, KernelConfig, regime_contexts
from harness.findings import TopkHolesAttended, rows_past_valid, topk_holes_finding
from harness.spec import batch
from harness.topk_holes import TopkHoles, describe_holes, measure_hole_rows
from reference.budget import compare_attention, compare_to_budget
from reference.indexer import HOLE_KINDS
from reference.rules import valid_counts

#: The kernel configurations the cases cycle (bf16: every release plans it).
CONFIGS = (KernelConfig("bfloat16", True, 16), KernelConfig("bfloat16", False, 32))
#: FlashMLA's on the GPU: DeepSeek-V3.2's, rope 64.
ROPE_CONFIGS = (KernelConfig("bfloat16", True, 16), KernelConfig("bfloat16", True, 64))


def hole_cases(topk: int, configs=CONFIGS) -> list[tuple[Case, TopkHoles, KernelConfig]]:
    """Per kpool and score pattern: one decode row at each regime context and a long request (so
    every row is the indexer's top-k, not the identity fill), in a configuration of ``configs``
    (cycled)."""
    cases = []
    for kpool in (1, 4):
        contexts = [c for c in regime_contexts(topk, kpool) if c != LONG_CTX]
        spec = batch(*[(ctx, 1) for ctx in contexts], (LONG_CTX, 1), topk=topk, kpool=kpool)
        for kind in HOLE_KINDS:
            holes = TopkHoles(kind, 1 if kind == "nan" else 3)
            config = configs[len(cases) % len(configs)]
            cases.append((Case(f"every-context-kpool{kpool}-topk{topk}", config.apply(spec), holes=holes), holes,
                          config))
    return cases


def hole_params(topk: int, configs=CONFIGS):
    return [pytest.param(case, id=f"{case.name}-{holes.id}-{config.id}")
            for case, holes, config in hole_cases(topk, configs)]


def rows_without_entries(scenario) -> list[int]:
    """The planned rows whose top-k holds no valid entry (each candidate a hole): empty rows,
    out 0 and LSE -inf under the contract."""
    return (valid_counts(scenario.intended_slots()[: scenario.planned_rows]) == 0).nonzero().flatten().tolist()


def planned_past_problems(outcome, scenario) -> list[str]:
    """The rows planned past their valid count, where nothing was read back (a step planned only)."""
    return [f"{describe_row(outcome, scenario, r)}: planned past its valid count"
            for r in rows_past_valid(outcome, scenario)]


def comparisons_of_rows(outcome, scenario, inputs, rows: list[int], kernel: str | None):
    """The output (and LSE) of ``rows`` against the float64 oracle over (a), by the budget."""
    truth, lowp = references(outcome, scenario, inputs)
    pick = torch.tensor(rows, dtype=torch.int64, device=outcome.out.device)
    kv = scenario.spec.kv_dtype
    if outcome.lse is None:
        return [compare_to_budget("out", outcome.out[pick], truth[0][pick], lowp[0][pick], kv)]
    return compare_attention(outcome.out[pick], outcome.lse[pick], (truth[0][pick], truth[1][pick]),
                             (lowp[0][pick], lowp[1][pick]), kv, kernel=kernel)


def check_hole_step(backend, layer, scenario, inputs, *, filler: str | None = None, spared=lambda outcome: ()):
    """One step of ``scenario`` on ``layer`` (planned only where ``inputs`` is None), judged as the
    module says; ``spared(outcome)``: rows whose output another finding decides (left out of the
    output check). Returns the outcome where no row reads a hole."""
    outcome = run_step(layer, scenario, inputs)
    problems = (routing_problems(outcome, scenario) + executed_length_problems(outcome, scenario)
                + selection_problems(outcome, scenario))
    if outcome.executed_lengths is None:
        problems += planned_past_problems(outcome, scenario)
    finding = topk_holes_finding(outcome, scenario, problems)
    where = f"{backend.name}; {describe_holes(scenario)}"
    if problems and finding is None:
        raise AssertionError(f"{where}\n" + "\n".join(problems[:12]))
    attended = set(rows_past_valid(outcome, scenario)) if finding is not None else set()
    if inputs is not None and outcome.planned_rows:
        left_out = attended | set(spared(outcome))
        others = [r for r in range(outcome.planned_rows) if r not in left_out]
        bad = [c for c in comparisons_of_rows(outcome, scenario, inputs, others, getattr(backend, "kernel", None))
               if not c.ok] if others else []
        if bad:
            raise AssertionError(f"rows that attend no hole beyond the error budget; {where}\n"
                                 + "\n".join(c.summary() for c in bad))
    if finding is not None:
        measured = measure_hole_rows(outcome, scenario, sorted(attended), inputs, filler)
        raise TopkHolesAttended(finding + "\n" + "\n".join(row.describe() for row in measured))
    return outcome


def check_empty_rows_as_flashmla_gives_them(outcome, empty: list[int]) -> None:
    """Rows the holes emptied, as FlashMLA gives an empty row: out 0 as the contract says, LSE
    +inf where the contract says -inf (docs/computation.md#empty-rows)."""
    out, lse = outcome.out[empty], outcome.lse[empty]
    assert bool((out == 0).all()) and bool((lse == float("inf")).all()), (
        f"{outcome.backend}: empty rows {empty}: out max |{float(out.abs().max()):.3g}|, lse {lse.unique().tolist()}")
