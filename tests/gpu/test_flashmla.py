"""vLLM's FLASHMLA_SPARSE backend of a release (``--vllm``; ``backends.vllm.flashmla``) on FlashMLA's
own kernels (the release's ``_flashmla_C``), every regime case under each configuration it serves
for DeepSeek-V3.2 (bf16 with rope; fp8 with rope at k_scale 1 and 0.5), decode- and
prefill-shaped batches, and steps through one layer; and the same scenarios and inputs through
the project's FA3 path, each against the float64 oracle.

Each step runs vLLM's ``build()`` and ``forward_mqa()`` (its convert kernel, head padding,
``topk_length``, the fp8 cache in FlashMLA's layout and the fp8 paths); what FlashMLA's kernels
are handed is read at their door, and every routed row's executed length must equal its valid
count, its slots its intended selection (a), and its output and LSE the oracle over (a) within
the error budget of ``reference.budget`` (measured for FA3: a failure reports FlashMLA's ratios,
from which its own budget is to be set); every step is judged by ``harness.judge`` (the
``judge`` fixture). The differential test writes each case's errors of both
kernels as a JSON line (``pytest_sparse_mla.flashmla_table.table_path``; ``scripts/flashmla_table.py`` makes
the docs table of a run).
"""

from __future__ import annotations

import pytest

from backends.registry import open_backend
from harness.backend_step import layer_config
from harness.builder import build_scenario
from harness.case_runner import run_case, run_sequence
from harness.cases import KernelConfig, large_batch_cases, sequence_steps
from harness.device_inputs import build_attention_inputs
from harness.input_space import classify
from harness.judge import measured
from harness.port.launch import DEVICE
from pytest_sparse_mla.coverage import record_input
from pytest_sparse_mla.flashmla_table import max_difference, table_row, write_table_row
from tests import flashmla_cases
from tests.flashmla_cases import gpu_regime_params, gpu_shaped_params, trap_params

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.flashmla]

GPU_PARAMS = gpu_regime_params() + gpu_shaped_params()


def test_flashmla_kernels_load_here(flashmla_load):
    assert flashmla_load[1] is None, flashmla_load[1]


@pytest.mark.parametrize("case, config", GPU_PARAMS)
def test_flashmla_and_fa3_against_the_oracle(flashmla_on_gpu, judge, case, config, request):
    """FlashMLA (through vLLM's FLASHMLA_SPARSE, on the one launch path: a failing step is written
    as a case under ``--dump-failures``) and FA3 (through the project's path) on one scenario and
    one set of inputs, each against the float64 oracle over (a): where they differ beyond the
    budget, the oracle names the kernel that is off (the two share the inputs, and so the float64
    truth, computed once). The case's errors of both go to the table (``scripts/flashmla_table.py``)."""
    spec = config.apply(case.spec)
    scenario = build_scenario(spec, 0)
    inputs = build_attention_inputs(scenario, DEVICE)
    config_of_layer = layer_config(scenario.spec, max(scenario.topk_indices.shape[0], 1))
    judge.admit(flashmla_on_gpu, config_of_layer)
    port = open_backend("port-fa3")
    fa3 = judge.verdict(port, port.open_layer(config_of_layer, DEVICE), scenario, inputs)
    try:
        ours = run_case(judge, flashmla_on_gpu, spec, DEVICE, inputs=inputs)
    except AssertionError as exc:
        if fa3.passed:
            raise
        raise AssertionError(f"FlashMLA and FA3 both off against the oracle over (a); FA3: "
                             f"{measured(fa3.comparisons)}\n{exc}\n{fa3.failure}") from exc
    flashmla = judge.last_verdict
    theirs = fa3.outcome
    n = ours.planned_rows
    assert theirs.planned_rows == n, f"FlashMLA serves {n} rows, FA3 {theirs.planned_rows}; {scenario.describe()}"
    if n == 0:
        return
    by_kernel = {"flashmla": flashmla.comparisons, "fa3": fa3.comparisons}
    differences = {"out_max_diff": max_difference(ours.out[:n], theirs.out[:n]),
                   "lse_max_diff": max_difference(ours.lse[:n], theirs.lse[:n])}
    write_table_row(request, table_row(request, scenario, config, n, by_kernel, differences))
    assert fa3.passed, (f"FA3 off against the oracle over (a), FlashMLA within it; the two differ by out "
                        f"{differences['out_max_diff']:.3g}, lse {differences['lse_max_diff']:.3g}. FlashMLA: "
                        f"{measured(flashmla.comparisons)}; FA3: {measured(fa3.comparisons)}\n{fa3.failure}")


@pytest.mark.parametrize("config", [KernelConfig("bfloat16", True, 64), KernelConfig("float8_e4m3fn", True, 16, 0.5),
                                    KernelConfig("float8_e4m3fn", True, 128, 1.0)], ids=lambda c: c.id)
@pytest.mark.parametrize("kpool", [1, 4])
def test_sequence_on_flashmla(flashmla_on_gpu, judge, kpool, config):
    """Steps through one layer and one cache; the fp8 decode kernel builds a tile schedule for
    every step that runs it (vLLM's builder hands a fresh FlashMLASchedMeta each build)."""
    layer, outcomes = run_sequence(judge, flashmla_on_gpu, sequence_steps(kpool, config), DEVICE)
    ran = sum(1 for o in outcomes if o.planned_rows)
    assert layer.plans == (ran if config.kv_dtype == "float8_e4m3fn" else 0), f"{layer.plans} schedules, {ran} steps"


@pytest.mark.parametrize(("case", "layout"), flashmla_cases.gpu_input_space_params())
def test_the_input_spaces_covering_design_on_flashmla(flashmla_on_gpu, judge, case, layout):
    """Every value class of the production input space but the kernel variant (block sizes,
    batch composition, CUDA-graph padding, context sources, kpool and topk, heads, slot ids past
    2**23) on FlashMLA's kernels, in DeepSeek-V3.2's configurations."""
    record_input(classify(case.spec, layout, case.holes))
    refusal = flashmla_cases.builder_refusal(case.spec)
    if refusal:
        pytest.skip(refusal)
    run_case(judge, flashmla_on_gpu, case.spec, DEVICE, holes=case.holes)


@pytest.mark.gpu_large
@pytest.mark.parametrize("config", [KernelConfig("bfloat16", True, 128), KernelConfig("float8_e4m3fn", True, 64, 0.5)],
                         ids=lambda c: c.id)
@pytest.mark.parametrize("case", large_batch_cases(), ids=lambda c: c.id)
def test_large_batch_on_flashmla(flashmla_on_gpu, judge, case, config):
    """About 66 and 132 rows, contexts up to 128k, slot ids past 2**23."""
    run_case(judge, flashmla_on_gpu, config.apply(case.spec), DEVICE)


@pytest.mark.parametrize("case, config", trap_params())
def test_spec_decode_rows_below_the_buffer_width_on_flashmla(flashmla_on_gpu, judge, case, config):
    """Speculative decode with 1 to 3 drafts on both of FlashMLA's paths, rows whose valid counts
    lie below the top-k buffer's width: each executes its valid count (``topk_length`` as FlashMLA's
    kernels are handed it) and no padded column."""
    run_case(judge, flashmla_on_gpu, config.apply(case.spec), DEVICE)
