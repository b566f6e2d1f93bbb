"""CUDA graphs (docs/regimes.md#cuda-graph-padding-and-replay,
docs/findings.md#stale-lengths-after-a-smaller-replan): the device part of a step
(convert -> layout -> run) captured
once at the maximum size, then for a sequence of batches replanned on the host (outside
capture) and replayed with other lengths, slots and q: fewer rows after more (stale lengths
must be zeroed), more again, and an empty batch. Every replay must equal an eager run of the
same plan bitwise and the reference (b) within the budget on live rows; padded rows are never
compared. plan() must refuse to run during capture. Where the installed FlashInfer refuses the
strided plan as it is expected to, the test ends at that refusal (counted as refused).
"""

from __future__ import annotations

import pytest
import torch

from backends.flashinfer.compat import fa3_mla_cluster_size
from backends.flashinfer.port import make_attention_state
from backends.flashinfer.sm90_state import PlanDuringCaptureError
from backends.seam import POISON_BYTE
from harness import build_attention_inputs, build_scenario
from harness.case_log import note_sequence, note_sequence_step
from harness.cases import covering_config, graph_replay_sequence
from harness.findings import STALE_CLUSTER_FINDING
from harness.layer_modes import occupy_freed_memory
from harness.port.launch import (
    DEVICE,
    StaticStep,
    assert_launchable,
    assert_within_budget,
    attention_config,
    compare_with_references,
    failure_context,
    plan_or_refusal,
    prepared,
    state_matches_step,
    sync,
)
from pytest_sparse_mla.port_reports import record_errors

pytestmark = pytest.mark.gpu


class StaleClusterReplay(AssertionError):
    """Replays differ from eager runs exactly where the plan's cluster size differs from the
    captured one."""


#: (layout, kpool, covering-config index): compacted meets regime C rows; packed and strided
#: run kpool 1 (their regime C finding is covered elsewhere). Heads 128 (index 3) captured at
#: the maximum size have cluster size 2; the smaller replays plan cluster size 1.
GRAPH_PARAMS = [
    pytest.param("compacted", 4, 2, id="compacted-kpool4-bf16-nope-h64"),
    pytest.param("packed", 1, 1, id="packed-kpool1-fp8-rope64-h32"),
    pytest.param("strided", 1, 8, id="strided-kpool1-bf16-nope-h16"),
    pytest.param("compacted", 1, 9, id="compacted-kpool1-bf16-rope64-h32"),
    pytest.param("compacted", 4, 3, id="compacted-kpool4-bf16-rope64-h128",
                 marks=pytest.mark.xfail(reason=STALE_CLUSTER_FINDING, raises=StaleClusterReplay, strict=True)),
]


@pytest.mark.parametrize(("layout", "kpool", "config_index"), GRAPH_PARAMS)
def test_capture_once_replan_and_replay(impl, features, request, regime_log, layout, kpool, config_index):
    config = covering_config(config_index)
    cases = graph_replay_sequence(kpool)
    scenarios = [build_scenario(config.apply(c.spec), seed=21 + i) for i, c in enumerate(cases)]
    static = StaticStep(scenarios, impl)
    steps = [prepared(impl, s, layout, max_rows=static.max_rows) for s in scenarios]
    for step, case in zip(steps, cases, strict=True):
        regime_log.record(step.regimes(), focus=case.focus or None)
        assert_launchable(step, features.version)
    width = scenarios[0].spec.resolved_width
    state = make_attention_state(impl, attention_config(scenarios[0], layout, static.max_rows), DEVICE)

    first = steps[0]
    if plan_or_refusal(features, state, first, regime_log) is not None:
        return  # the installed FlashInfer refuses this strided plan, as expected
    assert first.num_planned == static.max_rows, "the capture batch must be the largest"
    inputs = [build_attention_inputs(s, DEVICE) for s in scenarios]
    static.load(scenarios[0], inputs[0])
    state.step(*static.args())  # warm-up: compile and load outside capture
    sync()
    regime_log.kernel_ran()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with pytest.raises(PlanDuringCaptureError):
            state.plan(first.num_planned, first.planned_lens)
        state.step(*static.args())
    sync()

    order = [0, 1, 2, 1, 3, 2]  # max, smaller, larger, smaller again, empty, after empty
    note_sequence("attention-state", layout, static.max_rows, graph=True)
    heads = config.num_heads
    captured_cluster = fa3_mla_cluster_size(first.num_planned, heads, static.max_rows)
    stale = []
    for position, index in enumerate(order):
        scenario, step = scenarios[index], steps[index]
        note_sequence_step(scenario)
        ctx = f"replay {position} ({cases[index].name}); {failure_context(step, features.version)}"
        n = step.num_planned
        static.load(scenario, inputs[index])
        state.plan(n, step.planned_lens)
        graph.replay()
        sync()
        problems = state_matches_step(state, step)
        assert not problems, f"plan/layout buffers after replay; {ctx}\n" + "\n".join(problems)
        replayed_out, replayed_lse = static.out[:n].clone(), static.lse[:n].clone()

        static.out.fill_(float("nan"))
        static.lse.fill_(float("nan"))
        state.step(*static.args())
        sync()
        eager_out, eager_lse = static.out[:n].clone(), static.lse[:n].clone()
        if n == 0:
            continue
        eager = compare_with_references(step, inputs[index], eager_out, eager_lse, state)
        assert_within_budget(step, eager, features.version, what=f"eager run {position} vs (b)")
        cluster = fa3_mla_cluster_size(n, heads, static.max_rows)
        if not (torch.equal(replayed_out, eager_out) and torch.equal(replayed_lse, eager_lse)):
            diff = (replayed_out.float() - eager_out.float()).abs().nan_to_num(float("inf")).max().item()
            assert cluster != captured_cluster, f"graph replay != eager run of the same plan; {ctx}; max |diff| {diff}"
            stale.append(
                f"replay {position}: {n} rows, cluster {cluster} vs captured {captured_cluster}, max |diff| {diff}"
            )
            continue
        comparisons = compare_with_references(step, inputs[index], replayed_out, replayed_lse, state)
        record_errors(request.node, step, comparisons, label=f"graph-replay-{position}")
        assert_within_budget(step, comparisons, features.version, what=f"graph replay {position} vs (b)")
    if stale:
        raise StaleClusterReplay(f"{STALE_CLUSTER_FINDING}; flashinfer {features.version}; heads {heads}, "
                                 f"max_rows {static.max_rows}:\n" + "\n".join(stale))
    assert state.plans == len(order) + 1
    assert width == state.config.width


def block_holding(segments: list[dict], address: int) -> tuple[dict, dict] | None:
    """The segment of ``torch.cuda.memory_snapshot()`` and its block that hold ``address``; None
    where no segment of the allocator does (its memory went back to the driver)."""
    for segment in segments:
        start = segment["address"]
        if start <= address < start + segment["total_size"]:
            for block in segment["blocks"]:
                if block["address"] <= address < block["address"] + block["size"]:
                    return segment, block
    return None


@pytest.mark.parametrize("size", [4096, 3 << 20], ids=["small-pool", "large-pool"])
def test_the_allocation_churn_takes_and_poisons_freed_memory(size):
    """The graphed mode replays after :func:`harness.layer_modes.occupy_freed_memory`; unless it
    takes the memory a tensor freed, a graph that reads a freed buffer replays on its old bytes
    and passes. Both of the caching allocator's pools (blocks up to 1 MiB, and larger). Memory the
    allocator gave back to the driver meanwhile is no longer its to hand out: that happens only
    when a device allocation fails and it empties its cache (as under other processes' load), which
    its count of retried allocations shows."""
    device = torch.device(DEVICE)
    retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
    freed = torch.full((size,), 7, dtype=torch.uint8, device=device)
    start = freed.data_ptr()
    del freed
    held = occupy_freed_memory(device)
    covering = [t for t in held if t.data_ptr() <= start < t.data_ptr() + t.numel()]
    if covering:
        assert bool((covering[0] == POISON_BYTE).all()), "the block that covers the freed bytes is not poisoned"
        return
    where = block_holding(torch.cuda.memory_snapshot(), start)
    retried = torch.cuda.memory_stats(device).get("num_alloc_retries", 0) - retries
    if where is None:  # back to the driver: only a device allocation that failed empties the cache here
        assert retried > 0, (f"the {size} bytes freed at {start:#x} lie in no segment of the allocator, yet it "
                             f"emptied no cache ({len(held)} blocks taken)")
        return
    raise AssertionError(
        f"no occupied block covers the {size} bytes freed at {start:#x} ({len(held)} blocks taken); they lie in a "
        f"{where[1]['state']} block of {where[1]['size']} bytes of a {where[0].get('segment_type')} segment, pool "
        f"{where[0].get('segment_pool_id')}, stream {where[0].get('stream')} (current "
        f"{torch.cuda.current_stream(device).cuda_stream}); device allocations retried after emptying the cache: "
        f"{retried}")
