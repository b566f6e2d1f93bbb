"""Upgrade validation: ``--record-baseline DIR`` records every GPU-tier case on the installed
FlashInfer, ``--compare-baseline DIR`` records this run into ``--baseline-out`` and compares it
with DIR (the record format, the comparison and the report: ``recording.baseline``).

The run, on the controlling process:

1. configure: a baseline that is missing, empty, of another schema or with any file that
   cannot be read, an output folder that is not empty, a machine where the GPU tier cannot
   run, and an option of the check given without it (--baseline-out without
   --compare-baseline, --baseline-timing or --baseline-fixtures without either baseline
   option) are usage errors before any test runs;
2. the tests (any ``-n``): each GPU-tier case hands its outputs and ratios to the ``baseline``
   fixture; the record is written with the teardown report, which carries every property the
   test attached; the controller notes every test's outcome with its error line (the tests that
   record nothing included: ``outcomes.json`` in the record folder), the collection errors and
   the ids -k/-m deselected.
   The fixture replays (``tests/test_replay.py``, over ``--baseline-fixtures``, default the
   checked-in ``fixtures/``) record their re-run on the installed FlashInfer the same way
   (``note_fixture_replay``); one judged on its recorded outputs only records nothing and
   tells the controller why;
3. the timing pass (``--baseline-timing=pass``, the default): the recorded GPU-tier cases again, one
   ``pytest -p no:xdist`` process per GPU with ``--baseline-timing-out``, under which the
   tests only hand over repeated medians of their kernel and plan() times; these are merged
   into the records, and only they are judged;
4. the report (compare) or the record's summary, and exit status 1 when the check fails; the
   report's lines are followed by one line per test with a regression, naming its id.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .keys import GROUP, WARNING_KEY

TIMING_CHOICES = ("pass", "off")
DEFAULT_BASELINE_OUT = "baseline-compare"
DESELECTED_KEY = "sparse_mla_deselected"  # workeroutput: node ids a worker deselected
NOT_RERUN_KEY = "sparse_mla_fixture_not_rerun"  # report property: why a fixture replay was not re-run


def pytest_addoption(parser):
    group = parser.getgroup(*GROUP)
    group.addoption(
        "--record-baseline",
        default=None,
        metavar="DIR",
        help="record every GPU-tier case's outputs, error ratios, times and FlashInfer warnings into DIR "
        "(a new or empty folder)",
    )
    group.addoption(
        "--compare-baseline",
        default=None,
        metavar="DIR",
        help="compare the installed FlashInfer against a recorded baseline; report into --baseline-out",
    )
    group.addoption(
        "--baseline-out",
        default=None,
        metavar="DIR",
        help="where --compare-baseline records this run and writes report.md / report.json; a new or empty "
        f"folder (default: {DEFAULT_BASELINE_OUT})",
    )
    group.addoption(
        "--baseline-timing",
        default=None,
        choices=TIMING_CHOICES,
        help="pass (default): after the tests, time the recorded cases again with one process per GPU and "
        "judge those times; off: record and judge no time",
    )
    group.addoption(
        "--baseline-fixtures",
        action="append",
        default=[],
        metavar="PATH",
        help="fixture files or folders the upgrade check replays on the installed FlashInfer and compares with "
        "the old release's record (repeatable; default: the checked-in fixtures/); with --record-baseline or "
        "--compare-baseline, unlike --replay the whole suite still runs",
    )
    group.addoption(
        "--baseline-timing-out",
        default=None,
        metavar="DIR",
        help="(run by the timing pass) the GPU-tier tests only time their case, into DIR",
    )


def baseline_directory(config) -> Path | None:
    """Where this run's case records go, or None when no baseline option is given."""
    if config.getoption("--record-baseline"):
        return Path(config.getoption("--record-baseline"))
    if config.getoption("--compare-baseline"):
        return compare_folder(config) / "current"
    return None


def timing_directory(config) -> Path | None:
    """In a timing-pass process: where its case times go (None otherwise)."""
    out = config.getoption("--baseline-timing-out")
    return Path(out) if out else None


def output_folder(config) -> Path | None:
    """The folder this run writes: the record folder, or --baseline-out when comparing."""
    if config.getoption("--record-baseline"):
        return Path(config.getoption("--record-baseline"))
    if config.getoption("--compare-baseline"):
        return compare_folder(config)
    return None


def compare_folder(config) -> Path:
    """Where --compare-baseline records this run and writes its report (--baseline-out)."""
    return Path(config.getoption("--baseline-out") or DEFAULT_BASELINE_OUT)


def upgrade_check_fixtures(config) -> list[str]:
    """The fixture files and folders the replay tests take under the upgrade check
    (--baseline-fixtures; [] for the replay tests' own default)."""
    return list(config.getoption("--baseline-fixtures") or [])


def fixture_folder_problem(path: str) -> str:
    """Why a --baseline-fixtures path gives no fixture to replay ("" when it gives one)."""
    from recording.fixture import fixture_paths

    if not Path(path).exists():
        return f"{path} does not exist"
    if not fixture_paths([path]):
        return f"{path} holds no fixture (*.safetensors)"
    return ""


def not_empty_folder_problem(folder: Path) -> str:
    """Why ``folder`` cannot take this run's records ("" when it can): records left from another
    run would be taken for this run's."""
    if not folder.exists():
        return ""
    if not folder.is_dir():
        return f"{folder} exists and is not a folder"
    if any(folder.iterdir()):
        return (f"{folder} is not empty: records left there would be taken for this run's; "
                f"remove it (rm -r {folder}) or name a new folder")
    return ""


class BaselineNote:
    """What a GPU-tier case measured, kept for ``--record-baseline`` / ``--compare-baseline``."""

    def __init__(self):
        self.fields: dict = {}
        self.outputs: dict = {}

    def note(self, *, outputs=None, **fields) -> None:
        self.fields.update({k: v for k, v in fields.items() if v is not None})
        self.outputs.update({k: v.detach().cpu() for k, v in (outputs or {}).items()})


BASELINE = pytest.StashKey[BaselineNote]()
OUTCOME = pytest.StashKey["Outcome"]()  # the test's outcome, kept for its teardown report
RUN = pytest.StashKey["BaselineRun"]()  # controller: what this run did
SUMMARY = pytest.StashKey[list]()  # controller: the lines for the terminal
DESELECTED = pytest.StashKey[list]()  # any process: node ids deselected at collection


@pytest.fixture
def baseline(request) -> BaselineNote:
    """``baseline.note(ratios=..., error=..., outputs={...})``; in the timing pass
    ``baseline.note(kernel_us_repeats=[...], plan_us_repeats=[...])``."""
    note = BaselineNote()
    request.node.stash[BASELINE] = note
    return note


def check_fixture_options(config, checking: bool) -> None:
    """--baseline-fixtures belongs to the upgrade check and names fixtures that exist."""
    given = upgrade_check_fixtures(config)
    if not given:
        return
    if not checking:
        raise pytest.UsageError("--baseline-fixtures names the fixtures of the upgrade check: give it with "
                                "--record-baseline or --compare-baseline (to replay fixtures alone: --replay)")
    if config.getoption("--replay"):
        raise pytest.UsageError("--baseline-fixtures and --replay: name the fixtures with one of them (--replay runs "
                                "only the fixtures, --baseline-fixtures runs them with the whole suite)")
    problems = [p for p in map(fixture_folder_problem, given) if p]
    if problems:
        raise pytest.UsageError("--baseline-fixtures: " + "; ".join(problems))


def check_upgrade_options(config, record: bool, compare: bool) -> None:
    """The options that only the upgrade check reads are given with it: --baseline-out with
    --compare-baseline (--record-baseline writes into the folder it names), --baseline-timing
    with either."""
    if config.getoption("--baseline-out") is not None and not compare:
        raise pytest.UsageError(
            "--baseline-out names where --compare-baseline records this run and writes its report: give it with "
            "--compare-baseline" + (" (--record-baseline writes into the folder it names)" if record else ""))
    if config.getoption("--baseline-timing") is not None and not (record or compare):
        raise pytest.UsageError("--baseline-timing decides the timing pass of the upgrade check: give it with "
                                "--record-baseline or --compare-baseline")


def gpu_tier_unavailable_reason() -> str | None:
    """Why the GPU tier cannot run on this machine, as far as the controller can tell without
    CUDA (None: it may run; a FlashInfer that fails to import shows only when tests run)."""
    from harness import availability, gpu_env

    return availability.reason_without_cuda(gpu_env.gpus_without_cuda())


#: The module attribute by which a plugin that stands in for the SM90 machine (FlashInfer and
#: the device replaced, as ``-p tests.simulated_sm90`` does) says what it is: the upgrade check
#: then records and compares there, with no timing pass (no kernel times to take).
STAND_IN_MACHINE_ATTRIBUTE = "SPARSE_MLA_STAND_IN_MACHINE"


def stand_in_machine(config) -> str | None:
    """What stands in for the SM90 machine in this run (a registered plugin's
    :data:`STAND_IN_MACHINE_ATTRIBUTE`), or None on a real one."""
    for plugin in config.pluginmanager.get_plugins():
        described = getattr(plugin, STAND_IN_MACHINE_ATTRIBUTE, None)
        if isinstance(described, str) and described:
            return described
    return None


def pytest_configure(config):
    if hasattr(config, "workerinput"):
        return
    record, compare = config.getoption("--record-baseline"), config.getoption("--compare-baseline")
    if record and compare:
        raise pytest.UsageError("--record-baseline and --compare-baseline: give one of them")
    check_fixture_options(config, bool(record or compare))
    check_upgrade_options(config, bool(record), bool(compare))
    if not (record or compare):
        return
    from recording.baseline import BaselineError, check_baseline

    option = "--record-baseline" if record else "--compare-baseline"
    if compare:
        try:
            check_baseline(Path(compare))
        except BaselineError as e:
            raise pytest.UsageError(f"--compare-baseline: {e}") from None
    folder = output_folder(config)
    problem = not_empty_folder_problem(folder)
    if problem:
        raise pytest.UsageError(f"{'--record-baseline' if record else '--baseline-out'}: {problem}")
    reason = None if stand_in_machine(config) else gpu_tier_unavailable_reason()
    if reason:
        raise pytest.UsageError(f"{option}: the GPU tier cannot run here ({reason}); the upgrade check records and "
                                f"compares GPU-tier cases: run it on an SM90 GPU with FlashInfer")
    baseline_directory(config).mkdir(parents=True, exist_ok=True)
    config.stash[RUN] = BaselineRun()
    config.pluginmanager.register(config.stash[RUN], "sparse_mla_baseline_run")


def pytest_deselected(items):
    for item in items:
        item.config.stash.setdefault(DESELECTED, []).append(item.nodeid)


# --- writing the records (any process) ----------------------------------------------------------


def note_fixture_replay(request, path, report, not_rerun: str | None) -> None:
    """Under --record-baseline / --compare-baseline, what a fixture replay adds to the records.
    Re-run on the installed FlashInfer: a record like a GPU-tier case's, with the new out and
    lse and their error-budget ratios, or the refusal FlashInfer raised as the case's error.
    Judged on its recorded outputs only (``report.rerun`` None, or a re-run that could not
    start): no record, and ``not_rerun`` (why) goes to the controller with the test's report."""
    config = request.config
    if baseline_directory(config) is None or timing_directory(config) is not None:
        return
    rerun = report.rerun
    if rerun is None or (rerun.refused or "").startswith("not re-run"):
        why = not_rerun or (rerun.refused if rerun is not None else "not re-run")
        request.node.user_properties.append((NOT_RERUN_KEY, why))
        return
    note = request.getfixturevalue("baseline")
    fixture = str(Path(path).resolve())
    if rerun.refused:
        note.note(fixture=fixture, error=rerun.refused)
        return
    comparisons = report.kernel.get(rerun.label, ())
    ratios = {f"{c.name.split()[0]}_{k}": getattr(c, k) for c in comparisons for k in ("max_ratio", "mean_ratio")}
    note.note(fixture=fixture, ratios=ratios, outputs={"out": rerun.out, "lse": rerun.lse})


def _write_baseline_record(item, report, outcome) -> None:
    note = item.stash.get(BASELINE, None)
    if note is None:
        return
    from recording.baseline import CaseRecord, write_record, write_timing

    timing = timing_directory(item.config)
    if timing is not None:
        if note.fields.get("kernel_us_repeats") or note.fields.get("plan_us_repeats"):
            write_timing(timing, item.nodeid, note.fields.get("kernel_us_repeats") or [],
                         note.fields.get("plan_us_repeats") or [])
        return
    directory = baseline_directory(item.config)
    if directory is None:
        return
    from recording.environment import flashinfer_version

    warnings = [w for k, v in report.user_properties if k == WARNING_KEY for w in v]
    record = CaseRecord(case=item.nodeid, outcome=outcome.outcome, outcome_line=outcome.line or None,
                        flashinfer=flashinfer_version(), warnings=warnings,
                        **{k: v for k, v in note.fields.items() if k in ("error", "ratios", "fixture")})
    write_record(directory, record, note.outputs)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    phase = phase_outcome(report)
    if phase is not None:
        item.stash[OUTCOME] = merged_outcome(item.stash.get(OUTCOME, None), phase)
    if report.when == "teardown" and OUTCOME in item.stash:
        _write_baseline_record(item, report, item.stash[OUTCOME])


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if hasattr(config, "workerinput"):
        if baseline_directory(config) is not None:
            config.workeroutput[DESELECTED_KEY] = config.stash.get(DESELECTED, [])
        return
    run = config.stash.get(RUN, None)
    if run is None:
        return
    run.stopped = stop_reason(session, exitstatus, len(run.collect_errors))
    ok, lines = run.finish(config)
    config.stash[SUMMARY] = lines
    if not ok and session.exitstatus == 0:
        session.exitstatus = 1


def stop_reason(session, exitstatus, collect_errors: int) -> str:
    """Why the run stopped before running every test it collected ("" when it did not): -x or
    --maxfail, a test that asked the session to stop, or collection errors."""
    if session.shouldfail or session.shouldstop:
        return str(session.shouldfail or session.shouldstop)
    if exitstatus == pytest.ExitCode.INTERRUPTED:
        errors = f"{collect_errors} collection error" + ("" if collect_errors == 1 else "s")
        return f"interrupted by {errors}" if collect_errors else "interrupted"
    return ""


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = config.stash.get(SUMMARY, None)
    if lines:
        terminalreporter.section("upgrade check" if config.getoption("--compare-baseline") else "baseline")
        for line in lines:
            terminalreporter.write_line(line)


# --- the controller: outcomes, selection, timing pass, report -----------------------------------


def skip_reason(report) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr or "")
    return text.removeprefix("Skipped: ")


ERROR_LINE_WIDTH = 300


def error_line(report) -> str:
    """The line that says why a report failed: the exception's message as pytest's short summary
    gives it (its first line), else the first ``E`` line of the traceback, else its first line."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr or "")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    marked = [line[1:].strip() for line in lines if line.startswith("E ")] if crash is None else []
    line = (marked or lines or [""])[0]
    return line if len(line) <= ERROR_LINE_WIDTH else line[: ERROR_LINE_WIDTH - 3] + "..."


def phase_outcome(report):
    """What one phase's report says of its test (``recording.baseline.Outcome``): None for a
    setup or teardown that passed. A failed setup or teardown is ``error``; a test expected to
    fail that passed is ``xpassed`` (strict: pytest fails it with ``[XPASS(strict)] reason``)."""
    from recording.baseline import Outcome

    if report.when != "call" and report.passed:
        return None
    expected_failure = getattr(report, "wasxfail", None)
    if report.skipped:
        return Outcome("xfailed", error_line(report) or expected_failure) if expected_failure is not None \
            else Outcome("skipped", skip_reason(report))
    if report.passed:
        return Outcome("xpassed", f"[XPASS] {expected_failure}") if expected_failure is not None else Outcome("passed")
    line = error_line(report)
    if report.when != "call":
        return Outcome("error", f"at {report.when}: {line}")
    return Outcome("xpassed" if line.startswith("[XPASS(strict)]") else "failed", line)


def merged_outcome(before, phase):
    """A test's outcome after one more phase: a failed teardown makes a test that passed, was
    skipped or xfailed an ``error``; a failure already there stays."""
    if before is None or (phase.outcome == "error" and before.outcome not in ("failed", "error", "xpassed")):
        return phase
    return before


def selected_paths(config) -> tuple[str, ...]:
    """The run's path arguments as rootdir-relative node-id prefixes; () when the user gave none
    (the ini's testpaths: everything is selected)."""
    if config.args_source != pytest.Config.ArgsSource.ARGS:
        return ()
    root, here = Path(config.rootpath).resolve(), Path(config.invocation_params.dir)
    out = []
    for arg in config.args:
        path, sep, rest = str(arg).partition("::")
        try:
            rel = (here / path).resolve().relative_to(root).as_posix()
        except ValueError:
            continue
        out.append(rel + (sep + rest if sep else ""))
    return tuple(out)


def visible_gpus() -> list[str]:
    """The CUDA_VISIBLE_DEVICES value for each GPU this run may use, asked without CUDA."""
    from harness.gpu_env import count_gpus_without_cuda

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip():
        return [d.strip() for d in visible.split(",") if d.strip()]
    return [str(i) for i in range(count_gpus_without_cuda())]


def shard(cases: list[str], parts: int) -> list[list[str]]:
    """Round-robin over ``parts`` processes (the same case on the same GPU in each run)."""
    return [cases[i::parts] for i in range(parts) if cases[i::parts]]


def timing_command(config, cases: list[str], out: Path) -> list[str]:
    return [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q", "-o", "addopts=",
            f"--rootdir={config.rootpath}", f"--impl={config.getoption('--impl')}",
            f"--baseline-timing-out={out.resolve()}", *(f"{config.rootpath}/{case}" for case in cases)]


def run_timing_pass(config, records_dir: Path, cases: list[str]) -> tuple[str, bool]:
    """Time ``cases`` with one process per GPU and merge the times into the records. Returns
    (why times are missing, whether that fails the check): ("", False) when the pass ran."""
    from recording.baseline import TIMING_DIR, merge_timings
    from recording.commands import with_the_project_on_path

    if config.getoption("--baseline-timing") == "off":
        return "--baseline-timing=off", False
    if not cases:
        return "no case ran to a launch", False
    machine = stand_in_machine(config)
    if machine:
        return f"the GPU tier ran on {machine}: no kernel times to take", False
    gpus = visible_gpus()
    if not gpus:
        return "no GPU visible for the timing pass", True
    out = records_dir / TIMING_DIR
    out.mkdir(parents=True, exist_ok=True)
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    if terminal is not None:
        terminal.write_line(f"upgrade check: timing {len(cases)} cases, one process per GPU on {len(gpus)} GPUs "
                            f"(logs: {out})")
    env = with_the_project_on_path({k: v for k, v in os.environ.items()
                                    if not k.startswith(("PYTEST_XDIST", "PYTEST_ADDOPTS"))})
    procs = []
    for gpu, part in zip(gpus, shard(cases, len(gpus)), strict=False):  # fewer parts than GPUs: some idle
        log = open(out / f"gpu{gpu}.log", "w")
        procs.append((gpu, log, subprocess.Popen(timing_command(config, part, out), cwd=config.invocation_params.dir,
                                                 env=dict(env, CUDA_VISIBLE_DEVICES=gpu), stdout=log,
                                                 stderr=subprocess.STDOUT)))
    broken = []
    for gpu, log, proc in procs:
        rc = proc.wait()
        log.close()
        if rc not in (0, 1):  # 1: some test failed, its time may still be there
            broken.append(f"GPU {gpu} exit status {rc} (log: {out / f'gpu{gpu}.log'})")
    timed = merge_timings(records_dir, out)
    if broken:
        return "timing pass failed: " + "; ".join(broken), True
    if timed == 0:
        return f"the timing pass timed none of {len(cases)} cases (logs: {out})", True
    return "", False


class BaselineRun:
    """Registered on the controlling process when recording or comparing: what the run did."""

    def __init__(self):
        self.tests: dict = {}  # node id -> recording.baseline.Outcome, every test that reported
        self.collect_errors: dict[str, str] = {}  # collector node id -> its error line
        self.gpu_skip_reason = ""
        self.deselected: set[str] = set()
        self.not_rerun: dict[str, str] = {}  # fixture replay node id -> why it was not re-run
        self.stopped = ""  # why the run stopped before running every test it collected

    @property
    def outcomes(self) -> dict[str, str]:
        """node id -> ``outcome`` or ``outcome: line`` (``skipped: why``)."""
        return {case: o.text for case, o in self.tests.items()}

    def pytest_runtest_logreport(self, report):
        if report.when == "call":
            for key, why in report.user_properties:
                if key == NOT_RERUN_KEY:
                    self.not_rerun[report.nodeid] = why
        phase = phase_outcome(report)
        if phase is None:
            return
        self.tests[report.nodeid] = merged_outcome(self.tests.get(report.nodeid), phase)
        if phase.outcome == "skipped" and "gpu" in report.keywords and not self.gpu_skip_reason:
            self.gpu_skip_reason = phase.line

    def pytest_collectreport(self, report):
        if report.failed:
            self.collect_errors[report.nodeid] = error_line(report)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error):
        self.deselected.update(getattr(node, "workeroutput", {}).get(DESELECTED_KEY, []))

    def finish(self, config) -> tuple[bool, list[str]]:
        from recording.baseline import BaselineError

        try:
            return self.record_or_compare(config)
        except BaselineError as e:  # a record or outputs file that changed under the run
            return False, [f"FAIL  baseline   {e}"]

    def record_or_compare(self, config) -> tuple[bool, list[str]]:
        from recording.baseline import RunFacts, read_records, timed_cases, write_outcomes
        from recording.environment import flashinfer_version

        directory = baseline_directory(config)
        write_outcomes(directory, self.tests, flashinfer_version(), vllm=vllm_judged(config),
                       machine=machine_of_run(config))
        records = read_records(directory)
        timing, timing_failed = run_timing_pass(config, directory, timed_cases(records)) if records else ("", False)
        records = read_records(directory)  # with the timing pass's times
        if config.getoption("--record-baseline"):
            return self.record_summary(directory, records, timing, timing_failed)
        run = RunFacts(deselected=frozenset(self.deselected | set(config.stash.get(DESELECTED, []))),
                       selected_paths=selected_paths(config), outcomes=self.outcomes,
                       gpu_skip_reason=self.gpu_skip_reason, timing=timing, timing_failed=timing_failed,
                       not_rerun=self.not_rerun, collect_errors=self.collect_errors, stopped=self.stopped)
        return self.compare(config, directory, run)

    def record_summary(self, directory: Path, records: dict, timing: str,
                       timing_failed: bool) -> tuple[bool, list[str]]:
        reasons = sorted(set(self.not_rerun.values()))
        not_rerun = [f"note  fixtures: {len(self.not_rerun)} not re-run ({'; '.join(reasons)}): nothing recorded "
                     "of them"] if self.not_rerun else []
        if not records:
            reason = self.gpu_skip_reason or "no GPU-tier case recorded anything"
            return False, [f"FAIL  baseline {directory}: nothing recorded: the GPU tier did not run ({reason})",
                           *not_rerun]
        timed = sum(1 for r in records.values() if r.kernel_us_repeats or r.plan_us_repeats)
        fixtures = sum(1 for r in records.values() if r.fixture)
        times = f"{timed} timed by the timing pass" if not timing else f"times not taken: {timing}"
        status = "FAIL" if timing_failed else "PASS"
        return not timing_failed, [f"{status}  baseline {directory}: {len(self.tests)} test outcomes, "
                                   f"{len(records) - fixtures} cases and {fixtures} fixture re-runs recorded, {times}",
                                   *not_rerun]

    def compare(self, config, current: Path, run) -> tuple[bool, list[str]]:
        from recording.baseline import (
            compare_directories,
            compared_labels,
            read_run_code,
            regression_lines,
            summary_lines,
            write_report,
        )

        base = Path(config.getoption("--compare-baseline"))
        before_v, after_v = compared_labels(read_run_code(base), read_run_code(current))
        comparisons = compare_directories(base, current, run)
        ok = write_report(comparisons, current.parent, before_v, after_v, run)
        return ok, (summary_lines(comparisons, run, before_v, after_v) + regression_lines(comparisons)
                    + [f"report: {current.parent / 'report.md'}"])


def vllm_judged(config) -> str | None:
    """The vLLM release ``--vllm`` put under test, the sha256 of its SM90 module and the files
    that differ from the release's (None without ``--vllm``): two runs on the same release whose
    code differs are told apart in the report."""
    from backends.registry import sm90_module_sha256
    from pytest_sparse_mla.vllm import VLLM_SOURCE

    source = config.stash.get(VLLM_SOURCE, None)
    if source is None:
        return None
    modified = f", modified: {', '.join(source.modified)}" if source.modified else ""
    return f"{source.version} (SM90 module sha256 {sm90_module_sha256(source)[:12]}{modified})"


def machine_of_run(config) -> str | None:
    """What stood in for the SM90 machine (:func:`stand_in_machine`), or the GPUs the driver
    names (CUDA left uninitialised)."""
    from harness import gpu_env

    return stand_in_machine(config) or ", ".join(name for name, _ in gpu_env.gpus_without_cuda()) or None
