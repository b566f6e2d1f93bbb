"""The judgement of ``harness.plan_hygiene`` on counts made by hand (counting itself needs CUDA:
``tests/gpu/test_plan_hygiene.py``), and the counter's own behaviour off CUDA."""

from __future__ import annotations

import contextlib

import pytest
import torch

import backends.flashinfer.sm90_state as sm90
import backends.seam as seam
import harness.plan_hygiene as plan_hygiene
from backends.seam import device_syncs_counted, with_syncs_counted
from harness.plan_hygiene import (
    SYNC_ROWS,
    CoverageJudgedOnStaleIds,
    check_stale_ids_at_plan,
    check_syncs_per_plan,
    decode_contexts,
    sync_count_problems,
)
from pytest_sparse_mla.backend import open_run_backend
from tests import fa3_stand_in
from tests.support.reference_wrapper import ReferenceWrapper


def test_equal_counts_for_every_step_are_no_problem():
    assert sync_count_problems({1: [3], 16: [3], 128: [3]}) == []


def test_counts_that_grow_with_the_step_are_named_with_each_count():
    assert sync_count_problems({1: [2], 16: [2], 128: [129]}) == [
        "device synchronisations per plan() grow with the step (1 rows: 2, 16 rows: 2, 128 rows: 129)"]


def test_a_step_with_no_plan_or_two_is_named():
    assert sync_count_problems({1: [2], 16: [], 128: [2, 2]}) == [
        "the step of 16 rows made 0 plans, not one", "the step of 128 rows made 2 plans, not one"]


def test_nothing_is_counted_off_cuda_and_the_call_goes_through():
    with device_syncs_counted("cpu") as counted:
        torch.ones(3).sum().item()
    assert counted == []
    into: list[int] = []
    with seam.plan_syncs_counted():
        assert with_syncs_counted(lambda a, b=0: a + b, "cpu", into)(2, b=3) == 5
    assert into == []


def test_a_plan_outside_the_count_runs_bare(monkeypatch):
    """Outside ``plan_syncs_counted`` (every plan but the check's, the upgrade check's timed
    plans among them) the counter is not entered; inside, each call is counted."""
    monkeypatch.setattr(seam, "device_syncs_counted", one_sync_per_call)
    into: list[int] = []
    plan = with_syncs_counted(lambda: "planned", "cuda", into)
    assert plan() == "planned" and into == []
    with seam.plan_syncs_counted():
        assert plan() == "planned" and plan() == "planned"
    assert into == [1, 1] and plan() == "planned" and into == [1, 1]


def test_the_contexts_span_the_first_tile_to_past_a_thousand_tokens():
    contexts = decode_contexts(128)
    assert len(contexts) == 128 and min(contexts) == 40 and max(contexts) > 1000


@contextlib.contextmanager
def one_sync_per_call(device):
    """A counter that counts one synchronisation in every block, on any device."""
    yield [1]


@pytest.fixture
def backend(request, monkeypatch):
    """The port on the reference wrapper, or vLLM's SM90 backend on the fa3 stand-in."""
    if request.param == "port-fa3":
        monkeypatch.setattr(sm90, "MLAWrapper", ReferenceWrapper)
        monkeypatch.setattr(sm90, "WORKSPACE_BYTES", 1024)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        return open_run_backend(request.config, "port-fa3")
    return request.getfixturevalue("vllm_on_stand_in")


@pytest.mark.parametrize("backend", ["port-fa3", pytest.param("vllm", marks=pytest.mark.vllm)], indirect=True)
def test_every_step_of_the_check_plans_once_and_is_judged(backend, judge, device, monkeypatch):
    """The GPU check's sequence on the stand-ins, with a counter that counts one synchronisation
    per plan: each step plans exactly once (the bounded design keeps no plan across these row
    counts) and passes the judge."""
    monkeypatch.setattr(seam, "device_syncs_counted", one_sync_per_call)
    assert check_syncs_per_plan(judge, backend, device) == {rows: [1] for rows in SYNC_ROWS}


@pytest.mark.vllm
def test_a_correct_step_after_ids_past_the_cache_runs_where_coverage_is_not_judged_at_plan(vllm_backend, monkeypatch,
                                                                                           judge, device):
    """On the fa3 stand-in, which reads each row's executed span only and checks no range, the
    second step runs and passes the judge."""
    fa3_stand_in.install(monkeypatch, fa3_stand_in.StandInWrapper if vllm_backend.design == "bounded"
                         else fa3_stand_in.StandIn06Wrapper)
    check_stale_ids_at_plan(judge, vllm_backend, device)


@pytest.mark.vllm
def test_a_correct_step_after_ids_past_the_cache_is_refused_where_plan_records_the_range(vllm_backend, monkeypatch,
                                                                                         judge, device):
    """The finding through the release's own SM90 module on the stand-in of FlashInfer 0.7.4's
    coverage check: vLLM's build() plans before forward_mqa packs the step's ids, so the plan
    records the ids the first step left, and run() refuses the correct second step."""
    fa3_stand_in.install(monkeypatch, fa3_stand_in.StandInCoverageWrapper)
    with pytest.raises(CoverageJudgedOnStaleIds, match=r"the second step's run\(\) refused it \(KV cache does not "
                                                        r"cover the planned CSR page indices"):
        check_stale_ids_at_plan(judge, vllm_backend, device)


def test_the_adapters_warning_recorder_hands_sync_warnings_on_to_the_counter():
    """FlashInfer's adapter records the warnings its plan() raises; torch's sync warnings go on
    to an outer recorder (the counter), the others stay recorded."""
    import warnings

    from backends.flashinfer.compat import recorded_warnings, recording

    before = len(recorded_warnings())
    with warnings.catch_warnings(record=True) as outer:
        warnings.simplefilter("always")
        with recording():
            warnings.warn(seam.SYNC_WARNING, UserWarning, stacklevel=1)
            warnings.warn("a release's own warning", UserWarning, stacklevel=1)
    assert [str(w.message) for w in outer] == [seam.SYNC_WARNING]
    assert recorded_warnings()[before:] == [("UserWarning", "a release's own warning")]


def test_a_layer_without_index_buffers_shows_none():
    assert seam.index_buffers(object()) == []


def test_the_first_slot_id_past_a_cache_counts_its_blocks_rows():
    from harness.plan_hygiene import slot_rows

    assert slot_rows(torch.zeros(10, 64, 8)) == 640
    assert slot_rows(seam.blocks_apart(torch.zeros(10, 64, 8), 96)) == 960


@contextlib.contextmanager
def one_more_sync_per_call(device, made=[0]):  # noqa: B006 - the calls so far, shared on purpose
    made[0] += 1
    yield [made[0]]


@pytest.mark.parametrize("backend", ["port-fa3"], indirect=True)
def test_counts_that_grow_fail_the_check_naming_the_backend_and_each_count(backend, judge, device, monkeypatch):
    """Small steps (the check's sizes are its own; what is judged here is its verdict)."""
    monkeypatch.setattr(seam, "device_syncs_counted", one_more_sync_per_call)
    monkeypatch.setattr(plan_hygiene, "SYNC_ROWS", (1, 2, 3))
    with pytest.raises(AssertionError, match=r"^port-fa3: device synchronisations per plan\(\) grow with the step "
                                             r"\(1 rows: \d+, 2 rows: \d+, 3 rows: \d+\)$"):
        check_syncs_per_plan(judge, backend, device)


@pytest.mark.parametrize("backend", ["port-fa3"], indirect=True)
def test_the_stale_ids_check_refuses_a_layer_that_shows_no_index_buffers(backend, judge, device):
    """The port's layer has no ``index_buffers``: the check says so rather than passing."""
    with pytest.raises(AssertionError, match=r"port-fa3: its layer shows no kv_indices buffers"):
        check_stale_ids_at_plan(judge, backend, device)


def test_the_counter_counts_sync_warnings_and_hands_every_other_warning_on():
    import warnings

    with warnings.catch_warnings(record=True) as inner:
        warnings.simplefilter("always")
        warnings.warn(seam.SYNC_WARNING, UserWarning, stacklevel=1)
        warnings.warn("a release's own warning", DeprecationWarning, stacklevel=1)
        warnings.warn(seam.SYNC_WARNING, UserWarning, stacklevel=1)
    with warnings.catch_warnings(record=True) as outer:
        warnings.simplefilter("always")
        assert seam.syncs_counted_others_passed_on(inner) == 2
    assert [(w.category, str(w.message)) for w in outer] == [(DeprecationWarning, "a release's own warning")]
