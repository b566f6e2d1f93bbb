"""The ``interpreter`` marker: a test of the CPU tier that hands Triton kernels CPU tensors (the
crash-isolation worker, which moves CPU tensors through shared memory; the FlashMLA stand-in's
kernels) needs Triton's interpreter. Where the run compiles its kernels (a GPU machine: the
device is chosen once per run, and the interpreter cannot be switched on in a process that has
defined its kernels), such a test runs in a child pytest of its own with ``TRITON_INTERPRET=1``
and no visible GPU, and its outcome is the child's: a failure shows the child's output. Where Triton's interpreter
cannot run the project's convert kernel at all (a Triton release whose interpreter fails on it,
found by one probe in a child process per test process), the marked tests are skipped with that
reason: the kernel itself is checked compiled on that machine.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys

import pytest

#: Options of this run a child needs to run the same test the same way.
FORWARDED_OPTIONS = ("--vllm", "--impl", "--hypothesis-profile")
#: Seconds a child is given before it is stopped (the marked tests take well under a minute).
CHILD_TIMEOUT_S = 600


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "interpreter: hands Triton kernels CPU tensors; where the run's kernels are compiled it runs in a "
        "child pytest with TRITON_INTERPRET=1 and no visible GPU",
    )


def skip_discarded_overflow_checks() -> bool:
    """Stop Triton's interpreter from building the overflow check of every 32-bit integer add,
    sub and mul (the operation again in int64 and its bounds compared) that it then drops: the
    check ends in a device assert, which the interpreter runs only under its ``debug`` option, and
    it never sets that option. The kernels' results are the same (int32 arithmetic wraps as
    compiled) and the work on vLLM's index-remap kernel less. Nothing changes where the
    interpreter does assert (``debug`` on) or has no such option. Whether it was changed."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if not dataclasses.is_dataclass(options) or getattr(options, "debug", True):
        return False
    if not getattr(options, "sanitize_overflow", False):
        return False
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Where the tests run (not in an xdist controller, which imports no Triton before its
    workers start), before any fixture launches a kernel."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        skip_discarded_overflow_checks()


def runs_in_a_child(interpreted: bool) -> bool:
    """Whether an ``interpreter`` test runs in a child: where this process's kernels are compiled."""
    return not interpreted


def child_environment(environ: dict[str, str]) -> dict[str, str]:
    """The child's environment: the interpreter on, every GPU hidden, the tests' device the CPU, and
    nothing of this process's xdist worker or current test (the child is a session of its own)."""
    kept = {k: v for k, v in environ.items() if not k.startswith(("PYTEST_XDIST_", "PYTEST_CURRENT_TEST"))}
    return {**kept, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "SPARSE_MLA_DEVICE": "cpu"}


def forwarded_arguments(config) -> list[str]:
    """This run's values of :data:`FORWARDED_OPTIONS` (those it has)."""
    values = ((option, config.getoption(option, None)) for option in FORWARDED_OPTIONS)
    return [f"{option}={value}" for option, value in values if value is not None]


def child_command(nodeid: str, rootdir: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", nodeid, "-p", "no:xdist", "-p", "no:cacheprovider", "-q",
            "--rootdir", rootdir, *extra]


def run_in_interpreter(nodeid: str, rootdir: str, extra: list[str]) -> tuple[int, str]:
    """Run one test in a child pytest under Triton's interpreter: its exit status and output."""
    try:
        done = subprocess.run(child_command(nodeid, rootdir, extra), cwd=rootdir,
                              env=child_environment(dict(os.environ)), capture_output=True, text=True,
                              timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        return -1, f"the child pytest did not end within {CHILD_TIMEOUT_S} s\n{exc.stdout or ''}"
    return done.returncode, done.stdout + done.stderr


#: The probe: the project's convert kernel once, on CPU tensors.
PROBE = ("import torch\nfrom fast.impl import FastImpl\n"
         "FastImpl().convert(torch.zeros((1, 128), dtype=torch.int32), torch.zeros((1, 1), dtype=torch.int32), "
         "torch.zeros(1, dtype=torch.int32), 1)\n")


@functools.cache
def interpreter_problem(rootdir: str) -> str | None:
    """Why Triton's interpreter cannot run the project's convert kernel here, or None (probed
    once per process, in a child with the interpreter on and no visible GPU)."""
    try:
        done = subprocess.run([sys.executable, "-c", PROBE], cwd=rootdir, env=child_environment(dict(os.environ)),
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"Triton's interpreter did not run the convert kernel within {CHILD_TIMEOUT_S} s"
    if done.returncode == 0:
        return None
    import triton

    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    return (f"Triton's interpreter cannot run the project's convert kernel on this machine (triton "
            f"{triton.__version__}): {lines[-1] if lines else f'exit status {done.returncode}'}")


def child_verdict(rc: int, output: str) -> str | None:
    """Why the child's run of the test is not a pass, or None: exit status 0 with one test passed."""
    tail = output.strip().splitlines()[-1] if output.strip() else ""
    if rc == 0 and " passed" in tail and "failed" not in tail and "error" not in tail:
        return None
    return f"exit status {rc}, last line: {tail or '(no output)'}"


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if pyfuncitem.get_closest_marker("interpreter") is None:
        return None
    from fast import convert

    if not runs_in_a_child(convert.INTERPRETED):
        return None
    config = pyfuncitem.config
    problem = interpreter_problem(str(config.rootpath))
    if problem:
        pytest.skip(problem)
    rc, output = run_in_interpreter(pyfuncitem.nodeid, str(config.rootpath), forwarded_arguments(config))
    problem = child_verdict(rc, output)
    if problem:
        pytest.fail(f"run in Triton's interpreter in a child pytest (this run's kernels are compiled): {problem}\n"
                    f"{output[-6000:]}", pytrace=False)
    return True
