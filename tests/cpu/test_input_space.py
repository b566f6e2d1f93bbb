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
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from harness import BatchSpec, Request, build_scenario
from harness.case_log import note_sequence, note_sequence_step
from harness.cases import case_scenario
from harness.findings import topk_hole_rows
from harness.input_space import (
    SITUATIONS,
    SPACE,
    classify,
    classify_case,
    coverage_of,
    covering_assignments,
    covering_cases,
    pair_universe,
)
from harness.pipeline import describe_rows, prepare_step, selection_mismatches
from harness.sequence import ReusedBuffers, host_step_problems
from harness.spec import graph_padded, uniform_query_len
from harness.transitions import TRANSITIONS, step_transitions
from pytest_sparse_mla.coverage import coverage_lines, record_input, record_transitions
from pytest_sparse_mla.hypothesis_profiles import covering_strength, input_cases
from reference import kv_len_rule, valid_counts
from tests import bugs


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

MAX_ROWS = 40
TOPK_SMALL = 128


class EvolvingBatch(RuleBasedStateMachine):
    """Requests join (a prefill chunk), decode with drafts accepted or rejected (each request's
    draft count trimmed on its own, or no drafts at all), sit a step out, finish; each request's
    context comes from the source the machine draws (the host bound, the positions, seq_lens);
    steps may be padded up to the largest batch seen (a CUDA graph captured for it). Every step is
    planned into buffers sized once for MAX_ROWS rows and reused; the transitions between
    consecutive steps are recorded (harness.transitions)."""

    SEQUENCE_KIND = "reused-buffers"  # the state it carries (harness.sequence), as a failure is dumped

    def __init__(self):
        super().__init__()
        self.requests: list[list] = []  # [seq_len, q_len, idle, drafts]
        self.steps = 0
        self.previous = None  # the last step's spec
        self.largest = 0  # the most rows of any step so far
        self.prefills_turned = 0  # prefill requests of the last step that decode in the next

    @initialize(kpool=st.sampled_from((1, 4)), block_size=st.sampled_from((64, 192, 128)),
                layout=st.sampled_from(("strided", "packed", "compacted")), drafts=st.integers(0, 3),
                async_=st.booleans(), source=st.sampled_from(("host-bound", "positions", "seq-lens")),
                graph_padding=st.booleans())
    def configure(self, kpool, block_size, layout, drafts, async_, source, graph_padding):
        self.kpool, self.block_size, self.layout, self.drafts, self.async_ = kpool, block_size, layout, drafts, async_
        self.source, self.graph_padding = source, graph_padding
        self.slack = 0
        self.width = BatchSpec(requests=(), topk=TOPK_SMALL, kpool=kpool).resolved_width
        # The buffers an attention state reserves once; stale contents stay between steps.
        self.buffers = ReusedBuffers(MAX_ROWS, self.width, self.device)
        note_sequence(self.SEQUENCE_KIND, layout, MAX_ROWS)

    def rows(self) -> int:
        return sum(0 if r[2] else r[1] for r in self.requests)

    @precondition(lambda self: self.rows() + 16 <= MAX_ROWS - 4)
    @rule(ctx=st.sampled_from((5, TOPK_SMALL - 1, TOPK_SMALL + 1, TOPK_SMALL + 3, 3 * TOPK_SMALL + 2, 700)),
          chunk=st.integers(2, 16))
    def join(self, ctx, chunk):
        self.requests.append([max(ctx, chunk), chunk, False, self.drafts])

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish(self, data):
        self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def sit_out(self, data):
        self.requests[data.draw(st.integers(0, len(self.requests) - 1))][2] = True

    @precondition(lambda self: any(r[3] for r in self.requests))
    @rule(data=st.data())
    def trim_drafts(self, data):
        """One request drafts fewer tokens next (an n-gram drafter's miss, or max_model_len near)."""
        r = self.requests[data.draw(st.integers(0, len(self.requests) - 1))]
        r[3] = data.draw(st.integers(0, r[3]))
        if r[1] <= self.drafts + 1:  # a decode: its next step verifies that many drafts
            r[1] = r[3] + 1

    @precondition(lambda self: any(r[3] for r in self.requests))
    @rule()
    def stop_drafting(self):
        """No request drafts next step (after rejected drafts, say)."""
        for r in self.requests:
            r[3] = 0
            if r[1] <= self.drafts + 1:
                r[1] = 1

    @precondition(lambda self: self.async_ and self.source == "host-bound"
                  and any(r[3] and not r[2] and r[1] <= self.drafts + 1 for r in self.requests))
    @rule()
    def reject_every_draft_then_stop_drafting(self):
        """The step ran with every draft rejected under async scheduling (the next host bound
        over-counts by them) and the drafter proposes none for the next step."""
        threshold = self.drafts + 1
        self.slack = max(r[3] for r in self.requests if not r[2] and r[1] <= threshold)
        for r in self.requests:
            if not r[2]:
                r[0] += 1 if r[1] <= threshold else r[3] + 1
            r[1], r[2], r[3] = 1, False, 0

    @precondition(lambda self: self.rows() + len(self.requests) * 4 <= MAX_ROWS - 4)
    @rule(accepted=st.integers(0, 3))
    def advance(self, accepted):
        """The step ran: decodes gain their accepted drafts plus one token, prefill chunks
        become decodes; the rejected drafts make the next host bound optimistic."""
        threshold = self.drafts + 1
        self.prefills_turned = sum(1 for r in self.requests if not r[2] and r[1] > threshold)
        rejected = 0
        for r in self.requests:
            took = min(accepted, r[3])
            if not r[2]:
                r[0] += (took + 1) if r[1] <= threshold else r[3] + 1
                rejected = max(rejected, r[3] - took) if r[1] <= threshold else rejected
            r[1], r[2] = r[3] + 1, False
        self.slack = rejected if self.async_ and self.source == "host-bound" else 0

    def step_spec(self) -> BatchSpec:
        threshold = self.drafts + 1
        live = [Request(s, 0 if idle else q) for s, q, idle, _ in self.requests]
        order = sorted(range(len(live)), key=lambda i: (live[i].q_len > threshold, i))  # decodes first
        rows = sum(r.q_len for r in live)
        padded = max(0, self.largest - rows) if self.graph_padding else 0
        spec = BatchSpec(requests=tuple(live[i] for i in order), topk=TOPK_SMALL, kpool=self.kpool,
                         block_size=self.block_size, decode_threshold=threshold, async_scheduling=self.async_,
                         host_bound_slack=self.slack, padded_rows=padded,
                         with_host_bound=self.source == "host-bound", with_positions=self.source != "seq-lens")
        return self.in_full_graph(spec) if self.graph_padding else spec

    def in_full_graph(self, spec: BatchSpec) -> BatchSpec:
        """A uniform decode batch with no idle request runs in the FULL graph captured for the
        largest batch seen (its rows rounded up to the query length, within the buffers), as
        vLLM's runner pads it; any other batch keeps the piecewise padding."""
        q = uniform_query_len(spec)
        if q is None or q > spec.decode_threshold or any(not r.q_len for r in spec.requests):
            return spec
        rows = sum(r.q_len for r in spec.requests)
        capture = max(rows, -(-self.largest // q) * q)
        return graph_padded(spec, capture) if capture <= MAX_ROWS else spec

    @invariant()
    def step_plans_the_intended_slots(self):
        if not hasattr(self, "width"):
            return
        spec = self.step_spec()
        self.note_transitions(step_transitions(self.previous, spec, largest_rows=self.largest,
                                               prefills_before=self.prefills_turned))
        self.previous, self.prefills_turned = spec, 0
        self.largest = max(self.largest, sum(r.q_len for r in spec.requests))
        self.steps += 1
        record_input(classify(spec, self.layout))
        self.check_spec(spec)

    def note_transitions(self, names) -> None:
        record_transitions(names)

    def check_spec(self, spec):
        self.check_scenario(build_scenario(spec, seed=self.steps))

    def check_scenario(self, scenario):
        run_step_in_reused_buffers(self, scenario)


def run_step_in_reused_buffers(state, scenario):
    note_sequence_step(scenario)
    problems = host_step_problems(state.impl, state.buffers, scenario, state.layout, where=f"step {state.steps}")
    assert not problems, "\n".join(problems)


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
