"""Multi-step sequences: steps run through state carried from one step to the next, as an engine
carries it, so that a failure that needs several steps can be run again and handed on
(``recording.sequence`` writes and replays them).

Two kinds of carried state:

- ``reused-buffers`` (the host stages, any device): convert, kv_len, kv_indptr and the kv_indices
  layout of every step written into buffers sized once for ``max_rows`` rows and never cleared
  (the buffers an attention state reserves; they start with garbage, not -1 or 0);
- ``attention-state`` (an SM90 GPU with FlashInfer): one attention state of the implementation
  under test, sized for ``max_rows``; each step is planned, then converted, laid out and run on
  it, optionally with the device part captured once in a CUDA graph (after the plan of the first
  step) and replayed after each plan, or with the plan kept when it is the same
  (``reuse_plan``). Each step's state must hand the kernel what the step describes, and its
  output must be within the budget of (b). A graph replay is followed by an eager run of the
  same plan, as ``tests/gpu/test_cuda_graphs.py`` runs it: the eager output is judged against
  (b), the replay must equal it bitwise except where the plan's cluster size differs from the
  captured one (FlashInfer's standing finding, reported in the step's ``findings``).

A sequence names its steps as (spec, seed) pairs: the one scenario builder rebuilds them.
:func:`run_recorded_sequence` runs one and returns every step's problems (empty where it is right);
:func:`first_failure` names the first failing step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from backends.flashinfer.port import make_attention_state
from fast.layouts import indices_capacity
from reference import intended_selection, kv_len_rule, planned_selection
from reference.invariants import same_multisets

from ..scenario import build_scenario
from ..spec import BatchSpec, Scenario

KINDS = ("reused-buffers", "attention-state")
#: What the carried buffers hold before the first step (production never clears them).
GARBAGE_SLOT, GARBAGE_LEN, GARBAGE_INDEX = 12345, 7, 54321


@dataclass(frozen=True)
class Sequence:
    kind: str
    layout: str
    steps: tuple[tuple[BatchSpec, int], ...]  # (spec, seed) of each step, in order
    max_rows: int  # rows the carried buffers (and a captured graph) are sized for
    graph: bool = False
    reuse_plan: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"sequence kind must be one of {KINDS}, got {self.kind!r}")

    @property
    def width(self) -> int:
        return self.steps[0][0].resolved_width if self.steps else 0

    def scenarios(self) -> list[Scenario]:
        return [build_scenario(spec, seed) for spec, seed in self.steps]

    def without(self, index: int) -> Sequence:
        return dataclasses.replace(self, steps=self.steps[:index] + self.steps[index + 1:])

    def describe(self) -> str:
        mode = ", graph captured once and replayed" if self.graph else ""
        mode += ", plan kept when the same" if self.reuse_plan else ""
        return f"{len(self.steps)}-step {self.kind} sequence, layout {self.layout}, max_rows {self.max_rows}{mode}"


@dataclass
class StepResult:
    index: int
    problems: list[str] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)  # known findings the step showed, not its failures


def first_failure(results: list[StepResult]) -> StepResult | None:
    return next((r for r in results if r.problems), None)


def sequence_rows(scenarios: list[Scenario]) -> int:
    """The rows buffers sized once must hold for these steps (at least one)."""
    return max([1] + [s.topk_indices.shape[0] for s in scenarios])


# --- reused buffers (host stages) ---------------------------------------------------------------


class ReusedBuffers:
    """The convert output, kv_len and kv_indices an attention state reserves once."""

    def __init__(self, max_rows: int, width: int, device):
        self.max_rows, self.width, self.device = max_rows, width, device
        self.slots = torch.full((max_rows, width), GARBAGE_SLOT, dtype=torch.int32, device=device)
        self.kv_len = torch.full((max_rows,), GARBAGE_LEN, dtype=torch.int32, device=device)
        self.kv_indices = torch.full((indices_capacity(max_rows, width),), GARBAGE_INDEX, dtype=torch.int32,
                                     device=device)


def host_step_problems(impl, buffers: ReusedBuffers, scenario: Scenario, layout: str, where: str = "") -> list[str]:
    """One step's host stages through ``impl`` into the carried ``buffers``: kv_len must be the
    rule on every row, and every planned row must read its intended slots, except the regime C
    rows of the strided and packed layouts (docs/findings.md#regime-c-planned-as-a-prefix),
    which must be exactly the rows read wrong there."""
    dev, rows_cap, width = buffers.device, buffers.max_rows, buffers.width
    spec, meta = scenario.spec, scenario.meta
    rows = scenario.topk_indices.shape[0]
    if rows > rows_cap:
        return [f"the step has {rows} rows, more than the {rows_cap} the buffers hold; {where}"]
    topk = torch.full((rows_cap, width), -1, dtype=torch.int32)
    topk[:rows] = scenario.topk_indices
    table = scenario.block_table if scenario.block_table.shape[0] else torch.zeros((1, 1), dtype=torch.int32)
    topk, table = topk.to(dev), table.to(dev)
    req = impl.request_ids(meta.query_start_loc_cpu, rows_cap).to(dev)
    strided = layout == "strided"
    out = buffers.kv_indices[: rows_cap * width].view(rows_cap, width) if strided else buffers.slots
    impl.convert(topk, table, req, spec.block_size, out=out)
    lens = impl.kv_lens(meta, topk=spec.topk, kpool=spec.kpool, async_scheduling=spec.async_scheduling)
    planned = impl.planned_lens(meta, lens, topk=spec.topk).to(torch.int32)
    n = planned.numel()
    buffers.kv_len.zero_()
    buffers.kv_len[:n] = planned.to(dev)
    indptr = impl.kv_indptr(layout, planned, rows_cap, width)
    if not strided:
        impl.write_kv_indices(layout, out, buffers.kv_len, indptr.to(dev), buffers.kv_indices)
    where = f"{where} layout={layout} {scenario.describe()}".strip()
    problems = []
    truth = kv_len_rule(scenario.row_ctx, spec.topk, spec.kpool)
    if not torch.equal(lens.to(torch.int64), truth):
        wrong = (lens.to(torch.int64) != truth).nonzero().flatten().tolist()
        problems.append(f"kv_len != the rule on rows {wrong[:8]} (e.g. row {wrong[0]}: {int(lens[wrong[0]])} "
                        f"vs {int(truth[wrong[0]])}, regime {scenario.row_regime[wrong[0]]}); {where}")
        return problems
    b_slots, b_lens = planned_selection(indptr.cpu(), buffers.kv_indices.cpu(), planned.cpu(), n)
    a_slots, a_mask = intended_selection(scenario.intended_slots(), n)
    b_mask = torch.arange(b_slots.shape[1]).unsqueeze(0) < b_lens.unsqueeze(1)
    same = same_multisets(a_slots, a_mask, b_slots, b_mask)
    bad = set((~same).nonzero().flatten().tolist())
    c_rows = {r for r, g in enumerate(scenario.row_regime[:n]) if g == "C"}
    expected = set() if layout == "compacted" else c_rows
    if bad != expected:
        problems.append(f"rows planned wrong {sorted(bad)} (regime C rows {sorted(c_rows)}); {where}")
    return problems


def raised(index: int, exc: Exception) -> StepResult:
    """A step whose implementation raised: one problem naming the exception (the steps after it
    are not run)."""
    return StepResult(index, [f"step {index} raised {type(exc).__name__}: {str(exc)[:300]}"])


def run_host_sequence(impl, sequence: Sequence, device) -> list[StepResult]:
    buffers = ReusedBuffers(sequence.max_rows, sequence.width, device)
    results = []
    for i, scenario in enumerate(sequence.scenarios()):
        try:
            results.append(StepResult(i, host_step_problems(impl, buffers, scenario, sequence.layout,
                                                            where=f"step {i}")))
        except Exception as exc:  # the implementation under test raised: the step fails with it
            results.append(raised(i, exc))
            break
    return results


# --- one attention state (GPU) ------------------------------------------------------------------


class _Refusals:
    """A launch log that keeps the refusals the installed FlashInfer is expected to make."""

    def __init__(self):
        self.refused: list[str] = []

    def kernel_ran(self) -> None:
        pass

    def expected_refusal(self, why: str) -> None:
        self.refused.append(why)


def run_state_sequence(impl, features, sequence: Sequence) -> list[StepResult]:
    """Every step through one attention state on the GPU (``harness.port.launch.DEVICE``), its
    buffers and state sized for the sequence's row capacity (``sequence.max_rows``: what its
    test sized them for, which sets FlashInfer's batch size under CUDA graphs)."""
    from ..device_inputs import build_attention_inputs
    from . import launch

    scenarios = sequence.scenarios()
    static = launch.StaticStep(scenarios, impl, max_rows=sequence.max_rows)
    steps = [launch.prepared(impl, s, sequence.layout, max_rows=static.max_rows) for s in scenarios]
    config = dataclasses.replace(launch.attention_config(scenarios[0], sequence.layout, static.max_rows),
                                 reuse_plan=sequence.reuse_plan)
    state = make_attention_state(impl, config, launch.DEVICE)
    inputs = [build_attention_inputs(s, launch.DEVICE) for s in scenarios]
    graph, results, refusals = None, [], _Refusals()
    for i, (scenario, step) in enumerate(zip(scenarios, steps, strict=True)):
        try:
            result, graph = _state_step(impl, features, sequence, state, static, graph, i, scenario, step, inputs[i],
                                        refusals)
        except Exception as exc:  # the implementation (or FlashInfer, refusing what it was handed) raised
            results.append(raised(i, exc))
            break
        results.append(result)
    return results


@dataclass
class CapturedGraph:
    """The device part of a step captured once in a CUDA graph, after the plan of ``rows`` rows."""

    graph: object
    rows: int


def captured_step(state, static, rows: int) -> CapturedGraph:
    """Warm-up outside capture, then ``state.step`` on ``static``'s buffers captured in a CUDA
    graph, after the state's plan of ``rows`` rows."""
    state.step(*static.args())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        state.step(*static.args())
    return CapturedGraph(graph, rows)


def differing_rows(a_out, a_lse, b_out, b_lse) -> list[int]:
    """Rows whose outputs or LSE are not bitwise equal (NaN never equal)."""
    out_same = (a_out == b_out).reshape(a_out.shape[0], -1).all(dim=1)
    lse_same = (a_lse == b_lse).reshape(a_lse.shape[0], -1).all(dim=1)
    return (~(out_same & lse_same)).nonzero().flatten().tolist()


def replay_against_eager(rows: list[int], num_rows: int, captured_rows: int, num_heads: int,
                         max_rows: int) -> tuple[list[str], list[str]]:
    """``(problems, findings)`` of a graph replay whose ``rows`` differ from the eager run of the
    same plan, judged as ``tests/gpu/test_cuda_graphs.py`` judges it: a replay may differ only
    where the plan's cluster size differs from the captured one, FlashInfer's standing finding
    (docs/findings.md#graph-replay-with-stale-plan-state); any other difference is a problem."""
    from ..findings import STALE_CLUSTER_FINDING
    from ..plan_limits.scheduler import cluster_size

    if not rows:
        return [], []
    planned = cluster_size(num_rows, num_heads, max_rows)
    captured = cluster_size(captured_rows, num_heads, max_rows)
    what = (f"graph replay != eager run of the same plan on rows {rows[:8]} ({num_rows} rows, cluster size "
            f"{planned}; captured after {captured_rows} rows, cluster size {captured})")
    if planned != captured:
        return [], [f"{what}: {STALE_CLUSTER_FINDING}"]
    return [what], []


def _state_step(impl, features, sequence, state, static, graph, i, scenario, step, inputs, refusals):
    """One step of :func:`run_state_sequence`: ``(StepResult, the CapturedGraph so far)``. A
    graph sequence captures the device part once, at its first launched step, replays it after
    each plan and runs the same plan eagerly after it, as ``tests/gpu/test_cuda_graphs.py``
    does: the eager run is judged against the references, the replay against the eager run."""
    from . import launch

    where = f"step {i} of {sequence.describe()}; {launch.failure_context(step, features.version)}"
    mismatches = sorted(launch.selection_mismatches(step))
    c_rows = sorted(r for r, g in enumerate(step.regimes()) if g == "C")
    if sequence.layout != "compacted" and c_rows:
        # docs/findings.md#regime-c-planned-as-a-prefix: not launched; exactly those rows wrong
        wrong = [] if mismatches == c_rows else [f"rows planned wrong {mismatches[:8]} (regime C rows "
                                                 f"{c_rows[:8]}); {where}"]
        return StepResult(i, wrong), graph
    problems = [f"invariant {v}; {where}" for v in step.violations[:4]]
    if mismatches:
        problems.append(f"planned slots (b) != intended (a) on rows {mismatches[:8]}; {where}")
    if problems:
        return StepResult(i, problems), graph
    static.load(scenario, inputs)
    if launch.plan_or_refusal(features, state, step, refusals) is not None:
        return StepResult(i), graph
    n = step.num_planned
    if sequence.graph and graph is None:
        graph = captured_step(state, static, n)
        static.load(scenario, inputs)
    if graph is not None:
        graph.graph.replay()
    else:
        state.step(*static.args())
    launch.sync()
    problems = [f"{p}; {where}" for p in launch.state_matches_step(state, step)]
    if problems:
        return StepResult(i, problems), graph
    out, lse, findings = static.out, static.lse, []
    if graph is not None:
        out, lse = static.out[:n].clone(), static.lse[:n].clone()
        static.out.fill_(float("nan"))
        static.lse.fill_(float("nan"))
        state.step(*static.args())
        launch.sync()
        rows = differing_rows(out, lse, static.out[:n], static.lse[:n])
        problems, findings = replay_against_eager(rows, n, graph.rows, scenario.spec.num_heads, static.max_rows)
        problems = [f"{p}; {where}" for p in problems]
        out, lse = static.out, static.lse
    if n:
        comparisons = launch.compare_with_references(step, inputs, out, lse, state)
        problems += [f"{c.summary(step.scenario.row_regime)}; {where}" for c in comparisons if not c.ok]
    return StepResult(i, problems, findings), graph


def run_recorded_sequence(impl, sequence: Sequence, device, features=None) -> list[StepResult]:
    """Run ``sequence`` through ``impl``: an attention-state sequence on the GPU where
    ``features`` (the installed FlashInfer's) are given, else its host stages with the buffers
    carried."""
    if sequence.kind == "attention-state" and features is not None:
        return run_state_sequence(impl, features, sequence)
    return run_host_sequence(impl, sequence, device)


def first_droppable_step(sequence: Sequence) -> int:
    """The first step a shrink may drop: the second of a graph sequence, whose first step is
    the batch its test captured the graph after (the capture's shape and cluster size are that
    plan's), else the first."""
    return 1 if sequence.graph else 0


def shrink_sequence(sequence: Sequence, fails, max_trials: int = 24) -> tuple[Sequence, int]:
    """The sequence with every step dropped whose absence keeps ``fails(sequence)`` true (the
    last step always kept: it is where the failure shows; so is a graph sequence's first, the
    capture's: :func:`first_droppable_step`), trying each once, at most ``max_trials`` runs;
    returns it and the runs made."""
    trials, i = 0, first_droppable_step(sequence)
    while i < len(sequence.steps) - 1 and trials < max_trials:
        candidate = sequence.without(i)
        trials += 1
        if fails(candidate):
            sequence = candidate
        else:
            i += 1
    return sequence, trials
