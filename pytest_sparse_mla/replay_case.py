"""The replay of one written case, dispatched by its kind, for ``tests/test_replay.py``: a
sequence (``recording.sequence``) through the implementation under test with its state carried; a
backend's case (``recording.backend_case``) through the backend the run names; a fixture or a
recipe (``recording.fixture``, ``recording.recipe``) re-run on the installed FlashInfer where an
SM90 GPU runs it, its host stages re-run through the implementation under test elsewhere, and
judged by ``recording.replay``. What each kind needs of the run (the implementation, the device,
the upgrade check's notes, the regime log) comes from the test's request."""

from __future__ import annotations

import dataclasses
import importlib
import time

import pytest

from harness.findings import RegimeCPlannedAsPrefix
from pytest_sparse_mla.baselines import note_fixture_replay
from pytest_sparse_mla.keys import REPLAY_KEY
from pytest_sparse_mla.replay import rerun_unavailable_reason, run_options
from recording.backend_case import is_backend_case
from recording.commands import replay_command
from recording.fixture import FixtureError, load_fixture
from recording.heatmap import write_heatmaps
from recording.recipe import is_recipe, load_recipe, rebuild_fixture
from recording.replay import replay
from recording.sequence import is_sequence


def loaded_or_failed(load, *args):
    """``load(*args)``; a case file it refuses (``FixtureError``) fails the test with the
    message alone, raised outside the handler so that the error it came from is not chained."""
    try:
        return load(*args)
    except FixtureError as exc:
        problem = str(exc)
    pytest.fail(problem, pytrace=False)


def rerun_on_installed(request, fx):
    """(the fixture re-run on the installed FlashInfer, None) or, where no kernel re-runs it,
    (the host stages re-run through the implementation under test, why) where there is no SM90
    GPU with FlashInfer, and (None, why) under --replay-recorded-only or with an
    implementation without an attention state for a pipeline fixture."""
    why = rerun_unavailable_reason(request.config)
    if why == "--replay-recorded-only":
        return None, why
    if why:  # no kernel here: the host stages still run through the implementation under test
        from pytest_sparse_mla.impl import IMPL_SPEC
        from recording.restage import restage_fixture

        return restage_fixture(fx, request.getfixturevalue("impl"), request.config.stash.get(IMPL_SPEC, None),
                               request.getfixturevalue("device")), why
    impl = request.getfixturevalue("impl")

    from harness.port.launch import DEVICE
    from pytest_sparse_mla.impl import IMPL_SPEC
    from recording.rerun import rerun_fixture

    spec = request.config.stash.get(IMPL_SPEC, None)
    rerun = rerun_fixture(fx, impl, spec, DEVICE)
    if refused_as_strided_plans_are(fx, rerun):
        from recording.restage import restage_fixture

        why = (f"flashinfer {rerun.version} refuses a strided plan of rows shorter than W, as a release that checks "
               "page counts does (docs/findings.md#strided-layout-rejected-at-plan), and no recorded release did: "
               "the host stages re-run instead")
        return restage_fixture(fx, impl, spec, request.getfixturevalue("device")), why
    return rerun, None


def refused_as_strided_plans_are(fx, rerun) -> bool:
    """A fixture of the strided layout recorded where no release refused it (on the CPU tier, say),
    whose re-run the installed FlashInfer refuses with the page-count check: its kernel cannot run
    here, but its plan can still be judged."""
    from backends.registry import PAGE_COUNT_REFUSAL as PLAN_REFUSAL
    from recording.replay import first_line

    if not rerun.refused or fx.meta.get("layout") != "strided" or PLAN_REFUSAL not in rerun.refused:
        return False
    return not any(first_line(r) == first_line(rerun.refused) for r in (fx.meta.get("refused") or {}).values())


def load_case(path, request):
    """The fixture in ``path``, or the case a recipe rebuilds through the implementation under
    test (only the rows it names, where its batch is too large to build whole and no kernel
    re-runs it here). A recipe whose stages once killed their process runs them apart first
    (harness.pipeline.run_step_in_child); the recipe of a scale case that names no failing rows
    is first checked whole where a kernel runs, as its test did, in a child process
    (harness.port.scale); then the rows are replayed."""
    if not is_recipe(path):
        return load_fixture(path)
    recipe = load_recipe(path)
    from pytest_sparse_mla.impl import IMPL_SPEC

    impl_spec, device = request.config.stash[IMPL_SPEC], request.getfixturevalue("device")
    kernel_here = rerun_unavailable_reason(request.config) is None
    if recipe.get("crashed_at"):  # its stages killed a process once: run them apart first
        from harness.pipeline import run_step_in_child
        from harness.scenario import spec_from_dict

        result = run_step_in_child(impl_spec, spec_from_dict(recipe["spec"]), recipe["seed"], recipe["layout"], device)
        if result["outcome"] != "ok":
            pytest.fail(f"{path}: {result['detail']}", pytrace=False)
    elif recipe.get("scale_case") and kernel_here and not recipe.get("failing_rows"):
        from harness.port.scale import case_by_id, run_case_in_child

        result = run_case_in_child(case_by_id(recipe["scale_case"]), impl_spec, recipe["seed"])
        if result["outcome"] != "right":
            pytest.fail(f"{path}: {recipe['scale_case']}: {result['outcome']} at stage {result.get('stage')}: "
                        f"{result.get('detail', '')}", pytrace=False)
    whole = kernel_here and not recipe.get("scale_case")
    return rebuild_fixture(path, recipe, request.getfixturevalue("impl"), device, whole=whole)


def replay_sequence(path, request, regime_log) -> None:
    """A sequence (recording.sequence) run again through the implementation under test with the
    state carried as its test carried it: on an SM90 GPU with FlashInfer an attention-state
    sequence through one attention state, elsewhere the host stages with their buffers carried.
    It fails where a step fails, naming the step."""
    from harness.port.sequence import first_failure, run_recorded_sequence
    from recording.sequence import load_sequence

    sequence, recipe = loaded_or_failed(load_sequence, path)
    features = None
    how = "its host stages, buffers carried from step to step"
    if sequence.kind == "attention-state" and rerun_unavailable_reason(request.config) is None:
        from backends.registry import flashinfer_features

        features = flashinfer_features()
        how = "one attention state on the installed FlashInfer"
    elif sequence.kind == "attention-state":
        how += f" (the attention state is not re-run here: {rerun_unavailable_reason(request.config)})"
    results = run_recorded_sequence(request.getfixturevalue("impl"), sequence, request.getfixturevalue("device"),
                                    features)
    for scenario in sequence.scenarios():
        regime_log.record(scenario.row_regime[: scenario.planned_rows])
    failing = first_failure(results)
    lines = [f"sequence {path}: {sequence.describe()}, run again through {how}",
             f"  recorded: failed at step {recipe['failing_step']} ({recipe['why']})"]
    if recipe.get("impl"):
        lines.append(f"  recorded through --impl {recipe['impl']} ({recipe.get('nodeid', 'no test id')})")
    lines += [f"  step {r.index} shows a known finding, not failed: {f}" for r in results for f in r.findings]
    lines.append(f"  replay: {replay_command(path, **run_options(request.config))}")
    request.node.user_properties.append((REPLAY_KEY, "\n".join(lines)))
    if failing is not None:
        pytest.fail(f"step {failing.index} of the sequence fails:\n" + "\n".join(failing.problems[:8]) + "\n"
                    + "\n".join(lines), pytrace=False)


def replay_case_through_backend(path, request) -> None:
    """A backend's case (recording.backend_case) run again through the backend this run names;
    a case written on a CPU run with a stand-in FlashInfer runs on the same stand-in where no
    GPU tier runs here."""
    from pytest_sparse_mla.judge import replay_backend_case
    from recording.backend_case import load_backend_case

    record = loaded_or_failed(load_backend_case, path)
    if rerun_unavailable_reason(request.config) is not None:
        install_recorded_stand_in(record.get("flashinfer", ""), request.getfixturevalue("monkeypatch"))
    replay_backend_case(path, request, record)


def install_recorded_stand_in(flashinfer: str, monkeypatch) -> None:
    """Where a case was written on a stand-in FlashInfer (its ``flashinfer`` field names the
    stand-in's wrapper class as ``module:Class``, :func:`harness.case_runner.flashinfer_in_use`),
    install the same stand-in through its module's ``install(monkeypatch, wrapper_cls)``; a case
    written on FlashInfer itself (``flashinfer X.Y.Z``) or on none installs nothing. A stand-in
    that cannot be loaded fails the replay in one line naming it."""
    module_name, sep, class_name = flashinfer.partition(":")
    if not sep:
        return
    try:
        module = importlib.import_module(module_name)
        wrapper_cls, install = getattr(module, class_name), module.install
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"the case was written on the stand-in FlashInfer {flashinfer}, which cannot be loaded here: "
                    f"{exc}", pytrace=False)
    install(monkeypatch, wrapper_cls)


class StageClock:
    """Seconds each stage of one fixture's replay took, for its diagnostics."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def timed(self, stage: str, call, *args, **kwargs):
        started = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - started

    def line(self) -> str:
        return "seconds: " + ", ".join(f"{stage} {s:.2f}" for stage, s in self.seconds.items())


def replay_written_case(fixture_path, request, regime_log) -> None:
    """Replay one written case by its kind: a sequence, a backend's case, or a fixture or recipe
    (judged by ``recording.replay``); it fails, or meets the finding its test expected, as the
    case's test did."""
    if is_sequence(fixture_path):
        replay_sequence(fixture_path, request, regime_log)
        return
    if is_backend_case(fixture_path):
        replay_case_through_backend(fixture_path, request)
        return
    clock = StageClock()
    fx = loaded_or_failed(clock.timed, "load", load_case, fixture_path, request)
    rerun, not_rerun = clock.timed("re-run", rerun_on_installed, request, fx)
    report = clock.timed("judge", replay, fx, rerun=rerun)
    # A host-stage re-run ran no kernel: the upgrade check records it as not re-run.
    note_fixture_replay(
        request, fixture_path, dataclasses.replace(report, rerun=None) if not_rerun else report, not_rerun
    )
    regime_log.record(report.regimes, focus=fx.meta.get("focus") or None)
    text = report.render(replay_command(fixture_path, **run_options(request.config)) + " -p no:xdist -rA")
    failures = report.failures()  # the verdict, decided before any picture is drawn
    if request.config.getoption("--replay") and (failures or request.config.getoption("--replay-heatmaps")):
        text = "\n".join([text, *clock.timed("heatmaps", write_heatmaps, report)])
    text += "\n  " + clock.line()
    request.node.user_properties.append((REPLAY_KEY, text))
    mismatches = (
        report.rerun_plan_mismatch_rows if report.rerun and report.rerun.plan is not None else report.plan_mismatch_rows
    )
    if fx.meta.get("expect_finding") or failures:
        regime_log.blame(report.regimes[r] for r in mismatches if r < len(report.regimes))
    if failures:
        pytest.fail("; ".join(failures) + "\n" + text, pytrace=False)
    finding = report.known_finding()
    if finding:  # the test that wrote the case expected it: the finding, named, not a failure of its own
        request.applymarker(pytest.mark.xfail(raises=RegimeCPlannedAsPrefix, strict=True, reason=finding))
        raise RegimeCPlannedAsPrefix(f"{finding}\n{text}")
