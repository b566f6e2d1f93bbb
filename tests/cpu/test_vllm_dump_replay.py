"""A failing case of vLLM's own SM90 backend, handed on: bugs planted in a copy of the release's
module make its tests fail; ``--dump-failures`` writes each failing case (single steps and
sequences, with the release and the module's digest); ``--replay`` of those files fails on the
planted copy and passes on the release as it shipped, which is also named as a different module.

Each bug is a line of vLLM 0.33.0's ``flashinfer_mla_sparse_sm90.py`` changed: the kept-plan
condition (a plan kept while the bounds have outgrown it by up to 40 tokens), the device clamp
(rows past topk clamped one token short) and the host lengths (bounds 64 tokens low). The suite
runs in child pytest processes, as a user runs it."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from backends.vllm_source import MODULE_FILES

pytestmark = [pytest.mark.vllm, pytest.mark.suite_self_test]

ROOT = Path(__file__).resolve().parents[2]
SEQUENCE = "(sequence_keeps and 4)"
SINGLE_STEP = "(step_executes and decode-mixed-lengths-kpool4)"
#: bug -> (the line as vLLM 0.33.0 ships it, the planted line, the tests that run, the case kinds written)
BUGS = {
    "kept-plan": ("((planned >= kv_lens) & (planned <= kv_lens + _PLAN_SLACK)).all()",
                  "((planned + 40 >= kv_lens) & (planned <= kv_lens + _PLAN_SLACK)).all()",
                  SEQUENCE, {"sequence"}),
    "clamp": ("tl.maximum(tl.minimum(end, valid), start)",
              "tl.maximum(tl.minimum(end, valid - (ctx > TOPK).to(tl.int32)), start)",
              f"{SEQUENCE} or {SINGLE_STEP}", {"sequence", "step"}),
    "host-lengths": ("return num_rows, torch.clamp(ctx, max=state.max_valid), False",
                     "return num_rows, torch.clamp(ctx - 64, min=1, max=state.max_valid), False",
                     f"{SEQUENCE} or {SINGLE_STEP}", {"sequence", "step"}),
}


def planted_copy(source_root: Path, to: Path, shipped: str, planted: str) -> Path | None:
    """A copy of the release's files with ``shipped`` replaced by ``planted`` in its SM90 module,
    or None where the module does not hold the shipped line once."""
    shutil.copytree(source_root, to)
    module = to / MODULE_FILES[0]
    text = module.read_text()
    if text.count(shipped) != 1:
        return None
    module.write_text(text.replace(shipped, planted))
    return to


def pytest_run(*args: str) -> tuple[int, str, dict[str, int]]:
    """A child pytest in the project's root: its exit status, output and outcome counts."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    out = done.stdout + done.stderr
    tail = out.strip().splitlines()[-1] if out.strip() else ""
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|error|errors|skipped|xfailed)", tail)}
    return done.returncode, out, counts


@pytest.mark.parametrize("bug", BUGS)
def test_a_dumped_case_replays_red_under_the_bug_and_green_without_it(vllm_backend, bug, tmp_path):
    shipped, planted, tests, kinds = BUGS[bug]
    bugged = planted_copy(vllm_backend.source.root, tmp_path / "vllm-planted", shipped, planted)
    if bugged is None:
        pytest.skip(f"the planted line is vLLM 0.33.0's; vLLM {vllm_backend.version}'s module does not hold it: "
                    f"{shipped}")
    dumps = tmp_path / "dumps"
    status, out, counts = pytest_run("-m", "vllm", f"--vllm={bugged}", "tests/cpu/test_vllm_backend.py", "-k", tests,
                                     f"--dump-failures={dumps}")
    assert status == 1 and counts.get("failed"), f"the planted {bug} bug failed no test:\n{out[-3000:]}"
    written = sorted(dumps.glob("*.case.json"))
    assert len(written) == counts["failed"], f"{counts['failed']} failed, {len(written)} cases written:\n{out[-3000:]}"
    records = [json.loads(p.read_text()) for p in written]
    assert {r["kind"] for r in records} == kinds
    assert {r["backend"]["name"] for r in records} == {vllm_backend.name}

    status, out, counts = pytest_run(f"--replay={dumps}", f"--vllm={bugged}")
    assert status == 1 and counts.get("failed") == len(written), f"replay under the bug:\n{out[-3000:]}"
    status, out, counts = pytest_run(f"--replay={dumps}", f"--vllm={vllm_backend.source.root}", "-rA")
    assert status == 0 and counts.get("passed") == len(written), f"replay on the release as shipped:\n{out[-3000:]}"
    assert "the code under test differs" in out, out[-3000:]
