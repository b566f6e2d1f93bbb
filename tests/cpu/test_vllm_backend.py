"""A vLLM release's own SM90 backend (``--vllm``) on a machine without a GPU.

vLLM's code runs as it ships: its ``_kv_lens_host``, its ``build()``, its ``_SM90State`` (plan,
kept plan, replan, and the device clamp of the bounded design), its convert kernel and its pack
kernel (in Triton's interpreter without a GPU). FlashInfer is the stand-in of
``tests.fa3_stand_in``, which keeps its schedule in an int workspace as fa3 does and attends
what that schedule says at run time, so the executed KV length of every row is read back and
checked against its valid count. The GPU tier (``tests/gpu/test_vllm_sm90.py``) runs the same
cases on FlashInfer itself.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys

import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from backends.vllm.shims import REAL_MODULES, SHIMS_BY_NAME, ShimGap, stand_ins_in_use
from harness.backend_step import executed_length_problems, layer_config, run_step
from harness.builder import build_scenario
from harness.case_runner import run_case, run_sequence
from harness.cases import KernelConfig, sequence_steps, situation_cases
from harness.device_inputs import build_attention_inputs
from harness.findings import TopkHolesAttended
from harness.findings.vllm import Fp8PlannedAsUint8
from harness.input_space import classify, covering_cases
from harness.spec import batch, graph_padded
from mla_constants import TOPK
from pytest_sparse_mla.coverage import record_input
from pytest_sparse_mla.hypothesis_profiles import covering_strength, input_cases
from tests import fa3_stand_in
from tests.support.vllm_planting import stand_in_for
from tests.vllm_cases import magnitude_params, step_params

pytestmark = pytest.mark.vllm

BF16 = KernelConfig("bfloat16", True, 16)


@pytest.fixture
def stand_in(vllm_backend, monkeypatch):
    wrapper = stand_in_for(vllm_backend)
    fa3_stand_in.install(monkeypatch, wrapper)
    return wrapper


def with_covering_examples(test):
    """The active profile's covering design as explicit examples (every value class under ci)."""
    for i, case in enumerate(covering_cases(covering_strength())):
        test = example(case=case, seed=i)(test)
    return test


def drawn_phases() -> tuple:
    """Under ``ci`` the covering design's examples alone (every value class; the random draws of
    this test take minutes in Triton's interpreter, up to 20 s an example); ``thorough`` draws too."""
    if covering_strength() > 1:
        return (Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink)
    return (Phase.explicit,)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture],  # request only collects properties
          phases=drawn_phases())
@given(case=input_cases(), seed=st.integers(0, 2**31 - 1))
@with_covering_examples
def test_drawn_production_inputs_through_vllm(vllm_backend, device, case, seed, judge):
    """Any case of the production input space (block sizes, batch composition, context sources,
    kpool and topk, kernel variants, heads) through vLLM's build() and forward_mqa(): every row
    executes its valid count and its intended slots. The case's kv_indices layout is the
    project's axis; vLLM lays out its own."""
    record_input(classify(case.spec, case.layout, case.holes))
    with pytest.MonkeyPatch.context() as mp:
        fa3_stand_in.install(mp, stand_in_for(vllm_backend))
        try:
            run_case(judge.raising_findings(), vllm_backend, case.spec, device, seed=seed, compare=False,
                     holes=case.holes)
        except Fp8PlannedAsUint8:
            assert vllm_backend.plans_fp8_as_storage_dtype, "an fp8 plan refused by a release that maps it to e4m3"
        except TopkHolesAttended:
            assert case.holes is not None, "the top-k holes finding on a case without holes"


def test_release_design_and_facts_are_named(vllm_backend):
    plan = inspect.signature(vllm_backend.module._SM90State.plan)
    assert (vllm_backend.design == "bounded") == ("cam" in plan.parameters)
    assert f"vLLM {vllm_backend.version}" in vllm_backend.describe()
    assert vllm_backend.module.__file__.startswith(str(vllm_backend.source.root))
    # the summary's rows per backend and the findings' expectations read these
    assert vllm_backend.version == vllm_backend.source.version and vllm_backend.name == f"vllm-{vllm_backend.version}"
    described = vllm_backend.describe()
    assert f"{vllm_backend.design} design" in described
    pin = vllm_backend.flashinfer_pin
    assert (f"pins flashinfer-python {pin}" if pin else "pins no flashinfer-python") in described, described
    in_use = [n for n in stand_ins_in_use() if n.startswith("vllm")]
    assert in_use and vllm_backend.describe().endswith(f"stand-ins: {', '.join(in_use)}"), vllm_backend.describe()


def test_fp8_is_planned_with_the_dtype_its_facts_name(vllm_backend, stand_in, device, monkeypatch):
    """The dtype vLLM's builder hands FlashInfer's plan() for an fp8 cache is the one the facts of
    its release name (``backends.vllm.facts``): uint8 (the cache spec's storage dtype, which FlashInfer refuses: the
    finding docs/findings.md#vllm-fp8-planned-as-uint8) or float8_e4m3fn."""
    planned = []
    plan = stand_in.plan

    def noted_plan(self, *args, kv_data_type=None, **kwargs):
        planned.append(kv_data_type)
        return plan(self, *args, kv_data_type=kv_data_type, **kwargs)

    monkeypatch.setattr(stand_in, "plan", noted_plan)
    spec = KernelConfig("float8_e4m3fn", True, 16).apply(batch((TOPK + 9, 1), (40, 1)))
    scenario = build_scenario(spec, 11)
    layer = vllm_backend.open_layer(layer_config(spec, scenario.topk_indices.shape[0]), device)
    try:
        run_step(layer, scenario, None)
    except ValueError as exc:  # the stand-in refuses uint8 as FlashInfer does
        assert "kv_data_type torch.uint8 is not supported" in str(exc), exc
    expected = torch.uint8 if vllm_backend.plans_fp8_as_storage_dtype else torch.float8_e4m3fn
    assert planned == [expected], f"vLLM {vllm_backend.version} planned an fp8 cache as {planned}"


def test_minus_one_inside_a_planned_length_is_packed_as_the_release_packs_it(vllm_backend, stand_in, device):
    """Past each row's executed length, up to where the next row's entries start, kv_indices hold
    what the release's facts say its pack makes of the converted row's -1 tail
    (``minus_one_filler``: slot 0, or the row's first slot), never another slot: the clamp keeps
    the kernel from reading them, and a row's own first slot keeps a read there inside the row's
    selection."""
    filler = vllm_backend.minus_one_filler
    assert filler in ("slot 0", "the row's first slot"), filler
    case = next(c for c in situation_cases(4) if c.name.startswith("decode-mixed"))
    spec = BF16.apply(case.spec)
    scenario = build_scenario(spec, 2)
    layer = vllm_backend.open_layer(layer_config(spec, scenario.topk_indices.shape[0]), device)
    outcome = run_step(layer, scenario, build_attention_inputs(scenario, device))
    n = outcome.planned_rows
    indptr = layer.state.wrapper._kv_indptr_buf[: n + 1].to("cpu", torch.int64).tolist()
    indices = layer.state.kv_indices.to("cpu", torch.int64)
    padded = 0
    for row in range(n):
        start, end = indptr[row], indptr[row + 1]
        executed = int(outcome.executed_lengths[row])
        first = int(indices[start]) if executed else 0
        expected = 0 if filler == "slot 0" else first
        tail = indices[start + executed : end]
        padded += tail.numel()
        assert bool((tail == expected).all()), (
            f"row {row}: past its {executed} executed entries kv_indices hold {sorted(set(tail.tolist()))[:8]}, "
            f"expected {filler} ({expected}); {vllm_backend.describe()}")
    assert padded, "no row had entries past its executed length: the case checks nothing"


def _names_read_from_stand_ins(path) -> set[tuple[str, str]]:
    """(module, name) for every ``from vllm.X import name`` of a stand-in X in ``path``, and
    every ``envs.NAME`` read where ``envs`` is vLLM's."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in SHIMS_BY_NAME:
            found.update((node.module, alias.name) for alias in node.names)
        if isinstance(node, ast.ImportFrom) and node.module == "vllm":
            found.update((f"vllm.{a.name}", None) for a in node.names if f"vllm.{a.name}" in SHIMS_BY_NAME)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "envs":
            found.add(("vllm.envs", node.attr))
    return found


def test_every_name_the_release_reads_from_a_stand_in_is_there(vllm_backend):
    """Read statically from the release's files, so a new release that needs more of a stand-in
    fails here by name, whichever of its paths the other tests take."""
    missing = []
    for module_name, relative in REAL_MODULES.items():
        for shim, name in sorted(_names_read_from_stand_ins(vllm_backend.source.path_of(relative)),
                                 key=lambda x: (x[0], x[1] or "")):
            module = sys.modules.get(shim) or importlib.import_module(shim)
            if name is not None and name not in module.__dict__:
                missing.append(f"{module_name} reads {shim}.{name}")
    assert not missing, f"vLLM {vllm_backend.version} needs what the stand-ins lack:\n" + "\n".join(missing)


def test_an_import_no_stand_in_covers_fails_by_name(vllm_backend):
    with pytest.raises(ShimGap, match=r"vllm\.distributed\.parallel_state.*backends/vllm/shims\.py"):
        importlib.import_module("vllm.distributed.parallel_state")
    envs = importlib.import_module("vllm.envs")
    with pytest.raises(ShimGap, match=r"vllm\.envs\.VLLM_NOT_A_SETTING"):
        envs.VLLM_NOT_A_SETTING  # noqa: B018


@pytest.mark.parametrize("case, config", step_params())
def test_step_executes_each_rows_valid_count(vllm_backend, stand_in, case, config, device, judge):
    run_case(judge, vllm_backend, config.apply(case.spec), device)


@pytest.mark.edge("magnitude")
@pytest.mark.parametrize("case, config", magnitude_params())
def test_magnitude_edge(vllm_backend, stand_in, case, config, device, judge):
    """Raw scores far from zero: vLLM's executed lengths and slots, and its output over them."""
    run_case(judge, vllm_backend, config.apply(case.spec), device, seed=41)


@pytest.mark.parametrize("kpool", [1, 4])
def test_sequence_keeps_clamps_and_replans(vllm_backend, stand_in, kpool, device, judge):
    """Steps through one layer: every step's executed lengths are its own valid counts, whether
    the plan was made fresh, kept or made again. The bounded design keeps its plan while the
    bounds stay within its slack, so it plans fewer times than there are steps; the exact
    design plans every step."""
    layer, outcomes = run_sequence(judge, vllm_backend, sequence_steps(kpool, BF16), device)
    plans = layer.plans
    if vllm_backend.design == "bounded":
        assert plans < len(outcomes), f"vLLM {vllm_backend.version} planned {plans} times for {len(outcomes)} steps"
    else:
        assert plans == len(outcomes)


@pytest.mark.parametrize("source", ["host bound", "positions", "seq_lens"])
def test_every_context_source(vllm_backend, stand_in, source, device, judge):
    """The spec-decode and async situations with the host bound, without it (the builder reads
    the positions or the seq_lens), and the bound's exactness as the design says."""
    changes = {"host bound": {}, "positions": dict(with_host_bound=False),
               "seq_lens": dict(with_host_bound=False, with_positions=False)}[source]
    for case in [c for c in situation_cases(4) if "spec-decode" in c.name]:
        outcome = run_case(judge, vllm_backend, BF16.apply(case.spec).replace(**changes), device, seed=3)
        bounded = vllm_backend.design == "bounded" and source == "host bound"
        assert outcome.host_exact is not bounded, f"{case.name}: host lengths exact={outcome.host_exact}"


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_full_graph_step_plans_its_query_rows(vllm_backend, stand_in, async_scheduling, device, judge):
    """Spec-decode rows around topk in the FULL CUDA graph of 15 tokens, the metadata as vLLM's
    runner pads it (the token count and decode split count the padded rows, padded requests
    trail): vLLM's build plans the 6 query rows alone, and each executes its valid count."""
    spec = graph_padded(BF16.apply(batch((TOPK + 3, 3), (40, 3), kpool=4, decode_threshold=3,
                                         async_scheduling=async_scheduling,
                                         host_bound_slack=2 if async_scheduling else 0)), 15)
    scenario = build_scenario(spec, 7)
    assert (scenario.meta.num_actual_tokens, scenario.num_rows, scenario.meta.num_reqs) == (15, 6, 5)
    outcome = run_case(judge, vllm_backend, spec, device, seed=7)
    assert outcome.planned_rows == 6 and outcome.executed_lengths.numel() == 6


def test_adaptive_verification_bounds_every_row_by_the_longest(vllm_backend, stand_in, device, judge):
    case = next(c for c in situation_cases(4) if c.name.startswith("spec-decode"))
    spec = BF16.apply(case.spec)
    scenario = build_scenario(spec, 5)
    outcome = run_case(judge, vllm_backend, spec, device, seed=5, adaptive_verification=True)
    if vllm_backend.design == "bounded":
        longest = min(max(r.seq_len for r in spec.requests), spec.topk + spec.kpool - 1)
        assert outcome.host_lengths.tolist() == [longest] * scenario.num_rows


def test_a_clamp_that_loses_valid_tokens_is_caught(vllm_backend, stand_in, device, request, monkeypatch):
    """The executed length, not the output, catches a clamp one token short on rows past topk."""
    if vllm_backend.design != "bounded":
        pytest.skip(f"vLLM {vllm_backend.version} has the exact design: no clamp to break")
    state_cls = vllm_backend.module._SM90State
    clamp = state_cls._clamp_kv_end

    def short_clamp(self, cam, req_id_per_token):
        clamp(self, cam, req_id_per_token)
        total = int(self._int_ws[self._plan_offsets[0]])
        ends = self._int_ws[self._plan_offsets[3] : self._plan_offsets[3] + total]
        ends.sub_((ends > 2048).to(ends.dtype))

    monkeypatch.setattr(state_cls, "_clamp_kv_end", short_clamp)
    case = next(c for c in situation_cases(4) if c.name.startswith("decode-mixed"))
    spec = BF16.apply(case.spec)
    scenario = build_scenario(spec, 0)
    layer = vllm_backend.open_layer(layer_config(spec, scenario.topk_indices.shape[0]), device)
    problems = executed_length_problems(run_step(layer, scenario, None), scenario)
    past_topk = [r for r in range(scenario.num_rows) if int(scenario.row_ctx[r]) > spec.topk]
    assert past_topk and len(problems) == len(past_topk), problems
    assert all("is cut short" in p and "regime" in p for p in problems)


def test_stand_in_reads_the_schedule_at_run_time(vllm_backend, stand_in, device):
    """The stand-in attends what the schedule says when run() is called, so a clamp after the
    plan changes what it reads (otherwise the CPU tier could not see the clamp)."""
    ws = torch.zeros(16, dtype=torch.uint8, device=device)
    rows = 2
    buffers = dict(qo_indptr=torch.zeros(rows + 1, dtype=torch.int32, device=device),
                   kv_indptr=torch.zeros(rows + 1, dtype=torch.int32, device=device),
                   kv_indices=torch.arange(8, dtype=torch.int32, device=device),
                   kv_len_arr=torch.zeros(rows, dtype=torch.int32, device=device))
    wrapper = stand_in(ws, use_cuda_graph=True, **buffers)
    wrapper.plan(torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([0, 4, 8], dtype=torch.int32),
                 buffers["kv_indices"], torch.tensor([4, 4], dtype=torch.int32), 1, 512, 0, 1, False, 1.0,
                 kv_data_type=torch.bfloat16)
    ckv = torch.eye(8, 512, device=device).to(torch.bfloat16).unsqueeze(1)
    q = torch.zeros(rows, 1, 512, dtype=torch.bfloat16, device=device)
    before = wrapper.run(q, q[..., :0], ckv, ckv[..., :0])
    ws32 = wrapper._planned_backend._int_workspace_buffer.view(torch.int32) if stand_in.release == "0.7" \
        else wrapper._int_workspace_buffer.view(torch.int32)
    end_off = wrapper._plan_info[14] // 4
    ws32[end_off] = 1  # the first work item now reads one slot
    after = wrapper.run(q, q[..., :0], ckv, ckv[..., :0])
    assert not torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
