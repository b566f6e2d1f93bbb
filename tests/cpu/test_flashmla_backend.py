"""vLLM's FLASHMLA_SPARSE backend of a release (``--vllm``; ``backends.vllm.flashmla``) on a machine
without a GPU.

vLLM's code runs as it ships: its builder, ``forward_mqa`` with its convert kernel (in
Triton's interpreter), its q concat into the head-padded workspace, its fp8 paths (one mixed
batch on the decode kernel below 32 heads; decode and prefill kernels apart from 32 heads on,
the prefill rows' context gathered into a bf16 workspace) and FlashMLA's Python interface.
FlashMLA's two kernels are the stand-ins of ``tests.flashmla_stand_in``, which attend exactly
the indices they are handed, so a wrong slot, length or layout shows in the selection, length
or output check. The GPU tier (``tests/gpu/test_flashmla.py``) runs the cases on FlashMLA.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backends.vllm import flashmla as flashmla_backend_module
from backends.vllm.flashmla import FlashMLABackend, FlashMLAUnavailable, KernelRecorder, release_read_gaps
from backends.vllm.shims import (
    FLASHMLA_REAL_MODULES,
    FLASHMLA_SHIMS_BY_NAME,
    FLASHMLA_SPARSE_MODULE,
    PLATFORM,
    SHIMS_BY_NAME,
    cp_gather_and_upconvert_fp8_kv_cache,
    gathered_cache_rows,
    shim_attributes,
)
from backends.vllm.source import SLICE_METADATA, SLICE_MODULE_FILES, resolve
from harness.backend_step import (
    executed_length_problems,
    layer_config,
    output_comparisons,
    run_step,
    selection_problems,
)
from harness.case_runner import run_case, run_sequence
from harness.cases import LONG_CTX, Case, KernelConfig, context_case, sequence_steps, situation_cases
from harness.device_inputs import build_attention_inputs
from harness.input_space import classify, covering_cases
from harness.scenario import build_scenario
from harness.spec import batch, graph_padded
from mla_constants import TOPK
from pytest_sparse_mla.coverage import record_input
from reference import flashmla_layout
from tests import flashmla_cases, flashmla_stand_in
from tests.flashmla_cases import step_params

pytestmark = [pytest.mark.vllm, pytest.mark.flashmla]


BF16 = KernelConfig("bfloat16", True, 16)
FP8_MIXED = KernelConfig("float8_e4m3fn", True, 16, 0.5)
FP8_APART = KernelConfig("float8_e4m3fn", True, 64, 0.5)
#: A batch with decode rows and sparse prefill rows (the fp8 paths differ on it).
MIXED_CASE = next(c for c in situation_cases(4) if c.name.startswith("decode+prefill-sparse"))
#: Three spec-decode requests (2 rows each) in the FULL CUDA graph of 10 tokens.
FULL_GRAPH_CASE = Case("full-graph-decodes", graph_padded(
    batch((TOPK + 3, 2), (40, 2), (LONG_CTX, 2), topk=TOPK, kpool=4, decode_threshold=2), 10))


@pytest.fixture
def kernel_calls(monkeypatch):
    """The kernel calls of each step: (op, heads the kernel ran, rows)."""
    calls = []
    for op in ("prefill", "decode"):
        record = getattr(KernelRecorder, op)

        def spy(self, args, kwargs, result, record=record):
            record(self, args, kwargs, result)
            call = self.calls[-1]
            calls.append((call.op, call.heads, call.lengths.numel()))

        monkeypatch.setattr(KernelRecorder, op, spy)
    return calls


# --- every case ---------------------------------------------------------------------------

@pytest.mark.parametrize("case, config", step_params())
def test_kernel_is_handed_each_rows_selection(flashmla_on_stand_in, case, config, device, judge):
    """Every row served by the sparse kernel is handed exactly its intended selection (a), its
    valid count as its length, and its output and LSE are within budget of the oracle."""
    run_case(judge, flashmla_on_stand_in, config.apply(case.spec), device)


#: Decode rows and prefills that fit in topk (routed to dense MHA where the layer has that path).
TO_MHA_CASE = next(c for c in situation_cases(4) if c.name.startswith("decode+prefill-to-mha"))


@pytest.mark.parametrize(("config", "dense"), [(BF16, True), (KernelConfig("float8_e4m3fn", False, 16), False)],
                         ids=["bf16-rope64", "fp8-nope"])
def test_prefills_reach_the_sparse_kernel_only_where_the_layer_has_no_dense_path(flashmla_on_stand_in, config, dense,
                                                                                 device, judge):
    """vLLM's FLASHMLA_SPARSE has no dense-MHA prefill for a NoPE model on an fp8 cache (the
    576-byte rows do not fit the dense workspace): there every row of a step whose prefills fit
    in topk is served by the sparse kernel and checked; elsewhere the decode rows alone."""
    scenario = build_scenario(config.apply(TO_MHA_CASE.spec), 0)
    outcome = _run(flashmla_on_stand_in, TO_MHA_CASE, config, device, judge)
    assert scenario.prefills_to_mha and outcome.dense_prefill is dense
    assert outcome.planned_rows == (scenario.meta.num_decode_tokens if dense else scenario.num_rows)


@pytest.mark.parametrize("case", covering_cases(1), ids=lambda c: c.id)
def test_the_input_spaces_covering_design_through_flashmla(flashmla_on_stand_in, case, device, judge):
    """Every value class of every dimension of the production input space (block sizes, batch
    composition, CUDA-graph padding, context sources, kpool and topk, kernel variants, heads)
    through FLASHMLA_SPARSE's build() and forward_mqa(): each served row is handed its intended
    slots with its valid count as its length, and its output and LSE are within budget. A
    configuration FlashMLA does not serve is skipped with its reason."""
    record_input(classify(case.spec, case.layout, case.holes))
    refusal = flashmla_cases.builder_refusal(case.spec)
    if refusal:
        pytest.skip(refusal)
    run_case(judge, flashmla_on_stand_in, case.spec, device, holes=case.holes)


@pytest.mark.parametrize("case, config", flashmla_cases.magnitude_params())
def test_magnitude_edge_through_flashmla(flashmla_on_stand_in, case, config, device, judge):
    """Raw scores far from zero, mixed within rows and across the batch: each row's selection,
    length and output through vLLM's FLASHMLA_SPARSE code (the stand-in attends exactly; how
    FlashMLA's kernels round at these offsets is not yet measured on a GPU: docs/flashmla.md)."""
    run_case(judge, flashmla_on_stand_in, config.apply(case.spec), device)


@pytest.mark.parametrize("case, config", flashmla_cases.trap_params())
def test_spec_decode_rows_below_the_buffer_width(flashmla_on_stand_in, case, config, device, judge):
    """Speculative decode with 1 to 3 drafts on both of FlashMLA's paths, rows whose valid counts
    lie below the top-k buffer's width: each is handed its valid count as ``topk_length`` and its
    intended slots."""
    outcome = run_case(judge, flashmla_on_stand_in, config.apply(case.spec), device)
    assert outcome.planned_rows == sum(r.q_len for r in case.spec.requests)


@pytest.mark.parametrize("config", [BF16, FP8_MIXED, FP8_APART], ids=lambda c: c.id)
def test_sequence_through_one_layer(flashmla_on_stand_in, config, device, judge):
    """Steps through one layer and one cache: each step's rows as above; the fp8 decode kernel
    builds a fresh tile schedule every step that runs it (vLLM's builder hands a new
    FlashMLASchedMeta each build)."""
    layer, outcomes = run_sequence(judge, flashmla_on_stand_in, sequence_steps(4, config), device)
    decode_steps = sum(1 for o in outcomes if o.planned_rows)
    expected = decode_steps if config.kv_dtype == "float8_e4m3fn" else 0
    assert layer.plans == expected, f"{layer.plans} tile schedules for {decode_steps} steps that ran"


# --- which kernel vLLM chooses, and how many heads it hands it -------------------------------

def _run(backend, case, config, device, judge):
    return run_case(judge, backend, config.apply(case.spec), device)


def scenario_and_inputs(case, config, device):
    scenario = build_scenario(config.apply(case.spec), 0)
    return scenario, build_attention_inputs(scenario, device)


def test_bf16_cache_runs_the_prefill_kernel_on_every_row(flashmla_on_stand_in, kernel_calls, device, judge):
    outcome = _run(flashmla_on_stand_in, MIXED_CASE, BF16, device, judge)
    assert {op for op, _, _ in kernel_calls} == {"sparse_prefill_fwd"}
    assert sum(rows for _, _, rows in kernel_calls) == outcome.planned_rows


def test_fp8_cache_below_32_heads_runs_one_mixed_batch_on_the_decode_kernel(flashmla_on_stand_in, kernel_calls, device,
                                                                            judge):
    outcome = _run(flashmla_on_stand_in, MIXED_CASE, FP8_MIXED, device, judge)
    assert kernel_calls == [("sparse_decode_fwd", 64, outcome.planned_rows)], kernel_calls


@pytest.mark.parametrize("config", [BF16, FP8_MIXED, FP8_APART], ids=lambda c: c.id)
def test_a_full_graph_step_runs_its_padded_rows_and_serves_its_query_rows(flashmla_on_stand_in, kernel_calls, config,
                                                                          device, judge):
    """vLLM hands FlashMLA's kernels every token of a FULL graph's metadata (``num_actual_tokens``,
    padded rows included); the 6 query rows among the 10 are served and checked."""
    outcome = _run(flashmla_on_stand_in, FULL_GRAPH_CASE, config, device, judge)
    assert outcome.planned_rows == 6 and outcome.out.shape[0] == 6
    assert sum(rows for _, _, rows in kernel_calls) == 10, kernel_calls


def test_fp8_cache_from_32_heads_runs_decode_and_prefill_kernels_apart(flashmla_on_stand_in, kernel_calls, device,
                                                                       judge):
    """Decode rows on the decode kernel, prefill rows on the prefill kernel over the upconverted
    workspace (whose indices the recorder maps back to cache slots for the selection check)."""
    outcome = _run(flashmla_on_stand_in, MIXED_CASE, FP8_APART, device, judge)
    decodes = MIXED_CASE.spec.requests[0].q_len + MIXED_CASE.spec.requests[1].q_len
    assert kernel_calls[0] == ("sparse_decode_fwd", 64, decodes), kernel_calls
    assert {op for op, _, _ in kernel_calls[1:]} == {"sparse_prefill_fwd"}
    assert sum(rows for _, _, rows in kernel_calls) == outcome.planned_rows


@pytest.mark.parametrize("heads", [16, 32, 64, 128])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
def test_kernels_see_the_head_count_vllm_pads_to(flashmla_on_stand_in, kernel_calls, heads, kv_dtype, device, judge):
    """Each kernel call runs a head count FlashMLA's SM90 kernels take, no fewer than the layer's,
    and the one ``backends.vllm.flashmla.kernel_heads`` says (the rule ``unsupported`` judges by)."""
    config = KernelConfig(kv_dtype, True, heads, 0.5 if kv_dtype == "float8_e4m3fn" else 1.0)
    _run(flashmla_on_stand_in, MIXED_CASE, config, device, judge)
    seen = {h for _, h, _ in kernel_calls}
    expected = set(flashmla_backend_module.kernel_heads(flashmla_on_stand_in.module, layer_config(config.apply(
        MIXED_CASE.spec), 1)))
    assert seen <= set(flashmla_backend_module.SM90_KERNEL_HEADS) and min(seen) >= heads, seen
    assert seen == expected, f"kernels ran {sorted(seen)} heads, kernel_heads says {sorted(expected)}"


# --- the checks catch what the plumbing could get wrong -----------------------------------

def _convert_wrapped(monkeypatch, module, change):
    convert = module.triton_convert_req_index_to_global_index

    def wrapped(*args, **kwargs):
        return change(convert(*args, **kwargs))

    monkeypatch.setattr(module, "triton_convert_req_index_to_global_index", wrapped)


def test_a_slot_lost_in_conversion_fails_the_selection_check(flashmla_on_stand_in, device, monkeypatch):
    def drop_first_slot_of_row0(result):
        slots, counts = result
        slots[0, 0] = -1
        return slots, counts

    _convert_wrapped(monkeypatch, flashmla_on_stand_in.module, drop_first_slot_of_row0)
    scenario, inputs = scenario_and_inputs(MIXED_CASE, BF16, device)
    layer = flashmla_on_stand_in.open_layer(layer_config(scenario.spec, scenario.topk_indices.shape[0]), device)
    outcome = run_step(layer, scenario, inputs)
    problems = selection_problems(outcome, scenario)
    assert problems and problems[0].startswith("row 0 ") and "regime" in problems[0], problems


def test_a_topk_length_one_short_fails_the_length_check(flashmla_on_stand_in, device, monkeypatch):
    _convert_wrapped(monkeypatch, flashmla_on_stand_in.module, lambda result: (result[0], result[1] - 1))
    scenario, inputs = scenario_and_inputs(MIXED_CASE, BF16, device)
    layer = flashmla_on_stand_in.open_layer(layer_config(scenario.spec, scenario.topk_indices.shape[0]), device)
    problems = executed_length_problems(run_step(layer, scenario, inputs), scenario)
    assert len(problems) == scenario.planned_rows and all("is cut short" in p for p in problems), problems[:3]


def test_a_wrong_tile_scale_fails_the_output_check(flashmla_on_stand_in, device, monkeypatch):
    """The fp8 cache packed with twice the k_scale: slots and lengths stay right, the output
    and LSE move beyond the budget."""
    def doubled_scale(cache, k_scale):
        return flashmla_layout.pack(cache, 2 * k_scale)

    monkeypatch.setattr(flashmla_backend_module, "pack", doubled_scale)
    scenario, inputs = scenario_and_inputs(context_case(3000, 4), FP8_MIXED, device)
    layer = flashmla_on_stand_in.open_layer(layer_config(scenario.spec, scenario.topk_indices.shape[0]), device)
    outcome = run_step(layer, scenario, inputs)
    assert not selection_problems(outcome, scenario) and not executed_length_problems(outcome, scenario)
    comparisons = output_comparisons(outcome, scenario, inputs, kernel=flashmla_on_stand_in.kernel)
    assert [c.name for c in comparisons if not c.ok] == ["out", "lse"], [c.summary() for c in comparisons]


def test_an_index_outside_the_cache_handed_to_the_decode_kernel_is_refused(flashmla_on_stand_in, device, monkeypatch):
    """The decode kernel takes only -1 as invalid; the stand-in refuses where it would read out of
    bounds (on the GPU the recorder reports the index)."""
    def past_the_cache(result):
        result[0, 0] = 1 << 30
        return result

    _convert_wrapped(monkeypatch, flashmla_on_stand_in.module, past_the_cache)
    scenario, inputs = scenario_and_inputs(MIXED_CASE, FP8_MIXED, device)
    layer = flashmla_on_stand_in.open_layer(layer_config(scenario.spec, scenario.topk_indices.shape[0]), device)
    with pytest.raises(RuntimeError, match="outside the cache"):
        run_step(layer, scenario, inputs)


# --- the stand-ins -------------------------------------------------------------------------

def test_upconvert_gathers_each_prefills_tokens_at_its_workspace_start():
    gen = torch.Generator().manual_seed(11)
    cache = (torch.randn(6, 4, 576, generator=gen) * 2).to(torch.float8_e4m3fn)
    packed = flashmla_layout.pack(cache, 0.5)
    block_table = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)
    starts = torch.tensor([0, 6], dtype=torch.int32)
    dst = torch.empty(6 + 5, 576, dtype=torch.bfloat16)
    cp_gather_and_upconvert_fp8_kv_cache(packed, dst, block_table, starts, 2)
    slots = [4 * 4 + 0, 4 * 4 + 1, 4 * 4 + 2, 4 * 4 + 3, 1 * 4 + 0, 1 * 4 + 1,  # request 0: 6 tokens
             2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 5 * 4 + 0]  # request 1: 5 tokens
    assert gathered_cache_rows(block_table, starts, 2, 11, 4, 4).tolist() == slots
    assert torch.equal(dst, (cache.view(-1, 576)[slots].float() * 0.5).to(torch.bfloat16))


def test_stand_in_prefill_reads_only_the_entries_it_is_handed(flashmla_backend):
    """A NaN slot at an index past ``topk_length``, at -1 or at ``s_kv`` and beyond is not read;
    the same slot within ``topk_length`` is."""
    gen = torch.Generator().manual_seed(12)
    s_kv, heads = 8, 16
    memory = torch.randn(s_kv + 8, 1, 576, generator=gen).to(torch.bfloat16)
    memory[5] = float("nan")
    memory[s_kv:] = float("nan")  # past the KV the kernel is handed
    kv = memory[:s_kv]
    q = torch.randn(2, heads, 576, generator=gen).to(torch.bfloat16)
    indices = torch.tensor([[[0, 1, 2, 5]], [[3, -1, s_kv, s_kv + 7]]], dtype=torch.int32)
    ops = flashmla_stand_in.stand_in_ops()
    out, _, lse = ops.sparse_prefill_fwd(q, kv, indices, 0.1, 512, None, torch.tensor([3, 4], dtype=torch.int32),
                                         None)
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())
    out, _, _ = ops.sparse_prefill_fwd(q, kv, indices, 0.1, 512, None, None, None)
    assert bool(out[0].isnan().all()) and bool(torch.isfinite(out[1]).all())


# --- what the backend reads from the release ---------------------------------------------------

def test_every_name_the_backend_reads_is_in_the_release(flashmla_source):
    """Read statically from the release's files and its ``_flashmla_C`` library, so a release
    that renames what ``backends.vllm.flashmla`` reads fails here by name."""
    gaps = release_read_gaps(flashmla_source)
    assert not gaps, f"vLLM {flashmla_source.version} lacks what backends.vllm.flashmla reads:\n" + "\n".join(gaps)


def test_an_op_whose_arguments_moved_is_named():
    moved = {"sparse_prefill_fwd": "sparse_prefill_fwd(Tensor q, Tensor indices, Tensor kv, float sm_scale, int d_v, "
                                   "Tensor? attn_sink, Tensor? topk_length, Tensor(a!)? out_) -> Tensor[]"}
    gaps = flashmla_backend_module.signature_gaps(moved)
    assert len(gaps) == 1 and "op sparse_prefill_fwd takes (q, indices, kv," in gaps[0], gaps


def _names_read(path) -> set[tuple[str, str]]:
    """(module, name) of every ``from vllm.X import name`` in ``path``, every ``ops.NAME``
    where ``ops`` is ``vllm._custom_ops``, and every ``current_platform.NAME``."""
    tree = ast.parse(path.read_text())
    found = set()
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vllm"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in SHIMS_BY_NAME or full in FLASHMLA_SHIMS_BY_NAME:
                    aliases[alias.asname or alias.name] = full
                else:
                    found.add((node.module, alias.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            found.add((aliases[node.value.id], node.attr))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "current_platform":
            found.add(("current_platform", node.attr))
    return found


def test_every_name_flashmla_sparse_reads_from_a_stand_in_is_there(flashmla_source):
    """Read statically from the release's FLASHMLA_SPARSE modules: each name they import from a
    stand-in module, each ``ops.NAME`` of vLLM's ``_custom_ops`` and each platform method."""
    missing = []
    for module_name, relative in FLASHMLA_REAL_MODULES.items():
        for where, name in sorted(_names_read(flashmla_source.path_of(relative))):
            if where == "current_platform":
                if not hasattr(PLATFORM, name):
                    missing.append(f"{module_name} reads current_platform.{name}")
                continue
            shim = SHIMS_BY_NAME.get(where) or FLASHMLA_SHIMS_BY_NAME.get(where)
            if shim is not None and name not in shim_attributes(shim, flashmla_source):
                missing.append(f"{module_name} reads {where}.{name}")
    assert not missing, f"vLLM {flashmla_source.version} needs what the stand-ins lack:\n" + "\n".join(missing)


def test_flashmla_stand_ins_are_gone_after_loading(flashmla_backend):
    """FLASHMLA_SPARSE's stand-ins served its import only: the SM90 backend's imports of them
    still meet a ShimGap."""
    assert not [n for n in FLASHMLA_SHIMS_BY_NAME if n in sys.modules]
    assert FLASHMLA_SPARSE_MODULE in sys.modules


def test_a_modules_only_slice_is_refused_naming_the_kernels_and_the_slice_command(flashmla_source, tmp_path):
    for relative in SLICE_MODULE_FILES:
        if flashmla_source.path_of(relative).is_file():
            (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(flashmla_source.path_of(relative), tmp_path / relative)
    # the release's version as a slice keeps it (the source may be a wheel, a slice or an unpacked folder)
    (tmp_path / SLICE_METADATA).write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {flashmla_source.version}\n")
    source = resolve(str(tmp_path))
    with pytest.raises(FlashMLAUnavailable, match=r"_flashmla_C\.abi3\.so.*slice WHEEL -o DIR"):
        FlashMLABackend(source)


def test_without_cuda_or_the_stand_in_the_backend_refuses_with_the_loaders_error(flashmla_source):
    """In a fresh process on a machine without CUDA, vLLM's ops module finds FlashMLA
    unavailable; the refusal carries why importing the kernels failed."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: FlashMLA's kernels may load here")
    script = ("from backends.vllm.flashmla import FlashMLABackend, FlashMLAUnavailable\n"
              "from backends.vllm.source import resolve\n"
              f"try:\n    FlashMLABackend(resolve({str(flashmla_source.root)!r}))\n"
              "except FlashMLAUnavailable as exc:\n    print(exc)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2], env={**os.environ, "TRITON_INTERPRET": "1"})
    assert "FlashMLA's kernels cannot be used here" in run.stdout, run.stdout + run.stderr
    assert "import vllm._flashmla_C: " in run.stdout, run.stdout


@pytest.mark.parametrize("change, reason", [
    (dict(num_heads=256), "256 heads reach FlashMLA's SM90 kernels as"),
    (dict(block_size=16), "kernel block sizes"),
])
def test_unsupported_names_why(flashmla_backend, change, reason):
    config = dataclasses.replace(layer_config(BF16.apply(MIXED_CASE.spec), 8), **change)
    assert reason in (flashmla_backend.unsupported(config) or "")
    assert flashmla_backend.unsupported(layer_config(BF16.apply(MIXED_CASE.spec), 8)) is None
