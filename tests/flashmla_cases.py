"""The cases both tiers run through vLLM's FLASHMLA_SPARSE backend (``backends.vllm.flashmla``).

The CPU tier runs every regime case and batch situation with the covering design's kernel
configurations on the stand-in kernels (``tests.flashmla_stand_in``); the GPU tier runs every
regime case under each configuration FlashMLA serves for DeepSeek-V3.2 (bf16 with rope, fp8
with rope at k_scale 1 and 0.5), the batch situations (decode- and prefill-shaped) at 16 heads
(the fp8 mixed batch) and 128 (the fp8 decode and prefill kernels apart), on FlashMLA itself,
and the same scenarios and inputs through the project's FA3 path. Each step is judged by
``harness.judge`` (the ``judge`` fixture): the rows routed to the sparse kernel, each row's
executed length against its valid count, the slots handed to the kernel against its intended
selection (a), and the output and LSE against the float64 oracle over (a) within the error
budget of ``reference.budget`` (the FA3-measured budget: FlashMLA's has yet to be measured, so
a failure reports the measured ratios).
"""

from __future__ import annotations

import dataclasses

import pytest

from harness.builder import build_scenario
from harness.cases import Case, KernelConfig, all_regime_cases, covering_config, situation_cases
from harness.spec import batch
from mla_constants import DEEPSEEK_V32_SM_SCALE, TOPK

#: The configurations FlashMLA serves for DeepSeek-V3.2 on the GPU tier (heads vary by case).
GPU_VARIANTS = (("bfloat16", 1.0), ("float8_e4m3fn", 1.0), ("float8_e4m3fn", 0.5))
HEADS_CYCLE = (16, 32, 64, 128)
#: Heads of the batch situations on the GPU: below 32 the fp8 cache runs one mixed batch on the
#: decode kernel; at 128 its decode and prefill rows go to the two kernels apart.
SITUATION_HEADS = (16, 128)


def step_params():
    """Every regime case and batch situation with the covering design's configurations (the
    CPU tier)."""
    cases = all_regime_cases() + situation_cases(1) + situation_cases(4)
    return [pytest.param(case, covering_config(i), id=f"{case.id}-{covering_config(i).id}")
            for i, case in enumerate(cases)]


def gpu_regime_params():
    """Every regime case under each GPU configuration, heads cycling 16, 32, 64, 128 over the
    cases so that each configuration meets every head count."""
    params = []
    for kv_dtype, k_scale in GPU_VARIANTS:
        for i, case in enumerate(all_regime_cases()):
            config = KernelConfig(kv_dtype, True, HEADS_CYCLE[i % len(HEADS_CYCLE)], k_scale)
            params.append(pytest.param(case, config, id=f"{case.id}-{config.id}"))
    return params


def shaped_cases() -> list[Case]:
    """Decode-shaped and prefill-shaped batches: the batch situations of kpool 4, without the
    empty batch (it runs no kernel)."""
    return [c for c in situation_cases(4) if not c.name.startswith("empty-batch")]


def gpu_shaped_params():
    return [pytest.param(case, KernelConfig(kv_dtype, True, heads, k_scale),
                         id=f"{case.id}-{KernelConfig(kv_dtype, True, heads, k_scale).id}")
            for kv_dtype, k_scale in GPU_VARIANTS for heads in SITUATION_HEADS for case in shaped_cases()]


#: The magnitude edge's configurations on FlashMLA: bf16, and fp8 on each of its two kernels (the
#: decode kernel below 32 heads, the prefill kernel on the upconverted workspace from 32 on).
MAGNITUDE_CONFIGS = (KernelConfig("bfloat16", True, 16), KernelConfig("float8_e4m3fn", True, 16, 0.5),
                     KernelConfig("float8_e4m3fn", True, 64))


def magnitude_params():
    """The magnitude edge's cases (raw score offsets far from zero, docs/edges.md#magnitude) in
    each of :data:`MAGNITUDE_CONFIGS`."""
    from tests.support.magnitude import magnitude_cases

    return [pytest.param(case, config, id=f"{case.id}-{config.id}")
            for config in MAGNITUDE_CONFIGS for case in magnitude_cases()]


def gpu_input_space_params():
    """The input space's covering design (every value class of every dimension) in the
    configurations the GPU tier runs FlashMLA in, DeepSeek-V3.2's: a NoPE variant's case runs
    with rope 64 on the same cache dtype (the variant classes themselves are the CPU tier's)."""
    from harness.cases import input_space_cases
    from harness.input_space import SPACE, classify

    params = []
    for case, layout in input_space_cases(1):
        spec = case.spec if case.spec.rope else case.spec.replace(rope=True, sm_scale=DEEPSEEK_V32_SM_SCALE)
        classes = classify(spec, layout, case.holes)
        params.append(pytest.param(dataclasses.replace(case, spec=spec), layout,
                                   id="-".join(classes[d.name] for d in SPACE)))
    return params


#: Why a step with prefills and no host bound does not reach FlashMLA's kernels.
BUILDER_NEEDS_HOST_BOUND = ("vLLM's FLASHMLA_SPARSE builder asserts seq_lens_cpu_upper_bound on a step with prefills "
                            "(flashmla_sparse.py, build(): it reads the prefills' lengths from it, without a D2H sync)")


def builder_refusal(spec) -> str | None:
    """Why vLLM's FLASHMLA_SPARSE builder refuses the step of ``spec`` (an assertion, not a
    finding: the SM90 backend takes such a step through its exact host lengths), or None."""
    if spec.with_host_bound:
        return None
    return BUILDER_NEEDS_HOST_BOUND if build_scenario(spec, 0).meta.num_prefills else None


#: FlashMLA's two paths for the spec-decode cases: bf16 (the prefill kernel on every row), fp8 at
#: 16 heads (one mixed batch on the decode kernel) and at 128 (decode and prefill kernels apart).
TRAP_CONFIGS = (KernelConfig("bfloat16", True, 16), KernelConfig("float8_e4m3fn", True, 16),
                KernelConfig("float8_e4m3fn", True, 128))


def spec_decode_trap_cases() -> list[Case]:
    """Speculative decode with 1, 2 and 3 draft tokens (vLLM #31845), every request's rows routed
    as decodes, contexts whose valid counts lie below the top-k buffer's width (vLLM #36616:
    ``topk_length`` not passed, the padded columns attended), at topk and past it."""
    return [Case(f"spec-decode-{drafts}-drafts", batch((37, drafts + 1), (TOPK - 2, drafts + 1),
                                                       (TOPK + 5, drafts + 1), kpool=4, decode_threshold=drafts + 1))
            for drafts in (1, 2, 3)]


def trap_params():
    return [pytest.param(case, config, id=f"{case.id}-{config.id}")
            for config in TRAP_CONFIGS for case in spec_decode_trap_cases()]
