"""The ``judge`` fixture: the reporter of a test's steps through a backend.

A test runs its case with ``harness.case_runner.run_case`` / ``run_sequence`` and this fixture.
The runner judges each step (``harness.judge.judge_step``) and hands the verdict here, once
(``StepJudge.report``); it is read here and only here:

- the known findings it expects become the test's strict xfails, each expecting its own
  exception (``harness.findings``);
- the regime table counts the rows each backend served, the launches, the rows read back and
  the error ratios (``regime_log.step``), and blames the regimes of failing rows;
- an output beyond the budget that is bit for bit the twin's is counted as the kernel's rounding
  (``VLLM_TWIN_KEY``);
- under the upgrade check the step's outputs, integer results (executed, planned and host
  lengths) and error ratios are noted for the record (``baseline.note``);
- for ``--dump-failures`` the case is already noted by the runner (the backend, its release and
  module digest, a port's layout and plan-keeping, the layer mode, the steps as specs and seeds
  with their host query split where the device's differs).

The runner then raises the verdict's failure. :func:`replay_backend_case` re-runs a written case
through the backend the run names (``--impl``, ``--vllm``, ``--backend``) with the same fixture.
"""

from __future__ import annotations

import os

import pytest

from mla_constants import GPU_TIER_DEFAULT_DEVICE, GPU_TIER_DEVICE_ENV

from .keys import REPLAY_KEY
from .vllm import VLLM_SOURCE, VLLM_TWIN_KEY


def gpu_tier_device() -> str:
    """The device the GPU tier's tests run on (``harness.port.launch.DEVICE``, read here without
    importing torch)."""
    return os.environ.get(GPU_TIER_DEVICE_ENV, GPU_TIER_DEFAULT_DEVICE)


def flashinfer_checks_query_shape() -> bool:
    """Whether the FlashInfer importable as ``flashinfer.mla`` refuses q rows other than the
    planned ones at run: as a stand-in declares it (``checks_query_shape``), else probed on the
    device (``Features.run_checks_query_shape``)."""
    from backends.registry import flashinfer_features, flashinfer_wrapper_class

    try:
        wrapper = flashinfer_wrapper_class()
    except ImportError:
        return False
    if not getattr(wrapper, "__module__", "").startswith("flashinfer"):  # a stand-in says, else it does not check
        return bool(getattr(wrapper, "checks_query_shape", False))

    return bool(flashinfer_features(gpu_tier_device()).run_checks_query_shape)


def upgrade_check_active(config) -> bool:
    from .baselines import baseline_directory

    return baseline_directory(config) is not None


class StepJudge:
    """What the case runner reports each step of one test to (a
    :class:`harness.case_runner.Reporter`): a configuration the backend does not serve skips the
    test; each verdict's expected findings become the test's strict xfails, its rows the regime
    table's, its outputs the upgrade check's notes."""

    def __init__(self, request, marks_findings: bool = True):
        self.request = request
        self.marks_findings = marks_findings
        #: the verdict this judge reported last (a test reads the comparisons of the step
        #: ``harness.case_runner.run_case`` ran for it here)
        self.last_verdict = None

    def raising_findings(self) -> StepJudge:
        """The same judge, raising a known finding's exception without making the test an xfail
        (for a test that runs many cases and expects a finding on some of them)."""
        return StepJudge(self.request, marks_findings=False)

    def admit(self, backend, config) -> None:
        """Skip, with the backend's reason, a configuration the backend does not serve."""
        reason = backend.unsupported(config)
        if reason:
            pytest.skip(f"{backend.name}: {reason}")

    def query_shape_checked(self) -> bool:
        return flashinfer_checks_query_shape()

    def cannot_run(self, reason: str) -> None:
        """A layer mode that cannot run here (a forward no CUDA graph captures) skips the test."""
        pytest.skip(reason)

    def report(self, verdict, scenario, label: str, layer=None) -> None:
        for finding in verdict.expected if self.marks_findings else ():
            self.request.applymarker(pytest.mark.xfail(raises=finding.exception, strict=True, reason=finding.reason))
        self.last_verdict = verdict
        outcome = verdict.outcome
        if outcome is None:
            return
        regimes = scenario.row_regime[: outcome.planned_rows]
        regime_log = self.request.getfixturevalue("regime_log")
        regime_log.step(outcome, regimes, comparisons=verdict.comparisons, spec=scenario.spec, label=label)
        if verdict.refused:
            regime_log.expected_refusal(outcome.refusal)
        regime_log.blame([regimes[r] for r in verdict.rows_at_fault])
        if verdict.kernel_rounding:
            first = verdict.comparisons[0]
            self.request.node.user_properties.append((VLLM_TWIN_KEY, (first.max_ratio, first.mean_ratio)))
        if upgrade_check_active(self.request.config):
            self.request.getfixturevalue("baseline").note(**baseline_note(verdict, label, layer, self.request.config))

    def verdict(self, backend, layer, scenario, inputs, *, twin=None, compare: bool = True, label: str = "",
                context_of_step: str = ""):
        """One step judged and reported (``harness.case_runner.judged_step``); the verdict
        returned, its failure not raised."""
        from harness.case_runner import judged_step

        return judged_step(self, backend, layer, scenario, inputs, twin=twin, compare=compare, label=label,
                           context_of_step=context_of_step)

    def step(self, backend, layer, scenario, inputs, **kwargs):
        """One step judged and reported, its failure raised; the outcome returned."""
        verdict = self.verdict(backend, layer, scenario, inputs, **kwargs)
        if verdict.failure is not None:
            raise verdict.failure
        return verdict.outcome


def baseline_note(verdict, label: str, layer, config) -> dict:
    """What the upgrade check notes of a step: the refusal as the case's error; in the timing pass
    the kernel's and the plan's times where the layer shows its parts (``timing_parts``); else
    :func:`baseline_fields`."""
    from .baselines import timing_directory
    from .port_reports import timed_parts

    outcome = verdict.outcome
    if verdict.refused:
        return {"error": outcome.refusal}
    parts = getattr(layer, "timing_parts", None)
    if timing_directory(config) is not None and callable(parts) and outcome.out is not None:
        return timed_parts(*parts(None, outcome), rows=outcome.planned_rows)
    return baseline_fields(verdict, label)


def baseline_fields(verdict, label: str) -> dict:
    """What the upgrade check records of a step: the first comparison's error ratios, the output
    of the served rows, and the integer results (executed, planned and host lengths) that must be
    equal between releases."""
    outcome = verdict.outcome
    n = outcome.planned_rows
    outputs = {f"executed_len{label}": outcome.executed_lengths, f"planned_len{label}": outcome.planned_lengths,
               f"host_len{label}": outcome.host_lengths}
    ratios = {}
    if verdict.comparisons and outcome.out is not None:
        first = verdict.comparisons[0]
        ratios = {f"out{label}_max_ratio": first.max_ratio, f"out{label}_mean_ratio": first.mean_ratio}
        outputs[f"out{label}"] = outcome.out[:n]
    return {"ratios": ratios, "outputs": {k: v for k, v in outputs.items() if v is not None}}


@pytest.fixture
def judge(request) -> StepJudge:
    """The reporter ``harness.case_runner.run_case`` / ``run_sequence`` hand each step's verdict to."""
    return StepJudge(request)


# --- a written case, run again ----------------------------------------------------------------------


def backend_of_case(record: dict, config):
    """The backend a written case names, opened on what this run has (``--impl`` for the port's
    host stages, under the layout and plan-keeping its record names; ``--vllm`` for a vLLM
    release's backends, ``--backend module:factory`` for a user's own), its layers in the layer
    mode the case ran in (``layer_mode``, ``harness.layer_modes``; plain where the file has none),
    or ``(None, why)``."""
    from harness.layer_modes import in_layer_mode

    backend, why = backend_named(record, config)
    if backend is None:
        return None, why
    return in_layer_mode(backend, record.get("layer_mode", "plain")), None


def backend_named(record: dict, config):
    """The backend a written case names, as :func:`backend_of_case` opens it, before its layer mode."""
    from backends.registry import NEEDS_VLLM, PORT_KERNELS, family_and_release

    from .backend import factory_backends, open_run_backend

    identity = record["backend"]
    name = identity["name"]
    family, _ = family_and_release(name)
    if family in PORT_KERNELS:
        port = open_run_backend(config, family)
        return port.with_layer(identity.get("layout", port.layout), identity.get("reuse_plan", port.reuse_plan)), None
    if family in NEEDS_VLLM:
        if config.stash.get(VLLM_SOURCE, None) is None:
            return None, (f"the case was written on {name} (vLLM {record['backend'].get('release')}'s code): name a "
                          "release with --vllm=PATH")
        return open_run_backend(config, family), None
    own = [backend for backend in factory_backends(config) if backend.name == name]
    if own:
        return own[0], None
    return None, (f"the case was written on {name}, a backend of its user's own: name its factory with "
                  "--backend=module:factory")


def replay_backend_case(path, request, record: dict) -> None:
    """The written case ``path`` (its loaded ``record``) run again, step by step and with the state carried as its test
    carried it, through the backend this run names, each step judged as its test judged it. A
    release or module other than the recorded one is one line in the replay's report."""
    from harness.case_runner import port_twin, run_sequence
    from recording.backend_case import identity_lines, steps_of
    from recording.commands import replay_command

    from .replay import run_options, standalone_lines

    backend, why = backend_of_case(record, request.config)
    if backend is None:
        pytest.fail(f"{path}: {why}", pytrace=False)
    device = request.getfixturevalue("device")
    lines = [f"case {path}: {record['kind']} of {len(record['steps'])} steps on {record['backend']['name']} "
             f"({record.get('nodeid', 'no test id')}; layer mode {record.get('layer_mode', 'plain')})",
             *identity_lines(record, backend),
             f"  replay: {replay_command(path, **run_options(request.config))}",
             *standalone_lines(path, record, request.config)]
    request.node.user_properties.append((REPLAY_KEY, "\n".join(lines)))
    twin = port_twin(device) if record.get("twin") else None
    run_sequence(StepJudge(request), backend, steps_of(record), device, with_inputs=record["with_inputs"],
                 twin=twin, compare=record["compare"], kind=record["kind"],
                 adaptive_verification=record.get("adaptive_verification", False),
                 rejected_drafts=record.get("rejected_drafts", 0), kv_block_stride=record.get("kv_block_stride"),
                 mtp_draft_step=record.get("mtp_draft_step", 0))

