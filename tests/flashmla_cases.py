"""The cases both tiers run through vLLM's FLASHMLA_SPARSE backend (``backends.flashmla``), the
checks they share, and the per-case error table of the GPU tier's differential runs.

The CPU tier runs every regime case and batch situation with the covering design's kernel
configurations on the stand-in kernels (``tests.flashmla_stand_in``); the GPU tier runs every
regime case under each configuration FlashMLA serves for DeepSeek-V3.2 (bf16 with rope, fp8
with rope at k_scale 1 and 0.5), the batch situations (decode- and prefill-shaped) at 16 heads
(the fp8 mixed batch) and 128 (the fp8 decode and prefill kernels apart), on FlashMLA itself,
and the same scenarios and inputs through the project's FA3 path.

Checks, each naming the row, its regime and context: the rows routed to the sparse kernel,
each row's executed length against its valid count, the slots handed to the kernel against its
intended selection (a), and the output and LSE against the float64 oracle over (a) within the
error budget of ``reference.budget`` (the FA3-measured budget: FlashMLA's has yet to be
measured, so a failure reports the measured ratios).
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

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
from harness.cases import Case, KernelConfig, all_regime_cases, covering_config, situation_cases
from harness.device_inputs import AttentionInputs, build_attention_inputs, nan_kv_buffer
from mla_constants import DEEPSEEK_V32_SM_SCALE
from pytest_sparse_mla.vllm import NO_VLLM, VLLM_SOURCE, flashmla_absence
from tests.vllm_cases import in_one_cache, sequence_specs

#: The configurations FlashMLA serves for DeepSeek-V3.2 on the GPU tier (heads vary by case).
GPU_VARIANTS = (("bfloat16", 1.0), ("float8_e4m3fn", 1.0), ("float8_e4m3fn", 0.5))
HEADS_CYCLE = (16, 32, 64, 128)
#: Heads of the batch situations on the GPU: below 32 the fp8 cache runs one mixed batch on the
#: decode kernel; at 128 its decode and prefill rows go to the two kernels apart.
SITUATION_HEADS = (16, 128)
TABLE_ENV = "SPARSE_MLA_FLASHMLA_TABLE"
_RUN_IDS: dict[int, str] = {}


@pytest.fixture(scope="session")
def flashmla_source(pytestconfig):
    """The vLLM release ``--vllm`` names (skipped without it, and where its files lack FlashMLA's
    modules or kernels: the reason is in the run's header)."""
    source = pytestconfig.stash.get(VLLM_SOURCE, None)
    if source is None:
        pytest.skip(NO_VLLM)
    absent = flashmla_absence(source)
    if absent:
        pytest.skip(absent)
    return source


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
    from tests.gpu.test_edges import magnitude_cases

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
        classes = classify(spec, layout)
        params.append(pytest.param(Case(case.name, spec), layout, id="-".join(classes[d.name] for d in SPACE)))
    return params


def run_scenario(backend, scenario, device, request):
    """One step of ``scenario`` through a fresh layer of ``backend`` (a configuration it does
    not serve skipped with its reason), checked as :func:`check_step` checks."""
    max_tokens = max(scenario.topk_indices.shape[0], 1)
    skip_unsupported(backend, scenario.spec, max_tokens)
    layer = backend.open_layer(layer_config(scenario.spec, max_tokens), device)
    return check_step(backend, layer, scenario, build_attention_inputs(scenario, device), request)


def skip_unsupported(backend, spec, max_tokens: int) -> None:
    reason = backend.unsupported(layer_config(spec, max_tokens))
    if reason:
        pytest.skip(f"{backend.name}: {reason}")


def check_step(backend, layer, scenario, inputs, request, *, compare=True):
    """Run one step and assert the rows routed, their executed lengths, their slots and their
    output and LSE against the oracle; return ``(outcome, comparisons)``."""
    outcome = run_step(layer, scenario, inputs)
    where = f"{context(outcome, scenario)}; {backend.describe()}"
    problems = (routing_problems(outcome, scenario) + executed_length_problems(outcome, scenario)
                + selection_problems(outcome, scenario))
    regimes = scenario.row_regime[: outcome.planned_rows]
    comparisons = []
    if compare and inputs is not None and outcome.planned_rows:
        comparisons = output_comparisons(outcome, scenario, inputs, kernel=backend.kernel)
    regime_log = request.getfixturevalue("regime_log")
    regime_log.step(outcome, regimes, comparisons=comparisons, spec=scenario.spec)
    if problems:
        regime_log.blame([regimes[r] for r in problem_rows(problems, outcome.planned_rows)])
    assert not problems, f"{where}\n" + "\n".join(problems[:12])
    bad = [c for c in comparisons if not c.ok]
    assert not bad, (f"{outcome.backend}'s output vs (a) beyond the error budget (measured: "
                     f"{measured(comparisons)}); {where}\n" + "\n".join(c.summary(scenario.row_regime) for c in bad))
    return outcome, comparisons


def measured(comparisons) -> str:
    return ", ".join(f"{c.name} max {c.max_ratio:.2f}x lowp, mean {c.mean_ratio:.2f}x, rel L2 {c.rel_l2:.3g}"
                     for c in comparisons)


def scenario_and_inputs(case, config, device, seed: int = 0):
    spec = config.apply(case.spec)
    scenario = build_scenario(spec, seed)
    return scenario, build_attention_inputs(scenario, device)


def run_case(backend, case, config, device, request, seed: int = 0):
    scenario, inputs = scenario_and_inputs(case, config, device, seed)
    max_tokens = max(scenario.topk_indices.shape[0], 1)
    skip_unsupported(backend, scenario.spec, max_tokens)
    layer = backend.open_layer(layer_config(scenario.spec, max_tokens), device)
    return check_step(backend, layer, scenario, inputs, request)


def run_sequence(backend, kpool, config, device, request):
    """The steps of ``tests.vllm_cases.sequence_specs`` through one layer and one KV cache
    (each step's outputs checked); the layer and the outcomes."""
    specs = [config.apply(s) for s in sequence_specs(kpool)]
    scenarios = [build_scenario(s, seed) for seed, s in enumerate(specs)]
    max_tokens = max(s.topk_indices.shape[0] for s in scenarios)
    skip_unsupported(backend, specs[0], max_tokens)
    layer = backend.open_layer(layer_config(specs[0], max_tokens), device)
    blocks = max(s.num_blocks for s in scenarios)
    cache = nan_kv_buffer((blocks, specs[0].block_size, specs[0].head_dim), specs[0].kv_dtype, device)
    outcomes = []
    for scenario in scenarios:
        inputs: AttentionInputs = in_one_cache(build_attention_inputs(scenario, device), cache)
        outcomes.append(check_step(backend, layer, scenario, inputs, request)[0])
    return layer, outcomes


# --- the differential table -----------------------------------------------------------------

def table_path(config) -> Path:
    """Where the GPU tier's per-case errors go: ``$SPARSE_MLA_FLASHMLA_TABLE``, else the pytest
    cache (``.pytest_cache/d/sparse-mla/flashmla-table.jsonl``), which is the same folder under
    the rootdir where the cache plugin is off (``-p no:cacheprovider``, as scripts/gpu_runner.py
    runs)."""
    named = os.environ.get(TABLE_ENV)
    if named:
        return Path(named)
    cache = getattr(config, "cache", None)
    folder = cache.mkdir("sparse-mla") if cache is not None else config.rootpath / ".pytest_cache" / "d" / "sparse-mla"
    return folder / "flashmla-table.jsonl"


def run_id(config) -> str:
    """One id for every process of a run (xdist's run id, else one per session)."""
    return os.environ.get("PYTEST_XDIST_TESTRUNUID") or _RUN_IDS.setdefault(id(config), uuid.uuid4().hex)


def comparison_entry(comparisons) -> dict:
    return {f"{c.name}_{k}": getattr(c, k) for c in comparisons
            for k in ("ok", "max_err", "max_ratio", "mean_ratio", "rel_l2")}


def table_row(request, scenario, config: KernelConfig, rows: int, kernels: dict[str, list],
              differences: dict[str, float]) -> dict:
    return {
        "run": run_id(request.config), "test": request.node.nodeid, "case": request.node.callspec.id,
        "variant": config.variant, "heads": config.num_heads, "k_scale": config.k_scale, "rows": rows,
        "regimes": "".join(sorted(set(scenario.row_regime[:rows]))),
        **{name: comparison_entry(c) for name, c in kernels.items()}, **differences,
    }


def write_table_row(request, row: dict) -> None:
    """Append one JSON line (one write of one line, so processes writing at once do not
    interleave)."""
    path = table_path(request.config)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(row, sort_keys=True) + "\n")


def max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over the positions where both are finite (0 for no rows)."""
    a, b = a.double(), b.double()
    both = torch.isfinite(a) & torch.isfinite(b)
    return float((a - b).abs()[both].max()) if bool(both.any()) else 0.0
