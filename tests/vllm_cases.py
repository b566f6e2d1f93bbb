"""The cases both tiers run through a vLLM release's SM90 backend, and the checks they share.

Every regime case and batch situation (``harness.cases``), with kernel configurations from the
covering design, and the multi-step sequences that exercise a kept plan, a replan and the
clamp of a kept plan. The CPU tier runs them on a stand-in FlashInfer that keeps its schedule
as fa3 does (``tests.fa3_stand_in``); the GPU tier on FlashInfer itself.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from harness.backend_step import (
    context,
    executed_length_problems,
    layer_config,
    output_comparisons,
    problem_rows,
    routing_problems,
    run_step,
    selection_problems,
)
from harness.builder import build_scenario
from harness.cases import (
    Case,
    KernelConfig,
    all_regime_cases,
    batch,
    context_case,
    covering_config,
    identity_case,
    large_batch_cases,
    situation_cases,
)
from harness.device_inputs import AttentionInputs, build_attention_inputs, nan_kv_buffer
from harness.findings import (
    FINDINGS_DOC,
    PADDED_GRAPH_ROWS_FINDING,
    QUERY_SHAPE_REFUSAL,
    PaddedGraphRowsUnplanned,
    padded_graph_step,
)
from mla_constants import TOPK
from pytest_sparse_mla.vllm import VLLM_TWIN_KEY

#: vLLM dequantises the kpe part of an fp8 cache with 1.0, not the layer's k_scale.
KPE_SCALE_FINDING = "vLLM's fp8 kpe read without k_scale: " + FINDINGS_DOC + "#vllm-fp8-kpe-scale"


#: vLLM plans an fp8 cache with its storage dtype (its cache spec's uint8), which FlashInfer refuses.
FP8_AS_UINT8_FINDING = "vLLM plans an fp8 cache as uint8: " + FINDINGS_DOC + "#vllm-fp8-planned-as-uint8"
UINT8_REFUSAL = "kv_data_type torch.uint8 is not supported"


class Fp8PlannedAsUint8(AssertionError):
    """FlashInfer refused vLLM's plan of an fp8 cache with kv_data_type uint8."""


class KpeScaleIgnored(AssertionError):
    """vLLM's output is beyond the budget on an fp8 cache with rope and k_scale != 1, and only
    there (its forward_mqa passes kpe_scale=1.0)."""


def kpe_scale_ignored(config) -> bool:
    return config.kv_dtype == "float8_e4m3fn" and config.rope and config.k_scale != 1.0


def vllm_config(index: int) -> KernelConfig:
    """The covering design's ``index``-th configuration, at k_scale 1 where vLLM's fp8 kpe
    finding would decide the outcome (the finding has cases of its own)."""
    config = covering_config(index)
    return dataclasses.replace(config, k_scale=1.0) if kpe_scale_ignored(config) else config


def step_cases() -> list[tuple[Case, KernelConfig]]:
    cases = all_regime_cases() + situation_cases(1) + situation_cases(4)
    return [(case, vllm_config(i)) for i, case in enumerate(cases)]


#: The fp8 kpe finding's cases: rope 64, k_scale 0.5, a row past topk and the identity fill.
KPE_SCALE_CASES = [
    (context_case(TOPK + 952, 4), KernelConfig("float8_e4m3fn", True, 16, 0.5)),
    (identity_case(1), KernelConfig("float8_e4m3fn", True, 64, 0.5)),
]


def step_params(extra=()):
    return [pytest.param(case, config, id=f"{case.id}-{config.id}")
            for case, config in list(step_cases()) + KPE_SCALE_CASES + list(extra)]


def expect_findings(backend, config, request) -> None:
    """Mark the test a strict xfail where a known vLLM finding decides its outcome: an fp8 cache
    on a release that plans it as uint8 (refused before anything runs), else an fp8 cache with
    rope and k_scale != 1 (kpe read without k_scale)."""
    if not hasattr(backend, "design"):
        return  # not a vLLM release's backend
    fp8 = config.kv_dtype == "float8_e4m3fn"
    if fp8 and backend.plans_fp8_as_storage_dtype:
        request.applymarker(pytest.mark.xfail(raises=Fp8PlannedAsUint8, strict=True, reason=FP8_AS_UINT8_FINDING))
    elif kpe_scale_ignored(config):
        request.applymarker(pytest.mark.xfail(raises=KpeScaleIgnored, strict=True, reason=KPE_SCALE_FINDING))


def flashinfer_checks_query_shape(request) -> bool:
    """Whether the FlashInfer the test runs on refuses q rows other than the planned ones at run:
    probed on the GPU (``Features.run_checks_query_shape``), declared by a CPU stand-in."""
    if request.node.get_closest_marker("gpu") is not None:
        return bool(request.getfixturevalue("features").run_checks_query_shape)
    wrapper = getattr(sys.modules.get("flashinfer.mla"), "BatchMLAPagedAttentionWrapper", None)
    return bool(getattr(wrapper, "checks_query_shape", False))


def expect_padded_graph_finding(backend, spec, request) -> None:
    """A strict xfail where vLLM's padded FULL graph step meets a FlashInfer that checks the query
    shape at run (docs/findings.md#vllm-padded-graph-rows-unplanned)."""
    if hasattr(backend, "design") and padded_graph_step(spec) and flashinfer_checks_query_shape(request):
        request.applymarker(pytest.mark.xfail(raises=PaddedGraphRowsUnplanned, strict=True,
                                              reason=PADDED_GRAPH_ROWS_FINDING))


#: vLLM 0.31.0 packs a -1 inside a row's planned length as slot 0, which FlashInfer's fa3 kernel
#: loads past the row's executed length with weight 0: a non-finite slot 0 makes the row NaN.
SLOT_ZERO_FINDING = ("vLLM's -1 packed as slot 0, loaded past a row's length: " + FINDINGS_DOC
                     + "#vllm-slot-0-loaded-past-a-rows-length")


class SlotZeroLoaded(AssertionError):
    """The output rows that are not finite are exactly those whose kernel tiles load a non-finite
    slot 0 past their executed length."""


def expect_slot_zero_finding(backend, layer, outcome, inputs, request) -> list[int]:
    """On FlashInfer's own kernel: the rows that load, past their executed length, entries vLLM
    packed as slot 0 whose KV row is not finite (``VllmLayer.slots_loaded_past_length``), made
    a strict xfail when there are any. A release that packs the row's first slot there reads
    finite data and meets none."""
    if inputs is None or not hasattr(backend, "design") or not getattr(layer, "on_flashinfer", False):
        return []
    loaded = layer.slots_loaded_past_length(outcome)
    if not loaded:
        return []
    cache = inputs.kv_cache.reshape(-1, inputs.kv_cache.shape[-1])
    finite = bool(torch.isfinite(cache[0].float()).all())
    rows = sorted(r for r, slots in loaded.items() if not finite and 0 in slots)
    if rows:
        request.applymarker(pytest.mark.xfail(raises=SlotZeroLoaded, strict=True, reason=SLOT_ZERO_FINDING))
    return rows


def nonfinite_rows(out: torch.Tensor) -> list[int]:
    return (~torch.isfinite(out.float())).flatten(1).any(1).nonzero().flatten().tolist()


def magnitude_params():
    """The magnitude edge's cases (raw score offsets far from zero, docs/edges.md#magnitude), each
    with a covering configuration (fp8 rope at k_scale 1: the kpe finding has cases of its own)."""
    from tests.gpu.test_edges import magnitude_cases

    return [pytest.param(case, vllm_config(i), id=f"{case.id}-{vllm_config(i).id}")
            for i, case in enumerate(magnitude_cases())]


def padded_empty_step(spec) -> bool:
    """A step with no query row and rows padded for a CUDA graph. vLLM's runner never hands its
    attention such a step: a step without tokens skips the model, and an idle data-parallel rank
    or a capture runs a dummy batch of requests with query rows (``GPUModelRunner._dummy_run``).
    Run through vLLM's forward on an H200, FlashInfer refused it at run; the GPU tier leaves it
    out of vLLM's covering design (docs/vllm.md), and the project's port plans it."""
    return spec.padded_rows > 0 and not any(r.q_len for r in spec.requests)


def input_space_params(strength: int = 1):
    """The covering design of the production input space (every value class of every dimension
    at strength 1), fp8 rope at k_scale 1 as above."""
    from harness.cases import input_space_cases

    params = []
    for case, _ in input_space_cases(strength):
        spec = case.spec
        if padded_empty_step(spec):
            continue
        if kpe_scale_ignored(spec):
            spec = spec.replace(k_scale=1.0)
        params.append(pytest.param(dataclasses.replace(case, spec=spec), id=case.id))
    return params


def large_params():
    return step_params([(case, vllm_config(i)) for i, case in enumerate(large_batch_cases())])[-2:]


def sequence_specs(kpool: int) -> list:
    """One layer, steps in order: decode rows around topk advancing one token a step (the
    bounded design keeps its plan), a jump past the slack (a replan), spec-decode rows that
    straddle topk, fewer rows (a replan of fewer rows over buffers that hold the larger step's
    slots), the first batch again, an empty step."""
    base = [TOPK - 3, 17, TOPK + 5, 3 * TOPK + 1]
    steps = [batch(*[(s + t, 1) for s in base], kpool=kpool) for t in range(4)]
    steps.append(batch(*[(s + 40, 1) for s in base], kpool=kpool))
    steps.append(batch((TOPK + 3, 4), (TOPK - 2, 4), kpool=kpool, decode_threshold=4))
    steps.append(batch((TOPK + 1, 1), kpool=kpool))
    steps.append(batch(*[(s, 1) for s in base], kpool=kpool))
    steps.append(batch(kpool=kpool))
    return steps


def check_step(backend, layer, scenario, inputs, request, *, compare=True, twin=None, baseline=None, step=""):
    """Run one step and assert what a user of vLLM relies on; return the outcome.

    ``twin(scenario, inputs)``: where given (the GPU tier), FlashInfer's output on the same
    inputs through the project's own path (an exact plan of the intended selection, the
    compacted layout). An output beyond the error budget that is bit for bit the twin's is the
    kernel's rounding on these inputs, not vLLM's doing: it passes here, counted in the summary
    (``VLLM_TWIN_KEY``), and the kernel's budget is the kernel tests' to judge.

    ``baseline`` (the upgrade check's note): the step's output, its rows' executed KV lengths
    (what vLLM wrote into FlashInfer's schedule) and its error ratios are recorded under names
    ending in ``step``, so that a comparison on another release shows any drift in either."""
    expect_padded_graph_finding(backend, scenario.spec, request)
    try:
        outcome = run_step(layer, scenario, inputs)
    except ValueError as exc:
        if UINT8_REFUSAL in str(exc) and scenario.spec.kv_dtype == "float8_e4m3fn":
            raise Fp8PlannedAsUint8(f"vLLM {backend.version}: FlashInfer refused the plan: {exc}; "
                                    f"{scenario.describe()}") from exc
        if QUERY_SHAPE_REFUSAL in str(exc) and padded_graph_step(scenario.spec) and hasattr(backend, "design"):
            raise PaddedGraphRowsUnplanned(
                f"vLLM {backend.version}: FlashInfer's run() refused the padded FULL graph step: {exc}; vLLM's "
                f"build() planned the {scenario.num_rows} query rows (query_start_loc_cpu[-1]) and forward_mqa "
                f"ran {scenario.meta.num_actual_tokens} rows (num_actual_tokens, padded); {scenario.describe()}"
            ) from exc
        raise
    where = f"{context(outcome, scenario)}; {backend.describe()}"
    slot_zero = expect_slot_zero_finding(backend, layer, outcome, inputs, request)
    problems = (routing_problems(outcome, scenario) + executed_length_problems(outcome, scenario)
                + selection_problems(outcome, scenario))
    regimes = scenario.row_regime[: outcome.planned_rows]
    regime_log = request.getfixturevalue("regime_log")
    comparisons = []
    if compare and inputs is not None and outcome.planned_rows:
        comparisons = output_comparisons(outcome, scenario, inputs, kernel=getattr(backend, "kernel", None))
    regime_log.step(outcome, regimes, comparisons=comparisons, spec=scenario.spec)
    if problems:
        regime_log.blame([regimes[r] for r in problem_rows(problems, outcome.planned_rows)])
    assert not problems, f"{where}\n" + "\n".join(problems[:12])
    if comparisons:
        comparison = comparisons[0]
        if baseline is not None:
            n = outcome.planned_rows
            baseline.note(ratios={f"out{step}_max_ratio": comparison.max_ratio,
                                  f"out{step}_mean_ratio": comparison.mean_ratio},
                          outputs={f"out{step}": outcome.out[:n], f"executed_len{step}": outcome.executed_lengths})
        bad = [c for c in comparisons if not c.ok]
        if bad:
            summary = "\n".join(c.summary(scenario.row_regime) for c in bad)
            if kpe_scale_ignored(scenario.spec) and hasattr(backend, "design"):
                raise KpeScaleIgnored(f"{where}\n{summary}")
            n = outcome.planned_rows
            if slot_zero and nonfinite_rows(outcome.out[:n]) == slot_zero:
                raise SlotZeroLoaded(f"{where}\nrows {slot_zero} load slot 0 (not finite) past their executed "
                                     f"length and are not finite\n{summary}")
            if twin is not None and torch.equal(outcome.out[:n], twin(scenario, inputs)[:n]):
                request.node.user_properties.append((VLLM_TWIN_KEY, (comparison.max_ratio, comparison.mean_ratio)))
                return outcome
            raise AssertionError(f"{outcome.backend}'s output vs (a) beyond the error budget; {where}\n{summary}")
    return outcome


def run_case(backend, case, config, device, request, seed: int = 0, twin=None, baseline=None):
    expect_findings(backend, config, request)
    spec = config.apply(case.spec)
    scenario = build_scenario(spec, seed)
    layer = backend.open_layer(layer_config(spec, max(scenario.topk_indices.shape[0], 1)), device)
    inputs = build_attention_inputs(scenario, device)
    return check_step(backend, layer, scenario, inputs, request, twin=twin, baseline=baseline)


def in_one_cache(inputs: AttentionInputs, cache: torch.Tensor) -> AttentionInputs:
    """The step's inputs with its KV cache written into the front of ``cache``, the one cache
    every step of a sequence shares (as the engine's does; the rest stays NaN)."""
    flat = cache.view(-1, cache.shape[-1])
    own = inputs.kv_cache.view(-1, cache.shape[-1])
    flat[: own.shape[0]] = own
    return AttentionInputs(inputs.q_nope, inputs.q_pe, cache)


def run_sequence(backend, kpool, config, device, request, *, with_inputs=True, twin=None, baseline=None):
    """All steps of :func:`sequence_specs` through one layer and one KV cache; the layer."""
    expect_findings(backend, config, request)
    specs = [config.apply(s) for s in sequence_specs(kpool)]
    scenarios = [build_scenario(s, seed) for seed, s in enumerate(specs)]
    max_tokens = max(s.topk_indices.shape[0] for s in scenarios)
    layer = backend.open_layer(layer_config(specs[0], max_tokens), device)
    blocks = max(s.num_blocks for s in scenarios)
    cache = nan_kv_buffer((blocks, specs[0].block_size, specs[0].head_dim), specs[0].kv_dtype, device)
    outcomes = []
    for i, scenario in enumerate(scenarios):
        inputs = in_one_cache(build_attention_inputs(scenario, device), cache) if with_inputs else None
        outcomes.append(check_step(backend, layer, scenario, inputs, request, twin=twin, baseline=baseline,
                                   step=f"_step{i}"))
    return layer, outcomes
