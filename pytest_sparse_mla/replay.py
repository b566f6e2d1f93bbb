"""Recorded fixtures: ``--replay`` runs only the replay tests (and prints each fixture's
diagnostics at the end); on an SM90 GPU with FlashInfer each fixture is re-run on the installed
FlashInfer unless ``--replay-recorded-only``. ``--dump-failures DIR`` writes a fixture for every
failing differential case: the case the shared helpers last noted (recording.case_log), or
what a test armed on the ``failure_dump`` fixture, shrunk on the implementation under test and
written with its standalone reproducer, or as a recipe where it only fails at scale
(recording.dump); the failure message ends with the command that replays it, and the run with
what was written and the seconds writing and shrinking took (apart from the tests' own time).
Nothing is built or written for a passing test."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import time
from pathlib import Path

import pytest

from mla_constants import DEFAULT_IMPL_SPEC
from recording.commands import found_through_pythonpath, replay_command

from .keys import DUMP_KEY, GROUP, REPLAY_KEY

REPLAYS = pytest.StashKey[list]()  # the diagnostics texts the replay tests attached


def pytest_addoption(parser):
    group = parser.getgroup(*GROUP)
    group.addoption(
        "--replay",
        action="append",
        default=[],
        metavar="PATH",
        help="replay recorded fixtures (files or folders; repeatable) instead of running the suite",
    )
    group.addoption(
        "--dump-failures",
        default=None,
        metavar="DIR",
        help="write a fixture for every failing differential case into DIR",
    )
    group.addoption(
        "--replay-heatmaps",
        action="store_true",
        default=False,
        help="with --replay, write the error heatmaps of every fixture (default: only of those whose replay fails)",
    )
    group.addoption(
        "--replay-recorded-only",
        action="store_true",
        default=False,
        help="judge only the outputs recorded in each fixture, even where an SM90 GPU with FlashInfer could re-run it",
    )


def rerun_unavailable_reason(config) -> str | None:
    """Why the replay tests judge only the recorded outputs, or None when they re-run each
    fixture on the installed FlashInfer. Touches CUDA: call it inside a test."""
    if config.getoption("--replay-recorded-only"):
        return "--replay-recorded-only"
    from harness.availability import sm90_flashinfer_unavailable_reason

    return sm90_flashinfer_unavailable_reason()


#: The checked-in fixtures: what a run without ``--replay`` replays (``tests/test_replay.py``).
DEFAULT_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def run_options(config) -> dict:
    """What the run's cases ran with: ``impl_spec`` (``--impl``), ``vllm`` (``--vllm``, or None)
    and ``backends``, the users' own backends (``--backend module:factory``)."""
    from backends.registry import is_factory_spec

    from .impl import IMPL_SPEC

    impl_spec = config.stash.get(IMPL_SPEC, None)
    backends = tuple(s for s in config.getoption("--backend", None) or () if is_factory_spec(s))
    own = [spec for spec in (impl_spec, *backends) if spec and spec != DEFAULT_IMPL_SPEC]
    return {"impl_spec": impl_spec, "vllm": config.getoption("--vllm", None), "backends": backends,
            "search_path": found_through_pythonpath(own)}


class ReplayCollector:
    """Controller-side collector of the replay diagnostics the reports carry."""

    def __init__(self, config, summary_lines: FullSummaryLines | None = None):
        self.config = config
        self.dumps: list[dict] = []
        self.summary_lines = summary_lines

    def pytest_runtest_logreport(self, report):
        if report.when == "call":
            self.config.stash.setdefault(REPLAYS, []).extend(v for k, v in report.user_properties if k == REPLAY_KEY)
            self.dumps.extend({"nodeid": report.nodeid, **v} for k, v in report.user_properties if k == DUMP_KEY)

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter):
        """Where a replay test failed, pytest's short summary (printed right after this hook)
        gives each FAILED line its reason whole, as it does on CI: the first line of a replay's
        failure is why it failed (a bad file's one FixtureError line, or the verdict), and the
        test id of a fixture's path leaves no room for it on an 80-column line otherwise."""
        failed = terminalreporter.stats.get("failed", [])
        if self.summary_lines is not None and any(f"{REPLAY_TEST_FILE}::" in getattr(r, "nodeid", "") for r in failed):
            self.summary_lines.verbose_before = self.config.option.verbose
            self.config.option.verbose = max(self.config.option.verbose, 2)


class FullSummaryLines:
    """Puts ``--verbose`` back once the short summary is printed (see
    :meth:`ReplayCollector.pytest_terminal_summary`)."""

    def __init__(self, config):
        self.config = config
        self.verbose_before: int | None = None

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_terminal_summary(self):
        try:
            return (yield)
        finally:
            if self.verbose_before is not None:
                self.config.option.verbose = self.verbose_before
                self.verbose_before = None


#: Why a failing test leaves nothing to write, where it noted no case.
NO_CASE_NOTED = ("it noted no differential case (its stages ran outside the shared helpers: "
                 "harness.pipeline.prepare_step, the compare helpers of harness.port.launch, recording.replay.replay)")
#: Why a failing Hypothesis test leaves nothing to write, where its failing example noted no case.
NO_CASE_IN_EXAMPLE = "its failing example noted no differential case"


def dump_summary_lines(directory: str, dumps: list[dict]) -> list[str]:
    """What ``--dump-failures`` wrote: files, bytes, and the seconds writing and shrinking took
    (spent after each failing test's own time), the longest named."""
    if not dumps:
        return [f"--dump-failures={directory}: no failing case written"]
    written = [d for d in dumps if d.get("path")]
    seconds = sum(d["seconds"] for d in dumps)
    longest = max(dumps, key=lambda d: d["seconds"])
    lines = [f"--dump-failures={directory}: {len(written)} failing cases written "
             f"({sum(d.get('bytes', 0) for d in written) / 1e6:.1f} MB); writing and shrinking took {seconds:.1f} s "
             f"after the tests' own time (longest: {longest['nodeid'].split('::', 1)[-1]}, {longest['seconds']:.1f} s)"]
    unwritten = sum(1 for d in dumps if d.get("problem"))
    if unwritten:
        lines.append(f"  {unwritten} failing cases could not be written (their failure messages say why)")
    for d in dumps:
        if not d.get("path") and not d.get("problem"):
            lines.append(f"  nothing written for {d['nodeid'].split('::', 1)[-1]}: {d.get('nothing') or NO_CASE_NOTED}")
    return lines


def replay_path_problem(path: str) -> str:
    """Why a --replay path gives nothing to replay ("" when it gives a fixture)."""
    from pathlib import Path

    from recording.fixture import fixture_paths

    if not Path(path).exists():
        return f"--replay={path}: no such file or folder"
    if not fixture_paths([path]):
        return (
            f"--replay={path}: no fixture (*.safetensors, *.recipe.json, *.sequence.json, *.case.json) under it; "
            "an empty replay would pass and check nothing"
        )
    return ""


def dump_folder_problem(path: str) -> str | None:
    """Why ``--dump-failures`` cannot write into ``path``, or None. A missing folder is made
    and removed again (a run without failures leaves nothing behind)."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"--dump-failures={path}: exists and is not a folder"
    missing = []
    folder = os.path.abspath(path)
    while not os.path.exists(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        return f"--dump-failures={path}: cannot make the folder: {exc.strerror or exc}"
    finally:
        for made in missing:  # deepest first
            if os.path.isdir(made):
                os.rmdir(made)
    if not missing and not os.access(path, os.W_OK | os.X_OK):
        return f"--dump-failures={path}: the folder is not writable"
    return None


@pytest.hookimpl(trylast=True)  # after the checks of conflicting options
def pytest_configure(config):
    for path in config.getoption("--replay"):
        problem = replay_path_problem(path)
        if problem:
            raise pytest.UsageError(problem)
    dump = config.getoption("--dump-failures")
    if dump and not hasattr(config, "workerinput"):
        problem = dump_folder_problem(dump)
        if problem:
            raise pytest.UsageError(problem)
    if not hasattr(config, "workerinput"):
        summary_lines = FullSummaryLines(config)
        config.pluginmanager.register(summary_lines)
        config.pluginmanager.register(ReplayCollector(config, summary_lines))


REPLAY_TEST_FILE = "test_replay.py"


def pytest_ignore_collect(collection_path, config):
    """With ``--replay`` no other test module is even imported: collection stays fast and the
    workers of ``-n`` share out the fixtures alone."""
    if config.getoption("--replay") and collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return collection_path.name != REPLAY_TEST_FILE or None
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """With ``--replay`` only the replay tests run (before the GPU gating sees the items)."""
    if not config.getoption("--replay"):
        return
    keep = [item for item in items if item.get_closest_marker("replay")]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep


class FailureDump:
    """Where a failing test's case goes: what the test armed (a function building its
    fixture), else the case the shared helpers last noted during the test."""

    def __init__(self, directory: str | None, node):
        self.directory = directory
        self.node = node
        self._build = None
        self.meta: dict = {}
        self.log = None  # recording.case_log.CaseLog of the running test
        self.failed_examples: list = []  # (exception, CaseLog, the example) of each Hypothesis example that raised
        self.examples: list = []  # the failing examples to write, first choice first: (drawn text, CaseLog)

    def take_failing_example(self, exc: BaseException) -> None:
        """Of a Hypothesis test, the failing examples to write: first the one whose exception
        the test raised (Hypothesis raises its shrunk or simplest failing example's own; several
        failures come as a group of them), as Hypothesis reports it; then the test's other
        failing examples, the last one first, for where the reported one's failure is not one a
        replay judges (its rows are not planned, say)."""
        raised = [id(e) for e in exception_and_members(exc)]
        reported = [example for example in self.failed_examples if id(example[0]) in raised][-1:]
        others = [example for example in reversed(self.failed_examples)
                  if not any(example is r for r in reported)][:MAX_OTHER_EXAMPLES]
        self.examples = [(reported_text(failed, text), log) for failed, log, text in reported]
        self.examples += [(f"{OTHER_EXAMPLE}: {text}", log) for _, log, text in others]

    def arm(self, build) -> None:
        self._build = build

    def note(self, **meta) -> None:
        """Metadata the written fixture or recipe carries (a scale case's id, say)."""
        self.meta.update(meta)

    def build(self):
        if self._build is not None:
            return self._build()
        return None if self.log is None or self.log.empty else self.log.build()

    def _safe_name(self) -> str:
        return "".join(c if c.isalnum() or c in "-_." else "_" for c in self.node.nodeid.split("::", 1)[-1])

    def _run_meta(self) -> dict:
        """The run's ``impl`` and ``vllm``, as the written case records them."""
        options = run_options(self.node.config)
        meta = {"impl": options["impl_spec"], "vllm": options["vllm"]}
        return {k: v for k, v in meta.items() if v}

    def _recipe_meta(self, **extra) -> dict:
        return {"name": self._safe_name(), "nodeid": self.node.nodeid, **self.meta, **extra, **self._run_meta()}

    def dump(self) -> str | None:
        """Write the failing case (of a Hypothesis test: the first of its failing examples that
        can be written) and return its path; :class:`recording.dump.NothingToWrite` where none can."""
        if not self.directory:
            return None
        if not self.failed_examples:
            return self._dump_case()
        from recording.dump import NothingToWrite

        reasons = []
        meta = dict(self.meta)
        for drawn, log in self.examples:
            self.log, self.meta = log, dict(meta, drawn=drawn[:4000])
            try:
                return self._dump_case()
            except NothingToWrite as exc:
                reasons.append(str(exc))
        self.meta = meta
        raise NothingToWrite(reasons[0] if reasons else NO_CASE_IN_EXAMPLE)

    def _dump_case(self) -> str | None:
        if self._build is None and self.log is not None and self.log.backend_case is not None:
            return self._dump_backend_case(self.log.backend_case)
        sequence = self.log.sequence if self._build is None and self.log is not None else None
        # A sequence that failed at its first step is written as a sequence too where that step
        # noted no case of its own (a host-stage sequence checks its steps itself).
        if sequence is not None and (len(sequence["steps"]) > 1 or (sequence["steps"] and self.log.step is None)):
            path = self._dump_sequence(sequence)
            if path is not None:
                return path
            self.meta.setdefault("why", "its sequence of steps, run again, did not fail: the last step it checked "
                                        "is written alone")
        if self._build is None and self.log is not None and self.log.crash is not None:
            from recording.dump import write_crash

            path = write_crash(self.directory, self._safe_name(), self.log.crash, **self._recipe_meta())
            if path is None:
                from recording.dump import NothingToWrite

                raise NothingToWrite("the step that killed its process is not rebuilt by its spec and seed (the "
                                     "test changed the scenario it was given)")
            return str(path)
        step = self.log.step if self.log is not None and self.log.fixture is None else None
        fixture = None
        if step is not None:  # the step armed builders build from too
            from recording import step_size
            from recording.dump import WHY_TOO_LARGE, fixture_of_failing_rows, write_step_recipe
            from recording.step_size import build_bytes

            if build_bytes(step) > step_size.MAX_BUILD_BYTES:
                fixture = fixture_of_failing_rows(step, **self.meta)
                if fixture is None:
                    meta = self._recipe_meta(too_large_to_build=build_bytes(step), why=WHY_TOO_LARGE)
                    path = write_step_recipe(self.directory, self._safe_name(), step, **meta)
                    if path is not None:
                        return str(path)
        fixture = self.build() if fixture is None else fixture
        if fixture is None:
            from recording.dump import NothingToWrite

            raise NothingToWrite(NO_CASE_IN_EXAMPLE if self.failed_examples else NO_CASE_NOTED)
        for key, value in self.meta.items():
            fixture.meta.setdefault(key, value)
        from fast.impl import DEFAULT_IMPL_SPEC, load_impl
        from recording.dump import write_failure
        from recording.environment import runtime_environment

        from .impl import IMPL_SPEC, run_device

        safe = self._safe_name()
        if not fixture.meta.get("name"):
            fixture.meta["name"] = safe
        fixture.meta.setdefault("nodeid", self.node.nodeid)
        fixture.meta.setdefault("source", "pipeline")
        impl_spec = self.node.config.stash.get(IMPL_SPEC, None)
        for key, value in self._run_meta().items():
            fixture.meta.setdefault(key, value)
        if fixture.outputs and "environment" not in fixture.meta:
            env = runtime_environment()
            fixture.meta["environment"] = {version: env for version in fixture.outputs}
        impl = load_impl(impl_spec or DEFAULT_IMPL_SPEC)  # loaded and checked at start-up already
        return str(write_failure(self.directory, safe, fixture, impl, step, device=run_device(self.node.config)))


    def _dump_backend_case(self, case: dict) -> str:
        """The case a backend ran (``harness.case_runner.run_sequence``): its steps so far, as specs and
        seeds, with the backend's release and module digest (recording.backend_case)."""
        from recording.backend_case import OPTIONAL_FIELDS, write_backend_case

        meta = {k: v for k, v in self._recipe_meta().items() if k in OPTIONAL_FIELDS and isinstance(v, str)}
        return str(write_backend_case(self.directory, self._safe_name(), case, **meta))

    def _dump_sequence(self, note: dict) -> str | None:
        """The noted sequence, shrunk over its steps and written (recording.sequence); None where
        running it again does not fail."""
        from fast.impl import DEFAULT_IMPL_SPEC, load_impl
        from recording.sequence import write_failing_sequence

        from .impl import IMPL_SPEC, run_device

        impl = load_impl(self.node.config.stash.get(IMPL_SPEC, None) or DEFAULT_IMPL_SPEC)
        features = None
        if note["kind"] == "attention-state":
            from backends.registry import flashinfer_features

            features = flashinfer_features()
        path = write_failing_sequence(self.directory, self._safe_name(), note, impl, run_device(self.node.config),
                                      features, **{k: v for k, v in self._recipe_meta().items() if k != "name"})
        return None if path is None else str(path)


DUMP = pytest.StashKey[FailureDump]()


def _failure_dump_of(item) -> FailureDump:
    dump = item.stash.get(DUMP, None)
    if dump is None:
        dump = item.stash[DUMP] = FailureDump(item.config.getoption("--dump-failures"), item)
    return dump


@pytest.fixture
def failure_dump(request) -> FailureDump:
    """Arm it with a function that builds the case's fixture (without arming, the case the
    shared helpers noted is written)."""
    return _failure_dump_of(request.node)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    if not item.config.getoption("--dump-failures"):
        yield
        return
    from recording.case_log import logging_cases

    dump = _failure_dump_of(item)
    with logging_cases() as log, examples_logged_apart(item.obj, dump.failed_examples):
        dump.log = log
        yield


#: Failing examples tried after the reported one, at most.
MAX_OTHER_EXAMPLES = 8
#: How the written case names a failing example other than the one Hypothesis reports.
OTHER_EXAMPLE = ("another failing example of the test (the one Hypothesis reports fails only where a replay does "
                 "not judge, or noted no case)")


#: How Hypothesis's note on the exception begins (older releases say "Falsifying", newer "Failing").
REPORTED_EXAMPLE = ("Falsifying example: ", "Falsifying explicit example: ", "Failing test case: ",
                    "Failing explicit example: ")


def reported_text(exc: BaseException, example: str) -> str:
    """The example as Hypothesis reports it (its note on the exception), else as it was called."""
    notes = [note for note in getattr(exc, "__notes__", ()) if note.startswith(REPORTED_EXAMPLE)]
    return notes[0] if notes else example


def exception_and_members(exc: BaseException) -> list[BaseException]:
    """``exc`` and, for an exception group, every exception in it (nested groups too)."""
    found = [exc]
    for member in getattr(exc, "exceptions", ()):
        found += exception_and_members(member)
    return found


@contextlib.contextmanager
def examples_logged_apart(test, failed: list):
    """For a Hypothesis test, each example it runs notes its cases in a log of its own; an
    example that raises appends ``(exception, its log, the call)`` to ``failed``. Hypothesis runs every
    example through ``test.hypothesis.inner_test``, which is wrapped for the block."""
    hypothesis = getattr(test, "hypothesis", None)
    inner = getattr(hypothesis, "inner_test", None)
    if inner is None:
        yield
        return
    from recording.case_log import logging_cases

    @functools.wraps(inner)
    def example(*args, **kwargs):
        with logging_cases() as log:
            try:
                return inner(*args, **kwargs)
            except BaseException as exc:
                called = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
                failed.append((exc, log, f"{inner.__name__}({called})"))
                raise

    hypothesis.inner_test = example
    try:
        yield
    finally:
        hypothesis.inner_test = inner


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    dump = item.stash.get(DUMP, None)
    if dump is None or report.when != "call" or not report.failed or hasattr(report, "wasxfail"):
        return
    from recording.dump import NothingToWrite

    started = time.perf_counter()
    path = problem = nothing = None
    try:
        if call.excinfo is not None:
            dump.take_failing_example(call.excinfo.value)
        path = dump.dump()
    except NothingToWrite as exc:
        nothing = str(exc)
    except Exception as exc:  # a broken dump must not hide the failure itself
        problem = f"could not write the failing case under --dump-failures: {exc!r}"
    seconds = time.perf_counter() - started
    size = os.path.getsize(path) if path and os.path.exists(path) else 0
    report.user_properties.append((DUMP_KEY, {"path": path, "problem": problem, "nothing": nothing, "bytes": size,
                                              "seconds": round(seconds, 2)}))
    if path:
        _append_to_failure(report, "\n".join([
            f"failing case written to {path} ({size / 1e3:.0f} KB, written and shrunk in {seconds:.1f} s)",
            f"replay: {replay_command(path, **run_options(item.config))}",
            *(line.strip() for line in standalone_lines_of(path, item.config))]))
    elif problem:
        _append_to_failure(report, problem)
    elif nothing:
        _append_to_failure(report, f"nothing written under --dump-failures: {nothing}")


def standalone_lines_of(path, config) -> list[str]:
    """The ``standalone:`` line of a written case of vLLM's SM90 backend (none for any other case)."""
    from recording.backend_case import is_backend_case

    if not is_backend_case(path):
        return []
    with open(path) as file:
        return standalone_lines(path, json.load(file), config)


def standalone_lines(path, record: dict, config) -> list[str]:
    """For a case of vLLM's SM90 backend, the line with the commands that write its standalone
    reproducer (``recording.vllm_repro``) and run it on the release this run loaded."""
    from backends.registry import family_and_release
    from recording.commands import standalone_command

    from .vllm import VLLM_SOURCE

    backend = record["backend"]
    if family_and_release(backend["name"])[0] != "vllm" or backend.get("kernel") != "fa3":
        return []
    root = getattr(config.stash.get(VLLM_SOURCE, None), "root", None)
    return [f"  standalone: {standalone_command(path, root)}"]



def _append_to_failure(report, text: str) -> None:
    """End the failure message with ``text`` (a section of the long report where it has them)."""
    longrepr = report.longrepr
    if hasattr(longrepr, "addsection"):
        longrepr.addsection("failing case", text)
    else:
        report.longrepr = f"{longrepr}\n{text}"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput"):
        return
    collector = next((p for p in config.pluginmanager.get_plugins() if isinstance(p, ReplayCollector)), None)
    if config.getoption("--dump-failures") and collector is not None:
        for line in dump_summary_lines(config.getoption("--dump-failures"), collector.dumps):
            terminalreporter.write_line(line)
    if config.getoption("--replay"):
        texts = config.stash.get(REPLAYS, [])
        if texts and importlib.util.find_spec("matplotlib") is None:
            terminalreporter.write_line(
                "error heatmaps not written: matplotlib is not installed (pip install -e '.[plot]')"
            )
        if texts:
            terminalreporter.section("fixture replay diagnostics")
            for text in texts:
                terminalreporter.write_line(text)
