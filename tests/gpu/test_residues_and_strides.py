"""Every residue, every stride (docs/input-space.md#every-residue-every-stride), through every
backend behind the seam: the project's port on FlashInfer's fa3 (``port-fa3``), vLLM's own SM90
backend and FlashMLA through vLLM's FLASHMLA_SPARSE (the last two with ``--vllm``).

- contexts at every residue modulo kpool around topk and around multiples of the block size
  (vllm-project/vllm#55927: a wrong token whenever the prompt length was 3 mod 4);
- ckv and kpe handed as the strided views of one cache row (what vLLM hands FlashInfer) and as
  contiguous copies: the kernel must give the same bits (flashinfer-ai/flashinfer#1341, #3219);
- slot ids whose element offset (slot x row width) crosses 2**31 and 2**32 (flashinfer-ai/flashinfer#3130,
  #3136): caches of 2 to 9 GB, ``gpu_large``;
- a cache whose blocks lie apart, a view of a larger buffer with NaN between its blocks (vLLM
  0.32+'s ``flat_kv_row_view`` and block stride): the port takes none (vLLM 0.30.0's code is never
  handed one), nor do vLLM releases that read contiguous blocks;
- async steps whose single-token decodes carry the optimistic slack of drafts rejected the step
  before (``harness.builder.with_rejected_drafts``).

Every step is judged by ``harness.judge`` (the ``judge`` fixture): the rows served, each row's
executed length against its valid count, its executed slots against its intended selection (a),
its output (and LSE) against the float64 oracle over (a) within the error budget.
"""

from __future__ import annotations

import pytest

from backends.registry import open_backend
from harness.backend_step import layer_config, valid_lengths
from harness.builder import build_scenario
from harness.case_runner import port_twin, run_case, scenario_of_step
from harness.device_inputs import build_attention_inputs
from harness.port.launch import DEVICE
from tests.residues_and_strides import (
    FLASHMLA_TAKES_WHOLE_ROWS,
    blocks_apart_params,
    kv_parts_handed,
    kv_parts_params,
    rejected_drafts_params,
    residue_params,
    row_width,
    single_token_rows,
    slot_offset_params,
)

pytestmark = pytest.mark.gpu

BACKENDS = ["port-fa3", pytest.param("vllm", marks=pytest.mark.vllm),
            pytest.param("flashmla", marks=[pytest.mark.vllm, pytest.mark.flashmla])]


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    """Each backend under test: the port on fa3; vLLM's SM90 backend and FlashMLA with ``--vllm``
    (skipped without it, or where the release cannot run here: the reason is its own test's)."""
    if request.param == "port-fa3":
        return open_backend("port-fa3")
    return request.getfixturevalue("vllm_on_gpu" if request.param == "vllm" else "flashmla_on_gpu")


@pytest.fixture(scope="module")
def fa3_twin():
    return port_twin(DEVICE)


def twin_for(backend, fa3_twin):
    """The project's FA3 path as the twin of vLLM's backend (an output beyond the budget passes
    where it is FlashInfer's own rounding on the same inputs); none for the others."""
    return fa3_twin if backend.name.startswith("vllm") else None


@pytest.mark.parametrize("case", residue_params())
def test_every_residue_around_topk_and_block_multiples(backend, fa3_twin, judge, case):
    run_case(judge, backend, case.spec, DEVICE, twin=twin_for(backend, fa3_twin))


@pytest.mark.parametrize("case", kv_parts_params())
def test_ckv_and_kpe_views_give_the_bits_of_contiguous_copies(backend, judge, case):
    """The same step twice on fresh layers: ckv and kpe as the views of the cache's rows the
    backend hands the kernel, then as contiguous copies. Both judged against the oracle, and
    the two outputs bit for bit equal: a kernel that ignores the views' strides reads other
    elements than the copies hold. The second run's kernel reads the first run's kv_indices in
    the first run's order (``kv_parts_handed``: the same entries checked), so that a convert
    whose order varies from run to run does not change the bits."""
    if backend.kernel == "flashmla":
        pytest.skip(f"{backend.name}: {FLASHMLA_TAKES_WHOLE_ROWS}")
    scenario = build_scenario(case.spec, 0)
    inputs = build_attention_inputs(scenario, DEVICE)
    config = layer_config(scenario.spec, scenario.topk_indices.shape[0])
    judge.admit(backend, config)
    outputs, order = {}, {}
    for contiguous in (False, True):
        layer = backend.open_layer(config, DEVICE)
        with kv_parts_handed(layer, contiguous, order) as handed:
            outputs[contiguous] = judge.step(backend, layer, scenario, inputs).out
        assert handed and not any(ckv for ckv, _ in handed), f"{backend.name} handed the kernel a contiguous ckv"
    n = outputs[False].shape[0]
    differ = (outputs[False] != outputs[True]).flatten(1).any(1).nonzero().flatten().tolist()
    assert not differ, (f"{backend.name}: rows {differ[:8]} of {n} differ between ckv/kpe views and contiguous "
                        f"copies; {scenario.describe()}")


@pytest.mark.gpu_large
@pytest.mark.parametrize("case, width", slot_offset_params())
def test_slot_offsets_past_2p31_and_2p32(backend, fa3_twin, judge, case, width):
    """Rows below, across and past 2**31 and 2**32 elements from the cache's start, each read by
    a row of the step; the cache is built whole (2 to 9 GB), its slots no row reads NaN."""
    if row_width(backend, case.spec) != width:
        pytest.skip(f"{backend.name} multiplies this cache's slot ids by {row_width(backend, case.spec)}, not {width}")
    run_case(judge, backend, case.spec, DEVICE, twin=twin_for(backend, fa3_twin))


@pytest.mark.parametrize("case, stride", blocks_apart_params())
def test_cache_blocks_apart(backend, judge, case, stride):
    """The cache as a view of a larger buffer, its blocks ``stride`` rows apart, NaN between them:
    every row executes its intended slots (as slot ids) and its output is the oracle's, so no
    row between blocks was read."""
    run_case(judge, backend, case.spec, DEVICE, kv_block_stride=stride)


@pytest.mark.parametrize("case, slack", rejected_drafts_params())
def test_single_token_decodes_with_optimistic_slack(backend, fa3_twin, judge, case, slack):
    """Every row executes its valid count whatever the host bound over-counts; a backend that plans
    from the bound (vLLM's bounded design) plans past the valid count on single-token rows and
    its clamp cuts them back."""
    scenario = scenario_of_step(case.spec, 0, rejected_drafts=slack)
    outcome = run_case(judge, backend, case.spec, DEVICE, twin=twin_for(backend, fa3_twin), rejected_drafts=slack)
    if outcome.host_exact or outcome.host_lengths is None:
        return
    rows = single_token_rows(scenario, outcome.planned_rows)
    valid = valid_lengths(scenario, outcome.planned_rows)
    assert bool((outcome.host_lengths[rows] > valid[rows]).any()), (
        f"{backend.name}: no single-token row was bounded past its valid count; {scenario.describe()}")
