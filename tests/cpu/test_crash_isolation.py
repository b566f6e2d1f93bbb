"""A convert kernel that kills its process, called directly by tests/cpu/test_convert.py (not
through the pipeline's stages), and host lengths and layouts that do, called directly by
tests/cpu/test_kvlen_sources.py and tests/cpu/test_layouts.py: under plain pytest (no xdist
worker to lose) each test it kills fails naming the stage and the signal, the session goes on
to the end, ``--dump-failures`` writes the recipe of each crashed convert step, and the recipes
replay the crash under the bug and pass on the project's implementation."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from harness.isolation import ImplementationCrashed, IsolatedImpl, exit_description
from recording.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
BUG = "tests.bugs:ConvertFaultsOnPaddedRowsOnly"
CRASHED = "the implementation under test killed its process (SIGSEGV) at stage convert"

# The worker moves CPU tensors through shared memory, and the nested sessions build CPU inputs:
# the convert kernel runs them in Triton's interpreter (a child pytest on a GPU machine).
pytestmark = pytest.mark.interpreter


def run_pytest(pytester, *args: str):
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist", "--rootdir", str(ROOT), *args)


def test_a_convert_that_segfaults_fails_its_tests_and_the_session_goes_on(pytester, tmp_path):
    dump = tmp_path / "C"
    result = run_pytest(pytester, str(ROOT / "tests/cpu/test_convert.py"), "--impl", BUG, f"--dump-failures={dump}")
    out = "\n".join(result.outlines)
    outcomes = result.parseoutcomes()
    assert result.ret == 1 and outcomes.get("failed") == 2 and outcomes.get("passed", 0) > 30, out[-3000:]
    assert out.count(CRASHED) >= 2, out[-3000:]
    for name in ("test_padded_rows_of_a_step_with_no_request",
                 "test_a_padded_rows_only_step_with_an_empty_block_table_runs_apart"):
        assert re.search(rf"^FAILED \S*test_convert\.py::{name}\b", out, re.M), out[-3000:]
        recipe = load_recipe(dump / f"{name}.recipe.json")
        assert recipe["crashed_at"] == "convert" and recipe["impl"] == BUG and CRASHED in recipe["crash"], recipe
        assert recipe["spec"]["requests"] == [] and recipe["spec"]["padded_rows"] == 3, recipe["spec"]
    result = run_pytest(pytester, str(ROOT / "tests"), f"--replay={dump}", "--impl", BUG)
    out = "\n".join(result.outlines)
    assert result.ret == 1 and "2 failed" in out and CRASHED in out, out[-3000:]
    result = run_pytest(pytester, str(ROOT / "tests"), f"--replay={dump}")
    assert result.ret == 0 and "2 passed" in "\n".join(result.outlines), "\n".join(result.outlines[-20:])


def test_an_isolated_call_writes_into_the_callers_buffer_and_raises_as_the_implementation_does():
    """Through the worker, convert writes into the ``out`` it is handed and returns that very
    buffer; what the implementation raises is raised here; after a crash the next call runs
    in a new worker."""
    isolated = IsolatedImpl(BUG)
    try:
        topk = torch.full((2, 128), -1, dtype=torch.int32)
        topk[:, :3] = torch.tensor([0, 1, 17], dtype=torch.int32)
        table = torch.tensor([[3, 4]], dtype=torch.int32)
        out = torch.full((2, 128), 5, dtype=torch.int32)
        slots, counts = isolated.convert(topk, table, torch.zeros(2, dtype=torch.int32), 16, out=out,
                                         with_counts=True)
        assert slots is out and out[0, :4].tolist() == [48, 49, 65, -1] and counts.tolist() == [3, 3]
        with pytest.raises(ValueError, match="topk_indices: expected int32"):
            isolated.convert(topk.long(), table, torch.zeros(2, dtype=torch.int32), 16)
        with pytest.raises(ImplementationCrashed, match=re.escape(CRASHED)):
            isolated.convert(torch.full((2, 128), -1, dtype=torch.int32), table, torch.zeros(2, dtype=torch.int32), 16)
        assert isolated.request_ids(torch.tensor([0, 2], dtype=torch.int32), 3).tolist() == [0, 0, 0]
    finally:
        isolated.close()


def test_how_a_worker_ended_is_named():
    assert exit_description(-11) == "SIGSEGV" and exit_description(-6) == "SIGABRT"
    assert exit_description(3) == "exit status 3" and exit_description(None) == "no exit status"


def test_host_lengths_and_layouts_that_kill_their_process_fail_their_tests_and_the_session_goes_on(pytester):
    bug = "tests.bugs:HostStagesKillTheirProcess"
    modules = [str(ROOT / "tests/cpu" / name) for name in ("test_kvlen_sources.py", "test_layouts.py")]
    result = run_pytest(pytester, *modules,
                        "-k", "sync_path or async_path or strided_reads or packed_clamps", "--impl", bug)
    out = "\n".join(result.outlines)
    outcomes = result.parseoutcomes()
    assert result.ret == 1 and outcomes.get("failed") == 5 and "passed" not in outcomes, out[-3000:]
    assert crashed_stages(result) == {"kv_lens": 3, "kv_indptr": 2}, out[-3000:]


def crashed_stages(result) -> dict[str, int]:
    """How many failed tests each stage's crash ended, read from the test reports themselves
    (the printed output repeats a message in the short summary as wide as the terminal allows)."""
    pattern = re.compile(r"ImplementationCrashed: the implementation under test killed its process \(SIGSEGV\) "
                         r"at stage (\w+)")
    counts: dict[str, int] = {}
    for report in result.reprec.getfailures():
        stages = set(pattern.findall(report.longreprtext))
        assert len(stages) == 1, (report.nodeid, report.longreprtext[-2000:])
        stage = stages.pop()
        counts[stage] = counts.get(stage, 0) + 1
    return counts
