"""The per-regime summary at the end of a run, through pytester: a test that fails before it
records a row still counts as failed in the regimes it declares, an xpass counts as a failure,
a skipped test's rows are not counted, a blamed failure counts only where it was blamed, and a
test that covers no regime is counted on its own line, never dropped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_sparse_mla.regimes import NO_REGIME, credited_regimes, worse

SUITE = """
import pytest

from harness.cases import Case
from harness.scenario import batch

POOLED = Case("pooled", batch((5, 1), (1024, 1), (100_003, 1), topk=2048, kpool=4))  # no focus: rows of C, B, G


@pytest.mark.regimes("C")
def test_fails_before_recording():
    raise RuntimeError("broke before any row was checked")


@pytest.fixture
def broken():
    raise RuntimeError("setup broke")


@pytest.mark.regimes("D")
def test_setup_error(broken):
    pass


@pytest.mark.parametrize("case", [Case("h-focus", batch((5000, 1), topk=2048, kpool=1), ("H",)), POOLED],
                         ids=["focus", "rows"])
def test_case_fails_before_recording(case):
    raise RuntimeError("broke before any row was checked")


@pytest.mark.regimes("E")
@pytest.mark.xfail(reason="finding", strict=True)
def test_strict_xpass(regime_log):
    regime_log.record(["E", "E"])


@pytest.mark.regimes("F")
@pytest.mark.xfail(reason="finding", strict=False)
def test_loose_xpass(regime_log):
    regime_log.record(["F"])


@pytest.mark.regimes("F")
@pytest.mark.xfail(reason="finding", raises=ValueError, strict=True)
def test_xfail(regime_log):
    regime_log.record(["F", "F", "F"])
    raise ValueError("the finding")


def test_skipped_after_recording(regime_log):
    regime_log.record(["G"] * 7)
    pytest.skip("no GPU")


def test_recorded_and_passed(regime_log):
    regime_log.record(["A", "A", "G"])


def test_blamed(regime_log):
    regime_log.record(["A", "B", "B"])
    regime_log.blame(["B"])
    assert False, "row 1 (regime B) is wrong"


@pytest.fixture
def broken_teardown():
    yield
    raise RuntimeError("teardown broke")


@pytest.mark.regimes("H")
def test_teardown_error(broken_teardown, regime_log):
    regime_log.record(["H"])


def test_no_regime():
    pass


def test_no_regime_skipped():
    pytest.skip("nothing to do")
"""


def summary_table(output: str) -> dict[str, tuple]:
    """regime -> (rows checked, passed, failed, xfailed, skipped) from the printed table."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if "rows and test outcomes per context regime" in line)
    table = {}
    for line in lines[start + 2:]:
        if "|" not in line:
            break
        left, right = line.split("|", 1)
        name, checked = left.rsplit(None, 1)
        counts = right.split()[:4]
        table[name.strip()] = (checked, *map(int, counts))
    return table


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """The summary of one run of SUITE (in its own process, shared by the tests here)."""
    folder = tmp_path_factory.mktemp("regime_suite")
    (folder / "conftest.py").write_text('pytest_plugins = ("pytest_sparse_mla",)\n')
    (folder / "test_suite.py").write_text(SUITE)
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q", "--rootdir", str(folder),
         str(folder)],
        capture_output=True, text=True, timeout=300, cwd=folder, env={**os.environ, "PYTHONPATH": str(repo)},
    )
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, proc.stdout + proc.stderr
    return summary_table(proc.stdout), proc.stdout


def test_a_test_failing_before_recording_counts_as_failed_in_its_declared_regimes(table):
    counts, out = table
    assert counts["C"][2] >= 1 and counts["D"][2] == 1, out  # marker: call failure, setup error


def test_a_case_declares_its_focus_or_the_regimes_of_its_rows(table):
    counts, out = table
    # "focus" declares H; "rows" plans rows of regimes C, B and G (ctx 5, 1024, 100003, kpool 4).
    assert counts["H"][2] == 2, out  # the focus case and the teardown error
    assert counts["B"][2] == 2 and counts["C"][2] == 2 and counts["G"][2] == 1, out


def test_xpassed_counts_as_failed(table):
    counts, out = table
    assert counts["E"][1:] == (0, 1, 0, 0), out  # strict xpass
    assert counts["F"][1:] == (0, 1, 1, 0), out  # loose xpass failed, the finding xfailed


def test_a_skipped_tests_rows_are_not_counted(table):
    counts, out = table
    assert counts["G"][0] == "1", out  # test_recorded_and_passed's one G row; the skipped test's 7 are not
    assert counts["G"][1:] == (1, 1, 0, 1), out


def test_rows_are_counted_for_failed_and_xfailed_tests(table):
    counts, out = table
    assert counts["F"][0] == "4" and counts["E"][0] == "2", out


def test_a_blamed_failure_counts_only_where_blamed(table):
    counts, out = table
    assert counts["A"][1:3] == (1, 0) and counts["B"][2] == 2, out


def test_a_teardown_error_counts_as_failed(table):
    counts, out = table
    assert counts["H"][1] == 0, out


def test_tests_that_cover_no_regime_have_their_own_line(table):
    counts, out = table
    assert counts[NO_REGIME] == ("-", 1, 0, 0, 1), out


@pytest.mark.parametrize(("recorded", "declared", "expected"), [
    (None, None, []),
    (None, ["C"], ["C"]),
    ({"rows": {"A": 2}, "focus": ["A"], "blamed": []}, None, ["A"]),
    ({"rows": {"A": 2}, "focus": ["A"], "blamed": []}, ["C", "G"], ["C", "G"]),
    ({"rows": {"A": 2, "B": 1}, "focus": ["A", "B"], "blamed": ["B"]}, ["A", "B"], ["B"]),
])
def test_credited_regimes(recorded, declared, expected):
    assert credited_regimes(recorded, declared) == expected


def test_the_worst_phase_outcome_wins():
    assert worse(None, "passed") == "passed"
    assert worse("passed", "failed") == "failed"  # a teardown error after a pass
    assert worse("xfailed", "passed") == "xfailed"
    assert worse("skipped", "failed") == "failed"
