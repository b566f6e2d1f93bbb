"""Holes in the top-k through every backend the run has (docs/findings.md#top-k-holes-attended):
decode rows at every regime context whose top-k rows hold -1 inside their valid prefix (tied,
infinite or NaN indexer scores, ``tests.topk_hole_cases``), through the project's port on fa3 and
fa2, vLLM's SM90 backend (``--vllm``) and vLLM's FLASHMLA_SPARSE on FlashMLA's kernels (where the
release has them).

A backend that executes each such row with the length rule's count (the port and vLLM's SM90
backend) is a strict xfail raising :class:`~harness.findings.TopkHolesAttended`, and only where
exactly the rows with holes read past their valid count and every other row is right. The port
is checked before launch: its compacted layout leaves the -1 in the planned span, which FlashInfer
would read as slot -1. FlashMLA, handed each row's valid count as its length, must be right.
"""

from __future__ import annotations

import pytest

from backends.flashmla import FlashMLABackend, FlashMLAUnavailable
from backends.registry import open_backend
from backends.vllm_source import incompatibility
from fast.flashinfer_compat import parse_version
from harness.backend_step import layer_config
from harness.cases import case_scenario
from harness.device_inputs import build_attention_inputs
from harness.findings import TOPK_HOLES_FINDING, TopkHolesAttended
from harness.launch import DEVICE
from mla_constants import TOPK
from tests.topk_hole_cases import (
    ROPE_CONFIGS,
    check_empty_rows_as_flashmla_gives_them,
    check_hole_step,
    hole_params,
    rows_without_entries,
)

pytestmark = pytest.mark.gpu

ATTENDED = pytest.mark.xfail(raises=TopkHolesAttended, strict=True, reason=TOPK_HOLES_FINDING)
SEED = 3


def open_layer(backend, scenario):
    """A fresh layer of ``backend`` for the scenario (skipped where the backend does not serve it)."""
    config = layer_config(scenario.spec, scenario.topk_indices.shape[0])
    reason = backend.unsupported(config)
    if reason:
        pytest.skip(f"{backend.name}: {reason}")
    return backend.open_layer(config, DEVICE)


@ATTENDED
@pytest.mark.parametrize("kernel", ["fa3", "fa2"])
@pytest.mark.parametrize("case", hole_params(TOPK))
def test_port_plans_the_length_rule_over_holes(kernel, case):
    backend = open_backend(f"port-{kernel}")
    scenario = case_scenario(case, SEED)
    check_hole_step(backend, open_layer(backend, scenario), scenario, None)


@pytest.fixture(scope="module")
def vllm_here(vllm_backend):
    import flashinfer

    pairing = incompatibility(vllm_backend.design, parse_version(flashinfer.__version__))
    if pairing:
        pytest.skip(f"not run: {pairing}")
    return vllm_backend


def slot_zero_loaded_rows(layer, outcome, inputs) -> list[int]:
    """Rows whose loads past their executed length reach a slot 0 that is not finite, on
    FlashInfer's own kernel (docs/findings.md#vllm-slot-0-loaded-past-a-rows-length)."""
    slot_zero = inputs.kv_cache.reshape(-1, inputs.kv_cache.shape[-1])[0]
    if not layer.on_flashinfer or bool(slot_zero.float().isfinite().all()):
        return []
    return sorted(r for r, slots in layer.slots_loaded_past_length(outcome).items() if 0 in slots)


@pytest.mark.vllm
@ATTENDED
@pytest.mark.parametrize("case", hole_params(TOPK))
def test_vllm_executes_the_length_rule_over_holes(vllm_here, case):
    scenario = case_scenario(case, SEED)
    inputs = build_attention_inputs(scenario, DEVICE)
    layer = open_layer(vllm_here, scenario)
    check_hole_step(vllm_here, layer, scenario, inputs, filler=vllm_here.minus_one_filler(DEVICE),
                    spared=lambda outcome: slot_zero_loaded_rows(layer, outcome, inputs))


@pytest.fixture(scope="module")
def flashmla_here(flashmla_source):
    try:
        return FlashMLABackend(flashmla_source)
    except FlashMLAUnavailable as exc:
        pytest.skip(f"not run: {exc}")


@pytest.mark.vllm
@pytest.mark.parametrize("case", hole_params(TOPK, ROPE_CONFIGS))
def test_flashmla_executes_each_rows_valid_count(flashmla_here, case):
    """FlashMLA is handed each row's valid count (``topk_length``) and its valid entries: the
    contract's semantics, right on every row; a row the holes emptied gets out 0 and LSE +inf,
    FlashMLA's convention for an empty row."""
    scenario = case_scenario(case, SEED)
    empty = rows_without_entries(scenario)
    outcome = check_hole_step(flashmla_here, open_layer(flashmla_here, scenario), scenario,
                              build_attention_inputs(scenario, DEVICE), spared=lambda outcome: empty)
    check_empty_rows_as_flashmla_gives_them(outcome, empty)
