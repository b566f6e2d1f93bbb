"""Holes in the top-k (docs/input-space.md#holes-in-the-top-k): a step whose indexer rows carry
-1 inside their valid prefix, written by the indexer model of ``reference.indexer``
(:func:`~reference.indexer.row_with_holes`) from tied, infinite or NaN scores, and what each
such row does on a backend (docs/findings.md#top-k-holes-attended).

- :class:`TopkHoles`: the score pattern a case draws (a value of the input space's
  ``topk_holes`` class, carried by the case beside its batch spec);
- :func:`with_topk_holes`: a built scenario with every row of the indexer's top-k (not the
  identity fill) written from such scores, drawn from the scenario's seed;
- :func:`measure_hole_rows`: per row with holes, its lengths and its output's error against the
  contract oracle and the implementation oracle (``reference.contract``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from backends.seam import StepOutcome
from reference.budget import compare_to_budget
from reference.contract import contract_reference, implementation_reference
from reference.indexer import HOLE_KINDS, row_with_holes
from reference.rules import kv_len_rule, valid_counts, valid_first

from .device_inputs import AttentionInputs
from .hashed_values import component_seed
from .spec import Scenario


@dataclass(frozen=True)
class TopkHoles:
    """The indexer scores of a step's top-k rows: ``kind`` one of
    ``reference.indexer.HOLE_KINDS``; ``count`` the non-finite scores per row (``inf``, ``nan``)."""

    kind: str
    count: int = 1

    def __post_init__(self) -> None:
        if self.kind not in HOLE_KINDS:
            raise ValueError(f"kind must be one of {HOLE_KINDS}, got {self.kind!r}")
        if self.count < 1:
            raise ValueError(f"count must be >= 1, got {self.count}")

    @property
    def id(self) -> str:
        return self.kind if self.kind == "ties" else f"{self.kind}{self.count}"


def with_topk_holes(scenario: Scenario, holes: TopkHoles) -> Scenario:
    """``scenario`` with each query row that the indexer's top-k writes (every row but the
    identity fill) rewritten from scores of ``holes`` (``reference.indexer.row_with_holes``),
    drawn from a generator keyed by the scenario's seed; padded rows stay as built."""
    spec = scenario.spec
    rng = np.random.default_rng(component_seed(scenario.seed, f"topk-holes-{holes.id}"))
    topk = scenario.topk_indices.clone()
    for row in range(scenario.num_rows):
        if not bool(scenario.row_identity[row]):
            topk[row] = torch.from_numpy(row_with_holes(int(scenario.row_ctx[row]), spec.topk, spec.kpool,
                                                        spec.resolved_width, holes.kind, holes.count, rng))
    return dataclasses.replace(scenario, topk_indices=topk, extra={**scenario.extra, "topk_holes": holes})


def describe_holes(scenario: Scenario) -> str:
    """The scenario with the score pattern its top-k rows were written from, if any."""
    holes = scenario.extra.get("topk_holes")
    return scenario.describe() + (f" topk_holes={holes.id}" if holes is not None else "")


class HoleRow(NamedTuple):
    """A row with holes as a backend ran it: the length rule's count (``formula``), its valid
    entries, the length it executed (planned, where nothing was read back), the largest absolute
    error of its output against each oracle (NaN where the output holds a NaN) and whether the
    output is within the error budget of the contract's (None where not computed)."""

    row: int
    regime: str
    ctx: int
    formula: int
    valid: int
    executed: int
    error_contract: float | None = None
    error_implementation: float | None = None
    within_budget: bool | None = None

    def describe(self) -> str:
        errors = ""
        if self.error_contract is not None:
            budget = "within" if self.within_budget else "beyond"
            errors = f"; out max |err| vs contract {self.error_contract:.3g} ({budget} the budget)"
        if self.error_implementation is not None:
            errors += f", vs implementation {self.error_implementation:.3g}"
        return (f"row {self.row} (regime {self.regime}, ctx {self.ctx}): executed {self.executed}, length rule "
                f"{self.formula}, valid {self.valid} ({self.formula - self.valid} holes){errors}")


def row_max_errors(out: torch.Tensor, truth: torch.Tensor) -> list[float]:
    """Per row, ``max |out - truth|`` in float64 (NaN where ``out`` holds a NaN)."""
    return (out.double() - truth.double()).abs().flatten(1).amax(dim=1).tolist()


def rows_within_budget(out: torch.Tensor, truth: torch.Tensor, lowp: torch.Tensor, kv_dtype: str) -> list[bool]:
    """Per row, whether ``out`` is within the error budget of ``truth`` (``reference.budget``)."""
    return [compare_to_budget("out", out[i : i + 1], truth[i : i + 1], lowp[i : i + 1], kv_dtype).ok
            for i in range(out.shape[0])]


def measure_hole_rows(outcome: StepOutcome, scenario: Scenario, rows: list[int],
                      inputs: AttentionInputs | None = None, filler: str | None = None) -> list[HoleRow]:
    """``rows`` as ``outcome`` ran them; with ``inputs`` and an output, each row's error against
    the contract oracle (and whether it is within the budget) and, with ``filler`` (how the
    backend packs a -1 inside a row's length), against the implementation oracle, both over the
    row's compacted converted entries and the length it executed."""
    n = outcome.planned_rows
    slots = valid_first(scenario.intended_slots()[:n]).to(torch.int64)
    valid = valid_counts(slots).tolist()
    formula = kv_len_rule(scenario.row_ctx[:n], scenario.spec.topk, scenario.spec.kpool).tolist()
    lengths = outcome.executed_lengths if outcome.executed_lengths is not None else outcome.planned_lengths
    executed = lengths.to(torch.int64)[:n]
    contract = implementation = budget = [None] * len(rows)
    if inputs is not None and outcome.out is not None and rows:
        spec, device = scenario.spec, inputs.q_nope.device
        picked = torch.tensor(rows)
        args = (inputs.q_nope[picked.to(device)], inputs.q_pe[picked.to(device)], inputs.ckv, inputs.kpe,
                slots[picked].to(device), executed[picked].to(device))
        kw = dict(sm_scale=spec.sm_scale, k_scale=spec.k_scale)
        out = outcome.out[picked.to(outcome.out.device)].cpu()
        truth = contract_reference(*args, **kw)[0].cpu()
        contract = row_max_errors(out, truth)
        budget = rows_within_budget(out, truth, contract_reference(*args, mode="lowp", **kw)[0].cpu(), spec.kv_dtype)
        if filler is not None:
            implementation = row_max_errors(out, implementation_reference(*args, filler, **kw)[0].cpu())
    return [HoleRow(r, scenario.row_regime[r], int(scenario.row_ctx[r]), formula[r], valid[r], int(executed[r]), c, i,
                    b) for r, c, i, b in zip(rows, contract, implementation, budget, strict=True)]
