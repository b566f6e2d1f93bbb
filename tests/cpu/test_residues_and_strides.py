"""Every residue, every stride (docs/input-space.md#every-residue-every-stride) on a machine
without a GPU: the CPU twin of ``tests/gpu/test_residues_and_strides.py``.

The cases reach what they promise (every residue around each point, the rows around each offset
boundary read, the cache's blocks apart with NaN between them, the single-token decodes' host
bound over-counting); the port's host stages plan them right; and, with ``--vllm``, vLLM's SM90
backend (FlashInfer the stand-in of ``tests.fa3_stand_in``, as ``tests/cpu/test_vllm_backend.py``
installs it) and FlashMLA through vLLM's FLASHMLA_SPARSE (its kernels the stand-ins of
``tests.flashmla_stand_in``) run them, judged by ``harness.judge``. The offset class runs at a
boundary of 2**22 elements here (a 10 MB cache); the GPU tier's are 2**31 and 2**32. Where a class
has power of its own, a bug it alone catches is planted and caught.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.seam import BETWEEN_BLOCKS_BYTE, ROW_BETWEEN_BLOCKS, block_stride_of, slots_of_cache_rows
from fast.impl import FastImpl
from harness.backend_step import layer_config, valid_lengths
from harness.builder import build_scenario, plan_rows, single_token_decodes, with_rejected_drafts
from harness.case_runner import run_case, scenario_of_step
from harness.cases import (
    OFFSET_BOUNDARIES,
    ROW_576,
    ROW_656,
    KernelConfig,
    blocks_apart_cases,
    kv_parts_cases,
    residues_around,
    slot_offset_case,
    straddling_slot,
)
from harness.device_inputs import build_attention_inputs, with_blocks_apart
from harness.pipeline import prepare_step, selection_mismatches
from harness.spec import batch
from reference import kv_len_rule, valid_counts
from tests import fa3_stand_in
from tests.residues_and_strides import (
    blocks_apart_params,
    kv_parts_handed,
    kv_parts_params,
    rejected_drafts_params,
    residue_params,
    row_width,
    same_order,
    single_token_rows,
    slot_offset_params,
)

#: The offset boundary of the CPU tier: the straddling slot's row crosses 2**22 elements.
SMALL_BOUNDARY = 1 << 22


# --- the cases reach what they promise ----------------------------------------------------------

#: The points each residue case takes every residue around (topk and multiples of the block size),
#: and the regimes its rows reach.
RESIDUE_POINTS = {
    "residues-topk256-kpool4-bs64": ({64, 128, 192, 256, 320, 57344}, set("BCDEFG")),
    "residues-topk2048-kpool4-bs64": ({64, 1984, 2048, 2112, 57344}, set("BCDEFG")),
    "residues-topk2048-kpool1-bs576": ({576, 1728, 2048, 2304, 57600}, {"H"}),
}


def points_taken(spec, contexts: set[int]) -> set[int]:
    """The points (topk, multiples of the block size) every context of whose
    ``residues_around`` is in ``contexts``."""
    candidates = {spec.topk} | set(range(spec.block_size, max(contexts) + 1, spec.block_size))
    return {p for p in candidates if set(residues_around(p, spec.kpool)) <= contexts}


@pytest.mark.parametrize("case", residue_params())
def test_residue_cases_reach_every_residue_around_topk_and_each_block_multiple(case):
    """Decode rows at every residue modulo kpool on both sides of each point, on the indexer's
    pooled path (no identity fill), and prefill rows over the residues around topk, planned."""
    spec = case.spec
    rows = plan_rows(spec)
    decodes = set(rows.ctx[: rows.num_decode_tokens].tolist())
    points, regimes = RESIDUE_POINTS[case.name]
    assert points_taken(spec, decodes) == points
    for point in points:
        below = {c % spec.kpool for c in decodes if point - spec.kpool <= c < point}
        above = {c % spec.kpool for c in decodes if point <= c < point + spec.kpool}
        assert below == above == set(range(spec.kpool)), (point, below, above)
    prefills = set(rows.ctx[rows.num_decode_tokens :].tolist())
    assert spec.topk in points_taken(spec, prefills)
    assert set(rows.regime) == regimes and not any(rows.identity.tolist())
    assert not rows.prefills_to_mha


@pytest.mark.parametrize("width", [ROW_576, ROW_656])
@pytest.mark.parametrize("boundary", [*OFFSET_BOUNDARIES, SMALL_BOUNDARY], ids=hex)
def test_offset_cases_read_the_rows_below_across_and_past_each_boundary(boundary, width):
    case = slot_offset_case(boundary, width, KernelConfig("bfloat16", True, 16))
    scenario = build_scenario(case.spec, 0)
    read = set(scenario.readable_slots().tolist())
    slot = straddling_slot(boundary, width)
    assert slot * width < boundary < (slot + 1) * width, "the slot's row crosses the boundary"
    around = set(range(slot - 64, slot + 65))
    assert around <= read, f"unread around the boundary: {sorted(around - read)[:8]}"
    assert min(read) * width < boundary - 64 * width and max(read) * width > boundary + 64 * width


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
def test_blocks_apart_keep_every_slot_and_hold_nan_between_blocks(kv_dtype):
    case, stride = blocks_apart_cases()[0]
    scenario = build_scenario(case.spec.replace(kv_dtype=kv_dtype), 0)
    contiguous = build_attention_inputs(scenario, "cpu")
    apart = with_blocks_apart(contiguous, stride)
    bs = case.spec.block_size
    assert block_stride_of(apart.kv_cache) == stride and block_stride_of(contiguous.kv_cache) == bs
    assert torch.equal(apart.ckv.view(torch.uint8), contiguous.ckv.view(torch.uint8))
    assert torch.equal(apart.kpe.view(torch.uint8), contiguous.kpe.view(torch.uint8))
    buffer = apart.kv_cache.as_strided((scenario.num_blocks, stride, apart.kv_cache.shape[-1]),
                                       (stride * apart.kv_cache.shape[-1], apart.kv_cache.shape[-1], 1))
    between = buffer[:, bs:]
    assert bool((between.view(torch.uint8) == BETWEEN_BLOCKS_BYTE).all()) and bool(between.float().isnan().all())


def test_slots_of_cache_rows_undo_the_block_stride():
    slots = torch.arange(6 * 64)
    rows = slots // 64 * 192 + slots % 64
    assert torch.equal(slots_of_cache_rows(rows, 64, 192), slots)
    between = torch.tensor([64, 191, 2 * 192 + 70])
    assert slots_of_cache_rows(between, 64, 192).tolist() == [ROW_BETWEEN_BLOCKS] * 3
    assert slots_of_cache_rows(torch.tensor([-1, 5]), 64, 64).tolist() == [-1, 5]


@pytest.mark.parametrize("case, slack", rejected_drafts_params())
def test_rejected_drafts_over_count_the_single_token_decodes(case, slack):
    """The transform adds the rejected drafts to the host bound of every request decoding one
    token; the spec-decode requests keep their own slack; seq_lens and positions stay exact."""
    built = build_scenario(case.spec, 0)
    shaped = with_rejected_drafts(built, slack)
    single = single_token_decodes(case.spec)
    spec_rows = [i for i, r in enumerate(case.spec.requests) if r.q_len > 1]
    over = shaped.meta.seq_lens_cpu_upper_bound - shaped.meta.seq_lens
    assert single and over[single].tolist() == [slack] * len(single)
    assert over[spec_rows].tolist() == [case.spec.host_bound_slack] * len(spec_rows)
    assert torch.equal(shaped.meta.seq_lens, built.meta.seq_lens) and torch.equal(shaped.meta.positions,
                                                                                  built.meta.positions)


def test_the_builder_keeps_single_token_decodes_exact():
    """Built from a spec alone, a request decoding one token has an exact host bound, whatever
    the spec's slack (existing scenarios stay bit for bit as they were): only the transform
    makes it optimistic."""
    spec = batch((40, 1), (300, 3), (9, 1), decode_threshold=3, async_scheduling=True, host_bound_slack=2)
    over = build_scenario(spec, 0).meta.seq_lens_cpu_upper_bound - torch.tensor([40, 300, 9])
    assert over.tolist() == [0, 2, 0]
    with pytest.raises(ValueError, match="async scheduling"):
        with_rejected_drafts(build_scenario(spec.replace(async_scheduling=False, host_bound_slack=0), 0), 2)


class SingleDecodeBoundAsExact(FastImpl):
    """A re-created bug of the context source: under async scheduling the host bound is taken as
    exact for the requests that decode one token (they verify no draft, so their bound looks
    exact), the positions read for the others."""

    def kv_lens(self, meta, *, topk, kpool, async_scheduling):
        lens = super().kv_lens(meta, topk=topk, kpool=kpool, async_scheduling=async_scheduling)
        if not async_scheduling or meta.seq_lens_cpu_upper_bound is None:
            return lens
        bound = super().kv_lens(meta, topk=topk, kpool=kpool, async_scheduling=False)
        q_lens = meta.query_start_loc_cpu[1 : meta.num_reqs + 1] - meta.query_start_loc_cpu[: meta.num_reqs]
        single = torch.repeat_interleave(q_lens == 1, q_lens)
        return torch.where(single, bound, lens)


@pytest.mark.parametrize("case, slack", rejected_drafts_params())
def test_a_bound_taken_as_exact_for_single_token_decodes_is_caught_only_with_rejected_drafts(case, slack, device):
    """The builder alone gives single-token decodes exact bounds, so the bug plans them right;
    with the drafts rejected the step before, it plans them past their valid count."""
    bug = SingleDecodeBoundAsExact()
    for scenario, caught in ((build_scenario(case.spec, 0), False),
                             (with_rejected_drafts(build_scenario(case.spec, 0), slack), True)):
        step = prepare_step(bug, scenario, "compacted", device)
        wrong = (step.lens.to(torch.int64) != kv_len_rule(scenario.row_ctx, case.spec.topk, case.spec.kpool))
        rows = single_token_rows(scenario, step.num_planned)
        assert bool(wrong.any()) is caught and bool(wrong[rows].any()) is caught, (caught, wrong.nonzero().tolist())


# --- the port's host stages --------------------------------------------------------------------

def port_plans_right(impl, scenario, device) -> None:
    step = prepare_step(impl, scenario, "compacted", device)
    valid = valid_counts(scenario.intended_slots()[: step.num_planned]).to(torch.int64)
    assert torch.equal(step.planned_lens.to(torch.int64), valid), step.context()
    assert not step.violations and not selection_mismatches(step), step.context()


@pytest.mark.parametrize("case", residue_params())
def test_the_port_plans_every_residue(impl, device, case):
    port_plans_right(impl, build_scenario(case.spec, 0), device)


@pytest.mark.parametrize("case, slack", rejected_drafts_params())
def test_the_port_plans_single_token_decodes_with_optimistic_slack(impl, device, case, slack):
    port_plans_right(impl, with_rejected_drafts(build_scenario(case.spec, 0), slack), device)


@pytest.mark.parametrize("case, width", slot_offset_params((SMALL_BOUNDARY,)))
def test_the_port_plans_slot_ids_around_an_offset_boundary(impl, device, case, width):
    port_plans_right(impl, build_scenario(case.spec, 0), device)


# --- vLLM's SM90 backend and FlashMLA, stand-in kernels ----------------------------------------

@pytest.fixture(params=[pytest.param("vllm", marks=pytest.mark.vllm),
                        pytest.param("flashmla", marks=[pytest.mark.vllm, pytest.mark.flashmla])])
def backend(request):
    return request.getfixturevalue({"vllm": "vllm_on_stand_in", "flashmla": "flashmla_on_stand_in"}[request.param])


@pytest.mark.parametrize("case", residue_params())
def test_every_residue_around_topk_and_block_multiples(backend, device, judge, case):
    run_case(judge, backend, case.spec, device)


@pytest.mark.parametrize("case, width", slot_offset_params((SMALL_BOUNDARY,)))
def test_slot_ids_around_an_offset_boundary(backend, device, judge, case, width):
    if row_width(backend, case.spec) != width:
        pytest.skip(f"{backend.name} multiplies this cache's slot ids by {row_width(backend, case.spec)}, not {width}")
    run_case(judge, backend, case.spec, device)


@pytest.mark.parametrize("case, stride", blocks_apart_params())
def test_cache_blocks_apart(backend, device, judge, case, stride):
    run_case(judge, backend, case.spec, device, kv_block_stride=stride)


@pytest.mark.parametrize("case, slack", rejected_drafts_params())
def test_single_token_decodes_with_optimistic_slack(backend, device, judge, case, slack):
    scenario = scenario_of_step(case.spec, 0, rejected_drafts=slack)
    outcome = run_case(judge, backend, case.spec, device, rejected_drafts=slack)
    if not outcome.host_exact:  # planned from the bound: past the valid count on single-token rows, clamped
        rows = single_token_rows(scenario, outcome.planned_rows)
        assert bool((outcome.host_lengths[rows] > valid_lengths(scenario, outcome.planned_rows)[rows]).any())


@pytest.mark.vllm
@pytest.mark.parametrize("case", kv_parts_params())
def test_ckv_and_kpe_views_give_the_bits_of_contiguous_copies(vllm_on_stand_in, device, judge, case):
    scenario = build_scenario(case.spec, 0)
    inputs = build_attention_inputs(scenario, device)
    config = layer_config(scenario.spec, scenario.topk_indices.shape[0])
    outputs, order = {}, {}
    for contiguous in (False, True):
        layer = vllm_on_stand_in.open_layer(config, device)
        with kv_parts_handed(layer, contiguous, order) as handed:
            outputs[contiguous] = judge.step(vllm_on_stand_in, layer, scenario, inputs).out
        assert handed and not any(ckv or kpe for ckv, kpe in handed)
    assert torch.equal(outputs[False], outputs[True])


def test_a_second_run_reads_the_first_runs_order_of_the_same_entries():
    order = {}
    first = torch.tensor([7, 3, 5, 0], dtype=torch.int32)
    same_order(first, order)
    again = torch.tensor([3, 5, 7, 0], dtype=torch.int32)
    same_order(again, order)
    assert again.tolist() == [7, 3, 5, 0] and order["reordered"]
    with pytest.raises(AssertionError, match="different entries"):
        same_order(torch.tensor([3, 5, 6, 0], dtype=torch.int32), order)


def contiguous_strides(shape) -> tuple[int, ...]:
    strides, size = [], 1
    for n in reversed(shape):
        strides.insert(0, size)
        size *= n
    return tuple(strides)


@pytest.mark.vllm
def test_a_kernel_that_reads_the_views_as_contiguous_is_caught(vllm_on_stand_in, device, judge, monkeypatch):
    """Planted: the kernel reads ckv and kpe as if they were contiguous (their strides dropped).
    The step with contiguous copies passes; the same step with the views fails the judge."""
    run = fa3_stand_in.StandInWrapper.run

    def strides_dropped(self, q_nope, q_pe, ckv, kpe, *args, **kwargs):
        ckv, kpe = (t.as_strided(t.shape, contiguous_strides(t.shape), t.storage_offset()) for t in (ckv, kpe))
        return run(self, q_nope, q_pe, ckv, kpe, *args, **kwargs)

    monkeypatch.setattr(fa3_stand_in.StandInWrapper, "run", strides_dropped)
    scenario = build_scenario(kv_parts_cases()[0].spec, 0)
    inputs = build_attention_inputs(scenario, device)
    config = layer_config(scenario.spec, scenario.topk_indices.shape[0])
    layer = vllm_on_stand_in.open_layer(config, device)
    with kv_parts_handed(layer, contiguous=True):
        judge.step(vllm_on_stand_in, layer, scenario, inputs)
    with pytest.raises(AssertionError, match="beyond the error budget"):
        judge.step(vllm_on_stand_in, vllm_on_stand_in.open_layer(config, device), scenario, inputs)


@pytest.mark.vllm
def test_a_convert_that_ignores_the_block_stride_is_caught(vllm_on_stand_in, device, judge, monkeypatch):
    """Planted: vLLM's row view of the cache says the blocks are contiguous (its convert then
    maps tokens to rows as if they were). Its rows land between blocks and in other blocks: the
    executed slots are not the intended ones."""
    if not vllm_on_stand_in.reads_block_stride:
        pytest.skip(f"vLLM {vllm_on_stand_in.version} reads contiguous blocks")
    module = vllm_on_stand_in.module
    row_view = module.flat_kv_row_view
    monkeypatch.setattr(module, "flat_kv_row_view", lambda cache, block_size: (row_view(cache, block_size)[0],
                                                                               block_size))
    case, stride = blocks_apart_cases()[1]
    with pytest.raises(AssertionError, match="executes slots other than its selection"):
        run_case(judge, vllm_on_stand_in, case.spec, device, kv_block_stride=stride)


@pytest.mark.vllm
def test_a_release_that_reads_contiguous_blocks_names_why(vllm_backend):
    config = layer_config(blocks_apart_cases()[0][0].spec, 8)
    apart = dataclasses.replace(config, kv_block_stride=3 * config.block_size)
    assert vllm_backend.unsupported(config) is None
    reason = vllm_backend.unsupported(apart)
    assert (reason is None) is vllm_backend.reads_block_stride
    if reason:
        assert "LBHNC" in reason and f"{apart.kv_block_stride} rows apart" in reason


@st.composite
def rejected_drafts_steps(draw):
    """An async spec-decoding step (threshold 2 to 4) with 1 to 4 single-token decodes near or
    past a small topk, 0 to 2 spec-decode requests, and the drafts rejected the step before."""
    topk, kpool = draw(st.sampled_from((128, 256))), draw(st.sampled_from((1, 4)))
    threshold = draw(st.integers(2, 4))
    near = st.sampled_from((1, kpool + 1, topk - kpool - 1, topk - 1, topk, topk + 1, topk + kpool, 3 * topk + 1))
    single = [(draw(near), 1) for _ in range(draw(st.integers(1, 4)))]
    spec_decode = [(max(draw(near), threshold), threshold) for _ in range(draw(st.integers(0, 2)))]
    requests = draw(st.permutations(single + spec_decode))
    spec = batch(*requests, topk=topk, kpool=kpool, block_size=draw(st.sampled_from((64, 128))),
                 decode_threshold=threshold, async_scheduling=True,
                 host_bound_slack=draw(st.integers(0, threshold - 1)))
    return spec, draw(st.integers(1, threshold - 1))


@pytest.mark.vllm
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=12)
@given(step=rejected_drafts_steps(), seed=st.integers(0, 2**31 - 1))
def test_drawn_single_token_decodes_with_optimistic_slack_through_vllm(vllm_on_stand_in, device, judge, step, seed):
    """Drawn async steps whose single-token decodes over-count their host bound: every row of
    vLLM's step executes its valid count and its intended slots."""
    spec, slack = step
    run_case(judge, vllm_on_stand_in, KernelConfig("bfloat16", True, 16).apply(spec), device, seed=seed, compare=False,
             rejected_drafts=slack)
