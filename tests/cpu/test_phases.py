"""``--profile-phases``: each sample of a running test goes to the innermost frame's phase, and
the run writes seconds per test module and phase."""

from __future__ import annotations

import json

from pytest_sparse_mla.phases import BODY, added_up, phase_of


def test_the_innermost_frame_that_belongs_to_a_phase_names_it():
    torch_op = ("/site/torch/functional.py", "einsum")
    assert phase_of([torch_op, ("/w/reference/oracle.py", "sparse_mla_float64"),
                     ("/w/harness/judge.py", "judge_step")]) == "oracle and reference models"
    assert phase_of([("/site/flashinfer/mla/_batch_mla/__init__.py", "plan"),
                     ("/w/backends/flashinfer/sm90_state.py", "plan")]) == "FlashInfer plan"
    assert phase_of([("/site/flashinfer/mla/_batch_mla/__init__.py", "run")]) == "FlashInfer run"
    assert phase_of([("/usr/lib/python3.12/subprocess.py", "wait"), ("/w/tests/cpu/test_x.py", "test_y")]) \
        == "child processes"
    assert phase_of([("/w/harness/builder.py", "build_scenario"), ("/w/harness/judge.py", "run_case")]) \
        == "input building"
    assert phase_of([torch_op, ("/w/tests/gpu/test_x.py", "test_y"), ("/site/_pytest/python.py", "pyfunc_call")],
                    "tests/gpu/test_x.py") == BODY
    assert phase_of([("/site/_pytest/fixtures.py", "call_fixture_func")], "tests/gpu/test_x.py") == "pytest"


def test_parts_add_up_per_family_longest_first():
    total = added_up([{"a.py": {"judge": 1.0}}, {"a.py": {"judge": 0.5, "oracle": 2.0}, "b.py": {"judge": 0.1}}])
    assert total == {"a.py": {"oracle": 2.0, "judge": 1.5}, "b.py": {"judge": 0.1}}
    assert list(total) == ["a.py", "b.py"]


def test_a_run_writes_seconds_per_module_and_phase(pytester, tmp_path):
    pytester.makepyfile(test_slow="import time\n\ndef test_sleeps():\n    time.sleep(0.3)\n")
    target = tmp_path / "phases.json"
    result = pytester.runpytest_inprocess("-p", "pytest_sparse_mla", "-p", "no:cacheprovider", "-p", "no:xdist",
                                          f"--profile-phases={target}")
    result.assert_outcomes(passed=1)
    profile = json.loads(target.read_text())
    assert 0.2 < profile["test_slow.py"][BODY] < 1.0, profile
    assert "where the test time went (--profile-phases)" in "\n".join(result.outlines)
