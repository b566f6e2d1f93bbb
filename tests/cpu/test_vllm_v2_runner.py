"""The suite's model of vLLM's runner (``harness.builder``) against the release's own V2 runner
code (``backends.vllm.v2_runner``: ``GPUModelRunner.prepare_inputs`` and
``DefaultModelState.prepare_attn`` from the wheel): the counts, ``query_start_loc``, ``seq_lens``,
the host bound and the positions each graph mode hands the attention builders, field by field.
The padded FULL-graph finding's premise is read from the runner's own metadata here."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from backends.vllm.source import V2_RUNNER_FILES, VllmSource
from backends.vllm.v2_runner import (
    RunnerGap,
    field_differences,
    graph_descriptor,
    kernels_for,
    load_runner,
    runner_device,
    runner_step,
)
from harness.builder import build_scenario
from harness.cases import KernelConfig
from harness.input_space import covering_cases
from harness.spec import batch, graph_padded
from mla_constants import TOPK
from pytest_sparse_mla.hypothesis_profiles import covering_strength

pytestmark = pytest.mark.vllm

BF16 = KernelConfig("bfloat16", True, 16)

#: Uniform decode batches, the FULL graph sizes they are padded to (contexts around topk) and the
#: decode threshold (2: MTP's one draft token).
FULL_GRAPH_STEPS = {
    "3-decodes-in-4": (((TOPK - 1, 1), (TOPK + 6, 1), (300, 1)), 4, 1),
    "1-decode-in-8": (((TOPK + 1, 1),), 8, 1),
    "5-decodes-in-8": (((1, 1), (2, 1), (TOPK, 1), (3 * TOPK, 1), (17, 1)), 8, 1),
    "mtp-2-decodes-of-2-in-6": (((TOPK - 1, 2), (5000, 2)), 6, 2),
}
#: Mixed batches run eager or under piecewise graphs (decodes first, then prefills, as vLLM orders
#: them), with their decode threshold.
EAGER_STEPS = {
    "decodes-and-a-chunked-prefill": (((TOPK + 6, 1), (300, 1), (4000, 37)), 1),
    "one-prefill-from-empty": (((64, 64),), 1),
    "mtp-decodes-and-a-prefill": (((TOPK - 1, 2), (9, 2), (2500, 300)), 2),
}


def runner_inputs(scenario):
    """The live requests of ``scenario`` as the runner's request state holds them: query tokens,
    context after the step, prompt length (a prefill's prompt reaches past this step's chunk)."""
    meta = scenario.meta
    qsl = meta.query_start_loc_cpu.tolist()
    q_lens = [b - a for a, b in zip(qsl, qsl[1:], strict=False)]
    live = [i for i, q in enumerate(q_lens) if q]
    threshold = scenario.spec.decode_threshold
    seq_lens = [int(meta.seq_lens[i]) for i in live]
    prompts = [seq_lens[j] if q_lens[i] > threshold else 1 for j, i in enumerate(live)]
    return [q_lens[i] for i in live], seq_lens, prompts


def step_of(runner, scenario, mode, graph_tokens=None, graph_reqs=None):
    q_lens, seq_lens, prompts = runner_inputs(scenario)
    return runner_step(runner, q_lens, seq_lens, prompts, mode=mode, graph_tokens=graph_tokens,
                       graph_reqs=graph_reqs)


def full_graph_scenario(name):
    requests, capture, threshold = FULL_GRAPH_STEPS[name]
    return build_scenario(graph_padded(BF16.apply(batch(*requests, kpool=4, decode_threshold=threshold)), capture), 0)


@pytest.mark.parametrize("name", list(FULL_GRAPH_STEPS))
def test_a_full_graph_step_is_built_as_the_releases_runner_builds_it(vllm_runner, name):
    scenario = full_graph_scenario(name)
    meta = scenario.meta
    step = step_of(vllm_runner, scenario, "FULL", meta.num_actual_tokens, meta.num_reqs)
    assert field_differences(meta, step) == [], f"vLLM {vllm_runner.version}, {name}"
    live_rows = scenario.num_rows
    assert torch.equal(step.positions[:live_rows], meta.positions[:live_rows])


@pytest.mark.parametrize("name", list(FULL_GRAPH_STEPS))
def test_the_releases_full_graph_step_hands_the_builder_more_tokens_than_query_start_loc_ends_at(vllm_runner, name):
    """The padded FULL-graph finding's premise, from the runner's own metadata: the builder is handed
    the padded token count while ``query_start_loc`` ends at the live rows (flat past them), so a
    builder that plans ``query_start_loc[-1]`` rows plans fewer rows than ``forward_mqa`` runs."""
    scenario = full_graph_scenario(name)
    meta = scenario.meta
    step = step_of(vllm_runner, scenario, "FULL", meta.num_actual_tokens, meta.num_reqs)
    live = len(runner_inputs(scenario)[0])
    assert int(step.query_start_loc_cpu[-1]) == scenario.num_rows < step.num_actual_tokens
    assert step.query_start_loc_cpu[live:].unique().tolist() == [scenario.num_rows]
    assert step.seq_lens[live:].tolist() == [0] * (step.num_reqs - live)


@pytest.mark.parametrize("mode", ["NONE", "PIECEWISE"])
@pytest.mark.parametrize("name", list(EAGER_STEPS))
def test_an_eager_or_piecewise_step_is_built_as_the_releases_runner_builds_it(vllm_runner, name, mode):
    """Piecewise graphs pad the tokens (here by 5) but hand the builders the live counts, as eager
    steps do."""
    requests, threshold = EAGER_STEPS[name]
    scenario = build_scenario(BF16.apply(batch(*requests, kpool=4, decode_threshold=threshold)), 0)
    meta = scenario.meta
    padded_tokens = meta.num_actual_tokens + 5 if mode == "PIECEWISE" else None
    step = step_of(vllm_runner, scenario, mode, padded_tokens)
    assert field_differences(meta, step) == [], f"vLLM {vllm_runner.version}, {name}, {mode}"
    assert torch.equal(step.positions[:scenario.num_rows], meta.positions[:scenario.num_rows])


def test_a_model_that_leaves_out_the_padding_is_named_field_by_field(vllm_runner):
    """A model of the FULL step with the live counts only (as eager would give them) differs from the
    release's runner in the counts, ``query_start_loc`` and ``seq_lens``, each named with both values."""
    scenario = full_graph_scenario("3-decodes-in-4")
    meta = scenario.meta
    step = step_of(vllm_runner, scenario, "FULL", meta.num_actual_tokens, meta.num_reqs)
    eager = step_of(vllm_runner, scenario, "NONE")
    lines = field_differences(eager, step)
    assert [line.split(":")[0] for line in lines] == ["num_reqs", "num_actual_tokens", "query_start_loc_cpu",
                                                      "seq_lens", "seq_lens_cpu_upper_bound"]
    assert "the suite's model [0, 1, 2, 3], vLLM's FULL runner [0, 1, 2, 3, 3]" in lines[2]


def test_release_files_without_the_runners_method_are_named(vllm_runner, pytestconfig, tmp_path):
    """A release whose model state has no ``prepare_attn`` (renamed here) is refused naming it."""
    from pytest_sparse_mla.vllm import VLLM_SOURCE

    source = pytestconfig.stash[VLLM_SOURCE]
    for relative in V2_RUNNER_FILES:
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source.path_of(relative), tmp_path / relative)
    state = tmp_path / V2_RUNNER_FILES[2]
    state.write_text(state.read_text().replace("def prepare_attn(", "def prepare_attention("))
    edited = VllmSource(root=tmp_path, version=source.version, origin="an edited copy")
    with pytest.raises(RunnerGap, match="no DefaultModelState.prepare_attn"):
        load_runner(edited)
    (tmp_path / V2_RUNNER_FILES[1]).unlink()
    with pytest.raises(RunnerGap, match=r"has no vllm/v1/worker/gpu/model_runner\.py: a slice written before"):
        load_runner(edited)


def as_the_runner_builds_it(spec):
    """``spec`` as vLLM's V2 runner would build its step, or None where it builds none (no request
    has query rows): the host bound and the positions held, the bound exact (the stand-in runner
    schedules no drafts, so none is pending), requests without query rows left out of the batch
    except a FULL graph's trailing padding. The input space reaches past that on purpose (other
    context sources, requests without rows mid-batch) for the builders' own rules."""
    live = tuple(r for r in spec.requests if r.q_len)
    if not live:
        return None
    requests = spec.requests if spec.full_graph else live
    return spec.replace(requests=requests, with_host_bound=True, with_positions=True, host_bound_slack=0)


def test_the_covering_designs_steps_match_the_releases_runner(vllm_runner):
    """Every case of the input space's covering design with query rows (block sizes, batch
    compositions, MTP rows, FULL graph padding, kpool and topk, variants), as the release's
    runner would build it, eager and under a piecewise graph (or the FULL graph it is padded
    to): the suite's metadata is the release's, field by field."""
    cases = covering_cases(covering_strength())
    built = [(case, as_the_runner_builds_it(case.spec)) for case in cases]
    built = [(case, spec) for case, spec in built if spec is not None]
    assert len(built) >= len(cases) - sum(1 for c in cases if dict(c.assignment)["batch"] == "empty")
    graph_modes = set()
    for case, spec in built:
        scenario = build_scenario(spec, 0)
        meta = scenario.meta
        if spec.full_graph:
            runs = [("FULL", meta.num_actual_tokens, meta.num_reqs)]
        else:  # a piecewise graph pads the tokens (by the case's padded rows, or 5) and hands the live counts
            runs = [("NONE", None, None), ("PIECEWISE", scenario.num_rows + (spec.padded_rows or 5), None)]
        for mode, tokens, reqs in runs:
            graph_modes.add(mode)
            step = step_of(vllm_runner, scenario, mode, tokens, reqs)
            assert field_differences(meta, step) == [], f"vLLM {vllm_runner.version}, {mode}, case {case.id}"
            assert torch.equal(step.positions[:scenario.num_rows], meta.positions[:scenario.num_rows]), case.id
    assert graph_modes == {"NONE", "PIECEWISE", "FULL"}, f"the cases reach {sorted(graph_modes)}"


# --- the graph's sizes from the release's CUDA-graph dispatcher ---------------------------------

#: The graphs the dispatcher is given as captured: decode graphs per request count (per query
#: length) and token-keyed graphs, as vLLM's defaults space them.
DECODE_REQUEST_SIZES = [1, 2, 4, 8]
TOKEN_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def dispatched(runner, spec, mode="FULL_AND_PIECEWISE"):
    """The graph the release's CUDA-graph dispatcher runs ``spec``'s live requests in."""
    live = [r for r in spec.requests if r.q_len]
    q = live[0].q_len if len({r.q_len for r in live}) == 1 and live[0].q_len <= spec.decode_threshold else None
    return graph_descriptor(runner.dispatcher, mode, num_reqs=len(live), num_tokens=sum(r.q_len for r in live),
                            uniform_query_len=q, decode_request_sizes=DECODE_REQUEST_SIZES, token_sizes=TOKEN_SIZES)


@pytest.mark.parametrize("name", list(FULL_GRAPH_STEPS))
def test_a_uniform_decode_batch_is_padded_to_the_graph_the_releases_dispatcher_picks(vllm_runner, name):
    """Under ``FULL_AND_PIECEWISE`` (vLLM's default) the dispatcher runs a uniform decode batch in
    the smallest decode graph of its query length that holds it; the suite's model padded to that
    graph's token count has the graph's request count, and the step the release's runner builds
    for the graph is the model's, field by field."""
    requests, _, threshold = FULL_GRAPH_STEPS[name]
    spec = BF16.apply(batch(*requests, kpool=4, decode_threshold=threshold))
    desc = dispatched(vllm_runner, spec)
    assert desc.cg_mode.name == "FULL", desc
    scenario = build_scenario(graph_padded(spec, desc.num_tokens), 0)
    meta = scenario.meta
    assert (meta.num_actual_tokens, meta.num_reqs) == (desc.num_tokens, desc.num_reqs), desc
    step = step_of(vllm_runner, scenario, "FULL", desc.num_tokens, desc.num_reqs)
    assert field_differences(meta, step) == [], f"vLLM {vllm_runner.version}, {name}, {desc}"


@pytest.mark.parametrize("name", list(EAGER_STEPS))
def test_a_mixed_batch_runs_in_a_piecewise_graph_with_the_live_counts(vllm_runner, name):
    requests, threshold = EAGER_STEPS[name]
    spec = BF16.apply(batch(*requests, kpool=4, decode_threshold=threshold))
    desc = dispatched(vllm_runner, spec)
    assert (desc.cg_mode.name, desc.num_reqs) == ("PIECEWISE", None), desc
    scenario = build_scenario(spec, 0)
    step = step_of(vllm_runner, scenario, "PIECEWISE", desc.num_tokens)
    assert field_differences(scenario.meta, step) == [], f"vLLM {vllm_runner.version}, {name}, {desc}"


def test_a_single_routine_full_graph_pads_mtp_requests_to_the_token_count(vllm_runner):
    """Under ``cudagraph_mode=FULL`` (one routine for every batch) the dispatcher picks a
    token-keyed graph whose requests are padded to its token count: two MTP decodes of two tokens
    run with 4 requests, where the suite's FULL steps (``graph_padded``, the decode graphs of
    ``FULL_AND_PIECEWISE``) have 2. The suite does not build that step (docs/vllm.md)."""
    spec = BF16.apply(batch((TOPK - 1, 2), (5000, 2), kpool=4, decode_threshold=2))
    full = dispatched(vllm_runner, spec, "FULL")
    assert (full.cg_mode.name, full.num_tokens, full.num_reqs) == ("FULL", 4, 4), full
    assert build_scenario(graph_padded(spec, full.num_tokens), 0).meta.num_reqs == 2


@pytest.mark.parametrize("interpret", [None, "0", "1"], ids=["unset", "0", "1"])
def test_the_runners_kernels_run_where_its_tensors_are_whatever_the_environment(pytestconfig, monkeypatch,
                                                                                 interpret):
    """The stand-in runner holds its tensors on the GPU where one is visible and on the host
    otherwise, and the release's Triton kernels are defined and launched for that device
    (compiled for the GPU, Triton's interpreter on the host) whatever ``TRITON_INTERPRET`` the
    process was started with (unset on a GPU runner); the variable is left as it was."""
    from pytest_sparse_mla.vllm import VLLM_SOURCE

    if interpret is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
    runner = load_runner(pytestconfig.stash[VLLM_SOURCE])
    assert runner.device == runner_device()
    assert os.environ.get("TRITON_INTERPRET") == interpret
    scenario = build_scenario(BF16.apply(batch((300, 1), (TOPK + 6, 1), (4000, 37), kpool=4)), 0)
    step = step_of(runner, scenario, "NONE")
    assert os.environ.get("TRITON_INTERPRET") == interpret
    assert field_differences(scenario.meta, step) == []
    assert step.seq_lens.device.type == "cpu"


@pytest.mark.parametrize("visible", [True, False], ids=["gpu-visible", "no-gpu"])
def test_the_runner_is_held_on_the_gpu_where_one_is_visible(monkeypatch, visible):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible)
    assert runner_device() == torch.device("cuda" if visible else "cpu")


@pytest.mark.parametrize("device, value", [("cpu", "1"), ("cuda", "0")])
def test_kernels_are_defined_for_the_device_the_runner_holds(monkeypatch, device, value):
    """Inside ``kernels_for(device)`` Triton reads the interpreter flag of that device; after it,
    the value the process had."""
    monkeypatch.setenv("TRITON_INTERPRET", "held")
    with kernels_for(torch.device(device)):
        assert os.environ["TRITON_INTERPRET"] == value
    assert os.environ["TRITON_INTERPRET"] == "held"
