"""The per-regime summary at the end of a run, through pytester: a test that fails before it
records a row still counts as failed in the regimes it declares, an xpass counts as a failure,
a skipped test's rows are not counted, a blamed failure counts only where it was blamed, and a
test that covers no regime is counted on its own line, never dropped. Edge families: each has a
line whatever ran, a test marked with a family counts there (its outcome and all its rows)
besides its regimes, and an unknown family fails the test. Launches: a passed test that ended at
an expected refusal counts as refused (its rows unchecked), not passed, and the summary says how
many tests ran the kernel and how many were expected refusals, and so do the GPU tier's strided
cases on a simulated machine whose FlashInfer refuses them at plan. The same counts under xdist,
where the launches travel from the workers in the reports, are checked by the one nested xdist
run of tests/cpu/test_plugin_gating.py (LAUNCH_SUITE beside its own tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_sparse_mla.regimes import EDGE_FAMILIES, EDGE_LABEL, NO_REGIME, credited_regimes, tally_outcome, worse
from tests import simulated_page_counts, simulated_sm90
from tests.support.child_runs import LAUNCH_SUITE, refused_column, summary_table

REPO = Path(__file__).resolve().parents[2]

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


EDGE_SUITE = """
import pytest


@pytest.mark.edge("magnitude")
def test_magnitude_passed(regime_log):
    regime_log.record(["A", "A", "H"])


@pytest.mark.edge("magnitude")
def test_magnitude_fails_before_recording():
    raise RuntimeError("broke before any row was checked")


@pytest.mark.regimes("C")
@pytest.mark.edge("stale-slots")
@pytest.mark.xfail(reason="finding", raises=ValueError, strict=True)
def test_stale_slots_finding(regime_log):
    regime_log.record(["C", "C"])
    raise ValueError("the finding")


@pytest.mark.edge("scale")
def test_scale_skipped_after_recording(regime_log):
    regime_log.record(["H"] * 5)
    pytest.skip("no GPU")


@pytest.mark.edge("scale")
@pytest.mark.edge("invariance")
def test_two_families(regime_log):
    regime_log.record(["H"] * 4)


@pytest.mark.edge("invariance")
def test_no_rows():
    pass


@pytest.mark.edge("nonsense")
def test_unknown_family(regime_log):
    regime_log.record(["A"])


@pytest.mark.edge
def test_no_family():
    pass


def test_plain(regime_log):
    regime_log.record(["B"])
"""


def run_suite(pytester, name: str, suite: str) -> tuple[dict[str, tuple], str]:
    """The summary of one in-process run of ``suite`` (as module ``name``, in a folder of its own),
    and the run's output."""
    folder = pytester.mkdir(name)
    (folder / "conftest.py").write_text('pytest_plugins = ("pytest_sparse_mla",)\n')
    (folder / f"{name}.py").write_text(suite)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:benchmark", "-p", "no:xdist", "-q",
                                          "--rootdir", str(folder), str(folder))
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED, out + result.stderr.str()
    return summary_table(out), out


@pytest.fixture(scope="module")
def summaries() -> dict[str, tuple[dict[str, tuple], str]]:
    """The summary of each suite run so far in this module: each suite runs once, for all the tests here."""
    return {}


@pytest.fixture
def table(pytester, summaries):
    """The summary of one run of SUITE."""
    if "regime" not in summaries:
        summaries["regime"] = run_suite(pytester, "test_regime_suite", SUITE)
    return summaries["regime"]


@pytest.fixture
def edge_table(pytester, summaries):
    """The summary of one run of EDGE_SUITE."""
    if "edge" not in summaries:
        summaries["edge"] = run_suite(pytester, "test_edge_suite", EDGE_SUITE)
    return summaries["edge"]


def edge(name: str) -> str:
    return EDGE_LABEL.format(name)


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


def test_every_edge_family_has_a_line_even_without_tests(table, edge_table):
    counts, out = table
    assert all(counts[edge(name)] == ("0", 0, 0, 0, 0) for name in EDGE_FAMILIES), out
    counts, out = edge_table
    assert counts[edge("sanitizer")] == ("0", 0, 0, 0, 0), out


def test_an_edge_counts_its_tests_outcomes_and_every_row_they_record(edge_table):
    counts, out = edge_table
    assert counts[edge("magnitude")] == ("3", 1, 1, 0, 0), out  # 3 rows of regimes A and H


def test_an_edge_test_counts_in_its_regimes_too(edge_table):
    counts, out = edge_table
    assert counts[edge("stale-slots")] == ("2", 0, 0, 1, 0), out
    assert counts["C"] == ("2", 0, 0, 1, 0), out


def test_a_skipped_edge_tests_rows_are_not_counted(edge_table):
    counts, out = edge_table
    assert counts[edge("scale")] == ("4", 1, 0, 0, 1), out  # the two-family test's 4 rows; the skipped 5 are not


def test_a_test_of_two_families_counts_in_both(edge_table):
    counts, out = edge_table
    assert counts[edge("invariance")] == ("4", 2, 0, 0, 0), out  # with the test that records no row


def test_an_unknown_or_missing_family_fails_the_test_and_names_the_families(edge_table):
    counts, out = edge_table
    assert "test_unknown_family: @pytest.mark.edge('nonsense',): not an edge family" in out, out
    assert "test_no_family: @pytest.mark.edge needs a family name" in out, out
    assert str(sorted(EDGE_FAMILIES)) in out, out
    # neither is counted on an edge line; both cover no regime (the unknown one failed before recording),
    # as do test_magnitude_fails_before_recording (failed) and test_no_rows (passed)
    assert counts[NO_REGIME] == ("-", 1, 3, 0, 0), out
    assert counts["B"] == ("1", 1, 0, 0, 0), out


@pytest.fixture
def launch_table(pytester, summaries):
    """The summary of one run of LAUNCH_SUITE."""
    if "launch" not in summaries:
        summaries["launch"] = run_suite(pytester, "test_launch_suite", LAUNCH_SUITE)
    return summaries["launch"]


def test_an_expected_refusal_counts_as_refused_not_passed_and_its_rows_unchecked(launch_table):
    counts, out = launch_table
    refused = refused_column(out)
    assert counts["A"] == ("2", 1, 0, 0, 0) and refused["A"] == 1, out  # test_ran's 2 rows; the refused test's 3 not
    assert counts[edge("stale-slots")] == ("0", 0, 0, 0, 0) and refused[edge("stale-slots")] == 1, out
    assert counts["C"] == ("0", 0, 0, 0, 0) and refused["C"] == 1, out


def test_a_failure_after_a_refusal_counts_as_failed(launch_table):
    counts, out = launch_table
    assert counts["B"] == ("1", 0, 1, 0, 0) and refused_column(out)["B"] == 0, out


def test_the_summary_counts_tests_that_ran_the_kernel_and_expected_refusals(launch_table):
    counts, out = launch_table
    assert counts[NO_REGIME] == ("-", 2, 0, 0, 0), out
    assert ("attention kernel: ran in 2 tests; 3 ended at a refusal the installed FlashInfer is expected to make "
            "(counted as refused, not passed)") in out, out


def test_without_launches_the_summary_says_none_ran(table):
    counts, out = table
    assert "attention kernel: ran in 0 tests; 0 ended at a refusal" in out, out


@pytest.mark.parametrize(("outcome", "launches", "expected"), [
    ("passed", None, "passed"),
    ("passed", {"ran": 1, "refused": []}, "passed"),
    ("passed", {"ran": 0, "refused": ["ValueError at plan"]}, "refused"),
    ("failed", {"ran": 0, "refused": ["ValueError at plan"]}, "failed"),
    ("xfailed", {"ran": 0, "refused": ["ValueError at plan"]}, "xfailed"),
])
def test_tally_outcome(outcome, launches, expected):
    assert tally_outcome(outcome, launches) == expected


#: Strided cases of three GPU families on a simulated machine whose FlashInfer checks page counts
#: (tests.simulated_page_counts): rows shorter than W are refused at plan (ctx1; the stale-slots
#: case's second step, after a first step that ran; the graph sequence's capture batch), full-width
#: rows run (ctx4096).
REFUSING_SELECTION = ("ctx1-kpool1-strided or ctx4096-kpool1-strided or strided-short "
                      "or test_capture_once_replan_and_replay and strided")


def run_refusing_selection(pytester, monkeypatch):
    """The output of REFUSING_SELECTION's run on the simulated machine checking page counts: in this
    process where its convert kernel runs in Triton's interpreter (the patches undone after the
    test), in a process of its own otherwise."""
    paths = [str(REPO / "tests" / "gpu" / name) for name in ("test_attention_regimes.py", "test_edges.py",
                                                             "test_cuda_graphs.py")]
    common = ("-p", "no:xdist", "-p", "no:cacheprovider", "-q", "--rootdir", str(REPO), *paths,
              "-k", REFUSING_SELECTION)
    if simulated_sm90.can_simulate_in_process():
        simulated_sm90.simulate_in_process(monkeypatch)
        for module, name, value in simulated_page_counts.patches():  # undone after the test
            monkeypatch.setattr(module, name, value)
        with simulated_sm90.process_share_of_threads(), simulated_sm90.nested_failures_released():
            result = pytester.runpytest_inprocess(*common)
        return result.ret, "\n".join(result.outlines + result.errlines)
    env = {**os.environ, "PYTHONPATH": str(REPO), "SPARSE_MLA_DEVICE": "cpu", "TRITON_INTERPRET": "1",
           "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.simulated_sm90", "-p", "tests.simulated_page_counts", *common],
        capture_output=True, text=True, timeout=600, cwd=pytester.path, env=env,
    )
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.gpu_stand_in
@pytest.mark.suite_self_test
def test_expected_refusals_of_the_gpu_tier_count_as_refused_on_a_simulated_machine(pytester, monkeypatch):
    code, out = run_refusing_selection(pytester, monkeypatch)
    assert code == 0 and "4 passed" in out, out[-3000:]
    counts, refused = summary_table(out), refused_column(out)
    assert counts["H"][1] == 1 and refused["H"] == 3, out[-3000:]  # ctx4096 ran; ctx1, stale slots and graphs refused
    assert counts[edge("stale-slots")][1] == 0 and refused[edge("stale-slots")] == 1, out[-3000:]
    assert "attention kernel: ran in 2 tests; 3 ended at a refusal" in out, out[-3000:]
