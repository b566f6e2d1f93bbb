"""The upgrade check: comparison rules on hand-made records (behaviour changes, drift, times
and what counts as a regression), the report's summary, and through pytester the plugin's
refusals (unusable baseline, non-empty output folder), a run that ran no GPU case, baseline
cases not run or deselected, and the timing pass's plumbing (GPU count faked)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import pytest_sparse_mla.baselines as plugin
from recording.baseline import (
    RECORDED_ONLY,
    SCHEMA,
    BaselineError,
    CaseRecord,
    Outcome,
    RunFacts,
    check_baseline,
    compare_case,
    compare_directories,
    drift,
    judge_time,
    merge_timings,
    missing_case_status,
    passed,
    read_records,
    repeated_medians,
    safe_name,
    spread,
    summary_lines,
    timed_cases,
    write_outcomes,
    write_record,
    write_report,
    write_timing,
)
from recording.baseline import summary as summary_of
from recording.fixture import load_fixture
from tests.support.child_runs import run_plugin_in_process as run

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures"
STEADY = [70.0, 70.5, 69.8]  # repeated medians (us) that agree within the spread limits


def bf16_values(*shape: int, seed: int = 0) -> torch.Tensor:
    """Seeded bf16 test data: the same tensor on every run and every worker."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(torch.bfloat16)


def rec(**kw) -> CaseRecord:
    return CaseRecord(case=kw.pop("case", "tests/gpu/test_x.py::test_case[a]"), **kw)


def summary(comparisons, run=None, before="0.7.2") -> dict[str, str]:
    """Summary lines by class name -> the line."""
    return {line.split()[1]: line for line in summary_lines(comparisons, run or RunFacts(), before, "0.7.4")}


# --- comparison rules ---------------------------------------------------------------------------


def test_drift_counts_bitwise_equal_elements_relative_l2_and_the_rows_that_differ():
    a = torch.full((8, 8), 1.0, dtype=torch.bfloat16)
    b = a.clone()
    b[2] = 1.0078125  # the next bf16 above 1
    b[5, :2] = 1.5
    d = drift(a, b)
    assert d["bitwise_equal"] == 54 / 64 and d["max_abs"] == 0.5
    assert d["rel_l2"] == pytest.approx((8 * 0.0078125**2 + 2 * 0.5**2) ** 0.5 / 8)
    assert (d["rows"], d["rows_differing"]) == (8, 2)
    assert [r for r, _ in d["worst_rows"]] == [5, 2], "the row that moved most comes first"
    same = drift(a, a)
    assert (same["bitwise_equal"], same["max_abs"], same["rows_differing"]) == (1.0, 0.0, 0)


def test_empty_outputs_count_as_equal():
    empty = torch.zeros(0, 4, 8, dtype=torch.bfloat16)
    assert drift(empty, empty)["bitwise_equal"] == 1.0


def test_newly_raising_is_a_regression_and_names_the_error():
    c = compare_case("c", rec(outcome="passed"), rec(outcome="failed", error="ValueError: CSR metadata page counts"),
                     {}, {})
    assert c.refusal == "new" and c.regressions and "ValueError: CSR metadata" in c.regressions[0]


def test_a_newly_raising_call_is_a_regression_even_when_the_suite_expects_it():
    c = compare_case("c", rec(outcome="passed"), rec(outcome="passed", error="ValueError at plan: CSR"), {}, {})
    assert c.regressions == ["newly raising: ValueError at plan: CSR"]


def test_an_expected_finding_that_keeps_failing_is_not_a_regression():
    assert not compare_case("c", rec(outcome="xfailed"), rec(outcome="xfailed"), {}, {}).regressions


def test_newly_passing_and_new_or_gone_warnings_are_changes_not_regressions():
    c = compare_case("c", rec(outcome="failed", warnings=["UserWarning: old"]),
                     rec(outcome="passed", warnings=["DeprecationWarning: positional"]), {}, {})
    assert not c.regressions
    assert "outcome failed -> passed" in c.changes
    assert any("new warnings: DeprecationWarning" in ch for ch in c.changes)
    assert any("warnings gone: UserWarning" in ch for ch in c.changes)


# --- times --------------------------------------------------------------------------------------


def test_repeated_medians_are_medians_of_each_measurement_in_microseconds():
    samples = iter([[1e-6, 9e-6, 2e-6], [3e-6, 3e-6, 100e-6], [4e-6, 5e-6, 6e-6]])
    assert repeated_medians(lambda: next(samples), 3) == pytest.approx([2.0, 3.0, 5.0])


def test_spread_is_range_over_median():
    assert spread([100.0, 110.0, 105.0]) == pytest.approx(10 / 105)
    assert spread([1.0, 1.0, 1.0]) == 0.0


def test_plan_time_past_the_limit_is_a_regression_and_kernel_noise_is_not():
    c = compare_case("c", rec(plan_us_repeats=[150.0, 151.0, 149.0], kernel_us_repeats=[73.0, 73.2, 73.1]),
                     rec(plan_us_repeats=[1300.0, 1310.0, 1295.0], kernel_us_repeats=[74.0, 74.1, 73.9]), {}, {})
    assert round(c.plan_time.ratio, 2) == 8.67 and any("plan() time x8.67" in r for r in c.regressions)
    assert c.kernel_time.judged and not c.kernel_time.regressed, "1.4% kernel change is noise"


def test_kernel_time_needs_both_the_ratio_and_the_absolute_floor():
    assert not judge_time("kernel", [3.0] * 3, [4.5] * 3, 1.15, 0.1, floor_us=2.0).regressed, "below the floor"
    slow = judge_time("kernel", [70.0] * 3, [90.0] * 3, 1.15, 0.1, floor_us=2.0)
    assert slow.judged and slow.regressed and "kernel time x1.29" in slow.why


def test_unstable_times_are_reported_not_judged():
    noisy = [12_000.0, 96_000.0, 40_000.0]  # plan() under contention: 12 to 96 ms for one case
    j = judge_time("plan()", [150.0, 151.0, 150.0], noisy, 2.0, 0.25)
    assert not j.judged and not j.regressed and "unstable now" in j.why
    assert "unstable in the baseline" in judge_time("plan()", noisy, [150.0] * 3, 2.0, 0.25).why


def test_a_refused_plan_has_no_time_to_judge_and_says_nothing_about_it():
    c = compare_case("c", rec(kernel_us_repeats=STEADY, plan_us_repeats=STEADY), rec(error="ValueError at plan: CSR"),
                     {}, {})
    assert (c.kernel_time.judged, c.kernel_time.why, c.plan_time.why) == (False, "", "")
    timed = compared(rec(case="t::timed", kernel_us_repeats=STEADY, plan_us_repeats=STEADY),
                     rec(case="t::timed", kernel_us_repeats=STEADY, plan_us_repeats=STEADY))
    line = summary([c, timed])["time"]
    assert line.startswith("ok    time       2 times judged") and "not judged" not in line


def test_a_time_missing_on_either_side_is_not_judged():
    assert judge_time("kernel", [], STEADY, 1.15, 0.1).why == "kernel not timed in the baseline"
    assert judge_time("kernel", STEADY, [], 1.15, 0.1).why == "kernel not timed now"


def test_merge_timings_writes_the_timing_pass_medians_into_the_records(tmp_path):
    write_record(tmp_path, rec(case="t::x"), None)
    write_record(tmp_path, rec(case="t::y"), None)
    write_timing(tmp_path / "timing", "t::x", STEADY, [150.0, 151.0, 152.0])
    write_timing(tmp_path / "timing", "t::gone", STEADY, STEADY)
    assert merge_timings(tmp_path, tmp_path / "timing") == 1
    records = read_records(tmp_path)
    assert records["t::x"].kernel_us_repeats == STEADY and records["t::x"].plan_us == 151.0
    assert records["t::y"].kernel_us is None


# --- baseline cases that did not run ----------------------------------------------------------


def test_a_baseline_case_missing_now_is_not_run_unless_the_run_left_it_out():
    gpu = "tests/gpu/test_attention_regimes.py::test_large_batches[x]"
    run = RunFacts(deselected=frozenset({gpu}), selected_paths=("tests/gpu",),
                   outcomes={"tests/gpu/test_a.py::t": "skipped: GPU tier: no CUDA device"})
    assert missing_case_status(gpu, run) == ("deselected", "deselected by -k/-m")
    assert missing_case_status("tests/cpu/test_b.py::t", run) == ("deselected", "outside the paths given")
    assert missing_case_status("tests/gpu/test_a.py::t", run) == ("not run", "skipped: GPU tier: no CUDA device")
    assert missing_case_status("tests/gpu/test_a.py::u", run)[0] == "not run"
    not_run = compare_case("tests/gpu/test_a.py::t", rec(), None, {}, {}, run)
    assert not_run.regressions == ["not run: skipped: GPU tier: no CUDA device"]
    assert not compare_case(gpu, rec(), None, {}, {}, run).regressions


def test_a_path_argument_selects_the_cases_under_it():
    run = RunFacts(selected_paths=("tests/gpu/test_a.py::test_k",))
    assert missing_case_status("tests/gpu/test_a.py::test_k[p1]", run)[0] == "not run"
    assert missing_case_status("tests/gpu/test_a.py::test_kk", run)[0] == "deselected"


# --- the report ---------------------------------------------------------------------------------


def compared(before: CaseRecord, after: CaseRecord, bo=None, ao=None, run=None):
    return compare_case(before.case, before, after, bo or {}, ao or {}, run)


def fixture_rec(name: str, **kw) -> CaseRecord:
    """A fixture replay's record (as note_fixture_replay writes it)."""
    return rec(case=f"tests/test_replay.py::test_replay_fixture[fixtures/{name}.safetensors]",
               fixture=str(FIXTURES / f"{name}.safetensors"), **kw)


def test_a_release_against_itself_passes_with_every_class_ok():
    out = {"out": bf16_values(6, 2, 8)}
    r = rec(ratios={"out_max_ratio": 0.4}, kernel_us_repeats=STEADY, plan_us_repeats=[150.0, 152.0, 149.0])
    f = fixture_rec("a-identity-fill-bf16")
    lines = summary([compared(r, r, out, out), compared(f, f, out, out)])
    assert lines["verdict"].startswith("PASS")
    assert "2 tests compared, 1 case and 1 fixture of them on their records, no regression" in lines["verdict"]
    assert all(line.startswith("ok") for name, line in lines.items() if name != "verdict"), lines
    assert "2 times judged (one process per GPU, 3 medians of 15)" in lines["time"]
    assert "not judged" not in lines["time"]
    assert lines["fixtures"] == ("ok    fixtures   1 re-run: 1 of 1 with outputs bitwise equal to 0.7.2; refusals 0 "
                                 "new, 0 gone")


def test_summary_has_one_line_per_class_of_change():
    out = bf16_values(6, 2, 8)
    moved = out.clone()
    moved[4] += 0.5
    comparisons = [
        compared(rec(case="t::strided"), rec(case="t::strided", error="ValueError at plan: CSR metadata")),
        compared(rec(case="t::drift", ratios={"out_max_ratio": 0.4}), rec(case="t::drift",
                                                                          ratios={"out_max_ratio": 0.6}),
                 {"out": out}, {"out": moved}),
        compared(rec(case="t::warn"), rec(case="t::warn", warnings=["DeprecationWarning: flat form"])),
        compared(rec(case="t::slow", plan_us_repeats=[150.0] * 3), rec(case="t::slow", plan_us_repeats=[1500.0] * 3)),
        compare_case("t::gone", rec(case="t::gone"), None, {}, {}, RunFacts()),
        compare_case("t::new", None, rec(case="t::new"), {}, {}),
    ]
    lines = summary(comparisons)
    assert lines["verdict"].startswith("FAIL") and "3 regressions" in lines["verdict"]
    assert lines["refusals"].startswith("FAIL") and "1 new, 0 gone" in lines["refusals"]
    assert "CSR metadata" in lines["refusals"]
    assert lines["numerics"].startswith("note") and "`drift` out" in lines["numerics"]
    assert "1/6 rows" in lines["numerics"]
    assert "worst rows 4 (" in lines["numerics"]
    assert lines["errors"].startswith("note") and "out_max_ratio 0.4 -> 0.6" in lines["errors"]
    assert lines["time"].startswith("FAIL") and "plan() time x10.00" in lines["time"]
    assert lines["warnings"].startswith("note") and "1 new, 0 gone" in lines["warnings"]
    assert lines["not"].startswith("FAIL") and "1 test of the baseline did not run" in lines["not"]
    assert "1 new test not in the baseline (`new`), not judged" in lines["not"]
    assert list(lines) == ["verdict", "refusals", "outcomes", "numerics", "integers", "errors", "time", "warnings",
                           "fixtures", "not"]
    assert all(len(line) < 200 for line in lines.values()), "each line fits a terminal's glance"


def test_the_verdict_is_read_from_the_lines_status_data():
    out = bf16_values(6, 2, 8)
    moved = out.clone()
    moved[1] += 0.5
    drifting = [compared(rec(), rec(), {"out": out}, {"out": moved})]
    refused = [compared(rec(), rec(error="ValueError at plan: CSR"))]
    for comparisons, verdict in ((drifting, "PASS"), (refused, "FAIL")):
        lines = summary_of(comparisons, RunFacts(), "0.7.2", "0.7.4")
        below = {line.name: line.status for line in lines[1:]}
        assert lines[0].status == verdict and passed(lines) == (verdict == "PASS")
        assert ("FAIL" in below.values()) == (verdict == "FAIL"), below
        assert [line.render() for line in lines] == summary_lines(comparisons, RunFacts(), "0.7.2", "0.7.4")
    assert below["refusals"] == "FAIL" and summary_of(drifting, RunFacts(), "a", "b")[3].status == "note"


def test_times_not_taken_are_said_and_a_failed_timing_pass_fails():
    r = rec(plan_us_repeats=[150.0] * 3)
    off = RunFacts(timing="--baseline-timing=off")
    assert summary([compared(r, rec())], off)["time"].startswith("note  time       not judged: --baseline-timing=off")
    broken = RunFacts(timing="timing pass failed: GPU 0 exit status 2", timing_failed=True)
    lines = summary([compared(r, rec())], broken)
    assert lines["time"].startswith("FAIL") and lines["verdict"].startswith("FAIL")


def test_a_run_with_no_record_is_no_green(tmp_path):
    run = RunFacts(gpu_skip_reason="GPU tier: no CUDA device")
    comparisons = [compare_case("t::x", rec(case="t::x"), None, {}, {}, run)]
    assert not write_report(comparisons, tmp_path, "0.7.2", "0.7.4", run)
    md = (tmp_path / "report.md").read_text()
    assert "GPU tier   did not run (GPU tier: no CUDA device)" in md


def test_directories_round_trip_into_markdown_and_json(tmp_path):
    out = bf16_values(4, 2, 8)
    write_record(tmp_path / "a", rec(case="t::x", flashinfer="0.6.18.post1", kernel_us_repeats=STEADY,
                                     plan_us_repeats=[150.0] * 3, ratios={"out_max_ratio": 1.1}), {"out": out})
    write_record(tmp_path / "b", rec(case="t::x", flashinfer="0.7.4", kernel_us_repeats=STEADY,
                                     plan_us_repeats=[1400.0] * 3, ratios={"out_max_ratio": 1.1}), {"out": out})
    write_record(tmp_path / "b", rec(case="t::new", flashinfer="0.7.4"), None)
    comparisons = compare_directories(tmp_path / "a", tmp_path / "b")
    assert [c.case for c in comparisons] == ["t::new", "t::x"]
    assert comparisons[1].drift["out"]["bitwise_equal"] == 1.0
    assert not write_report(comparisons, tmp_path / "report", "0.6.18.post1", "0.7.4")
    md = (tmp_path / "report" / "report.md").read_text()
    head = md.split("```")[1].strip().splitlines()
    assert head[0].startswith("FAIL  verdict") and "0.6.18.post1 -> 0.7.4" in head[0]
    assert "plan() time x9.33" in md and "t::new`: new" in md
    data = json.loads((tmp_path / "report" / "report.json").read_text())
    assert data["passed"] is False and data["summary"] == head
    assert data["cases"][1]["plan_time"]["ratio"] == pytest.approx(1400 / 150)


# --- unusable baselines -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: None, "does not exist"),
        (lambda d: d.mkdir(), "holds no case records"),
        (lambda d: (d.mkdir(), (d / "x.json").write_text("{not json")), "x.json: not a readable JSON record"),
        (lambda d: (d.mkdir(), (d / "x.json").write_text('{"case": "t::x"}')), "x.json: no schema field"),
        (lambda d: (d.mkdir(), (d / "x.json").write_text('{"case": "t::x", "schema": 1}')),
         "x.json: schema 1, this tool reads"),
        (lambda d: (d.mkdir(), (d / "x.json").write_text(json.dumps({"case": "t::x", "timing_workers": 16,
                                                                     "schema": SCHEMA}))),
         "fields ['timing_workers'] do not fit"),
    ],
    ids=["missing", "empty", "corrupt", "no-schema", "old-schema", "other-fields"],
)
def test_an_unusable_baseline_is_refused_naming_the_path(tmp_path, make, message):
    make(tmp_path / "base")
    with pytest.raises(BaselineError, match="--record-baseline") as e:
        check_baseline(tmp_path / "base")
    assert str(tmp_path / "base") in str(e.value) and message in str(e.value)


@pytest.mark.parametrize("name", ["case.safetensors", "case.recipe.json", "case.sequence.json", "case.case.json"])
def test_a_written_case_given_as_a_baseline_is_named_as_one_with_what_to_give(tmp_path, name):
    (tmp_path / name).write_text("{}")
    with pytest.raises(BaselineError) as e:
        check_baseline(tmp_path / name)
    said = str(e.value)
    path = tmp_path / name
    assert f"is a written case (a file --dump-failures writes), not a baseline: run it with --replay={path}" in said
    assert "the folder --record-baseline wrote" in said


# --- the plugin, through pytester ---------------------------------------------------------------

CASES = """
import os

import pytest
import torch

from pytest_sparse_mla.baselines import timing_directory


@pytest.mark.parametrize("k", [1, 2, 3])
def test_case(request, baseline, k):
    if os.environ.get("SKIP_CASE") == str(k):
        pytest.skip("GPU tier: no CUDA device")
    if timing_directory(request.config) is not None:
        slow = 3.0 if os.environ.get("SLOW_CASE") == str(k) else 1.0
        baseline.note(kernel_us_repeats=[70.0 * slow, 70.5 * slow, 69.9 * slow], plan_us_repeats=[150.0, 151.0, 150.0])
        return
    baseline.note(ratios={"out_max_ratio": 0.4}, outputs={"out": torch.full((4, 2), float(k))})


def test_cpu_only():
    pass
"""


@pytest.fixture
def suite(pytester, gpu_tier_may_run):
    pytester.makeconftest('pytest_plugins = ("pytest_sparse_mla",)')
    pytester.makepyfile(test_cases=CASES)
    return pytester


def record(pytester, *args):
    result = run(pytester, "--record-baseline=base", "--baseline-timing=off", *args)
    assert result.ret == 0, result.stdout.str()
    return pytester.path / "base"


def test_a_missing_baseline_is_a_usage_error_before_any_test_runs(suite):
    result = run(suite, "--compare-baseline=nowhere")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--compare-baseline: baseline nowhere does not exist*"])
    assert "passed" not in result.stdout.str() and not (suite.path / "baseline-compare").exists()


@pytest.mark.parametrize("damage", ["truncated", "garbage", "orphan"])
def test_every_outputs_file_of_a_baseline_is_checked_at_start_up(suite, damage):
    base = record(suite)
    outputs = base / "test_case_2_.safetensors"
    if damage == "truncated":
        outputs.write_bytes(outputs.read_bytes()[:-7])
    elif damage == "garbage":
        outputs.write_bytes(b"not a safetensors file")
    else:
        (base / "test_case_2_.json").unlink()
    result = run(suite, f"--compare-baseline={base}", "--baseline-timing=off")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    message = ("outputs with no record beside them" if damage == "orphan"
               else "not a readable safetensors file of outputs")
    result.stderr.fnmatch_lines([f"*--compare-baseline: {outputs}: {message}*"])
    assert "passed" not in result.stdout.str() and not (suite.path / "baseline-compare").exists()


def test_an_outputs_file_unreadable_after_start_up_fails_the_check_in_one_line(tmp_path):
    write_record(tmp_path / "a", rec(case="t::x"), {"out": bf16_values(4, 2)})
    write_record(tmp_path / "b", rec(case="t::x"), {"out": bf16_values(4, 2)})
    (tmp_path / "b" / "x.safetensors").write_bytes(b"\0" * 12)
    with pytest.raises(BaselineError, match="x.safetensors: not a readable safetensors file of outputs"):
        compare_directories(tmp_path / "a", tmp_path / "b")


def test_a_corrupt_baseline_is_a_usage_error_naming_the_file(suite):
    (suite.path / "base").mkdir()
    (suite.path / "base" / "x.json").write_text("{")
    result = run(suite, "--compare-baseline=base")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*base/x.json: not a readable JSON record*"])


@pytest.mark.parametrize("option", ["--record-baseline=out", "--baseline-out=out"])
def test_a_non_empty_output_folder_is_refused(suite, option):
    base = record(suite)
    (suite.path / "out").mkdir()
    (suite.path / "out" / "leftover.json").write_text("{}")
    result = run(suite, option, f"--compare-baseline={base}" if "baseline-out" in option else "-q")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{option.split('=')[0]}: out is not empty*rm -r out*"])


def test_a_release_against_itself_passes_and_prints_the_summary(suite):
    base = record(suite)
    assert sorted(p.name for p in base.glob("*.json")) == ["outcomes.json", "test_case_1_.json", "test_case_2_.json",
                                                           "test_case_3_.json"]
    result = run(suite, f"--compare-baseline={base}", "--baseline-timing=off")
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(["*= upgrade check =*",
                                 "PASS  verdict*4 tests compared, 3 cases of them on their records, no regression",
                                 "ok    refusals   0 new, 0 gone",
                                 "ok    outcomes   none of 4 tests that passed (or xfailed) before fails, errors, "
                                 "xpasses or xfails now",
                                 "ok    numerics   all 3 cases with outputs bitwise equal",
                                 "note  time       not judged: --baseline-timing=off",
                                 "report: baseline-compare/report.md"])


def test_a_run_that_ran_no_gpu_case_fails(suite):
    base = record(suite)
    result = run(suite, f"--compare-baseline={base}", "-k", "cpu_only")
    assert result.ret == 1
    result.stdout.fnmatch_lines(["FAIL  GPU tier   did not run*nothing was compared"])


def test_a_baseline_case_skipped_now_fails_and_one_deselected_by_k_does_not(suite, monkeypatch):
    base = record(suite)
    monkeypatch.setenv("SKIP_CASE", "2")
    result = run(suite, f"--compare-baseline={base}", "--baseline-timing=off", "--baseline-out=skipped")
    assert result.ret == 1
    result.stdout.fnmatch_lines(["FAIL  not run    1 test of the baseline did not run (`test_case[2]`: skipped: GPU "
                                 "tier: no CUDA device)",
                                 "FAIL  test_cases.py::test_case[2]: not run: skipped: GPU tier: no CUDA device"])
    monkeypatch.delenv("SKIP_CASE")
    result = run(suite, f"--compare-baseline={base}", "--baseline-timing=off", "--baseline-out=narrow", "-k", "not 3")
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(["note  not run    0 tests of the baseline did not run; 1 left out by this run's "
                                 "selection (deselected by -k/-m), not judged"])


def test_deselection_is_known_under_xdist_too(suite):
    base = record(suite)
    result = suite.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:benchmark", "--rootdir", str(suite.path),
                                       "-n", "1",
                                       f"--compare-baseline={base}", "--baseline-timing=off", "-k", "not 3")
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(["*1 left out by this run's selection (deselected by -k/-m)*"])


class SpawnLog:
    """Stands in for the plugin's ``subprocess``: records each timing process it is asked to
    start (its command, its CUDA_VISIBLE_DEVICES, its log) and starts none."""

    STDOUT = subprocess.STDOUT

    def __init__(self):
        self.started = []

    def Popen(self, cmd, *, env, stdout, **kwargs):
        self.started.append((env["CUDA_VISIBLE_DEVICES"], [a for a in cmd if "::test_case[" in a],
                             Path(stdout.name).name, cmd))
        return SimpleNamespace(wait=lambda: 0)


def test_the_timing_pass_starts_one_process_per_gpu_each_with_its_cases(suite, monkeypatch):
    """Which processes the timing pass starts, without starting them (the test below times
    through a real one)."""
    spawned = SpawnLog()
    monkeypatch.setattr(plugin, "subprocess", spawned)
    monkeypatch.setattr(plugin, "visible_gpus", lambda: ["0", "1"])
    result = run(suite, f"--record-baseline={suite.path / 'base'}")
    cases = [f"{suite.path}/test_cases.py::test_case[{k}]" for k in (1, 2, 3)]
    assert [(gpu, part, log) for gpu, part, log, _ in spawned.started] == [
        ("0", [cases[0], cases[2]], "gpu0.log"), ("1", [cases[1]], "gpu1.log")]
    for *_, cmd in spawned.started:
        assert cmd[:3] == [sys.executable, "-m", "pytest"] and "-p" in cmd and "no:xdist" in cmd
        assert f"--baseline-timing-out={(suite.path / 'base' / 'timing').resolve()}" in cmd
    assert result.ret == 1  # the processes stood in for timed nothing
    result.stdout.fnmatch_lines(["FAIL  baseline *base: * the timing pass timed none of 3 cases*"])


def test_the_timing_pass_times_each_case_in_a_process_per_gpu_and_judges_only_those_times(suite, monkeypatch):
    monkeypatch.setattr(plugin, "visible_gpus", lambda: ["0"])
    base = suite.path / "base"
    result = run(suite, f"--record-baseline={base}")
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(["PASS  baseline *base: 4 test outcomes, 3 cases and 0 fixture re-runs recorded, 3 "
                                 "timed by the timing pass"])
    assert sorted(p.name for p in (base / "timing").glob("*.log")) == ["gpu0.log"]
    assert check_baseline(base)["test_cases.py::test_case[2]"].kernel_us_repeats == [70.0, 70.5, 69.9]
    monkeypatch.setenv("SLOW_CASE", "3")
    result = run(suite, f"--compare-baseline={base}")
    assert result.ret == 1
    result.stdout.fnmatch_lines(["FAIL  time       6 times judged (one process per GPU, 3 medians of 15): 1 slower "
                                 "past the limits, worst kernel time x3.00 (70.0 -> 210.0 us)"])


def test_the_timing_pass_finds_the_plugin_from_a_checkout_that_is_not_installed(tmp_path, monkeypatch):
    """Its processes start in the user's folder; the plugin's own folder leads their PYTHONPATH,
    so a checkout run without ``pip install -e`` is timed, not 'timed none of N cases'."""
    from recording.commands import PROJECT_ROOT, with_the_project_on_path

    env = with_the_project_on_path({"PYTHONPATH": f"{tmp_path}{os.pathsep}{PROJECT_ROOT}", "X": "1"})
    assert env == {"PYTHONPATH": f"{PROJECT_ROOT}{os.pathsep}{tmp_path}", "X": "1"}
    child = subprocess.run([sys.executable, "-S", "-c", "import recording.commands, mla_constants"], cwd=tmp_path,
                           env=with_the_project_on_path({}), capture_output=True, text=True)
    assert child.returncode == 0, child.stderr


def test_without_a_gpu_the_due_timing_pass_fails_the_check(suite, monkeypatch):
    base = record(suite)
    monkeypatch.setattr(plugin, "visible_gpus", lambda: [])
    result = run(suite, f"--compare-baseline={base}")
    assert result.ret == 1
    result.stdout.fnmatch_lines(["FAIL  time       not judged: no GPU visible for the timing pass"])


def test_shard_spreads_cases_round_robin_over_the_gpus():
    assert plugin.shard(["a", "b", "c"], 2) == [["a", "c"], ["b"]]
    assert plugin.shard(["a"], 4) == [["a"]]


def test_cases_outside_the_paths_given_are_left_out_not_failed(suite):
    suite.makepyfile(test_other="def test_other(baseline):\n    baseline.note(ratios={'out_max_ratio': 0.1})\n")
    base = record(suite)
    result = run(suite, f"--compare-baseline={base}", "--baseline-timing=off", str(suite.path / "test_cases.py"))
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(["*1 left out by this run's selection (outside the paths given), not judged"])


# --- fixtures across releases -------------------------------------------------------------------


def bumped(x: torch.Tensor, row: int) -> torch.Tensor:
    """``x`` with one element of ``row`` one unit in the last place away."""
    y = x.clone()
    bits = {2: torch.int16, 4: torch.int32}[y.element_size()]
    y[row].view(-1)[:1].view(bits).add_(1)
    return y


def fixture_outputs(name: str, version: str = "0.7.4") -> dict[str, torch.Tensor]:
    out, lse = load_fixture(FIXTURES / f"{name}.safetensors").outputs[version]
    return {"out": out, "lse": lse}


def test_drift_reads_bits_so_a_nan_equals_itself_and_differs_from_a_number_by_infinity():
    a = torch.tensor([[1.0, float("nan")], [float("-inf"), 2.0]])
    assert drift(a, a.clone())["bitwise_equal"] == 1.0
    b = a.clone()
    b[1, 0] = 0.0
    d = drift(a, b)
    assert (d["rows_differing"], d["max_abs"], d["worst_rows"]) == (1, float("inf"), [[1, float("inf")]])


def test_long_case_ids_get_distinct_record_files():
    deep = "tests/test_replay.py::test_replay_fixture[/" + "captures/" * 30 + "{}.safetensors]"
    names = {safe_name(deep.format(n)) for n in ("a", "b")}
    assert len(names) == 2 and all(len(n) <= 180 for n in names)
    assert safe_name("tests/gpu/test_x.py::test_case[a-1]") == "test_case_a-1_"


def test_fixture_re_runs_are_never_timed_and_leave_the_time_line_alone():
    records = {"t::gpu": rec(case="t::gpu"), "f": fixture_rec("c-compacted-fp8"), "t::refused": rec(error="ValueError")}
    assert timed_cases(records) == ["t::gpu"]
    c = compared(fixture_rec("c-compacted-fp8"), fixture_rec("c-compacted-fp8"))
    assert (c.kernel_time.why, c.plan_time.why) == ("", "")
    timed = rec(kernel_us_repeats=STEADY, plan_us_repeats=STEADY)
    assert "not judged" not in summary([c, compared(timed, timed)])["time"]


def test_fixtures_have_their_own_line_with_equal_outputs_the_worst_rows_and_refusals():
    equal = fixture_outputs("a-identity-fill-bf16")
    old = fixture_outputs("c-compacted-fp8")
    new = dict(old, lse=bumped(old["lse"], 2))
    comparisons = [
        compared(fixture_rec("a-identity-fill-bf16"), fixture_rec("a-identity-fill-bf16"), equal, equal),
        compared(fixture_rec("c-compacted-fp8"), fixture_rec("c-compacted-fp8"), old, new),
        compared(fixture_rec("h-kpool1-decode-bf16"), fixture_rec("h-kpool1-decode-bf16",
                                                                  error="ValueError: CSR metadata")),
        compared(rec(case="t::gpu"), rec(case="t::gpu")),
    ]
    lines = summary(comparisons)
    line = lines["fixtures"]
    assert line.startswith("FAIL  fixtures   3 re-run: 1 of 2 with outputs bitwise equal to 0.7.2"), line
    assert "worst `c-compacted-fp8` lse max abs" in line and "1/4 rows differ, worst rows 2 (" in line
    assert "refusals 1 new, 0 gone (now raising: ValueError: CSR metadata in `h-kpool1-decode-bf16`)" in line
    assert lines["verdict"].startswith("FAIL")
    assert "4 tests compared, 1 case and 3 fixtures of them on their records, 1 regression" in lines["verdict"]
    assert lines["refusals"].startswith("ok") and lines["numerics"].startswith("ok"), \
        "GPU-tier lines count GPU-tier cases"


def test_a_fixture_that_passed_and_fails_now_fails_the_fixtures_line():
    c = compared(fixture_rec("c-compacted-fp8"), fixture_rec("c-compacted-fp8", outcome="failed"))
    assert c.regressions == ["was passed, now failed"]
    assert summary([c])["fixtures"].startswith("FAIL")
    assert "1 that passed fail now (`c-compacted-fp8`: failed)" in summary([c])["fixtures"]


def after_only(tmp_path, version: str, record: CaseRecord, outputs=None) -> list:
    """compare_directories of a baseline holding one GPU-tier case of ``version`` and a
    run that recorded ``record`` (a fixture the baseline has no record of)."""
    write_record(tmp_path / "base", rec(case="t::gpu", flashinfer=version), None)
    write_record(tmp_path / "now", rec(case="t::gpu", flashinfer="0.8.0"), None)
    write_record(tmp_path / "now", record, outputs)
    return [c for c in compare_directories(tmp_path / "base", tmp_path / "now") if c.is_fixture]


def test_a_fixture_the_baseline_did_not_record_is_compared_with_the_file_s_own_output(tmp_path):
    [c] = after_only(tmp_path, "0.7.4", fixture_rec("c-compacted-fp8", flashinfer="0.8.0"),
                     fixture_outputs("c-compacted-fp8"))
    assert (c.status, c.against, c.bitwise_equal) == ("compared", "the fixture file's 0.7.4 record", True)
    assert set(c.drift) == {"out", "lse"} and not c.regressions
    line = summary([c], before="0.7.4")["fixtures"]
    assert line == ("ok    fixtures   1 re-run: 1 of 1 with outputs bitwise equal to 0.7.4 (1 compared with the "
                    "fixture file's record); refusals 0 new, 0 gone")

    moved = fixture_outputs("c-compacted-fp8", "0.6.18.post1")
    bumped_out = dict(moved, out=bumped(moved["out"], 3))
    [c] = after_only(tmp_path / "old", "0.6.18.post1", fixture_rec("c-compacted-fp8"), bumped_out)
    assert c.drift["out"]["worst_rows"][0][0] == 3 and c.drift["lse"]["bitwise_equal"] == 1.0
    assert summary([c])["fixtures"].startswith("note") and "worst `c-compacted-fp8` out" in summary([c])["fixtures"]


def test_a_refusal_recorded_in_the_fixture_file_is_the_old_release_s_refusal(tmp_path):
    refused = load_fixture(FIXTURES / "strided-seed-layout-bf16.safetensors").meta["refused"]["0.7.4"]
    [same] = after_only(tmp_path / "a", "0.7.4", fixture_rec("strided-seed-layout-bf16", error=refused))
    assert same.status == "compared" and same.refusal == "" and not same.regressions
    old = fixture_outputs("strided-seed-layout-bf16", "0.6.18.post1")
    [gone] = after_only(tmp_path / "b", "0.7.4", fixture_rec("strided-seed-layout-bf16"), old)
    assert gone.refusal == "gone" and not gone.regressions and "refusals 0 new, 1 gone" in summary([gone])["fixtures"]


def test_a_fixture_with_no_record_of_the_old_release_anywhere_is_not_compared_and_never_green(tmp_path):
    [c] = after_only(tmp_path, "0.7.2.post1", fixture_rec("c-compacted-fp8"), fixture_outputs("c-compacted-fp8"))
    assert c.status == "new" and "no record of 0.7.2.post1, neither in the baseline nor in the fixture file" in c.why
    line = summary([c, compared(rec(case="t::gpu"), rec(case="t::gpu"))])["fixtures"]
    assert line.startswith("note") and "1 re-run: 0 of 0 with outputs bitwise equal" in line
    assert "1 not compared (no record of 0.7.2.post1" in line
    write_report([c], tmp_path / "report", "0.7.2.post1", "0.8.0")
    assert "re-run, not compared: no record of 0.7.2.post1" in (tmp_path / "report" / "report.md").read_text()


def test_a_baseline_fixture_not_re_run_now_fails_unless_the_user_asked_for_recorded_only():
    before = fixture_rec("c-compacted-fp8")
    case = before.case
    recorded_only = RunFacts(not_rerun={case: RECORDED_ONLY}, outcomes={case: "passed"})
    assert missing_case_status(case, recorded_only, before) == ("deselected",
                                                                f"{RECORDED_ONLY}: recorded outputs judged only")
    no_gpu = RunFacts(not_rerun={case: "no CUDA device"}, outcomes={case: "passed"})
    assert compare_case(case, before, None, {}, {}, no_gpu).regressions == ["not run: not re-run: no CUDA device"]
    status, why = missing_case_status(case, RunFacts(), before)
    assert status == "not run" and "name its folder with --baseline-fixtures" in why and before.fixture in why


def test_fixtures_not_re_run_are_said_on_the_fixtures_line_and_do_not_fail_it():
    run = RunFacts(not_rerun={"tests/test_replay.py::test_replay_fixture[x]": "no CUDA device"})
    lines = summary([compared(rec(), rec())], run)
    assert lines["fixtures"] == ("note  fixtures   1 not re-run (no CUDA device): judged on their recorded outputs "
                                 "only, nothing compared")
    assert lines["verdict"].startswith("PASS")
    nothing = summary_lines([compare_case("t::x", rec(case="t::x"), None, {}, {}, run)], run, "0.7.2", "0.7.4")
    assert nothing[0].startswith("FAIL  GPU tier") and nothing[1].startswith("note  fixtures   1 not re-run")


# --- fixtures across releases, through the replay tests with a stand-in FlashInfer -------------

TWO = ("c-compacted-fp8", "h-kpool1-decode-bf16")


@pytest.fixture
def replaying(stand_in, device, monkeypatch, pytester, gpu_tier_may_run):
    """The replay tests re-run fixtures on the stand-in as if on an SM90 GPU; ``version(v)``
    sets the FlashInfer version the run reports."""
    import harness.availability
    import harness.port.launch
    import recording.environment
    import recording.rerun

    monkeypatch.setattr(harness.availability, "sm90_flashinfer_unavailable_reason", lambda: None)
    monkeypatch.setattr(harness.port.launch, "DEVICE", device.type)

    def version(v: str):
        monkeypatch.setattr(recording.environment, "flashinfer_version", lambda: v)
        monkeypatch.setattr(recording.rerun, "flashinfer_version", lambda: v)

    return version


def replay_run(pytester, *args):
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist", "--rootdir", str(ROOT),
                                        str(ROOT / "tests/test_replay.py"), "--baseline-timing=off",
                                        *(f"--baseline-fixtures={FIXTURES / n}.safetensors" for n in TWO), *args)


def test_the_upgrade_check_re_runs_fixtures_and_compares_them_with_the_old_release(
        replaying, stand_in, pytester, monkeypatch):
    replaying("0.7.2.post1")
    result = replay_run(pytester, "--record-baseline=base")
    assert result.ret == 0, "\n".join(result.outlines[-30:])
    result.stdout.fnmatch_lines(["PASS  baseline base: 2 test outcomes, 0 cases and 2 fixture re-runs recorded, times "
                                 "not taken: --baseline-timing=off"])
    records = check_baseline(pytester.path / "base")
    assert sorted(Path(r.fixture).stem for r in records.values()) == sorted(TWO)
    assert all(r.flashinfer == "0.7.2.post1" and r.ratios["out_max_ratio"] >= 0 for r in records.values())

    replaying("0.7.4")
    result = replay_run(pytester, "--compare-baseline=base", "--baseline-out=same")
    assert result.ret == 0, "\n".join(result.outlines[-30:])
    result.stdout.fnmatch_lines(["PASS  verdict    FlashInfer 0.7.2.post1 -> FlashInfer 0.7.4*: 2 tests compared, "
                                 "0 cases and 2 fixtures of them on their records, no regression",
                                 "ok    fixtures   2 re-run: 2 of 2 with outputs bitwise equal to FlashInfer "
                                 "0.7.2.post1; refusals 0 new, 0 gone"])

    original = stand_in.run

    def one_ulp_off(self, *args, out, lse, **kw):
        original(self, *args, out=out, lse=lse, **kw)
        out[1].view(-1)[:1].view(torch.int16).add_(1)

    monkeypatch.setattr(stand_in, "run", one_ulp_off)
    result = replay_run(pytester, "--compare-baseline=base", "--baseline-out=moved")
    assert result.ret == 0, "\n".join(result.outlines[-30:])
    result.stdout.fnmatch_lines(["note  fixtures   2 re-run: 0 of 2 with outputs bitwise equal to FlashInfer "
                                 "0.7.2.post1; worst `*` out max abs *, 1/* rows differ, worst rows 1 (*); "
                                 "refusals 0 new, 0 gone"])

    stand_in.refuse = "CSR metadata page counts in kv_indptr must equal ceil(kv_len_arr / page_size)."
    result = replay_run(pytester, "--compare-baseline=base", "--baseline-out=refused")
    assert result.ret == 1
    result.stdout.fnmatch_lines(["FAIL  verdict    *2 regressions",
                                 "FAIL  fixtures   2 re-run: 0 of 0 with outputs bitwise equal to FlashInfer "
                                 "0.7.2.post1; refusals 2 new, 0 gone (now raising: ValueError: CSR metadata "
                                 "page counts*"])


def test_an_old_baseline_without_fixture_records_is_compared_with_the_fixture_files(replaying, pytester):
    write_record(pytester.path / "base", rec(case="tests/gpu/test_x.py::test_case", flashinfer="0.7.4"), None)
    write_outcomes(pytester.path / "base", {"tests/gpu/test_x.py::test_case": Outcome("passed")}, "0.7.4")
    replaying("0.8.0")
    result = replay_run(pytester, "--compare-baseline=base")
    assert result.ret == 0, "\n".join(result.outlines[-30:])
    result.stdout.fnmatch_lines(["note  fixtures   2 re-run: * of 2 with outputs bitwise equal to FlashInfer 0.7.4 "
                                 "(2 compared with the fixture file's record); worst *",
                                 "note  not run    0 tests of the baseline did not run; 1 left out by this run's "
                                 "selection (outside the paths given), not judged"])
    md = (pytester.path / "baseline-compare" / "report.md").read_text()
    assert "## Fixtures" in md and "`c-compacted-fp8` (" in md
    assert "against the fixture file's 0.7.4 record; lse max abs" in md


@pytest.mark.parametrize("option", ["--record-baseline=base", "--compare-baseline=base"])
def test_the_upgrade_check_where_the_gpu_tier_cannot_run_is_a_usage_error_at_start_up(suite, monkeypatch, option):
    base = record(suite)  # on a GPU runner
    monkeypatch.setattr(plugin, "gpu_tier_unavailable_reason", lambda: "no NVIDIA GPU found")
    if option.startswith("--record"):
        shutil.rmtree(base)
    result = run(suite, option)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{option.split('=')[0]}: the GPU tier cannot run here (no NVIDIA GPU found)*"])
    assert "passed" not in result.stdout.str() and not (suite.path / "baseline-compare").exists()


def test_the_start_up_check_asks_the_machine_without_cuda(monkeypatch):
    import harness.availability
    import harness.gpu_env

    monkeypatch.setattr(harness.gpu_env, "gpus_without_cuda", lambda: [])
    assert plugin.gpu_tier_unavailable_reason() == "no NVIDIA GPU found"


def test_where_flashinfer_fails_only_at_run_time_fixtures_record_nothing_and_the_report_says_so(
        pytester, monkeypatch, gpu_tier_may_run):
    import harness.availability

    monkeypatch.setattr(harness.availability, "sm90_flashinfer_unavailable_reason", lambda: "no SM90 GPU (simulated)")
    result = replay_run(pytester, "--record-baseline=base")
    assert result.ret == 1, "the GPU tier did not run: nothing was recorded"
    assert result.parseoutcomes() == {"passed": 2}, "the replay tests themselves pass on their recorded outputs"
    result.stdout.fnmatch_lines(["FAIL  baseline base: nothing recorded*",
                                 "note  fixtures: 2 not re-run (no SM90 GPU (simulated)): nothing recorded of them"])
    assert [p.name for p in (pytester.path / "base").glob("*.json")] == ["outcomes.json"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--baseline-fixtures=fixtures"], "--baseline-fixtures names the fixtures of the upgrade check"),
        (["--record-baseline=b", "--baseline-fixtures=nowhere"], "--baseline-fixtures: nowhere does not exist"),
        (["--record-baseline=b", "--baseline-fixtures=empty"], "--baseline-fixtures: empty holds no fixture"),
        (["--record-baseline=b", "--baseline-fixtures=empty", "--replay=empty"], "--baseline-fixtures and --replay"),
    ],
    ids=["without-the-check", "missing", "empty", "with-replay"],
)
def test_baseline_fixtures_that_give_nothing_to_replay_are_a_usage_error(suite, args, message):
    (suite.path / "empty").mkdir()
    result = run(suite, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert message in result.stderr.str()
