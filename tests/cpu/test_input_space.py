"""The production input space (docs/input-space.md) drawn whole on the CPU tier, through the
implementation under test (``--impl``): every dimension's value classes in combination, each
case checked end to end before the kernel (kv_len against the valid count, the plan against the
intended slots), and the draw itself measured: the ``ci`` profile must reach every value class,
the covering design of ``thorough`` every feasible pair.

A batch evolving over steps (requests joining and finishing, prefill chunks turning into
decodes, drafts accepted and rejected, requests idle for a step, batches shrinking after
growing) is a stateful test that carries the production buffers from step to step as the
attention state does: the convert output, kv_len and kv_indices are reused, never cleared.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from harness.cases import case_scenario
from harness.findings import topk_hole_rows
from harness.input_space import (
    SITUATIONS,
    SPACE,
    classify_case,
    coverage_of,
    covering_assignments,
    covering_cases,
    pair_universe,
)
from harness.pipeline import describe_rows, prepare_step, selection_mismatches
from harness.transitions import TRANSITIONS
from pytest_sparse_mla.coverage import coverage_lines, record_input
from pytest_sparse_mla.hypothesis_profiles import covering_strength, input_cases
from reference import kv_len_rule, valid_counts
from tests import bugs
from tests.support.evolving_batch import SCRIPTED_TRANSITIONS, EvolvingBatch, run_scripted


def with_covering_examples(test):
    """The active profile's covering design as explicit examples, so the draw reaches every
    value class (ci) or every feasible pair (thorough) whatever the random draws are."""
    for i, case in enumerate(covering_cases(covering_strength())):
        test = example(case=case, seed=i)(test)
    return test


def check_case(impl, device, case, seed):
    scenario = case_scenario(case, seed)
    step = prepare_step(impl, scenario, case.layout, device)
    record_input(classify_case(case))
    where = f"case {case.id}; {step.context()}"
    truth = kv_len_rule(scenario.row_ctx, case.spec.topk, case.spec.kpool)
    assert torch.equal(step.lens.to(torch.int64), truth), f"kv_len != the rule; {where}"
    counts = step.counts[: scenario.num_rows].cpu()
    assert torch.equal(counts, valid_counts(scenario.intended_slots())[: scenario.num_rows]), f"valid counts; {where}"
    assert step.num_planned == scenario.planned_rows, (
        f"{step.num_planned} rows planned, q has {scenario.planned_rows}; {where}")
    bad = set(selection_mismatches(step))
    # docs/findings.md#top-k-holes-attended: rows with holes in their top-k are planned with the
    # length rule's count, past their valid entries, under every layout
    holes = set(topk_hole_rows(scenario))
    c_rows = {r for r, g in enumerate(scenario.row_regime[: step.num_planned]) if g == "C"}
    if case.layout == "compacted":
        violating = {v.row for v in step.violations}
        assert violating <= holes, where + "\n" + "\n".join(str(v) for v in step.violations if v.row not in holes)
        assert bad == holes, f"planned != intended slots beyond the rows with holes; {where}\n" + describe_rows(
            step, sorted(bad ^ holes))
    else:
        # docs/findings.md#regime-c-planned-as-a-prefix: exactly the regime C rows are wrong, and
        # the rows with holes.
        assert bad == c_rows | holes, (f"mismatches beyond the regime C and top-k holes findings; {where}\n"
                                       + describe_rows(step, sorted(bad ^ (c_rows | holes))))


@given(case=input_cases(), seed=st.integers(0, 2**31 - 1))
@with_covering_examples
def test_drawn_production_inputs_plan_the_intended_slots(impl, device, case, seed):
    """Any case of the production input space: kv_len is the rule on every row, the convert
    counts match the intended selection, and the plan reads the intended slots."""
    check_case(impl, device, case, seed)


def test_ci_draw_reaches_every_value_class():
    """The draw the ci profile makes (its examples and its random draws) reaches every value
    class of every dimension: a class no case reaches fails here."""
    drawn = []

    @settings(settings.get_profile("ci"))
    @given(case=input_cases(), seed=st.just(0))
    @with_covering_examples
    def collect(case, seed):
        drawn.append(classify_case(case))

    collect()
    cov = coverage_of(drawn)
    assert cov.every_class, f"value classes the ci draw misses: { {k: v for k, v in cov.classes_missed.items() if v} }"
    assert not cov.situations_missed, f"situations the ci draw misses: {cov.situations_missed}"
    assert not cov.outside, f"drawn values outside the production space: {cov.outside}"


def test_ci_design_reaches_every_class_and_situation_in_its_coverage_table():
    """The ci profile's covering design alone (its explicit examples, what every backend's
    drawn-input test runs under ci) shows in the --input-coverage table with no class and no
    situation MISSED, the new ones included."""
    lines = coverage_lines([tuple(sorted(a)) for a in covering_assignments(1)], full=True)
    assert not [line for line in lines if "MISSED" in line], lines
    table = "\n".join(lines)
    for name in ("bound-only", "positions-only", "neither", "holes", "fp8-nope", "full-graph"):
        assert name in table, f"{name} not in the table:\n{table}"
    for situation in SITUATIONS:
        assert situation.name in table, f"{situation.name} not in the table:\n{table}"


def test_covering_designs_reach_what_they_promise():
    """Strength 1 reaches every class, strength 2 every feasible pair, and each realised case
    falls in exactly the classes it was realised for (classify(realize(a)) == a); a case of top-k
    holes has a planned row with holes."""
    for strength in (1, 2):
        for case in covering_cases(strength, seed=strength):
            got = classify_case(case)
            assert got == dict(case.assignment), {k: (v, got[k]) for k, v in case.assignment if got[k] != v}
            if case.holes is not None:  # the class is the rows, not the label
                assert topk_hole_rows(case_scenario(case, seed=strength)), f"no planned row has holes: {case.id}"
    assert coverage_of(dict(a) for a in covering_assignments(1)).every_class
    pairs = coverage_of(dict(a) for a in covering_assignments(2))
    assert pairs.pairs_reached == pairs.pairs_total == len(pair_universe()), pairs.pairs_missed[:5]
    for strength in (1, 2):
        assert not coverage_of(dict(a) for a in covering_assignments(strength)).situations_missed
    # 16 dimensions; context_source holds 4 classes (which optional sources the metadata holds)
    assert sum(len(d.classes) for d in SPACE) == 46


# --- a batch evolving over steps, buffers carried -------------------------------------------


#: No shrinking: each shrink step re-runs whole sequences through the interpreted convert kernel;
#: a failure reports the sequence as found, its steps printed (and, under --dump-failures, writes
#: it shrunk over its steps: recording.sequence). Derandomized: every run draws the same sequences.
#: The thorough profile draws as many sequences as test_the_draw_reaches_every_transition shows
#: reach every transition.
EvolvingBatch.TestCase.settings = settings(max_examples=12 if covering_strength() == 1 else 300,
                                           stateful_step_count=8 if covering_strength() == 1 else 12,
                                           derandomize=True, database=None, phases=(Phase.explicit, Phase.generate))


class TransitionsDrawn(EvolvingBatch):
    """The machine's draws alone (no step is planned): the transitions they reach. (An override
    of the invariant itself would not be one: Hypothesis finds invariants by their decorator.)"""

    reached: set[str] = set()

    def note_transitions(self, names) -> None:
        TransitionsDrawn.reached |= names

    def check_spec(self, spec):
        pass


TransitionsDrawn.TestCase.settings = settings(max_examples=300, stateful_step_count=12, derandomize=True,
                                              database=None, phases=(Phase.explicit, Phase.generate))


def test_the_draw_reaches_every_transition():
    """The evolving batch's draw (the same rules, settings of its own: drawing is cheap) reaches
    every transition production makes between consecutive steps (harness.transitions)."""
    TransitionsDrawn.reached = set()
    TransitionsDrawn.device = "cpu"
    TransitionsDrawn.TestCase().runTest()
    missed = sorted(set(TRANSITIONS) - TransitionsDrawn.reached)
    assert not missed, f"transitions the draw never makes: {missed}"


@pytest.mark.parametrize("name", sorted(SCRIPTED_TRANSITIONS))
def test_each_scripted_transition_in_reused_buffers(impl, device, name):
    """The scripted run of each transition a small draw may miss, planned into reused buffers on
    the run's device: it makes its transition, and every step reads what it intends."""
    machine = EvolvingBatch()
    machine.impl, machine.device = impl, device
    assert name in run_scripted(machine, name)


@pytest.mark.parametrize("name", [n for n in sorted(SCRIPTED_TRANSITIONS) if n.startswith("idle-request-")])
def test_a_scripted_idle_request_fails_request_ids_that_skip_it(device, name):
    """The scripted idle-request runs are checks that can fail: request ids that skip a request
    with no query row plan the rows after it for the wrong request."""
    machine = EvolvingBatch()
    machine.impl, machine.device = bugs.RequestIdsSkipEmptyRequests(), device
    with pytest.raises(AssertionError, match="rows planned wrong"):
        run_scripted(machine, name)


def test_evolving_batch_in_reused_buffers(impl, device):
    """Steps of one batch planned into the same buffers (on the run's device): every step
    reads what it intends."""
    EvolvingBatch.impl, EvolvingBatch.device = impl, device
    EvolvingBatch.TestCase().runTest()


# --- the classes the older draws missed catch bugs ------------------------------------------


@pytest.mark.parametrize(("bug", "dimension", "value_class"), [
    ("BlockSizeAsShift", "block_size", "non-pow2-multiple-of-64"),
    ("RequestIdsSkipEmptyRequests", "no_query_requests", "middle"),
    ("RowsFromTheTokenCount", "padded_rows", "full-graph"),
])
def test_recreated_bug_is_caught_by_its_input_class(device, bug, dimension, value_class):
    """Each re-created bug of a class the hand-picked catalogue never drew fails on covering
    cases of that class, and passes on a few others (it is that class that catches it)."""
    impl = getattr(bugs, bug)()
    caught, other_failures = [], []
    cases = covering_cases(2)
    inside = [c for c in cases if dict(c.assignment)[dimension] == value_class]
    outside = [c for c in cases if dict(c.assignment)[dimension] != value_class][:3]
    for i, case in enumerate(inside[:4] + outside):
        try:
            check_case(impl, device, case, seed=i)
        except AssertionError:
            (caught if dict(case.assignment)[dimension] == value_class else other_failures).append(case.id)
    assert caught, f"{bug}: no covering case of {dimension}={value_class} fails"
    assert not other_failures, f"{bug}: fails outside {dimension}={value_class}: {other_failures[:3]}"


def test_coverage_table_shows_the_gaps():
    """A draw that misses a class shows it as MISSED in its dimension's line, and the pairs it
    misses; a full strength-2 draw reports every pair reached."""
    rows = [dict(a) for a in covering_assignments(1)]
    dropped = rows[0]["variant"]
    partial = [tuple(sorted(r.items())) for r in rows if r["variant"] != dropped]
    lines = coverage_lines(partial, full=True)
    assert any(line.strip().startswith("variant") and f"MISSED {dropped}" in line for line in lines), lines
    assert any("pairs missed" in line for line in lines), lines
    full = coverage_lines([tuple(sorted(dict(a).items())) for a in covering_assignments(2)], full=True)
    assert "every feasible pair reached" in full[-1] and "46/46 value classes" in full[0], full[:2]
