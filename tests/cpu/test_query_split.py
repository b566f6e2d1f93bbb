"""Adaptive verification with a device query split that differs from the host's
(docs/input-space.md#a-device-query-split-that-differs-from-the-hosts): vLLM's runner holds a
placeholder split on the host (``query_start_loc_cpu``: the draft budget dealt evenly) and runs the
confidence-ranked one on the device (``query_start_loc``). vLLM 0.31.0 to 0.34.0 bound every row
by the longest request there ("The host query split may not match the device one"), and the
device clamp cuts each row to its valid count under the device split.

The truth is the device's: every row belongs to its request under the device split, with that
request's context, indexer row and block table. The steps are ``harness.cases.device_split_cases``
built with ``harness.builder.with_host_query_split``, run through the release as it ships on the fa3
stand-in (``harness.case_runner.run_case`` with the host split: a failing one is written as a case that
keeps it), and with ``scripts.vllm_planted_bugs.HOST_SPLIT_BOUND`` planted (each row bounded by its
request under the host split), which the new steps catch, naming the rows, and the steps the suite
drew before (one split) miss.
"""

from __future__ import annotations

import json

import pytest
import torch

from backends.vllm.sm90 import common_metadata
from harness.backend_step import layer_config, valid_lengths
from harness.builder import build_scenario, even_host_split, host_split_problem, with_host_query_split
from harness.case_runner import run_case, scenario_of_step
from harness.cases import Case, device_split_cases, longest_request_cases, situation_cases
from harness.device_inputs import build_attention_inputs
from harness.judge import judge_step
from harness.spec import batch, device_query_start_loc
from recording.backend_case import load_backend_case, steps_of, write_backend_case
from recording.fixture import FixtureError
from recording.recipe import save_with_digest, scenario_digest
from reference.rules import request_ids_per_row, row_context
from scripts.vllm_planted_bugs import HOST_SPLIT_BOUND
from tests.support.vllm_planting import BF16, BUILDER, UnreportedJudge, planted

CASES = device_split_cases()
SEED = 3


def split_scenario(case, host_q_lens, seed: int = SEED):
    return with_host_query_split(build_scenario(case.spec, seed), host_q_lens)


def host_row_bounds(scenario):
    """Each row's context as the host split and the host bound give it (the bound of a builder that
    takes each row's request from the host split), clamped to the largest valid count."""
    meta, spec = scenario.meta, scenario.spec
    ctx = row_context(meta.seq_lens_cpu_upper_bound, meta.query_start_loc_cpu)
    return ctx.clamp(max=min(spec.topk + spec.kpool - 1, spec.resolved_width))


def rows_a_host_split_bound_cuts(scenario) -> list[int]:
    """The rows whose valid count (under the device split) passes their bound under the host split."""
    n = scenario.num_rows
    return (host_row_bounds(scenario) < valid_lengths(scenario, n)).nonzero().flatten().tolist()


# --- the steps themselves (no vLLM) -------------------------------------------------------------------


@pytest.mark.parametrize(("case", "host"), CASES, ids=[c.name for c, _ in CASES])
def test_device_split_cases_reach_what_they_promise(case, host):
    """Rows change request between the splits, some of them to a request whose valid counts pass
    what the host split bounds them by; prefill rows stay with their request."""
    scenario = split_scenario(case, host)
    meta = scenario.meta
    n = scenario.num_rows
    on_host = request_ids_per_row(meta.query_start_loc_cpu, n)
    on_device = request_ids_per_row(meta.query_start_loc, n)
    assert meta.query_start_loc_cpu[-1] == meta.query_start_loc[-1] == n
    assert (on_host != on_device).any()
    assert rows_a_host_split_bound_cuts(scenario), "no row's valid count passes its bound under the host split"
    prefill_rows = slice(meta.num_decode_tokens, n)
    assert (on_host[prefill_rows] == on_device[prefill_rows]).all()
    assert scenario.request_ids()[:n].tolist() == on_device.tolist()


def test_agreeing_splits_leave_the_step_as_it_was():
    """A host split equal to the device's leaves the scenario untouched, and a step without a device
    split hands the device the host's (every scenario built before is the same step)."""
    case, _ = CASES[0]
    scenario = build_scenario(case.spec, SEED)
    assert scenario.meta.query_start_loc is None
    assert with_host_query_split(scenario, [r.q_len for r in case.spec.requests]) is scenario
    assert device_query_start_loc(scenario.meta) is scenario.meta.query_start_loc_cpu
    cam = common_metadata(scenario.meta, scenario.block_table, scenario.topk_indices.shape[0], "cpu")
    assert cam.query_start_loc.tolist() == cam.query_start_loc_cpu.tolist()
    split = split_scenario(case, even_host_split(case.spec, 3))
    cam = common_metadata(split.meta, split.block_table, split.topk_indices.shape[0], "cpu")
    assert cam.query_start_loc.tolist() == split.meta.query_start_loc.tolist() != cam.query_start_loc_cpu.tolist()


@pytest.mark.parametrize(("host", "why"), [
    ([1, 20], "the 3 requests and 21 rows"),  # a request lost
    ([2, 4, 16], "the 3 requests and 21 rows"),  # a row more
    ([2, 4, 15], "only decode rows move"),  # a prefill row moved
    ([0, 5, 16], "only decode rows move"),  # a decode without a row, one past the decode threshold
])
def test_a_host_split_the_runner_never_makes_is_refused(host, why):
    """Adaptive verification moves draft rows between decodes: the same requests, rows and prefills."""
    spec = batch((40, 1), (300, 4), (900, 16), kpool=4, decode_threshold=4)
    problem = host_split_problem(spec, host)
    assert problem is not None and why in problem, problem


# --- a written case keeps the host split --------------------------------------------------------------

VLLM_IDENTITY = {"name": "vllm-0.33.0", "kernel": "fa3", "release": "0.33.0", "module_digest": None}


def noted_case(case, host) -> dict:
    """The case ``harness.case_runner.run_case`` notes for one step of ``case`` with the host split ``host``."""
    return {"kind": "step", "backend": VLLM_IDENTITY, "max_tokens": 32, "twin": False, "compare": True,
            "with_inputs": True, "adaptive_verification": True, "rejected_drafts": 0, "kv_block_stride": None,
            "steps": [{"spec": case.spec, "seed": SEED, "holes": None, "host_q_lens": host}], "flashinfer": "none"}


@pytest.mark.parametrize(("case", "host"), CASES, ids=[c.name for c, _ in CASES])
def test_a_written_case_rebuilds_the_step_with_its_host_split(tmp_path, case, host):
    """The case file keeps the host split; loaded, its step rebuilds the scenario the test ran, both
    splits bit for bit."""
    path = write_backend_case(tmp_path, "split", noted_case(case, host))
    (step,) = steps_of(load_backend_case(path))
    assert step[3] == host
    rebuilt, ran = scenario_of_step(*step), split_scenario(case, host)
    assert scenario_digest(rebuilt) == scenario_digest(ran) != scenario_digest(build_scenario(case.spec, SEED))
    assert torch.equal(rebuilt.meta.query_start_loc, ran.meta.query_start_loc)


@pytest.mark.parametrize(("edit", "why"), [
    (lambda host: host[:-1], "must hold the 3 requests"),  # a request lost
    (lambda host: [host[0] + 1, *host[1:]], "must hold the 3 requests and 8 rows"),  # a row more
    (lambda host: [-1, *host[1:]], "expected a list of at most"),  # not a row count
    (lambda host: "3,3,2", "expected a list of at most"),
])
def test_a_host_split_that_is_none_is_one_fixture_error_naming_the_field(tmp_path, edit, why):
    """A case file whose host split the runner never makes (its digest recomputed) is refused at load,
    naming the step's field; one without a host split is a step whose device runs the host's."""
    case, host = CASES[0]
    path = write_backend_case(tmp_path, "split", noted_case(case, host))
    record = json.loads(path.read_text())
    record["steps"][0]["host_q_lens"] = edit(host)
    save_with_digest(path, record)
    with pytest.raises(FixtureError, match=r"case field 'steps\[0\]\.host_q_lens' is .*" + why):
        load_backend_case(path)
    del record["steps"][0]["host_q_lens"]
    save_with_digest(path, record)
    with pytest.raises(FixtureError, match=r"steps\[0\]\.scenario_digest"):  # the device ran another step
        load_backend_case(path)


# --- through vLLM's backend -----------------------------------------------------------------------------


def run_split_case(judge, backend, case, host, device, seed: int = SEED):
    """One step of ``case`` with the host split ``host`` through a fresh layer of ``backend`` under
    adaptive verification, judged by ``judge`` (``harness.case_runner.run_case``: a failure under
    ``--dump-failures`` is written as a case that keeps the host split); the outcome."""
    return run_case(judge, backend, case.spec, device, seed=seed, adaptive_verification=True, host_q_lens=host)


def failing_rows(backend, case, host, device, seed: int = SEED) -> list[int]:
    """The rows the judge names for the step (none: it passed)."""
    scenario = split_scenario(case, host, seed)
    config = layer_config(case.spec, max(scenario.topk_indices.shape[0], 1), adaptive_verification=True)
    layer = backend.open_layer(config, device)
    verdict = judge_step(backend, layer, scenario, build_attention_inputs(scenario, device))
    return verdict.problem_rows if verdict.failure is not None else []


@pytest.mark.vllm
@pytest.mark.parametrize(("case", "host"), CASES, ids=[c.name for c, _ in CASES])
def test_adaptive_verification_with_a_device_split(vllm_on_stand_in, device, judge, case, host):
    """Every row executes its valid count under the device split, within a plan that bounds every
    row by the longest request's host bound."""
    if not vllm_on_stand_in.reads_adaptive_verification:
        pytest.skip(f"vLLM {vllm_on_stand_in.version}'s builder reads no adaptive verification setting")
    outcome = run_split_case(judge, vllm_on_stand_in, case, host, device)
    spec = case.spec
    longest = min(max(r.seq_len for r in spec.requests), spec.topk + spec.kpool - 1)
    assert outcome.host_lengths.tolist() == [longest] * sum(host)


@pytest.mark.vllm
def test_a_device_split_catches_a_bound_from_the_host_split(vllm_on_stand_in, device, monkeypatch):
    """``HOST_SPLIT_BOUND`` planted: the steps drawn before (adaptive verification with one split:
    the longest request anywhere, the spec-decode situation) pass; each device split case fails on
    exactly the rows whose valid count passes their bound under the host split."""
    backend = vllm_on_stand_in
    if backend.design != "bounded":
        pytest.skip(f"vLLM {backend.version} has the exact design: the planted line is the bounded design's")
    bug = HOST_SPLIT_BOUND
    planted(monkeypatch, backend.module, BUILDER, "_kv_lens_host", ((bug.shipped, bug.planted),))
    before = [c.spec for c in longest_request_cases()]
    before.append(BF16.apply(next(c for c in situation_cases(4) if c.name.startswith("spec-decode")).spec))
    for spec in before:
        run_split_case(UnreportedJudge(), backend, Case("drawn-before", spec), [r.q_len for r in spec.requests], device)
    for case, host in CASES:
        expected = rows_a_host_split_bound_cuts(split_scenario(case, host))
        rows = failing_rows(backend, case, host, device)
        assert rows == expected, f"{case.name}: the judge names rows {rows}; the host split bounds {expected} short"


@pytest.mark.vllm
@pytest.mark.flashmla
@pytest.mark.parametrize(("case", "host"), CASES, ids=[c.name for c, _ in CASES])
def test_flashmla_runs_the_device_split(flashmla_on_stand_in, device, judge, case, host):
    """FLASHMLA_SPARSE (bf16: its kernels are handed each row's valid count from the device's
    convert) serves every row under the device split the common metadata hands it."""
    run_split_case(judge, flashmla_on_stand_in, case, host, device)
