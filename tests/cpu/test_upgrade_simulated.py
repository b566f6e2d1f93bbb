"""The upgrade check where its backends run on CPU: the simulated SM90 machine
(``-p tests.simulated_sm90``) records vLLM's cases and compares another release's host code
against them (vLLM's code as it runs, FlashInfer and the device replaced); no timing pass, and
the report says why. The journey here: record on the release under test, compare a copy with a
bug planted in its SM90 module (the check fails, naming the test and the integer result that
changed), compare the release against itself (the check passes)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pytest_sparse_mla.interpreter import child_environment
from scripts.vllm_planted_bugs import BUGS_BY_NAME, planted_copy
from tests.support.child_runs import ROOT

#: Two single steps, each with a row past topk (what the clamp bug cuts short).
SELECTION = "test_step_on_flashinfer and (ctx2049-kpool4-bf16-nope-h32 or ctx2-kpool1-bf16-nope-h64)"


def simulated_run(*args: str) -> subprocess.CompletedProcess:
    """A child run on the simulated machine: Triton's interpreter on, every GPU hidden (as the
    ``interpreter`` marker's children run, ``pytest_sparse_mla.interpreter``), the tests' device
    the CPU."""
    env = child_environment(os.environ)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q",
                           "-p", "tests.simulated_sm90", "-m", "vllm", "tests/gpu/test_vllm_sm90.py", "-k", SELECTION,
                           *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.vllm
@pytest.mark.interpreter  # the simulated machine runs vLLM's kernels in Triton's interpreter
def test_the_upgrade_check_records_and_compares_vllm_on_the_simulated_machine(vllm_backend, tmp_path):
    bugged = planted_copy(vllm_backend.source.root, tmp_path / "vllm-planted", BUGS_BY_NAME["clamp"])
    if bugged is None:
        pytest.skip(f"the planted line is vLLM 0.33.0's; vLLM {vllm_backend.version}'s module does not hold it")
    base = tmp_path / "base"
    record = simulated_run(f"--vllm={vllm_backend.source.root}", f"--record-baseline={base}")
    out = record.stdout + record.stderr
    assert record.returncode == 0, out[-3000:]
    assert "PASS  baseline" in out and "times not taken: the GPU tier ran on the simulated SM90 machine" in out, \
        out[-3000:]

    broken = simulated_run(f"--vllm={bugged}", f"--compare-baseline={base}", f"--baseline-out={tmp_path / 'bugged'}")
    out = broken.stdout + broken.stderr
    assert broken.returncode == 1, out[-3000:]
    assert "FAIL  outcomes   2 of 2 tests that passed (or xfailed) before fail" in out, out[-3000:]
    assert "FAIL  integers" in out and "executed_len[" in out, out[-3000:]
    assert "note  time       not judged: the GPU tier ran on the simulated SM90 machine" in out, out[-3000:]
    report = (tmp_path / "bugged" / "report.md").read_text()
    assert "test_step_on_flashinfer[ctx2049-kpool4-bf16-nope-h32]`: was passed, now failed" in report
    title = report.splitlines()[0]  # the check names the vLLM code that changed, not FlashInfer
    assert title.startswith(f"# Upgrade check: vLLM {vllm_backend.version} (SM90 module sha256 ") and \
        "flashinfer_mla_sparse_sm90.py" not in title.split("->")[0] and \
        "(both: FlashInfer " in title and "machine the simulated SM90 machine" in title, title

    same = simulated_run(f"--vllm={vllm_backend.source.root}", f"--compare-baseline={base}",
                         f"--baseline-out={tmp_path / 'same'}")
    out = same.stdout + same.stderr
    assert same.returncode == 0, out[-3000:]
    assert "ok    outcomes" in out and "ok    integers" in out, out[-3000:]
