"""Rows checked and test outcomes per context regime: the ``regime_log`` fixture tests record
into, the regimes each test declares, and the table printed at the end of a run (xdist
included: the properties travel with the reports to the controlling process).

A test covers the regimes it declares, known before it runs: a ``regimes`` marker, or a
parameter that is a case (an object with ``focus`` and ``spec``, as ``harness.cases.Case``): its
focus, else the regimes of the rows its spec plans. A test that declares none covers the
regimes of the rows it records. Its outcome (the worst of setup, call and teardown; an xpass
is a failure) is credited to the regimes a failed check blamed, else to those it covers, so a
test that fails before recording a row still counts as failed where it belongs. A test that
covers no regime is counted on the ``no regime`` line. Rows are counted for every test that
was not skipped.

A test that launches the attention kernel says so (``regime_log.kernel_ran()``), and a test whose
plan() the installed FlashInfer refused as it is expected to (``regime_log.expected_refusal(why)``,
as the ``judge`` fixture does for an outcome's ``refusal``) says that instead: such a test that passed counts in the
``refused`` column, not as passed, and its rows are not counted as checked (no kernel read
them). The run's summary ends with how many tests ran the kernel and how many ended at an
expected refusal.

Beside the regimes, the table has one line per edge family (docs/edges.md): a test marked
``@pytest.mark.edge("family")`` counts its outcome and every row it records on that family's
line, whatever regimes it covers too. A test may carry several families; a family name that is
not one of :data:`EDGE_FAMILIES` fails the test at setup, naming the families.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter, defaultdict

import pytest

from .keys import DECLARED_EDGES_KEY, DECLARED_REGIMES_KEY, ERROR_KEY, LAUNCH_KEY, REGIME_KEY

NO_REGIME = "no regime"
OUTCOMES = ("passed", "failed", "xfailed", "skipped", "refused")

#: The edge families of the kernel's inputs (docs/edges.md), each with its line in the table.
EDGE_FAMILIES: dict[str, str] = {
    "scale": "plans from 1 row to production batch sizes, judged row by row",
    "magnitude": "raw scores far from zero, mixed in a row and across the batch; rows with no slot",
    "stale-slots": "kv_indices past each row's kv_len holding valid, wrong slot ids",
    "invariance": "a row's output bits against the batch it is planned in",
    "sanitizer": "compute-sanitizer memcheck and initcheck, one small case per kernel variant",
}
EDGE_LABEL = "edge {}"


def error_entry(backend: str, spec, comparisons, label: str = "", layout: str | None = None) -> dict:
    """The measured ratios of a case, as the run's ratio summary reads them (``ERROR_KEY``)."""
    return {
        "backend": backend, "kv_dtype": spec.kv_dtype, "rope": spec.rope_dim, "heads": spec.num_heads,
        "layout": layout, "label": label,
        **{f"{c.name}_{k}": getattr(c, k) for c in comparisons
           for k in ("max_ratio", "mean_ratio", "rel_l2", "max_err")},
    }


def comparison_groups(comparisons) -> dict[str, list]:
    """The comparisons by the rows they judge: ``out[offset 1024]`` and ``lse[offset 1024]`` are
    the group ``offset 1024``, named ``out`` and ``lse`` there, as the ratio summary reads them;
    ``out`` and ``lse`` the group ``""``."""
    groups: dict[str, list] = {}
    for c in comparisons:
        name, _, suffix = c.name.partition("[")
        groups.setdefault(suffix.rstrip("]"), []).append(dataclasses.replace(c, name=name))
    return groups


class RegimeLog:
    """Per-test record of the rows a test checked, by regime, and which regimes it targets."""

    def __init__(self, node):
        self._node = node
        self.rows: Counter[str] = Counter()
        self.focus: set[str] = set()
        self.blamed: set[str] = set()
        self.launches = {"ran": 0, "refused": []}
        self.backends: dict[str, dict[str, int]] = {}

    def record(self, regimes, focus=None) -> None:
        """Count checked rows; without declared regimes the test's outcome is credited to
        ``focus`` (default: the regimes of these rows)."""
        self.rows.update(regimes)
        self.focus.update(focus if focus is not None else set(regimes))
        self._save()

    def step(self, outcome, regimes, *, comparisons=(), spec=None, label: str = "") -> None:
        """One step's ``backends.seam.StepOutcome``, the one record every backend returns: its
        planned rows counted (``regimes``: theirs) on the backend that ran them, a kernel launch
        when it produced an output, the rows whose executed length was read back from the
        kernel's own schedule, and the error ratios of its ``comparisons`` (with ``spec``, the
        batch spec: the kernel variant they are summed up under, per backend)."""
        self.record(regimes)
        if spec is not None:
            for suffix, group in comparison_groups(comparisons).items():
                self._node.user_properties.append((ERROR_KEY, error_entry(outcome.backend, spec, group,
                                                                          f"{label} {suffix}".strip())))
        counts = self.backends.setdefault(outcome.backend, {"rows": 0, "read_back": 0})
        counts["rows"] += outcome.planned_rows
        if outcome.reads_back:
            counts["read_back"] += outcome.planned_rows
        self._save()
        if outcome.out is not None:
            self.kernel_ran()

    def blame(self, regimes) -> None:
        """A check failed on rows of these regimes: credit the outcome to them alone."""
        regimes = set(regimes)
        if regimes:
            self.blamed = regimes
            self._save()

    def kernel_ran(self) -> None:
        """The test launched the attention kernel (once more)."""
        self.launches["ran"] += 1
        self._save_launches()

    def expected_refusal(self, why: str) -> None:
        """The installed FlashInfer refused a plan, as this release is expected to: no kernel ran
        for it."""
        self.launches["refused"].append(why)
        self._save_launches()

    def _save_launches(self) -> None:
        self._node.user_properties[:] = [p for p in self._node.user_properties if p[0] != LAUNCH_KEY]
        self._node.user_properties.append((LAUNCH_KEY, {"ran": self.launches["ran"],
                                                        "refused": list(self.launches["refused"])}))

    def _save(self) -> None:
        self._node.user_properties[:] = [p for p in self._node.user_properties if p[0] != REGIME_KEY]
        entry = {"rows": dict(self.rows), "focus": sorted(self.focus), "blamed": sorted(self.blamed),
                 "backends": {name: dict(c) for name, c in self.backends.items()}}
        self._node.user_properties.append((REGIME_KEY, entry))


# --- what a test declares -----------------------------------------------------------------


@functools.cache
def planned_row_regimes(spec) -> tuple[str, ...]:
    """The regimes of the rows a batch spec plans (the query rows handed to the kernel), read
    from the spec alone (no scenario built)."""
    from harness.builder import plan_rows

    return tuple(sorted(set(plan_rows(spec).planned_regimes)))


def case_regimes(case) -> tuple[str, ...]:
    """A case's focus, else the regimes of the rows its spec plans (none where the spec
    cannot be built: the test itself then fails and says why)."""
    if case.focus:
        return tuple(case.focus)
    try:
        return planned_row_regimes(case.spec)
    except Exception:  # reported by the test, not by the report hook
        return ()


def declared_regimes(item) -> list[str] | None:
    """The regimes a test covers, from its ``regimes`` marker or its case parameters; None
    when it declares none."""
    marker = item.get_closest_marker("regimes")
    if marker is not None:
        return sorted(set(marker.args))
    callspec = getattr(item, "callspec", None)
    cases = [v for v in (callspec.params.values() if callspec else ()) if hasattr(v, "focus") and hasattr(v, "spec")]
    if not cases:
        return None
    return sorted({r for case in cases for r in case_regimes(case)})


def marked_edges(item) -> list[str]:
    """Every family named by the test's ``edge`` markers, in order, duplicates dropped."""
    names = [name for marker in item.iter_markers("edge") for name in marker.args]
    return list(dict.fromkeys(names))


def unknown_edges(item) -> str | None:
    """Why the test's ``edge`` markers are malformed (an ``edge`` marker naming no family, or a
    name that is not a family), or None."""
    if any(not marker.args for marker in item.iter_markers("edge")):
        return f"@pytest.mark.edge needs a family name, one of {sorted(EDGE_FAMILIES)}"
    unknown = [name for name in marked_edges(item) if name not in EDGE_FAMILIES]
    if unknown:
        return f"@pytest.mark.edge{tuple(unknown)!r}: not an edge family; the families are {sorted(EDGE_FAMILIES)}"
    return None


def declared_edges(item) -> list[str]:
    """The edge families a test belongs to (its ``edge`` markers), known families only."""
    return [name for name in marked_edges(item) if name in EDGE_FAMILIES]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Attach the declared regimes and edge families to the setup report (every test has one,
    skipped ones too)."""
    if call.when == "setup" and not any(p[0] == DECLARED_REGIMES_KEY for p in item.user_properties):
        declared = declared_regimes(item)
        if declared is not None:
            item.user_properties.append((DECLARED_REGIMES_KEY, declared))
    if call.when == "setup" and not any(p[0] == DECLARED_EDGES_KEY for p in item.user_properties):
        edges = declared_edges(item)
        if edges:
            item.user_properties.append((DECLARED_EDGES_KEY, edges))
    yield


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A test whose ``edge`` marker names no known family fails here, with the families."""
    problem = unknown_edges(item)
    if problem:
        pytest.fail(f"{item.nodeid}: {problem}", pytrace=False)


# --- the tally ------------------------------------------------------------------------------


def tally_outcome(outcome: str | None, launches: dict | None) -> str | None:
    """A passed test that ended at an expected refusal is ``refused``; any other as it is."""
    return "refused" if outcome == "passed" and launches and launches.get("refused") else outcome


def phase_outcome(report) -> str:
    """passed, failed, xfailed or skipped for one phase's report (an xpass is a failure)."""
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.outcome == "skipped" else "failed"
    return report.outcome


def worse(a: str | None, b: str) -> str:
    """The outcome of a test from two of its phases: failed over xfailed over skipped over passed."""
    order = ("passed", "skipped", "xfailed", "failed")
    return b if a is None or order.index(b) > order.index(a) else a


def credited_regimes(recorded: dict | None, declared: list[str] | None) -> list[str]:
    """Where a test's outcome counts: the blamed regimes, else the declared ones, else the
    recorded focus; empty for none."""
    recorded = recorded or {}
    return list(recorded.get("blamed") or declared or recorded.get("focus") or [])


class RegimeTally:
    def __init__(self):
        self.tests: dict[str, dict] = {}

    def add(self, report) -> None:
        test = self.tests.setdefault(report.nodeid, {"outcome": None, "recorded": None, "declared": None, "edges": [],
                                                     "launches": None})
        props = dict(report.user_properties)
        test["launches"] = props.get(LAUNCH_KEY, test["launches"])
        test["recorded"] = props.get(REGIME_KEY, test["recorded"])
        test["declared"] = props.get(DECLARED_REGIMES_KEY, test["declared"])
        test["edges"] = props.get(DECLARED_EDGES_KEY, test["edges"])
        if report.when == "call" or report.outcome != "passed":
            test["outcome"] = worse(test["outcome"], phase_outcome(report))

    def counts(self) -> tuple[Counter[str], dict[str, Counter[str]]]:
        """(rows checked, test outcomes) per line of the table: per regime (a test with none
        counts on the no-regime line) and per edge family (every row the family's tests
        recorded, whatever its regime). A skipped or refused test checked no row."""
        rows: Counter[str] = Counter()
        outcomes: dict[str, Counter[str]] = defaultdict(Counter)
        for test in self.tests.values():
            outcome = tally_outcome(test["outcome"], test["launches"])
            if outcome is None:
                continue
            checked = test["recorded"] and outcome not in ("skipped", "refused")
            recorded = test["recorded"]["rows"] if checked else Counter()
            rows.update(recorded)
            for regime in credited_regimes(test["recorded"], test["declared"]) or [NO_REGIME]:
                outcomes[regime][outcome] += 1
            for edge in test["edges"]:
                label = EDGE_LABEL.format(edge)
                outcomes[label][outcome] += 1
                rows[label] += sum(recorded.values())
        return rows, outcomes

    def lines(self) -> list[str]:
        from reference import REGIMES

        rows, outcomes = self.counts()
        meanings = [*REGIMES.items(), (NO_REGIME, "tests that cover no context regime"),
                    *((EDGE_LABEL.format(edge), meaning) for edge, meaning in EDGE_FAMILIES.items())]
        table = [
            (label, "-" if label == NO_REGIME else str(rows.get(label, 0)), outcomes.get(label, Counter()), meaning)
            for label, meaning in meanings
        ]
        width = max(len(label) for label, *_ in table) + 1
        head = (f"{'regime':<{width}}{'rows checked':>13}  | tests:{'passed':>7}{'failed':>8}{'xfailed':>9}"
                f"{'skipped':>9}{'refused':>9}  meaning")
        out = [head]
        for label, checked, o, meaning in table:
            out.append(f"{label:<{width}}{checked:>13}  |       {o['passed']:>7}{o['failed']:>8}{o['xfailed']:>9}"
                       f"{o['skipped']:>9}{o['refused']:>9}  {meaning}")
        return out

    def backend_rows(self) -> dict[str, dict[str, int]]:
        """Per backend: rows checked through the seam by tests that ran (not skipped or refused),
        and of those the rows whose executed length was read back."""
        totals: dict[str, dict[str, int]] = {}
        for test in self.tests.values():
            outcome = tally_outcome(test["outcome"], test["launches"])
            if outcome is None or outcome in ("skipped", "refused") or not test["recorded"]:
                continue
            for name, c in (test["recorded"].get("backends") or {}).items():
                t = totals.setdefault(name, {"rows": 0, "read_back": 0, "tests": 0})
                t["rows"] += c["rows"]
                t["read_back"] += c["read_back"]
                t["tests"] += 1
        return totals

    def backend_line(self) -> str | None:
        totals = self.backend_rows()
        if not totals:
            return None
        parts = [f"{name} {t['rows']} rows in {t['tests']} tests"
                 + (f" ({t['read_back']} read back from the kernel's schedule)" if t["read_back"] else "")
                 for name, t in sorted(totals.items())]
        return "rows checked per backend: " + "; ".join(parts)

    def launch_counts(self) -> tuple[int, int]:
        """(tests that ran the attention kernel, tests that ended at an expected refusal)."""
        launches = [t["launches"] for t in self.tests.values() if t["launches"] and t["outcome"] is not None]
        return sum(1 for x in launches if x["ran"]), sum(1 for x in launches if x["refused"])

    def launch_line(self) -> str:
        ran, refused = self.launch_counts()
        return (f"attention kernel: ran in {ran} test{'s' if ran != 1 else ''}; {refused} ended at a refusal the "
                "installed FlashInfer is expected to make (counted as refused, not passed)")

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
    config.addinivalue_line(
        "markers", "regimes(*names): the context regimes a test covers (see pytest_sparse_mla.regimes)"
    )
    config.addinivalue_line("markers", "edge(*families): the edge families a test belongs to, of "
                            f"{', '.join(EDGE_FAMILIES)} (docs/edges.md; see pytest_sparse_mla.regimes)")
    config.stash[TALLY] = RegimeTally()
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(config.stash[TALLY])


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput"):
        return
    tally = config.stash.get(TALLY, None)
    if tally is not None and tally.tests:
        terminalreporter.section("sparse-MLA rows and test outcomes per context regime and edge family")
        for line in tally.lines():
            terminalreporter.write_line(line)
        terminalreporter.write_line(tally.launch_line())
        backends = tally.backend_line()
        if backends:
            terminalreporter.write_line(backends)
