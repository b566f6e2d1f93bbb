"""``python3 -m scripts.mutation``: the score per area and in all, and the vLLM its adapter's
tests are handed."""

from __future__ import annotations

from pathlib import Path

from scripts.mutation import MUTANT_THREADS, by_area, pytest_env, score_lines, statuses, to_retest

RESULTS = """
    fast.kvlen.x_kv_lens_host__mutmut_1: killed
    fast.kvlen.x_kv_lens_host__mutmut_2: survived
    fast.layouts.x_kv_indptr_host__mutmut_1: timeout
    backends.flashinfer.fa3_schedule.x_read_schedule__mutmut_1: no tests
    backends.vllm.sm90.x_step__mutmut_3: killed
"""


def test_the_score_counts_caught_among_reached_per_area_and_in_all():
    found = statuses(RESULTS)
    assert score_lines(found)[0] == ("mutation score: 75.0 % (3 of 4 mutants reached by a test caught, 1 of them by a "
                                     "timeout; 1 survived)")
    assert score_lines(found)[1] == "not reached by any test: 1; all mutants: 5"
    areas = by_area(found)
    assert sorted(areas) == ["backends", "fast"] and len(areas["fast"]) == 3
    backends = score_lines(areas["backends"], "  backends/")[0]
    assert backends == "  backends/: 100.0 % (1 of 1 mutants reached by a test caught; 0 survived)"


def test_the_vllm_is_handed_to_every_pytest_session_mutmut_starts(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTEST_ADDOPTS", "-q")
    wheel = tmp_path / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    assert pytest_env(str(wheel))["PYTEST_ADDOPTS"] == f"-q --vllm={wheel.resolve()}"
    assert pytest_env(None)["PYTEST_ADDOPTS"] == "-q"
    monkeypatch.delenv("PYTEST_ADDOPTS")
    assert "PYTEST_ADDOPTS" not in pytest_env(None)
    assert pytest_env("rel/dir")["PYTEST_ADDOPTS"] == f"--vllm={Path('rel/dir').resolve()}"


def test_every_process_mutmut_starts_runs_torch_on_one_thread(monkeypatch):
    """Each mutant's process is forked from a server that has run torch: pools of one thread, so
    that no forked process waits for good on a lock another thread held (a hang counted caught)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    env = pytest_env(None)
    assert {k: env[k] for k in MUTANT_THREADS} == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def test_a_retest_runs_the_survivors_or_timeouts_of_the_mutants_named():
    found = {"harness.judge.x_judge_step__mutmut_1": "survived", "harness.judge.x_judge_step__mutmut_2": "killed",
             "harness.judge.x_measured__mutmut_1": "timeout", "harness.findings.x_a__mutmut_1": "survived"}
    assert to_retest(found, True, False, []) == ["harness.findings.x_a__mutmut_1",
                                                 "harness.judge.x_judge_step__mutmut_1"]
    assert to_retest(found, True, False, ["harness.judge*"]) == ["harness.judge.x_judge_step__mutmut_1"]
    assert to_retest(found, True, True, ["harness.judge*"]) == ["harness.judge.x_judge_step__mutmut_1",
                                                                "harness.judge.x_measured__mutmut_1"]
    assert to_retest(found, False, True, []) == ["harness.judge.x_measured__mutmut_1"]
    assert to_retest(found, False, False, []) == []
