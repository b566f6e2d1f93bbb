"""Plan history, poisoned workspaces and graph against eager (docs/input-space.md#plan-history,
#poisoned-workspaces, #graph-against-eager): the cases, the wrappers that run a backend's layer
with its workspaces poisoned or its forward captured in a CUDA graph, and the checks. Shared by
``tests/gpu/test_plan_history_and_state.py`` and its CPU twin.

One target step (decode rows below top-k, so the bounded design plans each row's bound plus the
slack) is run after three histories through one layer each: fresh (the target alone), kept (a
step one token shorter first: the bounded design keeps that plan, planned one past the bound less
than a fresh plan's, and clamps) and replan (a step 64 tokens longer first: past the slack, the
target is planned again). Every step is judged by ``harness.judge``.
"""

from __future__ import annotations

import pytest
import torch

import backends.sm90_state as sm90
from backends.seam import float_workspaces, poison, split_step_missing
from harness.bits import bitwise_equal
from harness.cases import KernelConfig
from harness.judge import run_sequence
from harness.spec import batch

BF16 = KernelConfig("bfloat16", True, 16)
#: The target step's decode contexts: one row inside the first KV tile, one across tiles, one longer.
TARGET_CONTEXTS = (40, 150, 330)
#: Tokens the replan history's first step is longer by: past the bounded design's slack of 32.
PAST_SLACK = 64
TARGET_SEED = 5
#: bf16 ULPs the output of the same step may differ by between plan histories whose planned
#: lengths differ (their KV split points differ). Measured 0 on the CPU stand-ins (they attend a
#: row in one softmax, unsplit); FlashInfer's fa3 kernel on an H200 is still to be measured
#: (docs/input-space.md#plan-history): a failure reports the ULPs it saw.
PLAN_HISTORY_ULPS = 1


def decode_step(contexts, seed: int, config: KernelConfig = BF16):
    return config.apply(batch(*[(c, 1) for c in contexts], kpool=1)), seed


def histories(config: KernelConfig = BF16) -> dict[str, list]:
    """The three histories, each ``(spec, seed)`` steps ending with the same target step."""
    target = decode_step(TARGET_CONTEXTS, TARGET_SEED, config)
    return {
        "fresh": [target],
        "kept": [decode_step([c - 1 for c in TARGET_CONTEXTS], 1, config), target],
        "replan": [decode_step([c + PAST_SLACK for c in TARGET_CONTEXTS], 2, config), target],
    }


def target_outcome(judge, backend, steps, device, wrap=None):
    """The last step's outcome of ``steps`` through one layer of ``backend`` (its layer wrapped
    by ``wrap`` where given), every step judged; and the step before's plan count."""
    opened = backend if wrap is None else WrappedBackend(backend, wrap)
    _, outcomes = run_sequence(judge, opened, steps, device)
    before = outcomes[-2].plans if len(outcomes) > 1 else 0
    return outcomes[-1], before


def ulp_distance_bf16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element, how many bf16 values lie between ``a`` and ``b`` (both bf16, finite)."""
    def ordered(x: torch.Tensor) -> torch.Tensor:
        bits = x.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits + 32768), bits)

    return (ordered(a) - ordered(b)).abs()


def history_problems(outcomes: dict, bound: int = PLAN_HISTORY_ULPS) -> list[str]:
    """Each history's target output against the fresh one: bit for bit where their planned
    lengths are the same (one plan, one split), within ``bound`` bf16 ULPs where they differ."""
    fresh = outcomes["fresh"]
    problems = []
    for name, outcome in outcomes.items():
        if name == "fresh":
            continue
        same_plan = fresh.planned_lengths is not None and outcome.planned_lengths is not None and \
            torch.equal(fresh.planned_lengths, outcome.planned_lengths)
        ulps = int(ulp_distance_bf16(outcome.out.cpu(), fresh.out.cpu()).max()) if outcome.out.numel() else 0
        if same_plan and not bitwise_equal(outcome.out, fresh.out):
            problems.append(f"{name}: the same planned lengths as fresh, output not bit for bit fresh's "
                            f"(max {ulps} bf16 ULPs apart)")
        elif ulps > bound:
            problems.append(f"{name}: output {ulps} bf16 ULPs from fresh's, beyond the plan-history bound of {bound} "
                            f"(planned {_lengths(outcome)} vs fresh {_lengths(fresh)})")
    return problems


def _lengths(outcome) -> list[int] | None:
    return None if outcome.planned_lengths is None else outcome.planned_lengths.tolist()


def keeps_plans(backend) -> bool:
    """A backend whose design keeps a plan while the bounds stay within its slack (vLLM's bounded design)."""
    return getattr(backend, "design", None) == "bounded"


def history_kind_problems(backend, runs: dict) -> list[str]:
    """Where the backend keeps plans: the kept history's target made no plan and runs on planned
    lengths other than fresh's, the replan history's target planned again."""
    if not keeps_plans(backend):
        return []
    problems = []
    (kept, kept_before), (replan, replan_before) = runs["kept"], runs["replan"]
    if kept.plans != kept_before:
        problems.append(f"the kept history planned its target again ({kept_before} -> {kept.plans} plans)")
    if torch.equal(kept.planned_lengths, runs["fresh"][0].planned_lengths):
        problems.append("the kept plan has fresh's planned lengths: no other split is exercised")
    if replan.plans == replan_before:
        problems.append("the replan history kept its plan for the target")
    return problems


# --- wrapped layers --------------------------------------------------------------------------------


class WrappedBackend:
    """``backend`` with each layer it opens wrapped by ``wrap(layer)``; everything else its own."""

    def __init__(self, backend, wrap):
        self._backend, self._wrap = backend, wrap

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def open_layer(self, config, device):
        return self._wrap(self._backend.open_layer(config, device))


class WrappedLayer:
    def __init__(self, layer):
        self.layer = layer

    def __getattr__(self, name):
        return getattr(self.layer, name)


class PoisonedLayer(WrappedLayer):
    """Every byte of the layer's float workspaces :data:`backends.seam.POISON_BYTE` after its plan,
    before its kernel (before the whole step where the layer has no plan/launch split)."""

    def step(self, step):
        if split_step_missing(self.layer):
            poison(float_workspaces(self.layer))
            return self.layer.step(step)
        outcome = self.layer.plan_step(step)
        if not step.runs_kernel:
            return outcome
        poison(float_workspaces(self.layer))
        self.layer.launch(step, outcome)
        return self.layer.finish(step, outcome)


def simulated_graphs() -> bool:
    """CUDA graphs are the simulated machine's (``tests.simulated_sm90.SimulatedGraph``)."""
    return torch.cuda.CUDAGraph.__module__ == "tests.simulated_sm90"


def capture_problem(layer) -> str | None:
    """Why ``layer``'s forward cannot be captured and replayed here, or None."""
    reason = getattr(layer, "capture_unsupported", None)
    if reason:
        return reason
    missing = split_step_missing(layer)
    if missing:
        return f"{type(layer).__name__} has no plan/launch split (lacks {', '.join(missing)}: backends.seam.Layer)"
    if simulated_graphs() and not isinstance(getattr(layer, "state", None), sm90.SM90AttentionState):
        return ("the simulated machine's CUDA graphs capture only the port's attention state step "
                "(tests.simulated_sm90.SimulatedGraph); this layer's forward would run outside the capture")
    if not simulated_graphs() and not torch.cuda.is_available():
        return "CUDA graphs need a CUDA device"
    return None


class GraphedLayer(WrappedLayer):
    """Each step planned on the host, its forward run eagerly (the warm-up, kept as
    ``eager``), then captured in a CUDA graph and replayed on the same inputs; the outcome is
    the replay's (the eager output poisoned in between, so a replay that writes nothing shows)."""

    def __init__(self, layer):
        super().__init__(layer)
        self.eager: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # (out, lse) of each eager run

    def step(self, step):
        skip_unless_capturable(self.layer)
        outcome = self.layer.plan_step(step)
        if not step.runs_kernel:
            return outcome
        self.layer.launch(step, outcome)
        warm = self.layer.finish(step, outcome)
        lse = warm.lse.clone() if warm.lse is not None else None
        self.eager.append((warm.out.clone(), lse))
        poison([warm.out] + ([warm.lse] if warm.lse is not None else []))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.layer.launch(step, outcome)
        graph.replay()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return self.layer.finish(step, outcome)


def graph_problems(graphed: GraphedLayer, outcomes) -> list[str]:
    """Each replayed step's output and LSE against the same step run eagerly: bit for bit."""
    problems = []
    ran = [o for o in outcomes if o.out is not None]
    for i, ((out, lse), outcome) in enumerate(zip(graphed.eager, ran, strict=True)):
        if not bitwise_equal(outcome.out, out):
            ulps = ulp_distance_bf16(outcome.out.cpu(), out.cpu())
            problems.append(f"step {i}: the graph replay's output is not the eager run's bit for bit "
                            f"({int((ulps > 0).sum())} elements differ, max {int(ulps.max())} bf16 ULPs)")
        if lse is not None and not bitwise_equal(outcome.lse, lse):
            gap = float((outcome.lse.float() - lse.float()).abs().max())
            problems.append(f"step {i}: the graph replay's LSE is not the eager run's bit for bit "
                            f"(max |diff| {gap:.3g})")
    return problems


def skip_unless_capturable(layer) -> None:
    reason = capture_problem(layer)
    if reason:
        pytest.skip(f"unsupported: {reason}")


# --- the checks both tiers run ---------------------------------------------------------------------


def check_plan_history(judge, backend, device) -> dict:
    """The target step after each history, each history run twice: bit for bit within one
    history, fresh's bits where the planned lengths are the same, within
    :data:`PLAN_HISTORY_ULPS` where they differ; a backend that keeps plans keeps one in the kept
    history. Returns each history's target outcome."""
    runs, problems = {}, []
    for name, steps in histories().items():
        first = target_outcome(judge, backend, steps, device)
        again, _ = target_outcome(judge, backend, steps, device)
        if not bitwise_equal(first[0].out, again.out):
            problems.append(f"{name}: the same history twice gives other bits")
        runs[name] = first
    problems += history_kind_problems(backend, runs) + history_problems({k: v[0] for k, v in runs.items()})
    assert not problems, f"{backend.name}, plan history:\n" + "\n".join(problems)
    return {k: v[0] for k, v in runs.items()}


def check_poisoned_workspaces(judge, backend, device) -> None:
    """Each history's target with the layer's float workspaces poisoned before every kernel: the
    clean run's output, bit for bit (the kept history clamps works of the kept plan short)."""
    problems = []
    for name, steps in histories().items():
        clean, _ = target_outcome(judge, backend, steps, device)
        poisoned, _ = target_outcome(judge, backend, steps, device, wrap=PoisonedLayer)
        if not bitwise_equal(poisoned.out, clean.out):
            ulps = ulp_distance_bf16(poisoned.out.cpu(), clean.out.cpu())
            problems.append(f"{name}: poisoned workspaces change the output ({int((ulps > 0).sum())} elements, "
                            f"non-finite: {int((~torch.isfinite(poisoned.out.float())).sum())})")
    assert not problems, f"{backend.name}, poisoned workspaces:\n" + "\n".join(problems)


def check_graph_against_eager(judge, backend, device) -> None:
    """Each history's steps with the forward captured in a CUDA graph and replayed (each replay
    judged) against the same step run eagerly: bit for bit."""
    problems = []
    for name, steps in histories().items():
        layer, outcomes = run_sequence(judge, WrappedBackend(backend, GraphedLayer), steps, device)
        problems += [f"{name}: {p}" for p in graph_problems(layer, outcomes)]
    assert not problems, f"{backend.name}, graph against eager:\n" + "\n".join(problems)
