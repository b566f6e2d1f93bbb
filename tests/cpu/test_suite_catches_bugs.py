"""Tests of the suite itself: each production bug (docs/findings.md), re-created in
``tests/bugs.py`` and plugged in with ``--impl``, must make the suite fail, with a message
that names what broke. The bugs of the attention state are caught by the GPU tier's edge
families (docs/edges.md): those run on the installed FlashInfer where the GPU tier runs, and
everywhere on a simulated SM90 machine (``tests/simulated_sm90.py``: FlashInfer's wrapper
replaced by the reference), where the families must also pass on the project's own path."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.child_runs import run_gpu_family

ROOT = Path(__file__).resolve().parents[2]
KVLEN = "tests/cpu/test_kvlen_regimes.py"
CONVERT = "tests/cpu/test_convert.py"

# (docs/findings.md anchor of the bug, re-creation, tests that must catch it, -k selection, message the failure shows)
BUG_CASES = [
    (
        "kpool-wrong-cache-spec",
        "KpoolFromWrongSpec",
        KVLEN,
        "test_kv_len_equals_valid_count and kpool4",
        r"kv_len != valid count on \d+ rows",
    ),
    # the same bug where a known finding could hide it: steps whose top-k has holes (the holes
    # finding is a strict xfail there), through the port with the run's host stages
    (
        "kpool-wrong-cache-spec",
        "KpoolFromWrongSpec",
        "tests/cpu/test_topk_holes.py",
        "test_port_plans_the_length_rule_over_holes and kpool4",
        r"the length it runs is neither its valid count nor the length rule's count",
    ),
    (
        "prefills-to-mha-still-planned",
        "PrefillsStillPlanned",
        KVLEN,
        "test_kv_len_equals_valid_count and to-mha",
        r"rows planned but q has \d+ rows",
    ),
    (
        "regime-c-compacted",
        "CompactionPlansPrefix",
        KVLEN,
        "test_plan_reads_the_intended_slots and compacted and kpool4",
        r"planned slots != intended slots .*regime C",
    ),
    (
        "packed-clamp-with-a-wrong-length",
        "PackedWithMaxTailLength",
        KVLEN,
        "test_plan_reads_the_intended_slots and packed and ctx2049-kpool4",
        r"\[len==valid\] row \d+: planned len \d+ != \d+ valid entries",
    ),
    (
        "ctx-off-by-one",
        "ContextIsPosition",
        KVLEN,
        "test_kv_len_equals_valid_count",
        r"kv_len != valid count on \d+ rows",
    ),
    (
        "optimistic-async-bounds",
        "OptimisticBoundAsExact",
        KVLEN,
        "test_kv_len_equals_valid_count and async",
        r"kv_len != valid count on \d+ rows",
    ),
    ("convert-block-column-out-of-range", "ConvertWithoutTableBound", CONVERT, "", r"FAILED \S*test_convert\.py::"),
    (
        "packed-rows-rewritten-only-when-their-span-changes",
        "PackedRewritesOnlyChangedRows",
        "tests/cpu/test_sequences.py",
        "test_decode_steps_through_reused_buffers",
        r"rows planned wrong \[\d+",
    ),
    (
        "convert-request-id-rows-mismatch",
        "ConvertAcceptsMismatchedReqIds",
        CONVERT,
        "req_id_rows",
        r"FAILED \S*test_convert\.py::test_req_id_rows",
    ),
]


def run_suite(pytester, impl: str, path: str, select: str):
    """Run part of the suite in a nested in-process session with another implementation."""
    args = [str(ROOT / path), f"--impl={impl}", "-x", "-p", "no:cacheprovider", "--rootdir", str(ROOT)]
    if select:
        args += ["-k", select]
    return pytester.runpytest_inprocess(*args)


@pytest.mark.suite_self_test
@pytest.mark.parametrize(("entry", "bug", "path", "select", "message"), BUG_CASES, ids=[c[1] for c in BUG_CASES])
def test_suite_fails_on_recreated_bug(pytester, entry, bug, path, select, message):
    result = run_suite(pytester, f"tests.bugs:{bug}", path, select)
    output = "\n".join(result.outlines + result.errlines)
    assert result.ret == 1, (
        f"docs/findings.md#{entry}: the suite did not fail on tests.bugs:{bug} (exit {result.ret})\n{output[-3000:]}"
    )
    assert re.search(message, output, flags=re.S), (
        f"docs/findings.md#{entry}: expected /{message}/ in\n{output[-3000:]}"
    )


def test_bad_impl_spec_is_a_clear_usage_error(pytester):
    result = run_suite(pytester, "tests.bugs:NoSuchThing", KVLEN, "identity")
    output = "\n".join(result.outlines + result.errlines)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("ERROR: ")]
    assert errors == [
        "ERROR: --impl 'tests.bugs:NoSuchThing': cannot load the factory: "
        "module 'tests.bugs' has no attribute 'NoSuchThing'"
    ], output[-3000:]


EDGES = "tests/gpu/test_edges.py"
SCALE = "tests/gpu/test_scale.py"
INVARIANCE = "tests/gpu/test_invariance.py"
SEAM = "tests/gpu/test_backends.py"
#: The scale case past the 512-row grid of StepKernelsOnTheCapturedGrid that the simulated
#: machine runs in seconds: 1024 rows at H 16 and a top-k of 64 (``harness.port.scale.narrow_scale_cases``).
SCALE_PAST_THE_GRID = "rows1024-kpool1-topk64"
#: The invariance case the simulated machine runs in seconds: its 256-row batches at H 16, no
#: rope, a top-k of 128 (``tests/gpu/test_invariance.py``, ``NARROW_TOPK``).
INVARIANCE_CASE = "short-bf16-nope-h16-topk128"

# (docs/findings.md anchor, or FILE.md#anchor of another page of docs/, re-creation, GPU test file, -k selection,
# message the failure shows)
GPU_BUG_CASES = [
    (
        "plan-kept-for-the-same-row-count",
        "PlanKeptForTheSameRowCount",
        EDGES,
        "test_previous_steps_slots_change_nothing and packed-short",
        r"edge stale-slots.*kv_len differs from the planned lens",
    ),
    (
        "lse-base-changed-through-exp",
        "LseBaseChangedThroughExp",
        EDGES,
        "test_kernel_holds_at_any_score_offset and offsets-across-batch-kpool1",
        r"lse\[offset 32768\]: .*inf mismatches",
    ),
    (
        "stale-lengths-after-a-smaller-replan",
        "StaleLengthsPastTheRowCount",
        EDGES,
        "test_previous_steps_slots_change_nothing and packed-short",
        # a release that checks page counts refuses the stale lengths at plan; one that does not plans them
        r"(edge stale-slots.*stale kv_len past row \d+|CSR metadata page counts in kv_indptr must equal)",
    ),
    # Exactly the rows past the grid fail, the first of them named: the 512 rows the grid covers
    # pass the family's checks.
    (
        "step-kernels-on-the-captured-grid",
        "StepKernelsOnTheCapturedGrid",
        SCALE,
        SCALE_PAST_THE_GRID,
        r"rows1024-\S+: wrong at stage done.*\b512 of 1024 rows beyond the error budget \(worst first\):\n"
        r"E?\s+row (51[2-9]|5[2-9]\d|[6-9]\d\d|10[01]\d|102[0-3]) \(request \d+, regime",
    ),
    # The `last` placement fails, its rows named, and no other placement does: those are
    # planned afresh and pass the family's checks.
    (
        "plan-kept-for-a-reordered-batch",
        "PlanKeptForAReorderedBatch",
        INVARIANCE,
        INVARIANCE_CASE,
        r"(?m)\A(?!.*^E\s+(?:alone|first|among-long|among-short): )"
        r".*^E\s+last: \d+ of 256 rows beyond the error budget \(worst first\):"
        r"\nE?\s+row \d+ \(row of key \d+, \d+ slots"
        r".*^E\s+last: the target row moved by more than its error budget",
    ),
    # A host-stage bug through the seam: the port runs --impl's host stages, so the seam's tests
    # of the port fail, before launch, on the rows the bug plans short.
    (
        "kpool-wrong-cache-spec",
        "KpoolFromWrongSpec",
        SEAM,
        "port-fa3-ctx2051-kpool4",
        r"invariant violations \(kernel not launched\).*\[len==valid\] row 0: planned len 2048 != 2051 valid "
        r"entries \(regime E\)",
    ),
    # A bug only a CUDA graph shows: the port's plan-history and poisoned-workspace tests, run
    # eagerly, pass (run first, under -x), and its graph-against-eager test fails on the replay's
    # output (the poison the graphed mode left in it).
    (
        "input-space.md#graph-against-eager",
        "GraphOutputLeftInItsStaticBuffers",
        "tests/gpu/test_plan_history_and_state.py",
        "port-fa3",
        r"the graph replay's output is not the eager run's bit for bit \(\d+ elements differ, .*non-finite: [1-9]"
        r".*\b1 failed, 2 passed\b",
    ),
]
GPU_BUG_IDS = [c[1] for c in GPU_BUG_CASES]

#: What runs on the project's path on the simulated machine: all of the edge file, and the scale
#: cases of 1 to 3 rows. The larger scale and the invariance cases run there with their bugs
#: only, whose messages above show the rows and placements the bugs leave right passing.
PROJECT_PATH_RUNS = [(EDGES, ""), (SCALE, "rows1- or rows2- or rows3-")]


def assert_caught(result, entry: str, bug: str, message: str) -> None:
    output = "\n".join(result.outlines + result.errlines)
    assert result.ret == 1, (
        f"{documented(entry)}: the suite did not fail on tests.bugs:{bug} (exit {result.ret})\n{output[-3000:]}"
    )
    assert re.search(message, output, flags=re.S), f"{documented(entry)}: expected /{message}/ in\n{output[-3000:]}"


def documented(entry: str) -> str:
    """Where ``entry`` is documented: a section of docs/findings.md, or ``FILE.md#anchor`` of docs/."""
    return f"docs/{entry}" if ".md#" in entry else f"docs/findings.md#{entry}"


@pytest.mark.gpu
@pytest.mark.suite_self_test
@pytest.mark.parametrize(("entry", "bug", "path", "select", "message"), GPU_BUG_CASES, ids=GPU_BUG_IDS)
def test_gpu_families_fail_on_recreated_bug(pytester, monkeypatch, entry, bug, path, select, message):
    """On the installed FlashInfer."""
    result = run_gpu_family(pytester, monkeypatch, path, select, "-x", f"--impl=tests.bugs:{bug}", simulated=False)
    assert_caught(result, entry, bug, message)


@pytest.mark.gpu_stand_in
@pytest.mark.suite_self_test
@pytest.mark.parametrize(("entry", "bug", "path", "select", "message"), GPU_BUG_CASES, ids=GPU_BUG_IDS)
def test_gpu_families_fail_on_recreated_bug_on_a_simulated_machine(
    pytester, monkeypatch, entry, bug, path, select, message
):
    result = run_gpu_family(pytester, monkeypatch, path, select, "-x", f"--impl=tests.bugs:{bug}", simulated=True)
    assert_caught(result, entry, bug, message)


@pytest.mark.gpu_stand_in
@pytest.mark.suite_self_test
@pytest.mark.parametrize(("path", "select"), PROJECT_PATH_RUNS, ids=[Path(p).stem for p, _ in PROJECT_PATH_RUNS])
def test_gpu_families_pass_on_the_project_path_on_a_simulated_machine(pytester, monkeypatch, path, select):
    """The families' tests pass on the project's own implementation: the failures above are the
    bugs', and the families' own code (plans, buffers, comparisons) runs in every CI run."""
    result = run_gpu_family(pytester, monkeypatch, path, select, simulated=True)
    output = "\n".join(result.outlines + result.errlines)
    outcomes = result.parseoutcomes()
    assert result.ret == 0 and outcomes.get("passed") and set(outcomes) <= {"passed", "deselected"}, (
        f"{path} on a simulated machine:\n{output[-3000:]}"
    )
