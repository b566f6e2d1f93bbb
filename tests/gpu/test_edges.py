"""The kernel's edges (docs/edges.md): score magnitudes and stale slots.

Every step runs through the one judge (``harness.judge``, the ``judge`` fixture) on the port under
the case's kv_indices layout (``backends.flashinfer.port.PortBackend``): the checks before launch, the
state's buffers against the rehearsed layout, a bitwise rerun, the kernel against the oracle.

Magnitude (``edge("magnitude")``): raw scores (q . k before sm_scale) offset far below and far
above zero, by row across a batch, inside a row (split signs), and rows far below the rest of
their batch, through the scenario's ``score_offsets`` (harness.scenario). Softmax is
shift-invariant, so the kernel must agree with the oracle within the error budget at any offset;
the judge compares each offset's rows on their own (``harness.backend_step.offset_comparisons``),
so that the LSE floor of a row at |lse| ~ 4000 is not the floor of a row at |lse| ~ 10. Rows with
no slot (kv_len 0 among normal rows) must hold :func:`empty_row_contract`.

Stale slots (``edge("stale-slots")``): one layer of the port, keeping its plan where rows and
lengths repeat, runs a step, then a step of as many rows with other lengths and slots, then a
smaller step, without clearing anything (as an engine reuses the state's buffers), for every
kv_indices layout; then every kv_indices entry outside the planned spans is overwritten with slot
ids the step reads elsewhere and the kernel is run again. A read past a row's kv_len shows as a
wrong number: each run must equal, bitwise, the same step on a fresh layer, which the judge holds
to the oracle within the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from backends.flashinfer.port import PortBackend
from fast.layouts import LAYOUTS
from harness import batch, build_scenario
from harness.backend_step import laid_out_step
from harness.case_log import note_sequence, note_sequence_step
from harness.case_runner import run_case, run_sequence
from harness.cases import LONG_CTX, Case, covering_config
from harness.judge import judge_step
from harness.pipeline import as_planned, describe_rows
from harness.port.launch import DEVICE
from harness.scenario import with_empty_rows
from mla_constants import TOPK
from tests.support.magnitude import magnitude_cases

pytestmark = pytest.mark.gpu

# --- magnitude --------------------------------------------------------------------------------


#: (layout, covering-config index) per case: the four cases meet the three kernel variants and
#: the four head counts; packed and compacted (strided is refused at plan for rows shorter than W
#: wherever the probe finds the page-count check).
MAGNITUDE_PARAMS = [
    pytest.param(case, layout, covering_config(index), id=f"{case.id}-{layout}-{covering_config(index).id}")
    for case, (layout, index) in zip(
        magnitude_cases(), [("packed", 0), ("compacted", 1), ("compacted", 2), ("packed", 3)], strict=True
    )
]


@pytest.mark.edge("magnitude")
@pytest.mark.parametrize(("case", "layout", "config"), MAGNITUDE_PARAMS)
def test_kernel_holds_at_any_score_offset(gpu, judge, case, layout, config):
    """Each offset's rows: kernel == the oracle within the budget, as at offset 0."""
    run_case(judge, PortBackend("fa3", gpu.impl, layout), config.apply(case.spec), DEVICE, seed=41,
             what="edge magnitude")


@dataclass(frozen=True)
class EmptyRowContract:
    """What every element of a planned row with kv_len 0 holds after run(): ``out`` in the
    output, ``lse`` in the (natural-log) LSE. NaN means the kernel leaves the element as it was
    (the tests fill the buffers with NaN first)."""

    out: float
    lse: float
    source: str

    def holds(self, values: torch.Tensor, expected: float) -> bool:
        values = values.float()
        return bool(torch.isnan(values).all()) if math.isnan(expected) else bool((values == expected).all())


def empty_row_contract(features) -> EmptyRowContract:
    """The contract for empty rows on the installed FlashInfer (``features``: its version and
    probed behaviour). The oracle's convention, 0 and -inf (docs/computation.md#empty-rows),
    which 0.6.18.post1, 0.7.0.post1 and 0.7.4 return on an H200 (docs/edges.md#rows-with-no-slot)."""
    return EmptyRowContract(
        out=0.0,
        lse=float("-inf"),
        source="the oracle's convention, measured on an H200 with 0.6.18.post1, 0.7.0.post1 and 0.7.4",
    )


class EmptyRows:
    """The implementation under test with kv_len 0 for ``rows`` (the production rule never
    plans an empty row: ctx >= 1); everything else is the implementation's."""

    def __init__(self, impl, rows):
        self._impl = impl
        self._rows = list(rows)

    def __getattr__(self, name):
        return getattr(self._impl, name)

    def kv_lens(self, meta, **kwargs):
        lens = self._impl.kv_lens(meta, **kwargs).clone()
        lens[self._rows] = 0
        return lens


def found_values(values: torch.Tensor) -> str:
    distinct = torch.unique(values.float().flatten().cpu())
    shown = ", ".join(f"{v:g}" for v in distinct[:4].tolist())
    return f"{{{shown}{', ...' if distinct.numel() > 4 else ''}}}"


#: First, middle and last rows emptied among rows of every kind of length.
EMPTY_ROWS_CASE = Case("empty-rows-among-normal-rows", batch((700, 1), (9, 1), (TOPK + 5, 1), (40, 1), (LONG_CTX, 1),
                                                             (1500, 1), kpool=1))
EMPTIED = (0, 3, 5)


@pytest.mark.edge("magnitude")
@pytest.mark.parametrize(
    ("layout", "config"),
    [
        pytest.param(layout, covering_config(index), id=f"{layout}-{covering_config(index).id}")
        for layout, index in [("packed", 4), ("compacted", 5)]
    ],
)
def test_rows_with_no_slot_hold_the_contract(gpu, judge, layout, config):
    """Empty rows among normal rows: the empty rows hold the contract, every row the oracle's
    (whose empty rows are the contract's too)."""
    case = EMPTY_ROWS_CASE
    scenario = with_empty_rows(build_scenario(config.apply(case.spec), seed=43), EMPTIED)
    what = f"edge magnitude (empty rows {list(EMPTIED)})"
    backend = PortBackend("fa3", EmptyRows(gpu.impl, EMPTIED), layout)
    outcome = run_case(judge, backend, scenario.spec, DEVICE, seed=43, scenario=scenario, what=what)
    empty = list(EMPTIED)
    assert [int(outcome.planned_lengths[r]) for r in empty] == [0] * len(empty), "test setup: rows not emptied"
    out, lse = outcome.out, outcome.lse
    contract = empty_row_contract(gpu.features)
    held = contract.holds(out[empty], contract.out) and contract.holds(lse[empty], contract.lse)
    assert held, (
        f"empty rows: out {found_values(out[empty])}, lse {found_values(lse[empty])}; the contract ({contract.source}) "
        f"says out {contract.out:g}, lse {contract.lse:g}; {what}; {scenario.describe()}; {backend.describe()}"
    )


# --- stale slots ------------------------------------------------------------------------------


def stale_sequence(kind: str) -> list[Case]:
    """The previous step (6 rows of topk slots each), a step of as many rows with other slots
    (``short``: other lengths too), and a smaller step. ``full``: every row topk = W long, the
    only lengths a strided plan is accepted with where the probe finds the page-count check."""
    previous = batch(*[(TOPK + 64 + 7 * i, 1) for i in range(6)], kpool=1)
    if kind == "full":
        return [Case("previous-6-rows", previous),
                Case("same-count-other-slots", batch(*[(TOPK + 900 + 13 * i, 1) for i in range(6)], kpool=1)),
                Case("smaller", batch((TOPK + 5, 1), (3 * TOPK, 1), (TOPK + 77, 1), kpool=1))]
    return [Case("previous-6-rows", previous),
            Case("same-count-other-lengths", batch((5, 1), (700, 1), (TOPK - 1, 1), (TOPK + 9, 1), (64, 1), (1500, 1),
                                                   kpool=1)),
            Case("smaller", batch((TOPK + 200, 1), (9, 1), (1000, 1), kpool=1))]


def cache_blocks(spec) -> int:
    """Physical blocks of a spec's cache (the scenario builder's count, known from the spec)."""
    return spec.min_block_id + sum(math.ceil(r.seq_len / spec.block_size) for r in spec.requests) + spec.spare_blocks


def one_cache_size(specs) -> list:
    """The specs with spare blocks added so that every cache has as many blocks as the largest:
    a slot id any step leaves in kv_indices is a slot, holding finite values, of every cache."""
    target = max(cache_blocks(s) for s in specs)
    return [s.replace(spare_blocks=s.spare_blocks + target - cache_blocks(s)) for s in specs]


def outside_spans(step, capacity: int) -> torch.Tensor:
    """Host bool ``[capacity]``: the kv_indices entries no planned row reads (kv_indptr[i] up to
    kv_indptr[i] + kv_len[i] is row i's span)."""
    read = torch.zeros(capacity, dtype=torch.bool)
    for row, length in enumerate(step.planned_lens.tolist()):
        start = int(step.kv_indptr[row])
        read[start:start + length] = True
    return ~read


def fill_outside_spans(kv_indices: torch.Tensor, step) -> int:
    """Overwrite every kv_indices entry outside the planned spans with slot ids the step reads
    elsewhere (finite KV, wrong for any row that would read them); the number overwritten."""
    outside = outside_spans(step, kv_indices.numel())
    slots, mask = as_planned(step)
    planned = slots[mask].to(torch.int32)
    count = int(outside.sum())
    if count == 0 or planned.numel() == 0:
        return 0
    ids = planned.roll(1).repeat(-(-count // planned.numel()))[:count]
    kv_indices[outside.to(kv_indices.device)] = ids.to(kv_indices.device)
    return count


def differing_rows(a_out, a_lse, b_out, b_lse) -> list[int]:
    """Rows whose outputs or LSE are not bitwise equal (NaN never equal)."""
    out_bad = ~(a_out == b_out).reshape(a_out.shape[0], -1).all(dim=1)
    lse_bad = ~(a_lse == b_lse).all(dim=1)
    return (out_bad | lse_bad).nonzero().flatten().tolist()


STALE_PARAMS = [
    pytest.param(layout, kind, covering_config(index), id=f"{layout}-{kind}-{covering_config(index).id}")
    for layout, kind, index in [("packed", "short", 6), ("compacted", "short", 7), ("strided", "short", 8),
                                ("strided", "full", 9)]
]
assert {p.values[0] for p in STALE_PARAMS} == set(LAYOUTS), "every kv_indices layout meets stale slots"


@pytest.mark.edge("stale-slots")
@pytest.mark.parametrize(("layout", "kind", "config"), STALE_PARAMS)
def test_previous_steps_slots_change_nothing(gpu, judge, layout, kind, config):
    """A step on a layer a larger step left behind, then with every entry outside the planned
    spans overwritten by slot ids it reads elsewhere, equals the same step on a fresh layer,
    bitwise. Where the installed FlashInfer refuses a step's plan as it is expected to, the test
    ends there."""
    cases = stale_sequence(kind)
    specs = one_cache_size([config.apply(c.spec) for c in cases])
    steps = [(spec, 51 + i) for i, spec in enumerate(specs)]
    scenarios = [build_scenario(spec, seed) for spec, seed in steps]
    rows = [s.planned_rows for s in scenarios]
    assert rows[1] == rows[0] > rows[2], "test setup: as many rows, then fewer"
    # Plans are kept where rows and lens repeat (AttentionConfig.reuse_plan), as an engine may.
    backend = PortBackend("fa3", gpu.impl, layout, reuse_plan=True)
    # a failure is written as this sequence of steps through one attention state (recording.sequence)
    note_sequence("attention-state", layout, max(s.topk_indices.shape[0] for s in scenarios), reuse_plan=True)
    for scenario in scenarios:
        note_sequence_step(scenario)

    def against_a_fresh_layer(index, layer, scenario, inputs, outcome):
        if index == 0:
            return
        ctx = (f"edge stale-slots, step {index} ({cases[index].name} after {cases[index - 1].name}); "
               f"{scenario.describe()}; {backend.describe()}")
        fresh = judge_step(backend, backend.open_layer(layer.config, DEVICE), scenario, inputs,
                           context_of_step=f"edge stale-slots, step {index} on a fresh layer")
        if fresh.failure is not None:
            raise fresh.failure
        step = laid_out_step(scenario, outcome)
        bad = differing_rows(outcome.out, outcome.lse, fresh.outcome.out, fresh.outcome.lse)
        gpu.regime_log.blame(step.regimes(bad))
        assert not bad, (f"the state the previous step left gives other results than a fresh state on "
                         f"{len(bad)} rows; {ctx}\n" + describe_rows(step, bad))
        overwritten = fill_outside_spans(layer.state.kv_indices, step)
        out, lse = layer.attend_again(outcome)
        gpu.regime_log.kernel_ran()
        bad = differing_rows(out, lse, fresh.outcome.out, fresh.outcome.lse)
        gpu.regime_log.blame(step.regimes(bad))
        assert not bad, (f"{overwritten} kv_indices entries outside the planned spans, overwritten with finite slot "
                         f"ids, changed {len(bad)} rows; {ctx}\n" + describe_rows(step, bad))

    run_sequence(judge, backend, steps, DEVICE, after_step=against_a_fresh_layer, what="edge stale-slots")
