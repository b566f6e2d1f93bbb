"""Upgrade comparison logic on hand-made records: behaviour changes, drift, time ratios, and
what counts as a regression."""

from __future__ import annotations

import json

import torch

from recording.baseline import CaseRecord, compare_case, compare_directories, drift, write_record, write_report


def rec(**kw) -> CaseRecord:
    return CaseRecord(case=kw.pop("case", "tests/gpu/test_x.py::test_case[a]"), **kw)


def test_drift_counts_bitwise_equal_elements_and_relative_l2():
    a = torch.randn(64, dtype=torch.float64).to(torch.bfloat16)
    b = a.clone()
    b[:16] = (b[:16].float() * 1.01).to(torch.bfloat16)
    d = drift(a, b)
    assert 0.74 <= d["bitwise_equal"] <= 0.76
    assert 0 < d["rel_l2"] < 0.02 and d["max_abs"] > 0
    assert drift(a, a) == {"max_abs": 0.0, "rel_l2": 0.0, "bitwise_equal": 1.0}


def test_newly_raising_is_a_regression_and_names_the_error():
    c = compare_case("c", rec(outcome="passed"), rec(outcome="failed", error="ValueError: CSR metadata page counts"), {}, {})
    assert c.regressions and "ValueError: CSR metadata" in c.regressions[0]
    assert any(ch.startswith("newly raising") for ch in c.changes)


def test_a_newly_raising_call_is_a_regression_even_when_the_suite_expects_it():
    c = compare_case("c", rec(outcome="passed"), rec(outcome="passed", error="ValueError at plan: CSR"), {}, {})
    assert c.regressions == ["newly raising: ValueError at plan: CSR"]


def test_an_expected_finding_that_keeps_failing_is_not_a_regression():
    assert not compare_case("c", rec(outcome="xfailed"), rec(outcome="xfailed"), {}, {}).regressions


def test_newly_passing_and_new_warnings_are_reported_as_changes_not_regressions():
    c = compare_case("c", rec(outcome="failed"), rec(outcome="passed", warnings=["DeprecationWarning: positional"]), {}, {})
    assert not c.regressions
    assert "outcome failed -> passed" in c.changes and any("DeprecationWarning" in ch for ch in c.changes)


def test_time_ratios_and_thresholds():
    slow_plan = compare_case("c", rec(plan_us=150.0, kernel_us=73.0), rec(plan_us=1300.0, kernel_us=74.0), {}, {})
    assert round(slow_plan.plan_ratio, 2) == 8.67 and any("plan() time" in r for r in slow_plan.regressions)
    assert not any("kernel" in r for r in slow_plan.regressions), "1.4% kernel change is noise"
    tiny = compare_case("c", rec(kernel_us=3.0), rec(kernel_us=4.5), {}, {})
    assert not tiny.regressions, "below the absolute floor"
    slow_kernel = compare_case("c", rec(kernel_us=70.0), rec(kernel_us=90.0), {}, {})
    assert any("kernel time" in r for r in slow_kernel.regressions)


def test_times_shared_between_test_processes_are_reported_not_judged():
    c = compare_case("c", rec(plan_us=150.0, timing_workers=16), rec(plan_us=50_000.0, timing_workers=16), {}, {})
    assert c.plan_ratio > 300 and not c.regressions


def test_empty_outputs_count_as_equal():
    empty = torch.zeros(0, 4, 8, dtype=torch.bfloat16)
    assert drift(empty, empty)["bitwise_equal"] == 1.0


def test_directories_round_trip_into_markdown_and_json(tmp_path):
    out = torch.randn(4, 2, 8).to(torch.bfloat16)
    write_record(tmp_path / "a", rec(case="t::x", flashinfer="0.6.18.post1", kernel_us=70.0, plan_us=150.0,
                                     ratios={"out_max": 1.1}), {"out": out})
    write_record(tmp_path / "b", rec(case="t::x", flashinfer="0.7.4", kernel_us=71.0, plan_us=1400.0,
                                     ratios={"out_max": 1.2}), {"out": out})
    write_record(tmp_path / "b", rec(case="t::new", flashinfer="0.7.4"), None)
    comparisons = compare_directories(tmp_path / "a", tmp_path / "b")
    assert [c.case for c in comparisons] == ["t::new", "t::x"]
    assert comparisons[1].drift["out"]["bitwise_equal"] == 1.0
    ok = write_report(comparisons, tmp_path / "report", "0.6.18.post1", "0.7.4")
    assert not ok
    md = (tmp_path / "report" / "report.md").read_text()
    assert "0.6.18.post1 -> 0.7.4" in md and "plan() time x9.33" in md and "new case" in md
    data = json.loads((tmp_path / "report" / "report.json").read_text())
    assert data["cases"][1]["plan_ratio"] > 9
