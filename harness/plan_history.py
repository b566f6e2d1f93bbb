"""Plan history, poisoned workspaces and graph against eager (docs/input-space.md#plan-history,
#poisoned-workspaces, #graph-against-eager): the histories and the three checks every backend
answers to, each history run through one layer in a mode of ``harness.layer_modes`` and every
step judged by ``harness.judge`` (the mode's comparison among the step's problems).

One target step (decode rows below top-k, so the bounded design plans each row's bound plus the
slack) is run after three histories through one layer each: fresh (the target alone), kept (a
step one token shorter first: the bounded design keeps that plan, planned one past the bound less
than a fresh plan's, and clamps) and replan (a step 64 tokens longer first: past the slack, the
target is planned again).
"""

from __future__ import annotations

import dataclasses

import torch

from .bits import bitwise_equal
from .case_runner import run_sequence
from .cases import KernelConfig
from .layer_modes import PLAN_HISTORY_ULPS, in_layer_mode
from .spec import batch

__all__ = ["PLAN_HISTORY_ULPS", "check_graph_against_eager", "check_plan_history", "check_poisoned_workspaces",
           "histories", "history_kind_problems", "keeps_plans"]

BF16 = KernelConfig("bfloat16", True, 16)
#: The target step's decode contexts: one row inside the first KV tile, one across tiles, one longer.
TARGET_CONTEXTS = (40, 150, 330)
#: Tokens the replan history's first step is longer by: past the bounded design's slack of 32.
PAST_SLACK = 64
TARGET_SEED = 5


#: What ends the message of a failure of :func:`check_plan_history` over several runs (its docstring says why).
OVER_SEVERAL_RUNS = ("(a check over several runs of the histories, not of one step: no written case replays it; "
                     "harness.plan_history.check_plan_history says why)")


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


def history_run(judge, backend, name: str, steps, device, mode: str):
    """``(target outcome, plans made before the target)`` of the history ``steps`` through one
    layer of ``backend`` in ``mode``, every step judged."""
    _, outcomes = run_sequence(judge, in_layer_mode(backend, mode), steps, device, what=f"the {name} history ({mode})")
    before = outcomes[-2].plans if len(outcomes) > 1 else 0
    return outcomes[-1], before


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


def check_plan_history(judge, backend, device) -> dict:
    """The target step after each history, each step against the same step through a fresh layer
    (the ``against-fresh`` mode, judged: fresh's bits where the planned lengths are the same,
    within :data:`PLAN_HISTORY_ULPS` where they differ), and each history run again: bit for bit
    within one history. A backend that keeps plans keeps one in the kept history. Returns each
    history's target outcome.

    Two of its failures are of the check, not of a step, and no written case replays them
    (:data:`OVER_SEVERAL_RUNS` ends their message):

    - "the same history twice gives other bits" sets the target outcomes of two runs of one
      history side by side, each through a layer of its own (the first in the ``against-fresh``
      mode, the second plain). A written case (``recording/backend_case.py``) is one sequence
      through one layer in one mode, and its replay runs it once: no step of either run is wrong
      on its own (each was judged and passed, its rerun on the same plan bit for bit), so the
      replay of either is green. What differs is the pair, and no layer mode runs a history twice
      through two layers of the same history;
    - the plan counts and planned lengths of :func:`history_kind_problems` say what a backend that
      keeps plans must do for the check to exercise a kept split (keep a plan for the kept
      history's target, plan again for the replan history's, plan other lengths than fresh's); a
      step that plans again where a plan could have been kept is right, so every step's verdict,
      and every case's replay, is green. They fail the check as having tested less than it claims.

    ``--dump-failures`` writes for such a failure the case ``harness.case_runner.run_sequence`` noted
    last (the replan history's plain run), whose steps passed when judged in the test."""
    runs, problems = {}, []
    for name, steps in histories().items():
        first = history_run(judge, backend, name, steps, device, "against-fresh")
        again, _ = history_run(judge, backend, name, steps, device, "plain")
        if not bitwise_equal(first[0].out, again.out):
            problems.append(f"{name}: the same history twice gives other bits")
        runs[name] = first
    problems += history_kind_problems(backend, runs)
    assert not problems, f"{backend.name}, plan history:\n" + "\n".join(problems) + f"\n{OVER_SEVERAL_RUNS}"
    return {k: v[0] for k, v in runs.items()}


#: Rows of CUDA-graph padding past the padded history's target (a piecewise graph: the step's
#: metadata does not count them).
PIECEWISE_PADDED_ROWS = 4


def padded_history(config: KernelConfig = BF16) -> list:
    """A step of more rows (it leaves its rows in a layer's persistent top-k buffer), then the
    target step under a piecewise graph's padding: rows the target must not read, past the ones
    its metadata counts."""
    target_spec, seed = decode_step(TARGET_CONTEXTS, TARGET_SEED, config)
    larger = decode_step([*TARGET_CONTEXTS, *(c + 7 for c in TARGET_CONTEXTS)], 3, config)
    return [larger, (dataclasses.replace(target_spec, padded_rows=PIECEWISE_PADDED_ROWS), seed)]


def check_poisoned_workspaces(judge, backend, device) -> None:
    """Each history, and :func:`padded_history`, with the layer's float workspaces poisoned and
    token 0 planted in the rows of its input buffers the step must not read, and the step's first token
    in its kv_indices past the planned spans (``backends.seam.plant_in_unread_rows``), before every kernel
    (the ``poisoned`` mode, judged): each step the clean run's output and LSE, bit for bit (the
    kept history clamps works of the kept plan short)."""
    for name, steps in {**histories(), "padded": padded_history()}.items():
        history_run(judge, backend, name, steps, device, "poisoned")


def check_graph_against_eager(judge, backend, device) -> None:
    """Each history's steps with the forward captured in a CUDA graph and replayed (the
    ``graphed`` mode, judged) against the same step run eagerly: bit for bit. A layer that cannot
    be captured here raises ``harness.layer_modes.CaptureUnsupported`` (the judge fixture skips
    the test with its reason)."""
    for name, steps in histories().items():
        history_run(judge, backend, name, steps, device, "graphed")
