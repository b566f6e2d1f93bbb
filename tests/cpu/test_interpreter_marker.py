"""The ``interpreter`` marker: where the run's Triton kernels are compiled (a GPU machine), a
marked test runs in a child pytest under Triton's interpreter with no visible GPU, and its
outcome, failure text included, is the child's."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

import fast.convert
from pytest_sparse_mla.interpreter import (
    child_environment,
    child_verdict,
    interpreter_problem,
    runs_in_a_child,
    skip_discarded_overflow_checks,
)

MARKED = """
import os
import pytest

@pytest.mark.interpreter
def test_sees_the_interpreter():
    assert os.environ["TRITON_INTERPRET"] == "1" and os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert "PYTEST_XDIST_WORKER" not in os.environ

@pytest.mark.interpreter
def test_fails_in_the_child():
    assert os.getpid() == -1, "the child's own assertion"

def test_unmarked_runs_here():
    assert os.environ.get("TRITON_INTERPRET") == "child"
"""


def test_only_a_run_with_compiled_kernels_sends_marked_tests_to_a_child():
    assert runs_in_a_child(False) and not runs_in_a_child(True)


def test_the_child_runs_interpreted_with_no_gpu_and_no_xdist_identity():
    env = child_environment({"PATH": "/bin", "PYTEST_XDIST_WORKER": "gw3", "PYTEST_XDIST_TESTRUNUID": "x",
                             "PYTEST_CURRENT_TEST": "t", "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": "0,1"})
    assert env == {"PATH": "/bin", "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "SPARSE_MLA_DEVICE": "cpu"}


def test_a_child_passes_only_with_status_0_and_a_pass():
    assert child_verdict(0, "....\n1 passed in 0.5s\n") is None
    assert child_verdict(1, "1 failed in 0.5s") == "exit status 1, last line: 1 failed in 0.5s"
    assert child_verdict(5, "no tests ran in 0.01s") == "exit status 5, last line: no tests ran in 0.01s"
    assert child_verdict(0, "1 skipped in 0.1s") == "exit status 0, last line: 1 skipped in 0.1s"
    assert child_verdict(-1, "") == "exit status -1, last line: (no output)"


def test_marked_tests_of_a_run_with_compiled_kernels_take_the_childs_outcome(pytester, monkeypatch):
    import pytest_sparse_mla.interpreter as plugin

    monkeypatch.setattr(fast.convert, "INTERPRETED", False)
    monkeypatch.setattr(plugin, "interpreter_problem", lambda root: None)  # what the probe says on CI
    monkeypatch.setenv("TRITON_INTERPRET", "child")
    pytester.makepyfile(test_marked=MARKED)
    result = pytester.runpytest_inprocess("-p", "pytest_sparse_mla.interpreter", "-p", "no:cacheprovider",
                                          "-p", "no:xdist")
    result.assert_outcomes(passed=2, failed=1)
    out = "\n".join(result.outlines)
    assert "run in Triton's interpreter in a child pytest (this run's kernels are compiled): exit status 1" in out
    assert "the child's own assertion" in out, out[-3000:]


def test_the_probe_finds_the_interpreter_working_here():
    """On a machine that runs the CPU tier interpreted (CI) the probe passes; where it cannot run
    the kernel, the marked tests skip with the probe's reason instead of failing on the machine."""
    from pathlib import Path

    if not fast.convert.INTERPRETED:
        pytest.skip("this run's kernels are compiled: whether this machine's Triton interpreter runs the "
                    "convert kernel is the probe's to find, not this test's to assume")
    root = str(Path(__file__).resolve().parents[2])
    assert interpreter_problem(root) is None


def test_a_machine_whose_interpreter_cannot_run_the_kernel_skips_marked_tests_with_the_reason(pytester, monkeypatch):
    import pytest_sparse_mla.interpreter as plugin

    monkeypatch.setattr(fast.convert, "INTERPRETED", False)
    monkeypatch.setattr(plugin, "interpreter_problem", lambda root: "Triton's interpreter cannot run it (probe)")
    monkeypatch.setenv("TRITON_INTERPRET", "child")
    pytester.makepyfile(test_marked=MARKED)
    result = pytester.runpytest_inprocess("-p", "pytest_sparse_mla.interpreter", "-p", "no:cacheprovider",
                                          "-p", "no:xdist", "-rs")
    result.assert_outcomes(passed=1, skipped=2)
    assert "Triton's interpreter cannot run it (probe)" in "\n".join(result.outlines)


@triton.jit
def _int32_arithmetic(a_ptr, b_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    a = tl.load(a_ptr + i)
    b = tl.load(b_ptr + i)
    tl.store(out_ptr + i, a * b + a - b)


def int32_arithmetic(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(a)
    _int32_arithmetic[(1,)](a, b, out, N=a.numel())
    return out


@pytest.mark.interpreter
def test_the_interpreter_computes_the_same_int32_results_without_the_overflow_checks_it_drops(monkeypatch):
    from triton.runtime import interpreter

    a = torch.tensor([7, 1 << 20, -(1 << 30), (1 << 31) - 1] * 4, dtype=torch.int32)
    b = torch.tensor([3, 1 << 12, 5, -2] * 4, dtype=torch.int32)
    wrapped = torch.from_numpy(a.numpy() * b.numpy() + a.numpy() - b.numpy())  # numpy int32 wraps
    options = interpreter.interpreter_builder.options
    monkeypatch.setattr(interpreter.interpreter_builder, "options",
                        dataclasses.replace(options, sanitize_overflow=True))
    checked = int32_arithmetic(a, b)
    assert skip_discarded_overflow_checks()
    assert interpreter.interpreter_builder.options.sanitize_overflow is False
    assert torch.equal(int32_arithmetic(a, b), checked) and torch.equal(checked, wrapped)
    assert not skip_discarded_overflow_checks(), "a second call finds nothing to change"


def test_an_interpreter_that_asserts_keeps_its_overflow_checks(monkeypatch):
    from triton.runtime import interpreter

    asserting = dataclasses.replace(interpreter.interpreter_builder.options, debug=True, sanitize_overflow=True)
    monkeypatch.setattr(interpreter.interpreter_builder, "options", asserting)
    assert not skip_discarded_overflow_checks()
    assert interpreter.interpreter_builder.options is asserting


@pytest.mark.interpreter
def test_a_test_under_the_interpreter_runs_without_the_checks_it_drops():
    from triton.runtime import interpreter

    assert interpreter.interpreter_builder.options.sanitize_overflow is False
