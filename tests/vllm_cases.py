"""The cases both tiers run through a vLLM release's SM90 backend: every regime case and batch
situation (``harness.cases``) with kernel configurations from the covering design, the magnitude
edge, the input space's covering design and the large batches. The CPU tier runs them on a
stand-in FlashInfer that keeps its schedule as fa3 does (``tests.fa3_stand_in``); the GPU tier on
FlashInfer itself. Each runs through ``harness.judge`` with the ``judge`` fixture.
"""

from __future__ import annotations

import dataclasses

import pytest

from harness.cases import (
    Case,
    KernelConfig,
    all_regime_cases,
    context_case,
    covering_config,
    identity_case,
    large_batch_cases,
    situation_cases,
)
from harness.findings.vllm import kpe_scale_ignored
from mla_constants import TOPK


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


def magnitude_params():
    """The magnitude edge's cases (raw score offsets far from zero, docs/edges.md#magnitude), each
    with a covering configuration (fp8 rope at k_scale 1: the kpe finding has cases of its own)."""
    from tests.support.magnitude import magnitude_cases

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
