"""Recorded fixtures: ``--replay`` runs only the replay tests (and prints each fixture's
diagnostics at the end), ``--dump-failures DIR`` writes a fixture for every failing
differential case that armed the ``failure_dump`` fixture."""

from __future__ import annotations

import pytest

from .keys import GROUP, REPLAY_KEY

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


class ReplayCollector:
    """Controller-side collector of the replay diagnostics the reports carry."""

    def __init__(self, config):
        self.config = config

    def pytest_runtest_logreport(self, report):
        if report.when == "call":
            self.config.stash.setdefault(REPLAYS, []).extend(v for k, v in report.user_properties if k == REPLAY_KEY)


def pytest_configure(config):
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(ReplayCollector(config))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """With ``--replay`` only the replay tests run (before the GPU gating sees the items)."""
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


DUMP = pytest.StashKey[FailureDump]()


@pytest.fixture
def failure_dump(request) -> FailureDump:
    dump = FailureDump(request.config.getoption("--dump-failures"), request.node)
    request.node.stash[DUMP] = dump
    return dump


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    dump = item.stash.get(DUMP, None)
    if dump is not None and report.when == "call" and report.failed and not hasattr(report, "wasxfail"):
        try:
            path = dump.dump()
        except Exception as exc:  # a broken dump must not hide the failure itself
            path = f"(could not write the fixture: {exc!r})"
        if path:
            report.sections.append(("fixture", f"failing case written to {path}\nreplay: pytest --replay={path}"))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput"):
        return
    if config.getoption("--replay"):
        texts = config.stash.get(REPLAYS, [])
        if texts:
            terminalreporter.section("fixture replay diagnostics")
            for text in texts:
                terminalreporter.write_line(text)
