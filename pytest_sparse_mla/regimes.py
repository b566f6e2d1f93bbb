"""Rows checked and test outcomes per context regime: the ``regime_log`` fixture tests record
into, and the table printed at the end of a run (xdist included: the properties travel with
the reports to the controlling process)."""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest

from reference import REGIMES

from .keys import REGIME_KEY


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

    def pytest_runtest_logreport(self, report):
        """Registered as a plugin on the controlling process only (one per session: nested
        test sessions of the suite's self-tests get their own)."""
        self.add(report)


TALLY = pytest.StashKey[RegimeTally]()


@pytest.fixture
def regime_log(request) -> RegimeLog:
    """Call ``regime_log.record(row_regimes, focus=...)`` to count checked rows per regime."""
    return RegimeLog(request.node)


def pytest_configure(config):
    config.stash[TALLY] = RegimeTally()
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(config.stash[TALLY])


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput"):
        return
    tally = config.stash.get(TALLY, None)
    if tally is not None and (tally.rows or tally.outcomes):
        terminalreporter.section("sparse-MLA rows and outcomes per context regime")
        for line in tally.lines():
            terminalreporter.write_line(line)
