"""The CPU twin of ``tests/gpu/test_plan_history_and_state.py`` (docs/input-space.md#plan-history,
#poisoned-workspaces, #graph-against-eager): plan history, poisoned workspaces and graph against
eager through the port (on the reference wrapper; its graphs the simulated machine's), vLLM's SM90
backend (on FlashInfer's fa3 stand-in) and FlashMLA (on its stand-in kernels), each step judged by
``harness.judge`` with its layer mode's comparison (``harness.layer_modes``); each check shown to fail
on the bug it exists for; and a failure only poisoned workspaces show written as a case that records
its layer mode and replays red under the bug and green without it.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

import backends.flashinfer.sm90_state as sm90
from backends.registry import open_backend
from backends.seam import float_workspaces, planned_then_run
from harness.bits import ulp_distance_bf16
from harness.layer_modes import WrappedBackend, WrappedLayer, capture_problem
from harness.plan_history import (
    OVER_SEVERAL_RUNS,
    PLAN_HISTORY_ULPS,
    check_graph_against_eager,
    check_plan_history,
    check_poisoned_workspaces,
    histories,
    history_run,
    keeps_plans,
    padded_history,
)
from pytest_sparse_mla.backend import open_run_backend
from tests import fa3_stand_in, simulated_sm90
from tests.support.backend_cases import port_case
from tests.support.reference_wrapper import ReferenceWrapper


@pytest.fixture
def reference_wrapper(monkeypatch):
    monkeypatch.setattr(sm90, "MLAWrapper", ReferenceWrapper)
    monkeypatch.setattr(sm90, "WORKSPACE_BYTES", 1024)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


@pytest.fixture
def simulated_machine(monkeypatch):
    """The simulated SM90 machine's patches: the port's wrapper stand-in and its CUDA graphs."""
    for module, name, value in simulated_sm90.patches():
        monkeypatch.setattr(module, name, value)


# --- the port ------------------------------------------------------------------------------------


# The port with the run's host stages (``--impl``), so that a host-stage bug shows in its state too.


def test_port_plan_history(reference_wrapper, device, judge, pytestconfig):
    check_plan_history(judge, open_run_backend(pytestconfig, "port-fa3"), device)


def test_port_poisoned_workspaces(reference_wrapper, device, judge, pytestconfig):
    check_poisoned_workspaces(judge, open_run_backend(pytestconfig, "port-fa3"), device)


def test_port_graph_against_eager(simulated_machine, device, judge, pytestconfig):
    check_graph_against_eager(judge, open_run_backend(pytestconfig, "port-fa3"), device)


# --- vLLM's SM90 backend and FlashMLA ------------------------------------------------------------


@pytest.mark.vllm
def test_vllm_plan_history(vllm_on_stand_in, device, judge):
    """On the bounded design the kept history keeps its plan (planned one less than fresh's) and
    clamps; on the stand-in, which attends a row unsplit, every history's output is fresh's."""
    outcomes = check_plan_history(judge, vllm_on_stand_in, device)
    assert int(ulp_distance_bf16(outcomes["kept"].out.cpu(), outcomes["fresh"].out.cpu()).max()) == 0


@pytest.mark.vllm
def test_vllm_poisoned_workspaces(vllm_on_stand_in, device, judge):
    check_poisoned_workspaces(judge, vllm_on_stand_in, device)


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["plain", "poisoned"])
def test_vllm_piecewise_padded_step_hands_forward_mqa_the_rows_its_metadata_counts(vllm_backend, monkeypatch,
                                                                                   device, judge, mode):
    """vLLM's MLA layer cuts q to the metadata's ``num_actual_tokens`` before ``forward_mqa``, so
    a piecewise graph's padded rows never reach FlashInfer's run(): on a FlashInfer that checks
    the planned query shape at run (0.7.4; here its stand-in) the padded history passes."""
    fa3_stand_in.install(monkeypatch, fa3_stand_in.StandInQueryShapeWrapper if vllm_backend.design == "bounded"
                         else fa3_stand_in.StandIn06Wrapper)
    history_run(judge, vllm_backend, "padded", padded_history(), device, mode)


@pytest.mark.vllm
def test_vllm_graph_is_unsupported_on_the_simulated_machine(vllm_on_stand_in, simulated_machine, device):
    """The simulated machine's graphs hold the port's attention state alone: vLLM's capture is
    skipped with that reason here and runs on a GPU."""
    from harness.backend_step import layer_config

    spec = histories()["fresh"][0][0]
    layer = vllm_on_stand_in.open_layer(layer_config(spec, 8), device)
    assert "simulated machine" in capture_problem(layer)


@pytest.mark.vllm
@pytest.mark.flashmla
def test_flashmla_plan_history(flashmla_on_stand_in, device, judge):
    check_plan_history(judge, flashmla_on_stand_in, device)


@pytest.mark.vllm
@pytest.mark.flashmla
def test_flashmla_poisoned_workspaces(flashmla_on_stand_in, device, judge):
    check_poisoned_workspaces(judge, flashmla_on_stand_in, device)


@pytest.mark.vllm
@pytest.mark.flashmla
def test_flashmla_graph_says_why_it_is_not_captured(flashmla_on_stand_in, device, judge):
    with pytest.raises(pytest.skip.Exception, match="unsupported: the FlashMLA layer reads every kernel call"):
        check_graph_against_eager(judge, flashmla_on_stand_in, device)


# --- each check fails on its bug -----------------------------------------------------------------


class ReadsStalePartials(WrappedLayer):
    """A layer that merges an empty split's stale partial from its float workspace with weight 0
    (0 x a NaN partial is NaN); its workspace is zero when opened, so a clean run is right."""

    def __init__(self, layer):
        super().__init__(layer)
        for buffer in float_workspaces(layer):
            buffer.zero_()

    def finish(self, step, outcome):
        outcome = self.layer.finish(step, outcome)
        partial = float_workspaces(self.layer)[0][:4].view(torch.float32)[0]
        outcome.out = (outcome.out.float() + 0.0 * partial).to(outcome.out.dtype)
        return outcome

    def step(self, step):
        outcome = self.layer.plan_step(step)
        if step.runs_kernel:
            self.layer.launch(step, outcome)
            outcome = self.finish(step, outcome)
        return outcome


def nudged(out: torch.Tensor, ulps: int) -> torch.Tensor:
    """``out`` with its first element ``ulps`` bf16 values further from zero."""
    out = out.clone()
    out.view(torch.int16).view(-1)[0] += ulps
    return out


class KeptPlanDrifts(WrappedLayer):
    """A layer whose output on a kept plan (no plan made this step) is 2 bf16 ULPs off in one element."""

    def __init__(self, layer):
        super().__init__(layer)
        self.plans_seen = -1

    def step(self, step):
        outcome = self.layer.step(step)
        if outcome.out is not None and outcome.plans == self.plans_seen:
            outcome.out = nudged(outcome.out, PLAN_HISTORY_ULPS + 1)
        self.plans_seen = outcome.plans
        return outcome


def smallest_nudged(q: torch.Tensor) -> torch.Tensor:
    """``q`` with the smallest nonzero element of its first row and head one bf16 ULP further from zero."""
    q = q.clone()
    first = q[0, 0]
    magnitude = torch.where(first == 0, torch.full_like(first, float("inf")), first.abs())
    first.view(torch.int16)[int(magnitude.float().argmin())] += 1
    return q


class CapturedQueryDiffers(WrappedLayer):
    """A layer whose captured forward reads a query one bf16 ULP off in its smallest element (the
    step's numerics depend on the graph mode, well within the error budget)."""

    def launch(self, step, outcome):
        if torch.cuda.is_current_stream_capturing():
            staged = list(self.layer.staged)
            staged[3] = smallest_nudged(staged[3])
            self.layer.staged = tuple(staged)
        self.layer.launch(step, outcome)


def test_poisoned_workspaces_catch_a_read_of_stale_partials(reference_wrapper, device, judge):
    """The clean run passes; with the workspace poisoned the judge finds the output other than the clean run's."""
    check_plan_history(judge, WrappedBackend(open_backend("port-fa3"), ReadsStalePartials), device)
    with pytest.raises(AssertionError, match=r"the poisoned run's output is not the clean run's bit for bit "
                                             r"\(\d+ elements differ, max \d+ bf16 ULPs, non-finite: [1-9]"):
        check_poisoned_workspaces(judge.raising_findings(), WrappedBackend(open_backend("port-fa3"),
                                                                           ReadsStalePartials), device)


class ReadsPastItsRows(WrappedLayer):
    """vLLM's layer with a convert that reads its last counted row from the row past it wherever
    that row holds an entry (the top-k buffer read one row too far). In a plain run what a step
    leaves past its rows is -1, never a token, so no output changes."""

    def step(self, step):
        return planned_then_run(self, step)

    def plan_step(self, step):
        return self.layer.plan_step(step)

    def finish(self, step, outcome):
        return self.layer.finish(step, outcome)

    def launch(self, step, outcome):
        n, buffer = step.meta.num_actual_tokens, self.layer.topk_indices_buffer
        if 0 < n < buffer.shape[0]:
            buffer[n - 1] = torch.where(buffer[n] >= 0, buffer[n], buffer[n - 1])
        self.layer.launch(step, outcome)


@pytest.mark.vllm
def test_poisoned_rows_catch_a_read_of_the_top_k_buffer_past_the_steps_rows(vllm_on_stand_in, device, judge):
    """Plain, the histories and the piecewise-padded one pass under the fault; with token 0
    planted in the rows past those each step's metadata counts, the judge finds the output other
    than the clean run's."""
    backend = WrappedBackend(vllm_on_stand_in, ReadsPastItsRows)
    for name, steps in {**histories(), "padded": padded_history()}.items():
        history_run(judge, backend, name, steps, device, "plain")
    with pytest.raises(AssertionError, match=r"the poisoned run's output is not the clean run's bit for bit"):
        check_poisoned_workspaces(judge.raising_findings(), backend, device)


@pytest.mark.vllm
def test_poisoned_slots_catch_a_kernel_that_reads_past_the_planned_spans(vllm_backend, monkeypatch, device, judge):
    """A kernel that also attends the kv_indices entry just past the last planned span (SGLang
    #27338's shape: ``sum(kv_len)`` beyond the indices written) where it names a written row: a
    plain run on fresh buffers, whose entry there is slot 0 (a row no request writes), passes;
    with the step's first token planted past the planned spans, the judge finds the output other
    than the clean run's (on the fresh history; where the layer's indices end with the step's
    spans, as 0.30.0's strided ones sized for the rows, on the padded one)."""
    bounded = vllm_backend.design == "bounded"
    fa3_stand_in.install(monkeypatch, fa3_stand_in.ReadsPastTheLastSpan if bounded
                         else fa3_stand_in.ReadsPastTheLastSpan06)
    history_run(judge, vllm_backend, "fresh", histories()["fresh"], device, "plain")
    with pytest.raises(AssertionError, match=r"(?s)history \(poisoned\).*the poisoned run's output is not the clean "
                                             r"run's bit for bit"):
        check_poisoned_workspaces(judge.raising_findings(), vllm_backend, device)


@pytest.mark.vllm
def test_plan_history_catches_a_kept_plan_beyond_the_bound(vllm_on_stand_in, device, judge):
    if not keeps_plans(vllm_on_stand_in):
        backend = vllm_on_stand_in
        pytest.skip(f"vLLM {backend.version}'s {backend.design} design plans every step: no plan is kept")
    with pytest.raises(AssertionError, match=f"beyond the plan-history bound of {PLAN_HISTORY_ULPS}"):
        check_plan_history(judge, WrappedBackend(vllm_on_stand_in, KeptPlanDrifts), device)


def test_plan_history_catches_other_bits_on_the_same_plan(reference_wrapper, device, judge):
    """The port plans the same lengths after every history: any drift between histories is a bug."""
    with pytest.raises(AssertionError, match="the same planned lengths as fresh, output not bit for bit"):
        check_plan_history(judge, WrappedBackend(open_backend("port-fa3"), KeptPlanDriftsOnReplan), device)


class KeptPlanDriftsOnReplan(WrappedLayer):
    """A layer whose output after any earlier step is 2 bf16 ULPs off in one element."""

    def __init__(self, layer):
        super().__init__(layer)
        self.steps = 0

    def step(self, step):
        outcome = self.layer.step(step)
        if outcome.out is not None and self.steps:
            outcome.out = nudged(outcome.out, PLAN_HISTORY_ULPS + 1)
        self.steps += 1
        return outcome


class SecondRunDrifts(WrappedLayer):
    """A layer whose output on the second step of every second layer that runs two steps is 2 bf16
    ULPs off in one element: each run of a history passes on its own (the fresh layers beside it
    run one step each), and the second run of a two-step history differs from the first."""

    layers_past_one_step = 0

    def __init__(self, layer):
        super().__init__(layer)
        self.steps = 0

    def step(self, step):
        outcome = self.layer.step(step)
        self.steps += 1
        if self.steps == 2:
            SecondRunDrifts.layers_past_one_step += 1
            if outcome.out is not None and SecondRunDrifts.layers_past_one_step % 2 == 0:
                outcome.out = nudged(outcome.out, PLAN_HISTORY_ULPS + 1)
        return outcome


def test_plan_history_catches_a_history_that_runs_otherwise_twice_and_says_no_case_replays_it(
        reference_wrapper, device, judge, monkeypatch):
    monkeypatch.setattr(SecondRunDrifts, "layers_past_one_step", 0)
    with pytest.raises(AssertionError, match=r"kept: the same history twice gives other bits\n"
                                             r"replan: the same history twice gives other bits\n"
                                             + re.escape(OVER_SEVERAL_RUNS)):
        check_plan_history(judge, WrappedBackend(open_backend("port-fa3"), SecondRunDrifts), device)


def test_graph_against_eager_catches_a_capture_that_computes_otherwise(simulated_machine, device, judge):
    with pytest.raises(AssertionError, match="the graph replay's (output|LSE) is not the eager run's"):
        check_graph_against_eager(judge, WrappedBackend(open_backend("port-fa3"), CapturedQueryDiffers), device)


# --- failures only a layer mode shows, written and replayed in their layer mode ------------------

STALE_PARTIAL = "--impl=tests.bugs:StaleSplitPartialMerged"
GRAPH_OUTPUT = "--impl=tests.bugs:GraphOutputLeftInItsStaticBuffers"
GPU_TWIN = "tests/gpu/test_plan_history_and_state.py"


def replayed(pytester, monkeypatch, dump, *args):
    """``pytest --replay=dump`` on the simulated SM90 machine: the nested session and its output."""
    from tests.support.child_runs import run_gpu_family

    result = run_gpu_family(pytester, monkeypatch, "tests/test_replay.py", "", f"--replay={dump}", *args,
                            simulated=True)
    return result, "\n".join(result.outlines + result.errlines)


def dumped_replayed_red_and_green(pytester, monkeypatch, tmp_path, impl: str, test: str, mode: str,
                                  message: str) -> None:
    """The GPU twin on the simulated machine under ``impl`` fails ``test`` alone; its one written
    case records ``mode``; replayed, it is red under ``impl`` (``message`` in its output) and green
    without it; the same file without its mode (a plain case, as a file written before the mode
    was recorded) replays green under ``impl``: the mode is what makes it red."""
    from recording.backend_case import load_backend_case
    from recording.recipe import save_with_digest
    from tests.support.child_runs import run_gpu_family

    dump = tmp_path / "dumps"
    result = run_gpu_family(pytester, monkeypatch, GPU_TWIN, "port-fa3", impl, f"--dump-failures={dump}",
                            simulated=True)
    output = "\n".join(result.outlines + result.errlines)
    outcomes = result.parseoutcomes()
    assert result.ret == 1 and (outcomes.get("failed"), outcomes.get("passed")) == (1, 2), output[-3000:]
    assert "FAILED " in output and f"{test}[port-fa3]" in output, output[-3000:]
    (written,) = sorted(dump.iterdir())
    record = load_backend_case(written)
    assert (record["layer_mode"], record["backend"]["name"]) == (mode, "port-fa3"), record

    red, red_text = replayed(pytester, monkeypatch, dump, impl)
    assert red.ret == 1 and red.parseoutcomes().get("failed") == 1, red_text[-3000:]
    assert re.search(message, red_text), red_text[-3000:]
    green, green_text = replayed(pytester, monkeypatch, dump)
    assert green.ret == 0 and green.parseoutcomes().get("passed") == 1, green_text[-3000:]

    plain = tmp_path / "plain"
    save_with_digest(plain / written.name, {k: v for k, v in record.items() if k not in ("layer_mode", "digest")})
    assert "layer_mode" not in json.loads((plain / written.name).read_text())
    unseen, unseen_text = replayed(pytester, monkeypatch, plain, impl)
    assert unseen.ret == 0 and unseen.parseoutcomes().get("passed") == 1, unseen_text[-3000:]


@pytest.mark.gpu_stand_in
@pytest.mark.suite_self_test
def test_a_failure_only_poisoned_workspaces_show_is_a_case_of_its_layer_mode_that_replays_red_and_green(
        pytester, monkeypatch, tmp_path):
    """``tests.bugs:StaleSplitPartialMerged`` (the port's state merges a stale partial of its float
    workspace with weight 0) fails only the poisoned-workspace test of the GPU twin on the simulated
    machine; its case records the layer mode, and its replay reopens the port in that mode: red
    under the bug, naming the poisoned run against the clean one, and green without it; plain, the
    same file is green under the bug."""
    dumped_replayed_red_and_green(
        pytester, monkeypatch, tmp_path, STALE_PARTIAL, "test_poisoned_workspaces", "poisoned",
        r"the poisoned run's output is not the clean run's bit for bit .*non-finite: [1-9]")


@pytest.mark.gpu_stand_in
@pytest.mark.suite_self_test
def test_a_failure_only_a_graph_shows_is_a_case_of_its_layer_mode_that_replays_red_and_green(
        pytester, monkeypatch, tmp_path):
    """``tests.bugs:GraphOutputLeftInItsStaticBuffers`` (the port's state copies its kernel's
    output into the step's buffers only outside a capture) fails only the graph-against-eager test
    of the GPU twin on the simulated machine (its graphs capture the state's step, the copy left
    out); its case records ``layer_mode: graphed``, and its replay captures and replays the step
    again: red under the bug, naming the replay against the eager run (the replay's output the
    poison it left in place), and green without it; plain, the same file is green under the bug."""
    dumped_replayed_red_and_green(
        pytester, monkeypatch, tmp_path, GRAPH_OUTPUT, "test_graph_against_eager", "graphed",
        r"the graph replay's output is not the eager run's bit for bit .*non-finite: [1-9]")


def test_a_case_keeps_its_layer_mode_and_one_without_it_is_plain(tmp_path):
    """Written, a case names its mode (plain where the test ran none); a file without the field,
    written before it was recorded, still loads (and replays plain: ``backend_of_case``)."""
    from recording.backend_case import load_backend_case, write_backend_case
    from recording.recipe import save_with_digest

    assert load_backend_case(write_backend_case(tmp_path, "graphed", port_case("graphed")))["layer_mode"] == "graphed"
    written = load_backend_case(write_backend_case(tmp_path, "plain", port_case(None)))
    assert written["layer_mode"] == "plain"
    old = save_with_digest(tmp_path / "old.case.json",
                           {k: v for k, v in written.items() if k not in ("layer_mode", "digest")})
    assert "layer_mode" not in load_backend_case(old)


def test_a_layer_mode_that_is_none_is_one_fixture_error_naming_the_field(tmp_path):
    from recording.backend_case import load_backend_case, write_backend_case
    from recording.fixture import FixtureError

    path = write_backend_case(tmp_path, "sideways", port_case("sideways"))
    with pytest.raises(FixtureError, match="'layer_mode'.*expected one of plain, poisoned, graphed, against-fresh"):
        load_backend_case(path)
