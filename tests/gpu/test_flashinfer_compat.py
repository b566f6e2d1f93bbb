"""The FlashInfer compatibility layer on the installed version: feature detection and the probed
checks before launch, the LSE base actually returned (docs/findings.md#lse-base-mix-up), the flat call forms and their
deprecation warnings, fp8 planned as float8_e4m3fn whatever the storage dtype
(docs/findings.md#fp8-planned-as-uint8), and
the full-width strided lens (docs/findings.md#full-width-lengths-strided) in a subprocess."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from backends.flashinfer.compat import (
    CANONICAL_MIN_VERSION,
    RELEASES_READ,
    Behaviour,
    distinct_warnings,
    features_from,
    parse_version,
    planning_kv_dtype,
    recorded_warnings,
    unsupported_reason,
)
from backends.flashinfer.port import make_attention_state
from harness import batch, build_attention_inputs, build_scenario
from harness.cases import covering_config
from harness.port.full_width_strided import outcome_problem
from harness.port.launch import (
    DEVICE,
    assert_launchable,
    attention_config,
    compare_with_references,
    eager_step,
    failure_context,
    launch_inputs,
    nan_buffers,
    planned_references,
    prepared,
    sync,
)
from pytest_sparse_mla.port_reports import record_errors
from reference import compare_to_budget, lse_to_base2
from reference.budget import LSE_ULPS

pytestmark = pytest.mark.gpu

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def small_scenario(config_index: int, seed: int, **extra):
    spec = covering_config(config_index).apply(
        batch((2051, 1), (700, 1), (5, 1), (100_003, 1), topk=2048, kpool=4, **extra)
    )
    return build_scenario(spec, seed)


def launch_compacted(impl, scenario, regime_log=None, **state_kwargs):
    """Plan and run the compacted layout eagerly; the rows are recorded before the launch."""
    step = prepared(impl, scenario, "compacted")
    if regime_log is not None:
        regime_log.record(step.regimes())
    assert_launchable(step, "n/a")
    inputs = build_attention_inputs(scenario, DEVICE)
    rows = step.max_rows
    state = make_attention_state(impl, attention_config(scenario, "compacted", rows), DEVICE, **state_kwargs)
    launch = launch_inputs(impl, scenario, inputs, rows)
    out, lse = nan_buffers(rows, scenario.spec.num_heads)
    eager_step(state, launch, step, out, lse)
    sync()
    return step, inputs, state, launch, out, lse


def test_features_match_the_installed_version(features):
    v = parse_version(features.version)
    assert features.canonical_plan == features.structural_run == (v >= CANONICAL_MIN_VERSION), features.describe()
    assert features.probed, f"the GPU tier's features were not probed: {features.describe()}"
    assert features.run_lse_base_e, f"return_lse_base_on_e missing in {features.version} (expected from 0.5.3)"
    assert features.nope == (v >= (0, 6, 18)) and features.fp8_kv == (v >= (0, 6, 14))
    old = features_from("0.6.10", ["qo_indptr"], ["q_nope", "return_lse_base_on_e"], False)
    assert unsupported_reason(old, rope_dim=0, kv_dtype=torch.bfloat16).startswith("NoPE")
    assert unsupported_reason(old, rope_dim=64, kv_dtype=torch.float8_e4m3fn).startswith("fp8 KV")
    assert unsupported_reason(features_from("0.8.1", [], [], True), rope_dim=64, kv_dtype=torch.bfloat16)
    assert planning_kv_dtype(torch.uint8) == planning_kv_dtype(torch.float8_e4m3fn) == torch.float8_e4m3fn


def test_probe_finds_the_checks_in_the_release_source(features, record_property):
    """The probe against what the source of the installed release checks (where it was read)."""
    record_property("flashinfer_features", features.describe())
    print(features.describe())
    if features.version not in RELEASES_READ:
        pytest.skip(f"no source reading for flashinfer {features.version}; probed: {features.describe()}")
    assert features.behaviour == Behaviour.in_source(features.version), features.describe()


@pytest.mark.parametrize("config_index", [0, 1], ids=["bf16", "fp8"])
def test_lse_base_returned_and_normalised(impl, features, request, regime_log, config_index):
    """Raw FlashInfer LSE is base 2 (lse_e * log2 e); the layer's LSE is natural log."""
    scenario = small_scenario(config_index, seed=31)
    step, inputs, state, launch, out, lse = launch_compacted(impl, scenario, regime_log)
    raw = make_attention_state(impl, attention_config(scenario, "compacted", step.max_rows), DEVICE, lse_base_e=False)
    out2, lse2 = nan_buffers(step.max_rows, scenario.spec.num_heads)
    eager_step(raw, launch, step, out2, lse2)
    sync()
    n = step.num_planned
    (t_out, t_lse), (l_out, l_lse) = planned_references(step, inputs)
    dtype = scenario.spec.kv_dtype
    natural = compare_to_budget("lse", lse[:n], t_lse, l_lse, dtype, ulps=LSE_ULPS)
    base2 = compare_to_budget("lse", lse2[:n], lse_to_base2(t_lse), lse_to_base2(l_lse), dtype, ulps=LSE_ULPS)
    ctx = failure_context(step, features.version)
    assert natural.ok, "normalised LSE is not natural log; " + ctx + "\n" + natural.summary(scenario.row_regime)
    assert base2.ok, "FlashInfer's raw LSE is not base 2; " + ctx + "\n" + base2.summary(scenario.row_regime)
    gap = float((lse2[:n].double() - lse[:n].double()).abs().max())
    assert gap > 0.1, f"base 2 and natural LSE indistinguishable here (min gap {gap}); {ctx}"
    assert torch.equal(out[:n], out2[:n]), "the LSE base changed the output"
    record_errors(request.node, step, [compare_to_budget("out", out[:n], t_out, l_out, dtype), natural], "lse-base")


def test_flat_forms_warn_and_agree_on_0_7(impl, features, regime_log):
    """On 0.7+ the pre-0.7 flat plan/run forms still work, agree bitwise with the canonical
    forms, and raise DeprecationWarnings that the layer records."""
    if not features.canonical_plan:
        pytest.skip(f"flashinfer {features.version} has only the flat forms (the canonical ones start at 0.7.0)")
    scenario = small_scenario(0, seed=32)
    step, inputs, state, launch, out, lse = launch_compacted(impl, scenario, regime_log)
    start = len(recorded_warnings())
    flat = dataclasses.replace(features, canonical_plan=False, structural_run=False)
    _, _, _, _, out2, lse2 = launch_compacted(impl, scenario, features=flat)
    n = step.num_planned
    assert torch.equal(out[:n], out2[:n]) and torch.equal(lse[:n], lse2[:n]), failure_context(step, features.version)
    seen = [w for w in distinct_warnings(start) if w.startswith("DeprecationWarning")]
    assert seen, f"no DeprecationWarning recorded for the flat forms on {features.version}"


def test_fp8_cache_in_uint8_storage_is_planned_as_e4m3(impl, features, request, regime_log):
    """An fp8 cache held as raw uint8 storage gives bitwise the same result as the e4m3 cache
    (planned as float8_e4m3fn, docs/findings.md#fp8-planned-as-uint8); FlashInfer itself refuses a uint8 plan."""
    scenario = small_scenario(1, seed=33)
    assert scenario.spec.kv_dtype == "float8_e4m3fn" and scenario.spec.k_scale != 1.0
    step, inputs, state, launch, out, lse = launch_compacted(impl, scenario, regime_log)
    raw = dataclasses.replace(inputs, kv_cache=inputs.kv_cache.view(torch.uint8))
    config = dataclasses.replace(attention_config(scenario, "compacted", step.max_rows), kv_dtype=torch.uint8)
    state2 = make_attention_state(impl, config, DEVICE)
    launch2 = dataclasses.replace(launch, inputs=raw)
    out2, lse2 = nan_buffers(step.max_rows, scenario.spec.num_heads)
    eager_step(state2, launch2, step, out2, lse2)
    sync()
    n = step.num_planned
    assert torch.equal(out[:n], out2[:n]), failure_context(step, features.version)
    comparisons = compare_with_references(step, inputs, out, lse, state)
    record_errors(request.node, step, comparisons, "fp8-uint8-storage")
    with pytest.raises((ValueError, TypeError)):
        state2.wrapper._wrapper.plan(
            state2._qo_host, state2._kv_indptr_host, state2.kv_indices, state2._kv_len_host,
            scenario.spec.num_heads, 512, 64, 1, False, scenario.spec.sm_scale, torch.bfloat16, torch.uint8,
        )


def run_full_width_strided() -> tuple[dict, str]:
    """The last stage ``harness.port.full_width_strided`` reached (with ``returncode`` and
    ``died`` when the process did not exit cleanly), and its stderr tail."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "harness.port.full_width_strided", "41"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    outcome = json.loads(lines[-1]) if lines else {"stage": None}
    if proc.returncode != 0:
        outcome.update(returncode=proc.returncode, died=True)
    return outcome, proc.stderr[-800:]


def test_full_width_strided_lens_in_a_subprocess(features, record_property):
    """Full-width kv_len with -1 tails (docs/findings.md#full-width-lengths-strided), in its own
    process. A FlashInfer whose run() checks cache coverage (probed) refuses it before launching;
    one that does not launches it and reads slot -1: it may finish (the rows holding NaN are
    recorded), fault at the sync, or kill the process there (``outcome_problem`` says which
    outcomes count). Either way this process's CUDA context stays healthy."""
    outcome, stderr = run_full_width_strided()
    record_property("full_width_strided", outcome)
    detail = f"{features.describe()}; outcome {outcome}; stderr tail: {stderr}"
    print(detail)
    problem = outcome_problem(outcome, run_checks_cache_coverage=features.run_checks_cache_coverage)
    assert not problem, f"{problem}, as the probe found; {detail}"
    sync()
    healthy = torch.arange(1 << 20, device=DEVICE, dtype=torch.float32)
    assert math.isclose(float(healthy.sum()), (1 << 20) * ((1 << 20) - 1) / 2, rel_tol=1e-6)
