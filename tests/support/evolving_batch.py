"""The evolving batch: a Hypothesis state machine whose steps are planned into buffers reused
from step to step (the CPU tier's ``test_input_space.py`` runs it on the host stages, the GPU
tier's ``test_input_space_gpu.py`` on the kernel)."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from harness import BatchSpec, Request, build_scenario
from harness.case_log import note_sequence, note_sequence_step
from harness.input_space import (
    classify,
)
from harness.port.sequence import ReusedBuffers, host_step_problems
from harness.spec import graph_padded, uniform_query_len
from harness.transitions import step_transitions
from pytest_sparse_mla.coverage import record_input, record_transitions

MAX_ROWS = 40
TOPK_SMALL = 128


class EvolvingBatch(RuleBasedStateMachine):
    """Requests join (a prefill chunk), decode with drafts accepted or rejected (each request's
    draft count trimmed on its own, or no drafts at all), sit a step out, finish; each request's
    context comes from the source the machine draws (the host bound, the positions, seq_lens);
    steps may be padded up to the largest batch seen (a CUDA graph captured for it). Every step is
    planned into buffers sized once for MAX_ROWS rows and reused; the transitions between
    consecutive steps are recorded (harness.transitions)."""

    SEQUENCE_KIND = "reused-buffers"  # the state it carries (harness.port.sequence), as a failure is dumped

    def __init__(self):
        super().__init__()
        self.requests: list[list] = []  # [seq_len, q_len, idle, drafts]
        self.steps = 0
        self.previous = None  # the last step's spec
        self.largest = 0  # the most rows of any step so far
        self.prefills_turned = 0  # prefill requests of the last step that decode in the next
        self.noted: set[str] = set()  # the transitions of its steps so far

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
        self.noted |= names
        record_transitions(names)

    def check_spec(self, spec):
        self.check_scenario(build_scenario(spec, seed=self.steps))

    def check_scenario(self, scenario):
        run_step_in_reused_buffers(self, scenario)




class Draws:
    """A scripted stand-in for Hypothesis's ``data``: each ``draw`` returns the next value given."""

    def __init__(self, *values):
        self.values = list(values)

    def draw(self, strategy):
        return self.values.pop(0)


#: The default profile draws a dozen sequences, which reach most transitions but not all of them;
#: these runs of the machine (its configuration, then its rules in order, a rule's ``data`` the
#: values it draws) each reach the transition they are named for, so every run checks every
#: transition at least once.
SCRIPTED_BASE = dict(kpool=1, block_size=64, layout="packed", drafts=0, async_=False, source="positions",
                     graph_padding=False)
SCRIPTED_TRANSITIONS: dict[str, tuple[dict, list]] = {
    "rejected-drafts-then-no-drafts": (
        dict(SCRIPTED_BASE, drafts=2, async_=True, source="host-bound"),
        [("join", dict(ctx=TOPK_SMALL + 1, chunk=4)), ("advance", dict(accepted=0)),
         ("reject_every_draft_then_stop_drafting", {})]),
    "drafts-differ-per-request": (
        dict(SCRIPTED_BASE, kpool=4, drafts=2, layout="strided"),
        [("join", dict(ctx=700, chunk=4)), ("join", dict(ctx=TOPK_SMALL + 1, chunk=4)), ("advance", dict(accepted=1)),
         ("trim_drafts", dict(data=(0, 0)))]),
    **{f"idle-request-{source}": (
        dict(SCRIPTED_BASE, source=source, block_size=192, layout="compacted"),
        [("join", dict(ctx=700, chunk=4)), ("join", dict(ctx=TOPK_SMALL - 1, chunk=4)), ("join", dict(ctx=5, chunk=3)),
         ("sit_out", dict(data=(1,)))]) for source in ("host-bound", "positions", "seq-lens")},
}


def run_scripted(machine: EvolvingBatch, name: str) -> set[str]:
    """The run of :data:`SCRIPTED_TRANSITIONS` ``name`` on ``machine``, its invariant checked after
    the configuration and after each rule, as Hypothesis runs a drawn sequence: the transitions
    its steps made."""
    config, rules = SCRIPTED_TRANSITIONS[name]
    machine.configure(**config)
    machine.step_plans_the_intended_slots()
    for rule_name, kwargs in rules:
        if "data" in kwargs:
            kwargs = dict(kwargs, data=Draws(*kwargs["data"]))
        getattr(machine, rule_name)(**kwargs)
        machine.step_plans_the_intended_slots()
    return machine.noted


def run_step_in_reused_buffers(state, scenario):
    note_sequence_step(scenario)
    problems = host_step_problems(state.impl, state.buffers, scenario, state.layout, where=f"step {state.steps}")
    assert not problems, "\n".join(problems)
