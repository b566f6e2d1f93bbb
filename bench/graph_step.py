"""The graph section: one production step (convert -> layout -> run) replayed from a CUDA graph
against the same step run eagerly, per step, with the replay checked equal to the eager output."""

from __future__ import annotations

import torch

from backends.flashinfer.port import make_attention_state
from harness.timing import estimate_seconds, summarize, synchronize

from .context import Context, error_text
from .counting import reps_for
from .scenarios import Prepared


def measure_graph(ctx: Context, prep: Prepared, lens: torch.Tensor, layout: str) -> dict:
    """Eager ``state.step`` against a CUDA graph captured once over the same step, one step
    per rotated set (so one replay runs ``count`` steps); times are per step."""
    from harness.port.launch import attention_config

    rows = prep.rows
    state = make_attention_state(ctx.impl, attention_config(prep.scenario, layout, rows), ctx.device)
    try:
        state.plan(rows, lens)
    except Exception as exc:
        return {"rejected_at_plan": error_text(exc)}
    count = prep.sets.count
    args = [prep.step_args(i) for i in range(count)]

    def eager(i):
        state.step(*args[i % count])

    for i in range(max(2, count)):
        eager(i)
    synchronize(ctx.device)
    out, lse = prep.sets.out(0)
    want = out[:rows].clone(), lse[:rows].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(count):
            state.step(*args[i])
    synchronize(ctx.device)

    def replay(i):
        graph.replay()

    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    replay(0)
    synchronize(ctx.device)
    same = torch.equal(out[:rows], want[0]) and torch.equal(lse[:rows], want[1])
    reps = max(count, reps_for(estimate_seconds(eager, ctx.device), target_s=ctx.sel.kernel_target_s, lo=20, hi=300))
    replays = max(10, reps // count)
    eager_dev, eager_how = ctx.timer.device_times(eager, reps)
    graph_dev, graph_how = ctx.timer.device_times(replay, replays)
    record = {
        "layout": layout,
        "replay_equals_eager": same,
        "steps_per_replay": count,
        "eager_device": summarize(eager_dev),
        "graph_device": summarize([t / count for t in graph_dev]),
        "eager_wall_per_step_s": ctx.timer.throughput(eager, reps),
        "graph_wall_per_step_s": ctx.timer.throughput(replay, replays) / count,
        "eager_host_enqueue_s": eager_how.get("host_enqueue_s"),
        "graph_host_enqueue_per_step_s": (graph_how.get("host_enqueue_s") or 0.0) / count,
    }
    return record
