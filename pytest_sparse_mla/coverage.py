"""The input-space coverage report (docs/input-space.md#measuring-coverage): which value classes
of every dimension, and which feasible pairs of classes, the run's drawn cases reached.

Tests call :func:`record_input` with each case they check (the classes come from
``harness.input_space.classify``). The classes go into the test's report
(``user_properties``), so under xdist they travel to the controller, which sums them up. The
summary ends with one line (classes, pairs and situations reached); ``--input-coverage`` adds
the table: per dimension the classes reached and missed, the situations
(``harness.input_space.SITUATIONS``) reached and missed, the pairs missed, and drawn values
outside the production space.
"""

from __future__ import annotations

import pytest

from .keys import GROUP

INPUT_SPACE_KEY = "sparse_mla_input_space"  # the classes of each case a test checked
TRANSITION_KEY = "sparse_mla_transitions"  # the transitions between steps a stateful test checked
_pending: list[tuple[tuple[str, str], ...]] = []
_pending_transitions: set[str] = set()


def record_input(assignment: dict) -> None:
    """Note that the running test checked a case of these classes (dimension -> class)."""
    _pending.append(tuple(sorted(assignment.items())))


def record_transitions(names) -> None:
    """Note that the running test checked steps reached by these transitions
    (``harness.transitions``)."""
    _pending_transitions.update(names)


def pytest_addoption(parser):
    parser.getgroup(*GROUP).addoption(
        "--input-coverage", action="store_true", default=False,
        help="end with the input-space coverage table: classes and pairs of classes reached and missed",
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    if _pending:
        item.user_properties.append((INPUT_SPACE_KEY, sorted(set(_pending))))
        _pending.clear()
    if _pending_transitions:
        item.user_properties.append((TRANSITION_KEY, sorted(_pending_transitions)))
        _pending_transitions.clear()
    yield


class _Collector:
    def __init__(self):
        self.cases: set = set()
        self.transitions: set[str] = set()

    def pytest_runtest_logreport(self, report):
        for key, value in report.user_properties:
            if key == INPUT_SPACE_KEY:
                self.cases.update(tuple(tuple(item) for item in case) for case in value)
            elif key == TRANSITION_KEY:
                self.transitions.update(value)


def pytest_configure(config):
    config.pluginmanager.register(_Collector(), "sparse_mla_input_coverage")


def coverage_lines(cases, full: bool) -> list[str]:
    """The summary line, and with ``full`` the table, for a set of classified cases."""
    from harness.input_space import SITUATIONS, SPACE, coverage_of

    cov = coverage_of(dict(c) for c in cases)
    classes = sum(len(v) for v in cov.classes_reached.values())
    total = sum(len(d.classes) for d in SPACE)
    lines = [f"input space: {len(cases)} distinct cases; {classes}/{total} value classes, "
             f"{cov.pairs_reached}/{cov.pairs_total} feasible pairs of classes, "
             f"{len(cov.situations_reached)}/{len(SITUATIONS)} situations reached"
             + ("" if full else " (--input-coverage for the table)")]
    if not full:
        return lines
    for d in SPACE:
        missed = cov.classes_missed[d.name]
        lines.append(f"  {d.name:18} reached {', '.join(cov.classes_reached[d.name]) or '-'}"
                     + (f" | MISSED {', '.join(missed)}" if missed else ""))
    lines.append(f"  {'situations':18} reached {', '.join(cov.situations_reached) or '-'}"
                 + (f" | MISSED {', '.join(cov.situations_missed)}" if cov.situations_missed else ""))
    for name, values in cov.outside.items():
        lines.append(f"  {name:18} drawn outside the production space: {', '.join(values)}")
    if cov.pairs_missed:
        lines.append(f"  pairs missed ({len(cov.pairs_missed)}):")
        lines += [f"    {a[0]}={a[1]} x {b[0]}={b[1]}" for a, b in cov.pairs_missed[:40]]
        if len(cov.pairs_missed) > 40:
            lines.append(f"    ... and {len(cov.pairs_missed) - 40} more")
    else:
        lines.append("  every feasible pair reached")
    return lines


def transition_line(reached) -> str:
    """How many of the transitions between steps the run's stateful tests checked, and which not."""
    from harness.transitions import TRANSITIONS

    missed = [name for name in TRANSITIONS if name not in reached]
    return (f"transitions between steps: {len(TRANSITIONS) - len(missed)}/{len(TRANSITIONS)} checked"
            + (f" (not reached: {', '.join(missed)})" if missed else ""))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    collector = config.pluginmanager.get_plugin("sparse_mla_input_coverage")
    if collector is not None and collector.transitions:
        terminalreporter.write_line(transition_line(collector.transitions))
    if collector is None or not collector.cases:
        return
    full = config.getoption("--input-coverage")
    if full:
        terminalreporter.section("input-space coverage")
    for line in coverage_lines(collector.cases, full):
        terminalreporter.write_line(line)
