"""kv_len against the convert kernel's count of valid entries, and the prefix invariant, in
every context regime (docs/regimes.md#context-regimes), for kpool 1 and 4 and every kv_indices layout.

Where the production layouts are wrong (regime C under strided and packed), the case is a
strict xfail naming docs/findings.md#regime-c-planned-as-a-prefix: CI stays green while the
finding stands, and the day it is
fixed the xfail turns into a failure that asks for the marker to go.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from fast.layouts import LAYOUTS
from harness import BatchSpec, Request, build_attention_inputs, build_scenario
from harness.pipeline import describe_rows, prepare_step, selection_mismatches
from recording.case_log import fixture_from_step
from reference import kv_len_rule, valid_counts
from tests.regime_c import REGIME_CASES as CASES
from tests.regime_c import raise_regime_c_finding, regime_c_marks


def layout_params():
    return [pytest.param(case, layout, id=f"{case.id}-{layout}", marks=regime_c_marks(case, layout))
            for case in CASES for layout in LAYOUTS]


class ConvertedOnce:
    """The implementation under test, its convert run once for a case's scenario: a case's
    layouts and its kv_len check share it (the convert does not depend on the layout), each
    getting its own copy of the converted rows."""

    def __init__(self, impl):
        self.impl = impl
        self.converted = None

    def convert(self, *args, **kwargs):
        if self.converted is None:
            self.converted = self.impl.convert(*args, **kwargs)
        return tuple(t.clone() for t in self.converted) if isinstance(self.converted, tuple) else self.converted.clone()

    def __getattr__(self, name):
        return getattr(self.impl, name)


_CASE_STEPS: dict = {}  # (implementation, device, case id) -> (scenario, ConvertedOnce)


def case_step(impl, device, case, layout: str):
    """The step of ``case`` (seed 2) in ``layout``, its convert shared with the case's other steps."""
    key = (id(impl), str(device), case.id)
    if key not in _CASE_STEPS or _CASE_STEPS[key][0] is not impl:
        _CASE_STEPS[key] = (impl, build_scenario(case.spec, seed=2), ConvertedOnce(impl))
    _, scenario, converted = _CASE_STEPS[key]
    return scenario, prepare_step(converted, scenario, layout, device)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_kv_len_equals_valid_count(impl, device, case, regime_log):
    """Every planned row's kv_len equals the convert kernel's count of valid entries, and the
    planned rows are exactly the rows q hands to the kernel (on the indexer rows of seed 2, the
    draw the layout tests of the case plan)."""
    scenario, step = case_step(impl, device, case, "compacted")
    regime_log.record(step.regimes(), focus=case.focus or None)
    counts = step.counts[: step.num_planned].cpu()
    bad = (counts != step.planned_lens).nonzero().flatten().tolist()
    regime_log.blame(step.regimes(bad))
    assert step.num_planned == scenario.planned_rows, (
        f"{step.num_planned} rows planned but q has {scenario.planned_rows} rows "
        f"(prefills to MHA: {scenario.prefills_to_mha}); {step.context()}"
    )
    assert not bad, f"kv_len != valid count on {len(bad)} rows; {step.context()}\n" + describe_rows(step, bad)


@pytest.mark.parametrize(("case", "layout"), layout_params())
def test_plan_reads_the_intended_slots(impl, device, case, layout, regime_log, failure_dump):
    """Invariants hold and the plan makes the kernel read exactly the valid slots of each
    indexer row (as-implemented selection == intended selection)."""
    scenario, step = case_step(impl, device, case, layout)
    failure_dump.arm(lambda: fixture_from_step(step, build_attention_inputs(scenario), focus=list(case.focus)))
    regime_log.record(step.regimes(), focus=case.focus or None)
    regime_log.blame(step.regimes([v.row for v in step.violations if v.row is not None]))
    raise_regime_c_finding(step, regime_log)
    assert not step.violations, f"invariant violations; {step.context()}\n" + "\n".join(map(str, step.violations[:8]))
    bad = selection_mismatches(step)
    regime_log.blame(step.regimes(bad))
    assert not bad, f"planned slots != intended slots on {len(bad)} rows; {step.context()}\n" + describe_rows(step, bad)


@pytest.mark.parametrize("layout", ["strided", "packed"])
def test_regime_c_reads_slot_zero_or_minus_one(impl, device, layout):
    """The consequence of the regime C finding, shown exactly: under packed the row attends
    slot 0 for its r newest tokens; under strided its planned span holds -1."""
    scenario = build_scenario(batch_regime_c(), seed=3)
    step = prepare_step(impl, scenario, layout, device)
    row = 0
    assert scenario.row_regime[row] == "C"
    ctx, kpool = int(scenario.row_ctx[row]), scenario.spec.kpool
    r = ctx % kpool
    start = int(step.kv_indptr[row])
    span = step.kv_indices[start : start + int(step.planned_lens[row])].cpu()
    expected_bad = 0 if layout == "packed" else -1
    assert int((span == expected_bad).sum()) == r, f"{layout}: row ctx={ctx} expected {r} entries == {expected_bad}"


def batch_regime_c() -> BatchSpec:
    return BatchSpec(requests=(Request(1001, 1), Request(100_003, 1)), topk=2048, kpool=4)


# --- random batches ------------------------------------------------------------------------

TOPKS = (128, 256, 2048)


@st.composite
def batch_specs(draw) -> BatchSpec:
    topk = draw(st.sampled_from(TOPKS))
    kpool = draw(st.sampled_from((1, 4)))
    near = st.sampled_from([1, kpool - 1, kpool, kpool + 1, topk - kpool - 1, topk - 1, topk, topk + 1,
                            topk + kpool - 1, topk + kpool, 2 * topk + 1])
    ctx = st.one_of(near.filter(lambda c: c >= 1), st.integers(1, 3 * topk), st.integers(3 * topk, 200_000))
    num_decodes = draw(st.integers(0, 5))
    spec_k = draw(st.sampled_from((0, 0, 3)))
    decodes = []
    for _ in range(num_decodes):
        seq = draw(ctx)
        decodes.append(Request(max(seq, spec_k + 1), spec_k + 1))
    prefills = []
    for _ in range(draw(st.integers(0, 3))):
        seq = draw(ctx)
        q = draw(st.integers(spec_k + 2, max(spec_k + 2, min(seq, 96))))
        prefills.append(Request(max(seq, q), q))
    async_ = draw(st.booleans())
    return BatchSpec(
        requests=tuple(decodes + prefills), topk=topk, kpool=kpool, decode_threshold=spec_k + 1,
        async_scheduling=async_, host_bound_slack=draw(st.integers(0, 3)) if async_ else 0,
        block_size=draw(st.sampled_from((1, 16, 64))), padded_rows=draw(st.integers(0, 3)),
    )


#: A step with no request and padded rows only (a CUDA-graph step): its block table has no row.
PADDING_ONLY = BatchSpec(requests=(), topk=128, kpool=1, block_size=1, padded_rows=1)


@given(spec=batch_specs(), seed=st.integers(0, 2**31 - 1))
@example(spec=PADDING_ONLY, seed=0)
def test_random_batches_plan_intended_slots_compacted(impl, device, spec, seed):
    """Random batches: kv_len == valid count, and the compacted plan reads the intended slots."""
    scenario = build_scenario(spec, seed)
    step = prepare_step(impl, scenario, "compacted", device)
    assert torch.equal(
        step.counts[: scenario.num_rows].cpu(), valid_counts(scenario.intended_slots())[: scenario.num_rows]
    )
    assert torch.equal(step.lens.to(torch.int64), kv_len_rule(scenario.row_ctx, spec.topk, spec.kpool)), step.context()
    assert not step.violations, step.context() + "\n" + "\n".join(map(str, step.violations[:8]))
    bad = selection_mismatches(step)
    assert not bad, step.context() + "\n" + describe_rows(step, bad)


@given(spec=batch_specs(), seed=st.integers(0, 2**31 - 1))
@example(spec=PADDING_ONLY, seed=0)
def test_random_batches_packed_fails_only_on_regime_c(impl, device, spec, seed):
    """The packed layout's only mismatches are regime C rows (and every regime C row mismatches)."""
    scenario = build_scenario(spec, seed)
    step = prepare_step(impl, scenario, "packed", device)
    bad = set(selection_mismatches(step))
    c_rows = {r for r, g in enumerate(scenario.row_regime[: step.num_planned]) if g == "C"}
    assert bad == c_rows, step.context() + "\n" + describe_rows(step, sorted(bad ^ c_rows))
