"""The pure parts of the scale edge (docs/edges.md#scale): the builder's fast indexer rows and
device-side generators (bitwise the host builder's), the scale batches, the row-by-row judge
(the tolerance policy per row) and the selections compared on a device."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import harness.builder
import harness.hashed_values as hashed_values_module
from fast.impl import FastImpl
from fast.layouts import LAYOUTS
from harness import batch, build_attention_inputs, build_scenario
from harness.cases import KPOOLS, VARIANTS
from harness.pipeline import as_planned, prepare_step, selection_mismatches
from harness.port.scale import (
    LARGE_ROWS,
    SCALE_HEADS,
    SCALE_ROWS,
    case_by_id,
    run_case_in_child,
    scale_cases,
    scale_spec,
)
from harness.row_check import judge_rows, planned_selection_on, row_errors, same_multisets_on, selection_mismatches_on
from harness.scenario import (
    build_attention_inputs_on,
    component_seed,
    indexer_rows_fast,
    intended_slots_on,
    query_rows,
    readable_slots_on,
    slot_values,
    slot_values_on,
)
from mla_constants import INVALID, TOPK
from reference import compare_to_budget, kv_len_rule, sparse_mla_reference
from reference.budget import LSE_ULPS
from reference.indexer import indexer_rows
from reference.invariants import same_multisets
from reference.rules import valid_counts

BIT_VIEWS = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float32: torch.int32}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(BIT_VIEWS[t.dtype])


# --- the builder at scale ------------------------------------------------------------------------


@st.composite
def indexer_inputs(draw):
    kpool = draw(st.sampled_from([1, 2, 4, 8]))
    topk = kpool * draw(st.integers(1, 40))
    width = -(-(topk + kpool - 1) // 128) * 128 + draw(st.sampled_from([0, 128]))
    ctx = draw(st.lists(st.integers(1, 6 * topk), max_size=30))
    identity = [draw(st.booleans()) and c <= width for c in ctx]
    return (torch.tensor(ctx, dtype=torch.int64), torch.tensor(identity, dtype=torch.bool), topk, kpool, width,
            draw(st.integers(0, 2**32)), draw(st.integers(0, 3)))


@given(indexer_inputs())
@settings(max_examples=150)
def test_fast_indexer_rows_are_the_reference_model_bit_for_bit(args):
    ctx, identity, topk, kpool, width, seed, pad = args
    assert torch.equal(indexer_rows_fast(ctx, identity, topk, kpool, width, seed, pad),
                       indexer_rows(ctx, identity, topk, kpool, width, seed, pad))


def test_fast_indexer_rows_refuse_what_the_model_refuses():
    with pytest.raises(ValueError, match="identity fill needs ctx <= width"):
        indexer_rows_fast(torch.tensor([300]), torch.tensor([True]), 128, 4, 256, 0)
    with pytest.raises(ValueError, match="multiple of kpool"):
        indexer_rows_fast(torch.tensor([3]), torch.tensor([False]), 130, 4, 256, 0)


@pytest.mark.parametrize("kpool", KPOOLS)
def test_fast_rows_of_a_scale_batch_equal_the_model(kpool):
    scenario = build_scenario(scale_spec(1024, kpool), seed=3)
    model = indexer_rows(scenario.row_ctx, scenario.row_identity, TOPK, kpool, scenario.spec.resolved_width,
                         component_seed(3, "indexer"))
    assert torch.equal(scenario.topk_indices, model)


@pytest.mark.parametrize("kpool", KPOOLS)
def test_32768_row_batch_is_built_as_specified(kpool):
    scenario = build_scenario(scale_spec(32768, kpool), seed=4)
    assert scenario.num_rows == scenario.planned_rows == scenario.topk_indices.shape[0] == 32768
    assert not scenario.prefills_to_mha and not bool(scenario.row_identity.any())
    expected = {"B", "C", "D", "E", "F", "G"} if kpool == 4 else {"H"}
    assert set(scenario.row_regime) == expected
    counts = valid_counts(scenario.topk_indices)
    assert torch.equal(counts.to(torch.int64), kv_len_rule(scenario.row_ctx, TOPK, kpool)), (
        "a row's valid count is not its kv_len"
    )
    assert int(scenario.row_ctx.max()) == 131_072 and int(scenario.row_ctx.min()) == 1


def unwritten_indexer_rows(ctx, identity, topk, kpool, width, seed, num_padded_rows=0):
    """Indexer rows of the right shape, all INVALID: what a build needs where only its row
    counts are read."""
    return torch.full((ctx.numel() + num_padded_rows, width), INVALID, dtype=torch.int32)


@pytest.mark.parametrize("rows", SCALE_ROWS)
def test_scale_batches_plan_exactly_their_rows(rows, monkeypatch):
    """The rows planned come from the step's metadata (decodes, prefills and whether prefills go
    to dense MHA), never from the indexer rows: those, most of a large build's time, are left
    unwritten here (the 32768-row batches are built in full above)."""
    monkeypatch.setattr(harness.builder, "indexer_rows_fast", unwritten_indexer_rows)
    for kpool in KPOOLS:
        spec = scale_spec(rows, kpool)
        assert sum(r.q_len for r in spec.requests) == rows
        if rows >= 1024:
            scenario = build_scenario(spec, seed=0)
            assert scenario.num_rows == scenario.planned_rows == rows, (rows, kpool)


def test_scale_cases_cover_every_variant_and_kpool_at_each_head_count():
    cases = scale_cases()
    assert len({c.id for c in cases}) == len(cases) == len(SCALE_ROWS) * len(SCALE_HEADS)
    for heads in SCALE_HEADS:
        mine = [c for c in cases if c.config.num_heads == heads]
        assert {(c.config.kv_dtype, c.config.rope, c.config.k_scale) for c in mine} == set(VARIANTS)
        assert {c.kpool for c in mine} == set(KPOOLS)
        assert {c.rows for c in mine} == set(SCALE_ROWS)
    assert all(c.large == (c.rows >= LARGE_ROWS) for c in cases)
    assert [c.rows for c in cases if c.over_capacity] == [32768, 32768]
    assert case_by_id(cases[5].id) == cases[5]
    with pytest.raises(ValueError, match="no scale case"):
        case_by_id("rows7")


def test_device_slot_values_are_the_host_values_bit_for_bit():
    slots = np.array([0, 1, 2, 143, 144, 1 << 23, (1 << 23) + 99, 12_345_678_901], dtype=np.uint64)
    for head_dim in (512, 576, 3):
        host = slot_values(123, slots, head_dim)
        device = slot_values_on(123, torch.from_numpy(slots.astype(np.int64)), head_dim)
        assert np.array_equal(host.view(np.int32), device.numpy().view(np.int32)), head_dim


def test_hashed_values_do_not_depend_on_the_chunking(monkeypatch):
    keys = torch.arange(37) * 1000 + 5
    whole = query_rows(9, keys, 4, 576, "cpu")
    monkeypatch.setattr(hashed_values_module, "_HASH_ELEMENTS", 200)
    assert torch.equal(bits(query_rows(9, keys, 4, 576, "cpu")), bits(whole))


def test_a_row_q_depends_on_its_key_alone():
    batch_a = query_rows(5, torch.tensor([3, 17, 4]), 16, 576, "cpu")
    batch_b = query_rows(5, torch.tensor([17]), 16, 576, "cpu")
    assert torch.equal(bits(batch_a[1]), bits(batch_b[0]))
    assert not torch.equal(batch_a[0], batch_a[2])
    assert batch_a.dtype == torch.bfloat16 and 0.9 < float(batch_a.float().std()) < 1.1


def small_spec(**config):
    defaults = dict(topk=128, kpool=4, block_size=16, num_heads=2, padded_rows=2)
    defaults.update(config)
    return batch((40, 1), (301, 1), (150, 24), **defaults)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("poison", [True, False])
def test_device_builder_cache_is_the_host_builder_cache(kv_dtype, poison):
    scenario = build_scenario(small_spec(kv_dtype=kv_dtype, rope=kv_dtype == "bfloat16"), seed=8)
    host = build_attention_inputs(scenario, poison=poison)
    device = build_attention_inputs_on(scenario, "cpu", poison=poison)
    assert torch.equal(bits(device.kv_cache), bits(host.kv_cache))
    assert device.q_nope.shape == host.q_nope.shape and device.q_pe.shape == host.q_pe.shape


def test_device_builder_q_follows_the_row_keys():
    scenario = build_scenario(small_spec(), seed=8)
    rows = scenario.topk_indices.shape[0]
    keys = torch.arange(rows).flip(0)
    plain = build_attention_inputs_on(scenario, "cpu")
    keyed = build_attention_inputs_on(scenario, "cpu", row_keys=keys)
    assert torch.equal(bits(keyed.q_nope), bits(plain.q_nope.flip(0)))
    with pytest.raises(ValueError, match="row_keys"):
        build_attention_inputs_on(scenario, "cpu", row_keys=keys[:3])


def test_device_intended_and_readable_slots_are_the_host_ones():
    scenario = build_scenario(small_spec(), seed=9)
    assert torch.equal(intended_slots_on(scenario, "cpu"), scenario.intended_slots())
    assert torch.equal(readable_slots_on(scenario, "cpu"), scenario.readable_slots())


# --- the row-by-row judge -------------------------------------------------------------------------


def attention_problem(rows=24, heads=4, slots=200, width=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    qn = torch.randn(rows, heads, 512, generator=g).bfloat16()
    qp = torch.randn(rows, heads, 64, generator=g).bfloat16()
    ckv = torch.randn(slots, 512, generator=g).bfloat16()
    kpe = torch.randn(slots, 64, generator=g).bfloat16()
    sel = torch.randint(0, slots, (rows, width), generator=g)
    lens = torch.randint(1, width + 1, (rows,), generator=g)
    lens[0] = 1
    mask = torch.arange(width)[None] < lens[:, None]
    out, lse = sparse_mla_reference(qn, qp, ckv, kpe, sel, mask=mask, sm_scale=0.1, mode="float32")
    return (qn, qp, ckv, kpe, sel, mask), out.bfloat16(), lse


def test_a_kernel_as_good_as_float32_passes_every_row():
    inputs, out, lse = attention_problem()
    report = judge_rows(out, lse, *inputs, sm_scale=0.1)
    assert report.ok and report.num_rows == 24 and 0 < report.worst_ratio() < 1


def test_one_wrong_row_fails_alone_and_is_named_with_its_head():
    inputs, out, lse = attention_problem()
    out[17, 3, 200] += 0.03
    lse[5, 0] = float("nan")
    report = judge_rows(out, lse, *inputs, sm_scale=0.1)
    assert report.bad_rows() == [5, 17]
    text = report.describe(lambda r: f"request {r // 2}")
    assert text.startswith("2 of 24 rows beyond the error budget")
    assert "row 17 (request 8): out max err" in text and "worst head 3" in text and "1 NaN" in text


def test_a_wrong_row_among_many_right_ones_is_below_a_whole_output_relative_l2():
    inputs, out, lse = attention_problem(rows=64)
    truth = sparse_mla_reference(*inputs[:5], mask=inputs[5], sm_scale=0.1)
    out[40] = (out[40].float() * 1.02).bfloat16()  # 2% off on one row of 64
    rel_l2 = float((out.double() - truth[0]).norm() / truth[0].norm())
    assert rel_l2 < 1e-2, "the row-wise judge is needed only where a whole-output number hides the row"
    assert judge_rows(out, lse, *inputs, sm_scale=0.1).bad_rows() == [40]


def test_chunks_do_not_change_the_verdict():
    inputs, out, lse = attention_problem(rows=30)
    out[11, 1, 7] += 0.02
    whole = judge_rows(out, lse, *inputs, sm_scale=0.1, chunk_rows=1000)
    for chunk in (1, 7):
        parts = judge_rows(out, lse, *inputs, sm_scale=0.1, chunk_rows=chunk)
        assert torch.equal(parts.out.max_err, whole.out.max_err) and torch.equal(
            parts.lse.max_budget, whole.lse.max_budget
        )
        assert parts.bad_rows() == whole.bad_rows() == [11]


def test_a_chunk_without_gpu_memory_is_judged_again_in_halves(monkeypatch):
    """The other workers' tests can hold the GPU's memory while a large batch is judged: a chunk
    that runs out of it is judged again in smaller chunks, with the same verdict."""
    import harness.row_check

    inputs, out, lse = attention_problem(rows=30)
    out[11, 1, 7] += 0.02
    whole = judge_rows(out, lse, *inputs, sm_scale=0.1, chunk_rows=1000)
    reference, sizes = harness.row_check.sparse_mla_reference, []

    def short_of_memory(q_nope, *args, **kwargs):
        sizes.append(q_nope.shape[0])
        if q_nope.shape[0] > 8:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (other processes)")
        return reference(q_nope, *args, **kwargs)

    monkeypatch.setattr(harness.row_check, "sparse_mla_reference", short_of_memory)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)  # no CUDA here
    parts = judge_rows(out, lse, *inputs, sm_scale=0.1, chunk_rows=30)
    assert sizes[:3] == [30, 15, 7] and max(sizes[2:]) <= 8
    assert parts.bad_rows() == whole.bad_rows() == [11]
    assert torch.equal(parts.out.max_err, whole.out.max_err) and torch.equal(parts.lse.max_budget, whole.lse.max_budget)

    def no_memory_at_all(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (none left)")

    monkeypatch.setattr(harness.row_check, "sparse_mla_reference", no_memory_at_all)
    with pytest.raises(torch.cuda.OutOfMemoryError):  # not even one row fits: the error stands
        judge_rows(out, lse, *inputs, sm_scale=0.1, chunk_rows=4)


def test_no_rows_give_an_empty_passing_report():
    inputs, out, lse = attention_problem(rows=3)
    report = judge_rows(
        out[:0], lse[:0], *(x[:0] if i in (0, 1, 4, 5) else x for i, x in enumerate(inputs)), sm_scale=0.1
    )
    assert report.ok and report.num_rows == 0 and report.worst_ratio() == 0.0


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("what", ["out", "lse"])
def test_the_policy_per_row_is_the_whole_output_policy_on_one_row(seed, what):
    g = torch.Generator().manual_seed(seed)
    shape = (1, 4, 64) if what == "out" else (1, 4)
    truth = torch.randn(shape, generator=g, dtype=torch.float64)
    lowp = truth + 1e-3 * torch.randn(shape, generator=g, dtype=torch.float64)
    scale = [0.5, 1.5, 2.5, 4.0, 1.0, 3.0][seed]
    actual = truth + scale * (lowp - truth)
    if seed == 4:
        actual[0, 1] = float("nan")
    if seed == 5:
        truth[0, 2], lowp[0, 2], actual[0, 2] = float("-inf"), float("-inf"), 0.0
    ulps = LSE_ULPS if what == "lse" else 0.0
    for kv_dtype in ("bfloat16", "float8_e4m3fn"):
        whole = compare_to_budget(what, actual, truth, lowp, kv_dtype, ulps=ulps)
        rows = row_errors(what, actual, truth, lowp, kv_dtype, ulps=ulps)
        assert bool(rows.bad[0]) == (not whole.ok), (seed, kv_dtype, whole.summary())
        assert float(rows.max_err[0]) == pytest.approx(whole.max_err)


# --- selections on a device -----------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_device_selections_are_the_host_selections(impl, device, layout):
    """(b) gathered, multisets compared and mismatching rows found on the device give what the
    host functions give, regime C rows of the strided and packed layouts included."""
    scenario = build_scenario(batch((5, 1), (130, 1), (301, 1), (70, 9), topk=64, kpool=4, block_size=16), seed=6)
    step = prepare_step(impl, scenario, layout, device)
    host_slots, host_mask = as_planned(step)
    slots, mask = planned_selection_on(step.kv_indptr, step.kv_indices, step.planned_lens, step.num_planned, device)
    assert torch.equal(slots.cpu(), host_slots) and torch.equal(mask.cpu(), host_mask)
    a = scenario.intended_slots()[: step.num_planned]
    assert torch.equal(same_multisets_on(a.to(device), a.to(device) != INVALID, slots, mask).cpu(),
                       same_multisets(a, a != INVALID, host_slots, host_mask))
    assert selection_mismatches_on(step, device) == selection_mismatches(step)
    if layout == "compacted":
        assert selection_mismatches(step) == []
    else:
        regimes = {scenario.row_regime[r] for r in selection_mismatches(step)}
        assert regimes <= {"C"}


# --- a scale case in a child process ------------------------------------------------------------


class DyingImpl(FastImpl):
    """The production path, dying (as a device fault would) when it makes the attention state."""

    def make_attention_state(self, config, device="cuda", **kwargs):
        sys.stderr.write("CUDA error: an illegal memory access was encountered\n")
        sys.stderr.flush()
        os._exit(3)


class RefusingState:
    def __init__(self, *args, **kwargs):
        pass

    def plan(self, num_rows, lens):
        raise ValueError(f"FA MLA needs {num_rows} work items including KV splits; native capacity is 1")


class RefusingImpl(FastImpl):
    def make_attention_state(self, config, device="cuda", **kwargs):
        return RefusingState()


def dying_impl():
    return DyingImpl()


def refusing_impl():
    return RefusingImpl()


@pytest.fixture
def child_on_this_device(monkeypatch, device):
    """The child runs where this process's tests run: the compiled convert kernel on a GPU
    machine, Triton's interpreter on CPU (TRITON_INTERPRET is inherited)."""
    monkeypatch.setenv("SPARSE_MLA_DEVICE", device.type)


def test_a_scale_child_that_dies_is_reported_with_its_stage_and_regimes(child_on_this_device):
    case = case_by_id("rows1-kpool4-bf16-rope64-h16")
    result = run_case_in_child(case, f"{__name__}:dying_impl", timeout=240)
    assert result["outcome"] == "crashed" and result["stage"] == "selection", \
        f"{result['outcome']} at stage {result.get('stage')}: {result.get('detail')}"
    assert result["regimes"] == {"G": 1}
    assert "exited with 3 at stage selection" in result["detail"] and "illegal memory access" in result["detail"]
    assert "memory_retries" not in result  # a crash, not a memory shortage: made once


def test_a_scale_child_that_ran_out_of_gpu_memory_is_made_again(monkeypatch):
    """Another worker's test held the memory: the case runs again in a fresh child, and the
    result says so; a child that runs out every time is reported as it ended."""
    import harness.memory_retry
    import harness.port.scale

    monkeypatch.setattr(harness.memory_retry, "OOM_PAUSE_S", 0.0)
    out_of_memory = {"outcome": "crashed", "stage": "judge", "detail": "child exited with 1 at stage judge: "
                     "torch.OutOfMemoryError: CUDA out of memory", "out_of_gpu_memory": True}
    results = [dict(out_of_memory), {"outcome": "right", "detail": "every row within budget"}]
    monkeypatch.setattr(harness.port.scale, "_case_in_one_child", lambda *args: results.pop(0))
    result = run_case_in_child(case_by_id("rows1-kpool4-bf16-rope64-h16"), "fast.impl:default_impl")
    assert result["outcome"] == "right" and result["memory_retries"] == 1 and "made 2 times" in result["detail"]
    monkeypatch.setattr(harness.port.scale, "_case_in_one_child", lambda *args: dict(out_of_memory))
    result = run_case_in_child(case_by_id("rows1-kpool4-bf16-rope64-h16"), "fast.impl:default_impl")
    assert result["outcome"] == "crashed" and result["memory_retries"] == harness.memory_retry.OOM_RETRIES
    assert "CUDA out of memory" in result["detail"] and "made 3 times" in result["detail"]


def test_a_scale_child_reports_a_refusal_at_plan(child_on_this_device):
    case = case_by_id("rows2-kpool4-bf16-rope64-h128")
    result = run_case_in_child(case, f"{__name__}:refusing_impl", timeout=240)
    assert result["outcome"] == "refused" and result["refusal_is_value_error"], \
        f"{result['outcome']} at stage {result.get('stage')}: {result.get('detail')}"
    assert result["detail"].startswith("ValueError: FA MLA needs 2 work items") and result["regimes"] == {
        "C": 1,
        "G": 1,
    }


@pytest.mark.parametrize("stderr", [
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB.",
    "RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
    "RuntimeError: cudaErrorMemoryAllocation: out of memory",
], ids=["allocator", "context", "runtime"])
def test_every_way_a_child_says_the_gpu_had_no_memory_for_it_is_retried(stderr):
    from harness.memory_retry import out_of_gpu_memory

    assert out_of_gpu_memory(stderr)
    assert not out_of_gpu_memory("RuntimeError: CUDA error: an illegal memory access was encountered")
