"""The suite run again in a child session (pytester or a subprocess), and reading what it printed:
the usage errors, the regime summary table, a GPU family on the simulated SM90 machine, a
child pytest's outcome counts."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import simulated_sm90

ROOT = Path(__file__).resolve().parents[2]

LAUNCH_SUITE = """
import pytest


@pytest.mark.regimes("A")
def test_ran(regime_log):
    regime_log.record(["A", "A"])
    regime_log.kernel_ran()


@pytest.mark.regimes("A")
def test_refused(regime_log):
    regime_log.record(["A"] * 3)
    regime_log.expected_refusal("ValueError at plan: CSR metadata page counts")


@pytest.mark.regimes("B")
def test_refused_then_failed(regime_log):
    regime_log.record(["B"])
    regime_log.expected_refusal("ValueError at plan: CSR metadata page counts")
    assert False, "a check after the refusal failed"


@pytest.mark.edge("stale-slots")
def test_edge_refused(regime_log):
    regime_log.record(["C"] * 4)
    regime_log.expected_refusal("ValueError at plan: CSR metadata page counts")


def test_ran_twice(regime_log):
    regime_log.kernel_ran()
    regime_log.kernel_ran()


def test_launched_nothing():
    pass
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


def refused_column(output: str) -> dict[str, int]:
    """regime -> the tests counted as expected refusals, from the printed table."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if "rows and test outcomes per context regime" in line)
    assert lines[start + 1].split("|", 1)[1].split()[1:6] == ["passed", "failed", "xfailed", "skipped", "refused"]
    return {line.split("|", 1)[0].rsplit(None, 1)[0].strip(): int(line.split("|", 1)[1].split()[4])
            for line in lines[start + 2:] if "|" in line}


def usage_run(pytester, *args: str, xdist: bool = False):
    """A nested run of USAGE_TEST with ``args`` on this machine, in this process (as the
    controller of an xdist run with ``xdist``)."""
    pytester.makeconftest("pytest_plugins = ('pytest_sparse_mla',)\n")
    pytester.makepyfile(test_gating=USAGE_TEST, bad_impls=BAD_IMPLS)
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs the GPU tier\n")
    pytester.syspathinsert()
    workers = ("-n", "2") if xdist else ("-p", "no:xdist")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", *workers, *args)
    return result, "\n".join(result.outlines + result.errlines)


def assert_one_usage_error(result, out: str, line: str, *, exact: bool = True) -> None:
    """rc 4, one error line (``line``, or beginning with it), no test run, no traceback."""
    assert result.ret == pytest.ExitCode.USAGE_ERROR, out[-3000:]
    errors = [text for text in out.splitlines() if text.startswith("ERROR: ")]
    assert len(errors) == 1, out[-3000:]
    assert errors[0] == f"ERROR: {line}" if exact else errors[0].startswith(f"ERROR: {line}"), out[-3000:]
    assert "passed" not in out and "Traceback" not in out, out[-3000:]


BAD_IMPLS = """
def raises():
    raise RuntimeError("this backend needs its server")


def lacking():
    return object()
"""


#: GPU_TEST on this machine as it is: the device is whichever ``--device=auto`` picks here.
USAGE_TEST = """
import pytest


@pytest.mark.gpu
def test_needs_the_gpu():
    pass

def test_runs_anywhere(device):
    assert device.type in ("cpu", "cuda")
"""


def run_gpu_family(pytester, monkeypatch, path: str, select: str, *args: str, simulated: bool):
    """Run GPU tests in a nested session in this process (no interpreter, torch, FlashInfer and
    plugin to start again): on the installed FlashInfer, or on a simulated SM90 machine with
    every GPU hidden where this process's convert kernel runs in Triton's interpreter (its
    patches undone after the test; in a subprocess otherwise). The re-created bugs run here
    read and write only inside the attention state's reserved buffers: none of them can crash
    the process or leave a CUDA error behind."""
    selection = ("-k", select) if select else ()
    common = (str(ROOT / path), *selection, "-p", "no:xdist", "-p", "no:cacheprovider", "--rootdir", str(ROOT))
    if not simulated:
        try:
            with simulated_sm90.process_share_of_threads(), simulated_sm90.nested_failures_released():
                return pytester.runpytest_inprocess(*common, "--require-gpu-tier", *args)
        finally:  # the GPU memory the nested tests cached goes back to the other workers' tests
            gc.collect()
            torch.cuda.empty_cache()
    if simulated_sm90.can_simulate_in_process():
        simulated_sm90.simulate_in_process(monkeypatch)
        with (
            simulated_sm90.freed_memory_kept(),
            simulated_sm90.process_share_of_threads(),
            simulated_sm90.nested_failures_released(),
        ):
            return pytester.runpytest_inprocess(*common, *args)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for name, value in KEEP_FREED_MEMORY.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SPARSE_MLA_DEVICE", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    return pytester.runpytest_subprocess(*common, "-p", "tests.simulated_sm90", *args, timeout=600)


#: glibc keeps freed memory for reuse instead of returning it: the references' large temporaries
#: are then not mapped and zeroed afresh on every call (half the simulated runs' time otherwise).
KEEP_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(1 << 34), "MALLOC_TRIM_THRESHOLD_": str(1 << 34)}


def pytest_run(*args: str) -> tuple[int, str, dict[str, int]]:
    """A child pytest in the project's root: its exit status, output and outcome counts."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    out = done.stdout + done.stderr
    tail = out.strip().splitlines()[-1] if out.strip() else ""
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|error|errors|skipped|xfailed)", tail)}
    return done.returncode, out, counts


def run_plugin_in_process(pytester, *args):
    """A nested run of ``pytester``'s suite in this process, one worker, no cache, rooted at its folder."""
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:benchmark", "--rootdir",
                                        str(pytester.path), *args)
