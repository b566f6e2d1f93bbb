"""The suite's pytest plugin: the implementation under test, GPU gating and pinning, hypothesis
profiles, and the per-regime summary printed at the end of a run (xdist included).

Options are declared in the root ``conftest.py``; this module implements them.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest
from hypothesis import HealthCheck, settings

from fast.impl import load_impl

from harness.gpu_env import pin_worker_gpu
from reference import REGIMES

# Fixed, derandomised examples by default so every run (CI included) checks the same cases;
# `--hypothesis-profile=thorough` explores.
settings.register_profile(
    "ci", derandomize=True, max_examples=30, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("thorough", max_examples=400, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("ci")

REGIME_KEY = "sparse_mla_regimes"


# --- GPU gating --------------------------------------------------------------------------


# --- hooks -------------------------------------------------------------------------------


def pytest_configure(config):
    pin_worker_gpu(getattr(config, "workerinput", {}).get("workerid"))
    config.stash[IMPL_SPEC] = config.getoption("--impl")
    config.stash[TALLY] = RegimeTally()
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(SessionReporter(config))


IMPL_SPEC = pytest.StashKey[str]()
TALLY = pytest.StashKey["RegimeTally"]()


def _skip_gpu_items_without_gpu(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    from harness.availability import sm90_flashinfer_unavailable_reason

    reason = sm90_flashinfer_unavailable_reason()
    config.stash[GPU_REASON] = reason or ""
    if reason:
        skip = pytest.mark.skip(reason=f"GPU tier: {reason}")
        for item in gpu_items:
            item.add_marker(skip)


GPU_REASON = pytest.StashKey[str]()


def pytest_collection_modifyitems(config, items):
    _keep_only_replay_items(config, items)
    _skip_gpu_items_without_gpu(config, items)


@pytest.fixture(scope="session")
def impl(pytestconfig):
    """The implementation under test (``--impl module:factory``; default: fast/)."""
    return load_impl(pytestconfig.stash[IMPL_SPEC])


class RegimeLog:
    """Per-test record of the rows a test checked, by regime, and which regimes it targets."""

    def __init__(self, node):
        self._node = node
        self.rows: Counter[str] = Counter()
        self.focus: set[str] = set()

    def record(self, regimes, focus=None) -> None:
        """Count checked rows; the test's outcome is credited to ``focus`` (default: all)."""
        self.rows.update(regimes)
        self.focus.update(focus if focus is not None else set(regimes))
        self._save()

    def blame(self, regimes) -> None:
        """A check failed on rows of these regimes: credit the outcome to them alone."""
        if regimes:
            self.focus = set(regimes)
            self._save()

    def _save(self) -> None:
        self._node.user_properties[:] = [p for p in self._node.user_properties if p[0] != REGIME_KEY]
        self._node.user_properties.append((REGIME_KEY, {"rows": dict(self.rows), "focus": sorted(self.focus)}))


@pytest.fixture
def regime_log(request) -> RegimeLog:
    """Call ``regime_log.record(row_regimes, focus=...)`` to count checked rows per regime."""
    return RegimeLog(request.node)


class RegimeTally:
    def __init__(self):
        self.rows: Counter[str] = Counter()
        self.outcomes: dict[str, Counter[str]] = defaultdict(Counter)

    def add(self, report) -> None:
        props = dict(report.user_properties).get(REGIME_KEY)
        if not props:
            return
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            outcome = "xfailed" if hasattr(report, "wasxfail") and report.outcome == "skipped" else report.outcome
            outcome = "xpassed" if hasattr(report, "wasxfail") and report.outcome == "passed" else outcome
            self.rows.update(props["rows"] if outcome != "skipped" else {})
            for regime in props["focus"]:
                self.outcomes[regime][outcome] += 1

    def lines(self) -> list[str]:
        out = [f"{'regime':<7}{'rows checked':>13}{'passed':>8}{'failed':>8}{'xfailed':>9}{'skipped':>9}  meaning"]
        for regime, meaning in REGIMES.items():
            o = self.outcomes.get(regime, Counter())
            out.append(
                f"{regime:<7}{self.rows.get(regime, 0):>13}{o['passed']:>8}{o['failed'] + o['xpassed']:>8}"
                f"{o['xfailed']:>9}{o['skipped']:>9}  {meaning}"
            )
        return out


class SessionReporter:
    """Controller-side collector of what the reports carry (one per session: nested test
    sessions of the suite's self-tests get their own)."""

    def __init__(self, config):
        self.config = config

    def pytest_runtest_logreport(self, report):
        self.config.stash[TALLY].add(report)
        if report.when == "call":
            self.config.stash.setdefault(REPLAYS, []).extend(v for k, v in report.user_properties if k == REPLAY_KEY)


# --- which GPU each xdist worker used ---------------------------------------------------------

GPU_USED_KEY = "sparse_mla_gpu"


def gpu_identity() -> str:
    """The visible devices and, where CUDA was initialised by the tests, the device's bus id."""
    import os
    import sys

    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<all>")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        bus = getattr(props, "pci_bus_id", None)
        return f"CUDA_VISIBLE_DEVICES={visible} -> {props.name}" + (f" (PCI bus {bus})" if bus is not None else "")
    return f"CUDA_VISIBLE_DEVICES={visible} (CUDA not used)"


def _record_worker_gpu(session) -> None:
    if hasattr(session.config, "workerinput"):
        session.config.workeroutput[GPU_USED_KEY] = gpu_identity()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    used = getattr(node, "workeroutput", {}).get(GPU_USED_KEY)
    if used:
        node.config.stash.setdefault(GPUS_USED, {})[node.workerinput["workerid"]] = used


GPUS_USED = pytest.StashKey[dict]()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput"):
        return
    used = config.stash.get(GPUS_USED, {})
    if len(set(used.values())) > 1 or any("CUDA not used" not in v for v in used.values()):
        terminalreporter.section("GPU per xdist worker")
        for worker in sorted(used, key=lambda w: int(w[2:]) if w[2:].isdigit() else 0):
            terminalreporter.write_line(f"{worker}: {used[worker]}")
    tally = config.stash.get(TALLY, None)
    if tally is not None and (tally.rows or tally.outcomes):
        terminalreporter.section("sparse-MLA rows and outcomes per context regime")
        for line in tally.lines():
            terminalreporter.write_line(line)
    if config.getoption("--replay"):
        texts = config.stash.get(REPLAYS, [])
        if texts:
            terminalreporter.section("fixture replay diagnostics")
            for text in texts:
                terminalreporter.write_line(text)
    reason = config.stash.get(GPU_REASON, None)
    if reason:
        terminalreporter.write_line(f"GPU tier skipped: {reason}")
    if BASELINE_REPORT in config.stash:
        path, ok = config.stash[BASELINE_REPORT]
        terminalreporter.write_line(f"upgrade report: {path} ({'no regression' if ok else 'REGRESSIONS: exit status 1'})")
    impl_spec = config.stash.get(IMPL_SPEC, None)
    if impl_spec:
        terminalreporter.write_line(f"implementation under test: {impl_spec}")


# --- fixtures: replay and failure dumps ------------------------------------------------------

REPLAY_KEY = "sparse_mla_replay"
REPLAYS = pytest.StashKey[list]()


def _keep_only_replay_items(config, items):
    """With ``--replay`` only the replay tests run."""
    if not config.getoption("--replay"):
        return
    keep = [item for item in items if item.get_closest_marker("replay")]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep




class FailureDump:
    """Tests arm it with a function that builds the case's fixture; when the test fails and
    ``--dump-failures DIR`` is set, the fixture is written to DIR."""

    def __init__(self, directory: str | None, node):
        self.directory = directory
        self.node = node
        self._build = None

    def arm(self, build) -> None:
        self._build = build

    def dump(self) -> str | None:
        if not self.directory or self._build is None:
            return None
        from recording.fixture import save_fixture

        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.node.nodeid.split("::", 1)[-1])
        fixture = self._build()
        fixture.meta.setdefault("name", safe)
        fixture.meta.setdefault("nodeid", self.node.nodeid)
        return str(save_fixture(f"{self.directory}/{safe}.safetensors", fixture))


@pytest.fixture
def failure_dump(request) -> FailureDump:
    dump = FailureDump(request.config.getoption("--dump-failures"), request.node)
    request.node.stash[DUMP] = dump
    return dump


DUMP = pytest.StashKey[FailureDump]()


# --- baselines (upgrade validation) ----------------------------------------------------------

WARNING_KEY = "flashinfer_warnings"  # report property: the FlashInfer warnings a test raised


def baseline_directory(config):
    """Where this run's case records go, or None when no baseline option is given."""
    from pathlib import Path

    if config.getoption("--record-baseline"):
        return Path(config.getoption("--record-baseline"))
    if config.getoption("--compare-baseline"):
        return Path(config.getoption("--baseline-out")) / "current"
    return None


class BaselineNote:
    """What a GPU-tier case measured, kept for ``--record-baseline`` / ``--compare-baseline``."""

    def __init__(self):
        self.fields: dict = {}
        self.outputs: dict = {}

    def note(self, *, outputs=None, **fields) -> None:
        self.fields.update({k: v for k, v in fields.items() if v is not None})
        self.outputs.update({k: v.detach().cpu() for k, v in (outputs or {}).items()})


@pytest.fixture
def baseline(request) -> BaselineNote:
    """``baseline.note(ratios=..., kernel_us=..., plan_us=..., error=..., outputs={...})``."""
    note = BaselineNote()
    request.node.stash[BASELINE] = note
    return note


BASELINE = pytest.StashKey[BaselineNote]()
OUTCOME = pytest.StashKey[str]()


def _write_baseline_record(item, report, outcome: str) -> None:
    """Called with the teardown report, which carries every property the test attached."""
    from tests.baseline import CaseRecord, write_record

    directory = baseline_directory(item.config)
    note = item.stash.get(BASELINE, None)
    if directory is None or note is None:
        return
    warnings = [w for k, v in report.user_properties if k == WARNING_KEY for w in v]
    from recording.environment import flashinfer_version

    record = CaseRecord(case=item.nodeid, outcome=outcome, flashinfer=flashinfer_version(), warnings=warnings,
                        timing_workers=gpu_sharing_workers(),
                        **{k: v for k, v in note.fields.items() if k in ("error", "ratios", "kernel_us", "plan_us")})
    write_record(directory, record, note.outputs)


def gpu_sharing_workers() -> int:
    """Test processes sharing this process's GPU (xdist workers over the visible GPUs)."""
    import os

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    from harness.gpu_env import count_gpus_without_cuda

    return max(1, -(-workers // max(count_gpus_without_cuda(), 1)))


def pytest_sessionfinish(session, exitstatus):
    _record_worker_gpu(session)
    config = session.config
    base = config.getoption("--compare-baseline")
    if not base or hasattr(config, "workerinput"):
        return
    from pathlib import Path

    from tests.baseline import compare_directories, read_records, write_report

    current = baseline_directory(config)
    before = {r.flashinfer for r in read_records(Path(base)).values()} - {None}
    after = {r.flashinfer for r in read_records(current).values()} - {None} if current.exists() else set()
    ok = write_report(compare_directories(Path(base), current), current.parent, ",".join(sorted(before)) or "?",
                      ",".join(sorted(after)) or "?")
    config.stash[BASELINE_REPORT] = (str(current.parent / "report.md"), ok)
    if not ok and session.exitstatus == 0:
        session.exitstatus = 1


BASELINE_REPORT = pytest.StashKey[tuple]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        item.stash[OUTCOME] = "xfailed" if hasattr(report, "wasxfail") else report.outcome
    elif report.when == "teardown" and OUTCOME in item.stash:
        _write_baseline_record(item, report, item.stash[OUTCOME])
    dump = item.stash.get(DUMP, None)
    if dump is not None and report.when == "call" and report.failed and not hasattr(report, "wasxfail"):
        try:
            path = dump.dump()
        except Exception as exc:  # a broken dump must not hide the failure itself
            path = f"(could not write the fixture: {exc!r})"
        if path:
            report.sections.append(("fixture", f"failing case written to {path}\nreplay: pytest --replay={path}"))
