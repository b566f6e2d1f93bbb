"""A failing case of vLLM's SM90 backend, handed on as a standalone reproducer: a bug planted in a
copy of vLLM 0.33.0's module (``scripts/vllm_planted_bugs.py``) fails a test; ``--dump-failures``
writes its case; ``recording.vllm_repro`` writes the folder (``repro.py`` and ``case.pt``); the
script, run in a child process with nothing of the project within reach, names vLLM's plan/clamp
on the planted copy and is green on the release as shipped. On a stand-in kernel that is off on
the slots it is handed, the script names FlashInfer's kernel.

Without a GPU the script runs on the fa3 stand-in (``tests.run_on_fa3_stand_in`` installs it as
``flashinfer.mla`` and then puts the project out of reach) with vLLM's Triton kernels in Triton's
interpreter."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.case_runner import backend_identity
from harness.spec import batch
from recording.backend_case import write_backend_case
from recording.commands import standalone_command
from recording.vllm_repro import ALLOWED_IMPORTS, DATA_NAME, SCRIPT_NAME, write_standalone
from scripts.vllm_planted_bugs import BUGS_BY_NAME, planted_copy
from tests import fa3_stand_in
from tests.run_on_fa3_stand_in import IMPORTED_THE_PROJECT
from tests.support.child_runs import pytest_run
from tests.support.vllm_planting import SINGLE_STEP

pytestmark = [pytest.mark.vllm, pytest.mark.suite_self_test]

ROOT = Path(__file__).resolve().parents[2]
PLAN_OFF = "verdict: vLLM's plan/clamp is off"
KERNEL_OFF = "verdict: FlashInfer's kernel is off"
RIGHT = "verdict: nothing: the step is right on this install"


class SkewedWrapper(fa3_stand_in.StandInWrapper):
    """The fa3 stand-in with an output 2 % off on every row: a kernel wrong on the slots it is handed."""

    def run(self, *args, **kwargs):
        out = super().run(*args, **kwargs)
        out.mul_(1.02)
        return out


def run_standalone(folder: Path, vllm_root: Path, cwd: Path, wrapper: str = "0.7") -> tuple[int, str]:
    """``repro.py`` of ``folder`` on ``vllm_root`` in a child process started in ``cwd``, through the
    launcher that installs the stand-in ``wrapper`` and puts the project out of reach."""
    env = dict(os.environ, TRITON_INTERPRET="1", SPARSE_MLA_DEVICE="cpu", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "tests.run_on_fa3_stand_in", "--wrapper", wrapper,
                           str(folder / SCRIPT_NAME), str(vllm_root), "--device", "cpu"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize("bug", ["clamp", "host-lengths"])
def test_red_naming_vllms_plan_under_the_bug_and_green_on_the_release(bug, vllm_backend, tmp_path):
    bugged = planted_copy(vllm_backend.source.root, tmp_path / "vllm-planted", BUGS_BY_NAME[bug])
    if bugged is None:
        pytest.skip(f"the planted line is vLLM 0.33.0's; vLLM {vllm_backend.version}'s module does not hold it")
    status, out, counts = pytest_run("-m", "vllm", f"--vllm={bugged}", "tests/cpu/test_vllm_backend.py", "-k",
                                     SINGLE_STEP, f"--dump-failures={tmp_path / 'dumps'}")
    assert status == 1 and counts.get("failed") == 1, f"the planted {bug} bug failed no test:\n{out[-3000:]}"
    (case,) = sorted((tmp_path / "dumps").glob("*.case.json"))
    printed = [line for line in out.splitlines() if line.startswith("standalone: ")]
    assert printed == [f"standalone: {standalone_command(case, bugged)}"], out[-3000:]
    folder = write_standalone(case, tmp_path / "standalone")
    assert sorted(p.name for p in folder.iterdir()) == sorted([SCRIPT_NAME, DATA_NAME])
    torch.load(folder / DATA_NAME, weights_only=True)  # tensors and plain values only
    assert script_imports(folder / SCRIPT_NAME) <= set(ALLOWED_IMPORTS)

    status, out = run_standalone(folder, bugged, tmp_path)
    assert status == 1 and PLAN_OFF in out, out[-3000:]
    assert "(the module the case was written on)" in out, out[-3000:]
    status, out = run_standalone(folder, vllm_backend.source.root, tmp_path)
    assert status == 0 and RIGHT in out, out[-3000:]
    assert "the case was written on" in out and "within the budget" in out, out[-3000:]


def script_imports(script: Path) -> set[str]:
    """The top-level modules a script imports, the standard library's left out."""
    tree = ast.parse(script.read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and not node.level}
    return imported - set(sys.stdlib_module_names) - {"__future__"}


def test_a_kernel_off_on_the_slots_it_is_handed_is_named(vllm_backend, tmp_path):
    """A case written in-process (one step at topk 128: rows below, at and past topk), run on the
    release as shipped: green on the stand-in, FlashInfer's kernel named on the skewed one."""
    spec = batch((5, 1), (128, 1), (131, 1), (1000, 1), topk=128, kpool=4, num_heads=16)
    case = {"kind": "step", "backend": backend_identity(vllm_backend), "max_tokens": 4, "twin": False,
            "compare": True, "with_inputs": True, "adaptive_verification": False, "rejected_drafts": 0,
            "kv_block_stride": None, "steps": [{"spec": spec, "seed": 3, "holes": None}],
            "flashinfer": "tests.fa3_stand_in:StandInWrapper"}
    folder = write_standalone(write_backend_case(tmp_path, "topk128", case))
    status, out = run_standalone(folder, vllm_backend.source.root, tmp_path)
    assert status == 0 and RIGHT in out, out[-3000:]
    status, out = run_standalone(folder, vllm_backend.source.root, tmp_path,
                                 wrapper="tests.cpu.test_vllm_standalone_repro:SkewedWrapper")
    assert status == 1 and KERNEL_OFF in out and "beyond the budget" in out, out[-3000:]
    # on a machine without FlashInfer: one line and its own status, no verdict on vLLM or the kernel
    done = subprocess.run([sys.executable, "-m", "tests.run_without", "flashinfer", str(folder / SCRIPT_NAME),
                           str(vllm_backend.source.root), "--device", "cpu"], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, TRITON_INTERPRET="1"), timeout=300)
    lines = done.stderr.splitlines()
    assert done.returncode == 4 and len(lines) == 1, done.stdout[-2000:] + done.stderr[-3000:]
    assert lines[0].startswith("cannot run here: flashinfer") and lines[0].endswith("nothing was judged"), lines


def test_the_launcher_refuses_a_script_that_imports_the_project(tmp_path):
    script = tmp_path / "imports_the_project.py"
    script.write_text("import harness\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "tests.run_on_fa3_stand_in", str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == IMPORTED_THE_PROJECT and "['harness']" in done.stderr, done.stderr[-2000:]
