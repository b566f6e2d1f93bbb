"""The upgrade check's verdict covers every test, not only those that record outputs: a small
suite recorded on release A and compared on release B (a stand-in FlashInfer whose ``run()``
breaks one test on B), through the plugin's own record and compare passes. Each way a test that
passed on A can go wrong on B fails the verdict and is named with its test id and its error
line; integer results are compared entry for entry."""

from __future__ import annotations

import json

import pytest
import torch

from recording.baseline import (
    OUTCOMES_FILE,
    BaselineError,
    CaseRecord,
    Outcome,
    RunCode,
    RunFacts,
    check_baseline,
    compare_case,
    compare_directories,
    compared_labels,
    integer_difference,
    read_outcomes,
    read_run_code,
    summary_lines,
    write_outcomes,
    write_record,
)
from recording.baseline.comparison import outcome_regressed
from tests.support.child_runs import run_plugin_in_process as run

RELEASE_A, RELEASE_B = "0.7.2.post1", "0.7.4"
RUN_ERROR = "RuntimeError: BatchMLAPagedAttentionWrapper.run: CUDA error: an illegal memory access was encountered"

#: The suite: GPU-tier-like cases that record outputs and integer results through the ``baseline``
#: fixture (asked for after run(), as the judge asks), and tests that record nothing. BREAKS names
#: what release B breaks (FAKE_RELEASE=B): run() raising for one test, a setup or teardown
#: error, a known finding fixed or newly met, a skip, a renamed case, an executed length.
SUITE = '''
import os

import pytest
import torch

RUN_ERROR = "BatchMLAPagedAttentionWrapper.run: CUDA error: an illegal memory access was encountered"


def breaks(what):
    return os.environ.get("FAKE_RELEASE") == "B" and os.environ.get("BREAKS") == what


def flashinfer_run(test):
    """Stands in for FlashInfer's run(): on release B it raises for the test BREAKS names."""
    if breaks(test):
        raise RuntimeError(RUN_ERROR)
    return torch.full((4, 2), 0.5)


@pytest.mark.parametrize("k", [1, 2])
def test_case(request, k):
    out = flashinfer_run(f"case{k}")
    executed_len = torch.tensor([16, 16, 16, 16, 64, 64, 64, 2048], dtype=torch.int32)
    if breaks(f"executed_len{k}"):
        executed_len[5] = 63
    request.getfixturevalue("baseline").note(ratios={"out_max_ratio": 0.4},
                                             outputs={"out": out * k, "executed_len": executed_len})


def test_run_records_nothing():
    flashinfer_run("records-nothing")


@pytest.fixture
def workspace():
    if breaks("setup"):
        raise RuntimeError("workspace: cudaMalloc failed")
    yield
    if breaks("teardown"):
        raise RuntimeError("workspace: cudaFree failed")


def test_with_workspace(workspace):
    flashinfer_run("workspace")


@pytest.mark.xfail(raises=ValueError, strict=True, reason="finding: CSR metadata refused")
def test_known_finding():
    if not breaks("finding-gone"):
        raise ValueError("CSR metadata page counts")


def test_finding_met(request):
    if breaks("finding-met"):
        request.applymarker(pytest.mark.xfail(raises=ValueError, strict=True, reason="finding: kpe without k_scale"))
        raise ValueError("fp8 kpe read without k_scale")


def test_skippable():
    if breaks("skip"):
        pytest.skip("needs the planner of FlashInfer < 0.7.3")


@pytest.mark.parametrize("layout", ["packed", "strided-v2" if breaks("renamed") else "strided"])
def test_layout(layout):
    pass


def test_skipped_everywhere():
    pytest.skip("no CUDA graphs here")
'''

#: A module that fails to import on B where BREAKS=import.
PLANNER = '''
import os

if os.environ.get("FAKE_RELEASE") == "B" and os.environ.get("BREAKS") == "import":
    raise ImportError("cannot import name 'BatchMLAPagedAttentionWrapper' from 'flashinfer.mla'")


def test_plan():
    pass
'''


@pytest.fixture
def releases(pytester, gpu_tier_may_run, monkeypatch):
    """The suite recorded on release A; ``compare(breaks)`` runs the compare pass on release B
    breaking ``breaks`` and returns the run's result."""
    import recording.environment

    pytester.makeconftest('pytest_plugins = ("pytest_sparse_mla",)')
    pytester.makepyfile(test_suite=SUITE, test_planner=PLANNER)
    monkeypatch.setattr(recording.environment, "flashinfer_version", lambda: RELEASE_A)
    monkeypatch.setenv("FAKE_RELEASE", "A")
    recorded = run(pytester, "--record-baseline=base", "--baseline-timing=off")
    assert recorded.ret == 0, recorded.stdout.str()

    def compare(breaks: str, *args: str):
        monkeypatch.setattr(recording.environment, "flashinfer_version", lambda: RELEASE_B)
        monkeypatch.setenv("FAKE_RELEASE", "B")
        monkeypatch.setenv("BREAKS", breaks)
        return run(pytester, "--compare-baseline=base", f"--baseline-out=upgrade-{breaks}", "--baseline-timing=off",
                   *args)

    return compare


def verdict_lines(result) -> list[str]:
    """The upgrade check's section of a run's terminal output."""
    out = result.stdout.lines
    start = next(i for i, line in enumerate(out) if "upgrade check" in line and "=" in line)
    end = next(i for i, line in enumerate(out) if line.startswith("report: "))
    return out[start + 1:end]


def test_the_record_pass_keeps_the_outcome_of_every_test(releases, pytester):
    version, outcomes = read_outcomes(pytester.path / "base")
    assert version == RELEASE_A
    assert {case.split("::")[1]: o.text for case, o in outcomes.items()} == {
        "test_case[1]": "passed", "test_case[2]": "passed", "test_run_records_nothing": "passed",
        "test_with_workspace": "passed", "test_known_finding": "xfailed: ValueError: CSR metadata page counts",
        "test_finding_met": "passed", "test_skippable": "passed", "test_layout[packed]": "passed",
        "test_layout[strided]": "passed", "test_skipped_everywhere": "skipped: no CUDA graphs here",
        "test_plan": "passed"}


def test_release_b_against_a_with_nothing_broken_passes(releases):
    result = releases("nothing")
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines([
        # the machine the two runs share ends the new run's name on a GPU: "(both: machine NAME)"
        f"PASS  verdict    FlashInfer {RELEASE_A} -> FlashInfer {RELEASE_B}*: 10 tests compared, 2 cases of them on "
        "their records, no regression",
        "ok    outcomes   none of 10 tests that passed (or xfailed) before fails, errors, xpasses or xfails now",
        "ok    integers   all 2 cases with integer results equal",
        "ok    not run    0 tests of the baseline did not run; 1 skipped in the baseline and not run now, not judged"])


def test_run_raising_on_b_in_a_test_that_records_nothing_fails_the_verdict_naming_the_test_and_its_error(releases):
    result = releases("records-nothing")
    assert result.ret == 1
    lines = verdict_lines(result)
    assert lines[0].startswith("FAIL  verdict") and lines[0].endswith("1 regression")
    result.stdout.fnmatch_lines([
        "FAIL  outcomes   1 of 10 tests that passed (or xfailed) before fail, error, xpass or xfail now "
        "(`test_run_records_nothing`: passed -> failed: RuntimeError: BatchMLAPagedAttentionWrapper.run: CUDA error: "
        "an illegal memor...)",
        f"FAIL  test_suite.py::test_run_records_nothing: was passed, now failed: {RUN_ERROR}"])


def test_run_raising_on_b_before_a_case_records_its_outputs_is_a_failure_not_a_case_not_run(releases):
    result = releases("case2")
    assert result.ret == 1
    result.stdout.fnmatch_lines([f"FAIL  test_suite.py::test_case[2]: was passed, now failed: {RUN_ERROR}"])
    assert "did not run (" not in result.stdout.str()


def test_the_tests_a_run_stopped_by_x_did_not_run_are_not_run_and_say_why(releases):
    result = releases("case1", "-x")
    lines = verdict_lines(result)
    assert f"FAIL  test_suite.py::test_case[1]: was passed, now failed: {RUN_ERROR}" in lines
    assert "FAIL  test_suite.py::test_case[2]: not run: the run stopped early (stopping after 1 failures)" in lines


def test_run_raising_on_b_is_named_under_xdist_too(releases):
    result = releases("records-nothing", "-p", "xdist", "-n", "1")
    assert result.ret == 1
    result.stdout.fnmatch_lines(["created: 1/1 worker*"])
    result.stdout.fnmatch_lines([f"FAIL  test_suite.py::test_run_records_nothing: was passed, now failed: {RUN_ERROR}"])


@pytest.mark.parametrize(("breaks", "regression"), [
    ("setup", "test_with_workspace: was passed, now error: at setup: RuntimeError: workspace: cudaMalloc failed"),
    ("teardown", "test_with_workspace: was passed, now error: at teardown: RuntimeError: workspace: cudaFree failed"),
    ("finding-gone", "test_known_finding: was xfailed, now xpassed: [XPASS(strict)] finding: CSR metadata refused"),
    ("finding-met", "test_finding_met: was passed, now xfailed: ValueError: fp8 kpe read without k_scale"),
], ids=["passed-to-setup-error", "passed-to-teardown-error", "xfailed-to-xpassed", "passed-to-known-finding"])
def test_each_way_a_test_that_passed_on_a_goes_wrong_on_b_fails_with_its_line(releases, breaks, regression):
    result = releases(breaks)
    assert result.ret == 1
    lines = verdict_lines(result)
    assert lines[0].startswith("FAIL  verdict") and lines[0].endswith("1 regression")
    assert [line for line in lines if line.startswith("FAIL  ")][1:] == [
        next(line for line in lines if line.startswith("FAIL  outcomes")), f"FAIL  test_suite.py::{regression}"]


def test_a_test_skipped_on_b_that_passed_on_a_is_not_run(releases):
    result = releases("skip")
    assert result.ret == 1
    result.stdout.fnmatch_lines([
        "ok    outcomes   none of 9 tests that passed (or xfailed) before fails, errors, xpasses or xfails now",
        "FAIL  not run    1 test of the baseline did not run (`test_skippable`: skipped: needs the planner of "
        "FlashInfer < 0.7.3); 1 skipped in the baseline and not run now, not judged",
        "FAIL  test_suite.py::test_skippable: not run: skipped: needs the planner of FlashInfer < 0.7.3"])


def test_a_test_on_one_side_only_is_not_run_on_a_and_new_on_b(releases, pytester):
    result = releases("renamed")
    assert result.ret == 1
    result.stdout.fnmatch_lines([
        "FAIL  not run    1 test of the baseline did not run (`test_layout[strided]`: not collected (renamed or "
        "removed?)); 1 new test not in the baseline (`test_layout[strided-v2]`), not judged; 1 skipped in the baseline "
        "and not run now, not judged",
        "FAIL  test_suite.py::test_layout[strided]: not run: not collected (renamed or removed?)"])
    report = (pytester.path / "upgrade-renamed" / "report.md").read_text()
    assert "- `test_suite.py::test_layout[strided-v2]`: new" in report


@pytest.mark.parametrize("go_on", [True, False], ids=["continue-on-collection-errors", "stop-there"])
def test_a_module_that_fails_to_import_on_b_names_its_error_and_the_tests_it_kept_from_running(releases, go_on):
    result = releases("import", *(["--continue-on-collection-errors"] if go_on else []))
    assert result.ret != 0
    lines = verdict_lines(result)
    assert ("FAIL  test_planner.py::test_plan: not run: collection error in test_planner.py: ImportError: cannot "
            "import name 'BatchMLAPagedAttentionWrapper' from 'flashinfer.mla'") in lines
    stopped = [line for line in lines if line.startswith("FAIL  test_suite.py::")]
    if go_on:
        assert stopped == [] and "1 regression" in lines[0]
    else:
        assert len(stopped) == 9 and lines[0].startswith("FAIL  GPU tier   did not run")
        assert stopped[0] == ("FAIL  test_suite.py::test_case[1]: not run: the run stopped early (interrupted by 1 "
                              "collection error)")


def test_an_executed_length_that_differs_fails_naming_the_case_and_its_first_differing_entry(releases):
    result = releases("executed_len1")
    assert result.ret == 1
    result.stdout.fnmatch_lines([
        "ok    numerics   all 2 cases with outputs bitwise equal",
        "FAIL  integers   1 of 2 cases with integer results differ (`test_case[1]`: executed_len[5] is 63 now, was 64 "
        "(1 of 8 entries differ))",
        "FAIL  test_suite.py::test_case[1]: executed_len[5] is 63 now, was 64 (1 of 8 entries differ)"])


# --- the rules, on hand-made records ------------------------------------------------------------


@pytest.mark.parametrize(("before", "after", "regressed"), [
    ("passed", "failed", True), ("passed", "error", True), ("passed", "xpassed", True), ("passed", "xfailed", True),
    ("xfailed", "failed", True), ("xfailed", "error", True), ("xfailed", "xpassed", True),
    ("passed", "passed", False), ("xfailed", "xfailed", False), ("xfailed", "passed", False),
    ("failed", "failed", False), ("failed", "error", False), ("skipped", "failed", False), ("error", "passed", False),
])
def test_which_outcome_changes_are_regressions(before, after, regressed):
    assert outcome_regressed(CaseRecord("t::x", outcome=before), CaseRecord("t::x", outcome=after)) == regressed


def test_an_outcome_change_that_is_not_a_regression_is_a_change():
    c = compare_case("t::x", CaseRecord("t::x", outcome="xfailed"), CaseRecord("t::x", outcome="passed"), {}, {})
    assert c.changes == ["outcome xfailed -> passed"] and not c.regressions


def test_integer_results_are_equal_entry_for_entry_across_integer_dtypes():
    lengths = torch.tensor([[3, 7], [2048, 0]], dtype=torch.int32)
    assert integer_difference("executed_len", lengths, lengths.long()) == ""
    moved = lengths.clone()
    moved[1, 0], moved[1, 1] = 2047, 1
    assert integer_difference("executed_len", lengths, moved) == "executed_len[1, 0] is 2047 now, was 2048 (2 of 4 " \
                                                                 "entries differ)"
    assert integer_difference("executed_len", lengths, lengths[:1]) == "executed_len shape (2, 2) -> (1, 2)"
    assert integer_difference("executed_len", lengths, lengths.float()) == ("executed_len dtype torch.int32 -> "
                                                                            "torch.float32")


def test_an_integer_result_missing_from_a_passing_run_is_a_regression_and_floats_still_only_drift():
    out = torch.randn(4, 2, generator=torch.Generator().manual_seed(3))
    before = {"out": out, "executed_len": torch.tensor([16, 64])}
    c = compare_case("t::x", CaseRecord("t::x"), CaseRecord("t::x"), before, {"out": out + 1})
    assert c.regressions == ["executed_len recorded before, not now"]
    assert c.drift["out"]["bitwise_equal"] == 0.0 and "out" not in c.integers
    lines = {line.split()[1]: line for line in summary_lines([c], RunFacts(), RELEASE_A, RELEASE_B)}
    assert lines["integers"].startswith("FAIL") and "executed_len recorded before, not now" in lines["integers"]
    assert lines["numerics"].startswith("note")


MODULE_A = "0.33.0 (SM90 module sha256 5f0c2a9e1b7d)"
MODULE_B = "0.33.0 (SM90 module sha256 0be41c7d2f3a, modified: x.py)"


@pytest.mark.parametrize(("before", "after", "labels"), [
    (RunCode(RELEASE_A, MODULE_A, "H200"), RunCode(RELEASE_B, MODULE_A, "H200"),
     (f"FlashInfer {RELEASE_A}", f"FlashInfer {RELEASE_B} (both: vLLM {MODULE_A}; machine H200)")),
    (RunCode(RELEASE_B, MODULE_A, "sim"), RunCode(RELEASE_B, MODULE_B, "sim"),
     (f"vLLM {MODULE_A}", f"vLLM {MODULE_B} (both: FlashInfer {RELEASE_B}; machine sim)")),
    (RunCode(RELEASE_A, None, "H100"), RunCode(RELEASE_B, MODULE_A, "H200"),
     (f"FlashInfer {RELEASE_A}, vLLM none, machine H100", f"FlashInfer {RELEASE_B}, vLLM {MODULE_A}, machine H200")),
    (RunCode(RELEASE_B), RunCode(RELEASE_B), (f"FlashInfer {RELEASE_B}", f"FlashInfer {RELEASE_B}")),
    (RunCode(RELEASE_A), RunCode(RELEASE_B, None, "H200"), (f"FlashInfer {RELEASE_A}", f"FlashInfer {RELEASE_B}")),
], ids=["flashinfer", "vllm-code", "everything", "nothing", "machine-not-recorded"])
def test_the_check_names_the_runs_by_what_differs_between_them(before, after, labels):
    """A check of two vLLM modules on one FlashInfer is not called a FlashInfer upgrade: the
    report names what changed (FlashInfer, the vLLM module, the machine) and what both ran."""
    assert compared_labels(before, after) == labels


def test_the_outcomes_file_keeps_the_vllm_and_the_machine_of_its_run(tmp_path):
    write_outcomes(tmp_path, {"t::x": Outcome("passed")}, RELEASE_A, vllm=MODULE_A, machine="H200")
    assert read_run_code(tmp_path) == RunCode(RELEASE_A, MODULE_A, "H200")
    write_outcomes(tmp_path, {"t::x": Outcome("passed")}, RELEASE_B)
    assert read_run_code(tmp_path) == RunCode(RELEASE_B)


def damaged_outcomes(damage: str):
    """An outcomes file's JSON with ``damage`` done to it."""
    good = {"schema": 3, "flashinfer": RELEASE_A, "tests": {"t::x": {"outcome": "passed", "line": ""}}}
    return {"old-schema": dict(good, schema=2), "bad-outcome": dict(good, tests={"t::x": {"outcome": "maybe",
                                                                                        "line": ""}}),
            "no-tests": {"schema": 3, "flashinfer": None}}[damage]


@pytest.mark.parametrize(("damage", "message"), [
    ("missing", "baseline {dir} holds no outcomes.json (the outcome of every test the run ran)"),
    ("not-json", "{file}: not a readable JSON outcomes file"),
    ("old-schema", "{file}: schema 2, this tool reads schema 3"),
    ("no-tests", "{file}: outcomes field 'tests' is missing"),
    ("bad-outcome", "{file}: outcomes field 'tests[t::x].outcome' is str \"maybe\", expected one of passed, failed, "
                    "skipped, xfailed, xpassed, error"),
])
def test_a_baseline_without_a_readable_outcomes_file_is_refused_naming_it(tmp_path, damage, message):
    write_record(tmp_path, CaseRecord("t::x"), None)
    path = tmp_path / OUTCOMES_FILE
    if damage == "not-json":
        path.write_text("{")
    elif damage != "missing":
        path.write_text(json.dumps(damaged_outcomes(damage)))
    with pytest.raises(BaselineError, match="record it again with --record-baseline") as info:
        check_baseline(tmp_path)
    assert message.format(dir=tmp_path, file=path) in str(info.value)
    write_outcomes(tmp_path, {"t::x": Outcome("passed")}, RELEASE_A)
    assert list(check_baseline(tmp_path)) == ["t::x"], "the outcomes file is no case record"


def test_a_test_that_recorded_outputs_before_and_passes_now_without_them_is_not_run(tmp_path):
    fixture = "tests/test_replay.py::test_replay_fixture[c.safetensors]"
    case = "tests/gpu/test_x.py::test_case[a]"
    write_record(tmp_path / "a", CaseRecord(fixture, fixture="/fixtures/c.safetensors"), None)
    write_record(tmp_path / "a", CaseRecord(case), {"executed_len": torch.tensor([16, 64])})
    for folder in ("a", "b"):
        write_outcomes(tmp_path / folder, {fixture: Outcome("passed"), case: Outcome("passed")}, RELEASE_A)
    run = RunFacts(outcomes={fixture: "passed", case: "passed"}, not_rerun={fixture: "no CUDA device"})
    comparisons = {c.case: c for c in compare_directories(tmp_path / "a", tmp_path / "b", run)}
    assert comparisons[fixture].regressions == ["not run: not re-run: no CUDA device"]
    assert comparisons[case].regressions == ["not run: ran without recording its outputs (passed)"]
