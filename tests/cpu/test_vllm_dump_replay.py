"""A failing case of vLLM's own SM90 backend, handed on: bugs planted in a copy of the release's
module make its tests fail; ``--dump-failures`` writes each failing case (single steps, sequences
and a Hypothesis test's failing example, with the release and the module's digest); ``--replay``
of those files fails on the planted copy and passes on the release as it shipped, which is also
named as a different module.

The bugs are ``scripts/vllm_planted_bugs.py``'s: the kept-plan condition, the device clamp and
the host lengths, and the bound from the host's query split, which only a step whose device split
differs shows (its case keeps the host's split). The suite runs in child pytest processes, as a user runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cases import device_split_cases
from scripts.vllm_planted_bugs import BUGS_BY_NAME, HOST_SPLIT_BOUND, planted_copy
from tests.support.child_runs import pytest_run
from tests.support.vllm_planting import SEQUENCE, SINGLE_STEP

pytestmark = [pytest.mark.vllm, pytest.mark.suite_self_test]

ROOT = Path(__file__).resolve().parents[2]
#: A Hypothesis test: its failing example is written.
DRAWN = "drawn_production_inputs"
#: (bug, the tests that run, the case kinds written)
RUNS = [
    ("kept-plan", SEQUENCE, {"sequence"}),
    ("clamp", f"{SEQUENCE} or {SINGLE_STEP}", {"sequence", "step"}),
    ("host-lengths", f"{SEQUENCE} or {SINGLE_STEP}", {"sequence", "step"}),
    ("clamp", DRAWN, {"step"}),
]


def ended_green(counts: dict[str, int]) -> int:
    """The replays that passed or ended at a finding the release is known for (a strict xfail
    expecting the finding's own exception: on FlashInfer's kernel, vLLM 0.31.0's slot 0 loaded
    past a row's length, for one)."""
    return counts.get("passed", 0) + counts.get("xfailed", 0)


@pytest.mark.parametrize(("bug", "tests", "kinds"), RUNS, ids=[f"{bug}-{'drawn' if tests == DRAWN else 'cases'}"
                                                                 for bug, tests, _ in RUNS])
def test_a_dumped_case_replays_red_under_the_bug_and_green_without_it(vllm_backend, bug, tests, kinds, tmp_path):
    bugged = planted_copy(vllm_backend.source.root, tmp_path / "vllm-planted", BUGS_BY_NAME[bug])
    if bugged is None:
        pytest.skip(f"the planted line is vLLM 0.33.0's; vLLM {vllm_backend.version}'s module does not hold it: "
                    f"{BUGS_BY_NAME[bug].shipped}")
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
    assert status == 0 and ended_green(counts) == len(written), f"replay on the release as shipped:\n{out[-3000:]}"
    assert "the code under test differs" in out, out[-3000:]


def test_a_device_split_case_keeps_the_host_split_and_replays_red_under_the_bug_and_green_without_it(
        vllm_backend, tmp_path):
    """Each row bounded by its request under the host's query split (``HOST_SPLIT_BOUND``) fails the
    device split cases of ``tests/cpu/test_query_split.py``; each written case keeps its step's host
    split, without which the step is right under the bug, and replays red on the planted copy and
    green on the release as shipped."""
    bugged = planted_copy(vllm_backend.source.root, tmp_path / "vllm-planted", HOST_SPLIT_BOUND)
    if bugged is None:
        pytest.skip(f"the planted line is vLLM 0.33.0's; vLLM {vllm_backend.version}'s module does not hold it")
    dumps = tmp_path / "dumps"
    status, out, counts = pytest_run("-m", "vllm", f"--vllm={bugged}", "tests/cpu/test_query_split.py", "-k",
                                     "test_adaptive_verification_with_a_device_split", f"--dump-failures={dumps}")
    cases = device_split_cases()
    assert status == 1 and counts.get("failed") == len(cases), f"the planted bug:\n{out[-3000:]}"
    records = [json.loads(p.read_text()) for p in sorted(dumps.glob("*.case.json"))]
    assert sorted(r["steps"][0].get("host_q_lens") for r in records) == sorted(host for _, host in cases), records
    assert all(r["adaptive_verification"] for r in records), records

    status, out, counts = pytest_run(f"--replay={dumps}", f"--vllm={bugged}")
    assert status == 1 and counts.get("failed") == len(cases), f"replay under the bug:\n{out[-3000:]}"
    status, out, counts = pytest_run(f"--replay={dumps}", f"--vllm={vllm_backend.source.root}")
    assert status == 0 and ended_green(counts) == len(cases), f"replay on the release as shipped:\n{out[-3000:]}"
