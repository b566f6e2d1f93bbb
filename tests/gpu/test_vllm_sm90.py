"""A vLLM release's own SM90 backend (``--vllm``) on FlashInfer itself, every regime case and
batch situation, the large batches and the multi-step sequences.

Each step runs vLLM's ``build()`` (host lengths, plan, kept plan or replan, the clamp of the
bounded design) and ``forward_mqa()`` (its convert kernel, its kv_indices layout, FlashInfer's
run); FlashInfer's schedule is read back after the plan and the clamp, and every planned row's
executed KV length must equal its valid count, its executed slots its intended selection (a),
and its output the float64 oracle over (a) within the error budget (an output beyond it passes
only where it is bit for bit FlashInfer's output through the project's own path on the same
inputs: the kernel's rounding, counted in the summary). Every step is judged by ``harness.judge``
through the ``judge`` fixture: under the upgrade check each step records its output and its
rows' executed, planned and host lengths, so a comparison shows drift in what vLLM writes into
FlashInfer's schedule as well as in what the kernel returns; under ``--dump-failures`` a failing
case is written with the release and module it ran (``pytest --replay`` runs it again). A vLLM release whose design
cannot run on the installed FlashInfer fails one test with the reason
(:func:`backends.vllm.source.incompatibility`); its other tests are skipped with it.
"""

from __future__ import annotations

import pytest

from harness.case_runner import port_twin, run_case, run_sequence
from harness.cases import KernelConfig, device_split_cases, sequence_steps
from harness.port.launch import DEVICE
from tests.vllm_cases import input_space_params, large_params, magnitude_params, step_params

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]


@pytest.fixture(scope="module")
def fa3_twin():
    """FlashInfer's output through the project's own path (``port-fa3``: an exact plan, the
    compacted layout) on the same scenario and inputs."""
    return port_twin(DEVICE)


def test_vllm_release_runs_on_this_flashinfer(vllm_backend, vllm_pairing):
    assert vllm_pairing is None, f"vLLM {vllm_backend.version} cannot run here: {vllm_pairing}"


@pytest.mark.parametrize("case, config", step_params())
def test_step_on_flashinfer(vllm_on_gpu, fa3_twin, judge, case, config):
    run_case(judge, vllm_on_gpu, config.apply(case.spec), DEVICE, twin=fa3_twin)


@pytest.mark.gpu_large
@pytest.mark.parametrize("case, config", large_params())
def test_large_batch_on_flashinfer(vllm_on_gpu, fa3_twin, judge, case, config):
    run_case(judge, vllm_on_gpu, config.apply(case.spec), DEVICE, twin=fa3_twin)


@pytest.mark.parametrize("kpool", [1, 4])
@pytest.mark.parametrize("config", [KernelConfig("bfloat16", True, 64), KernelConfig("float8_e4m3fn", False, 16, 0.5)],
                         ids=lambda c: c.id)
def test_sequence_on_flashinfer(vllm_on_gpu, fa3_twin, judge, kpool, config):
    layer, outcomes = run_sequence(judge, vllm_on_gpu, sequence_steps(kpool, config), DEVICE, twin=fa3_twin)
    if vllm_on_gpu.design == "bounded":
        assert layer.plans < len(outcomes), f"planned {layer.plans} times for {len(outcomes)} steps"
    else:
        assert layer.plans == len(outcomes)


@pytest.mark.edge("magnitude")
@pytest.mark.parametrize("case, config", magnitude_params())
def test_magnitude_edge_on_flashinfer(vllm_on_gpu, fa3_twin, judge, case, config):
    """Raw scores far from zero through vLLM's backend: executed lengths and slots as always, the
    output within the budget or bit for bit the project's own FA3 path (where the kernel's own
    score-precision finding shows, docs/findings.md#score-precision-at-2-15)."""
    run_case(judge, vllm_on_gpu, config.apply(case.spec), DEVICE, seed=41, twin=fa3_twin)


@pytest.mark.parametrize("case", input_space_params())
def test_input_space_covering_design_on_flashinfer(vllm_on_gpu, fa3_twin, judge, case):
    """Every value class of every dimension of the production input space through vLLM's
    build() and forward_mqa() on FlashInfer."""
    run_case(judge, vllm_on_gpu, case.spec, DEVICE, twin=fa3_twin, holes=case.holes)


@pytest.mark.parametrize(("case", "host"), device_split_cases(), ids=[c.name for c, _ in device_split_cases()])
def test_device_split_on_flashinfer(vllm_on_gpu, judge, case, host):
    """Adaptive verification with a device query split that differs from the host's
    (docs/input-space.md#a-device-query-split-that-differs-from-the-hosts): every row executes
    its valid count under the device split on FlashInfer, its output within the budget. No twin:
    the port reads each row's request from the host's split (it ports 0.30.0, which knows one), so
    its output is no twin of this step."""
    if not vllm_on_gpu.reads_adaptive_verification:
        pytest.skip(f"vLLM {vllm_on_gpu.version}'s builder reads no adaptive verification setting")
    run_case(judge, vllm_on_gpu, case.spec, DEVICE, seed=3, adaptive_verification=True, host_q_lens=host)
