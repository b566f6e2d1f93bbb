"""The plan-limit study's pure parts (harness.plan_limits): the grow-then-bisect search, the
children that make attempts (stood in for by small fake programs: crashes, hangs, refusals),
the sizes whose rows are checked, the scheduler's work-item count, and the report."""

from __future__ import annotations

import json
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.plan_limits import (
    INT32_ROWS_BOUND,
    PLAN_WIDTH,
    Attempt,
    PlanWorker,
    WarmRowsChildren,
    checked_sizes,
    entry_finding,
    exceeds_work_capacity,
    fa3_work_items,
    report_markdown,
    run_rows_attempt,
    search_largest,
    search_near,
    study_heads,
    write_report,
)
from harness.port.plan_limits_child import plan_attempt, rows_attempt, rows_from_line, warm_up
from mla_constants import FA3_WORK_CAPACITY
from tests.support.reference_wrapper import ReferenceWrapper


def threshold_attempts(limit: int, failing: str = "refused"):
    """An attempt function that succeeds up to ``limit`` rows and fails above it, with a log."""
    log = []

    def attempt(n: int) -> Attempt:
        log.append(n)
        return Attempt("plan", n, 16, "accepted" if n <= limit else failing, "" if n <= limit else f"over {limit}")

    return attempt, log


# --- the search ------------------------------------------------------------------------------


@given(limit=st.integers(0, 5000), bound=st.integers(1, 4000))
def test_search_finds_the_exact_limit_or_the_bound(limit, bound):
    attempt, log = threshold_attempts(limit)
    search = search_largest(attempt, bound=bound)
    assert search.largest_ok == min(limit, bound)
    if limit < bound:
        assert search.first_failing is not None and search.first_failing.rows == limit + 1
        assert not search.reached_bound
    else:
        assert search.reached_bound and search.first_failing is None
    assert [a.rows for a in search.attempts] == log
    assert len(log) == len(set(log)), "an N was attempted twice"
    assert len(log) <= 2 * bound.bit_length() + 2


def test_search_grows_by_doubling_then_bisects():
    attempt, log = threshold_attempts(20)
    search_largest(attempt, bound=1000)
    assert log == [1, 2, 4, 8, 16, 32, 24, 20, 22, 21]


def test_search_caps_the_growth_at_the_bound():
    attempt, log = threshold_attempts(10**9)
    search = search_largest(attempt, bound=100)
    assert log == [1, 2, 4, 8, 16, 32, 64, 100] and search.largest_ok == 100 and search.reached_bound


def test_search_where_the_first_attempt_fails():
    attempt, log = threshold_attempts(0, failing="crashed")
    search = search_largest(attempt, bound=64)
    assert search.largest_ok == 0 and search.first_failing.outcome == "crashed" and log == [1]


@pytest.mark.parametrize("failing", ["refused", "crashed", "timeout"])
def test_crashes_and_timeouts_stop_the_growth_like_refusals(failing):
    attempt, _ = threshold_attempts(300, failing=failing)
    search = search_largest(attempt, bound=10_000)
    assert search.largest_ok == 300 and search.first_failing.outcome == failing and search.first_failing.rows == 301


def test_search_rejects_a_start_outside_the_bound():
    with pytest.raises(ValueError, match="start"):
        search_largest(lambda n: Attempt("plan", n, 16, "accepted"), bound=4, start=5)


@given(limit=st.integers(0, 5000), bound=st.integers(1, 4000), data=st.data())
def test_search_near_finds_what_the_search_from_one_finds(limit, bound, data):
    expected = data.draw(st.integers(1, bound), label="expected")
    attempt, log = threshold_attempts(limit)
    near = search_near(attempt, bound=bound, expected=expected)
    full = search_largest(threshold_attempts(limit)[0], bound=bound)
    assert (near.largest_ok, near.reached_bound) == (full.largest_ok, full.reached_bound)
    assert (near.first_failing and near.first_failing.rows) == (full.first_failing and full.first_failing.rows)
    assert [a.rows for a in near.attempts] == log and len(log) == len(set(log)), "an N was attempted twice"
    assert len(log) <= 2 * bound.bit_length() + 3
    if limit == expected < bound:
        assert log == [expected, expected + 1], "the expected limit takes two attempts"
    if limit >= bound > expected:
        assert log == ([expected, expected + 1, bound] if expected + 1 < bound else [expected, bound])


def test_search_near_at_the_work_capacity():
    attempt, log = threshold_attempts(16384)
    search = search_near(attempt, bound=32768, expected=16384)
    assert search.largest_ok == 16384 and search.first_failing.rows == 16385 and log == [16384, 16385]
    attempt, log = threshold_attempts(10**9)
    assert search_near(attempt, bound=32768, expected=16384).reached_bound and log == [16384, 16385, 32768]
    attempt, log = threshold_attempts(20000)
    assert search_near(attempt, bound=32768, expected=16384).largest_ok == 20000 and log[:3] == [16384, 16385, 32768]
    attempt, log = threshold_attempts(20, failing="crashed")
    search = search_near(attempt, bound=32768, expected=16384)
    assert search.largest_ok == 20 and search.first_failing.rows == 21 and search.first_failing.outcome == "crashed"
    assert log == [16384, 1, 2, 4, 8, 16, 32, 24, 20, 22, 21]
    with pytest.raises(ValueError, match="expected"):
        search_near(attempt, bound=4, expected=5)


def test_search_result_survives_json():
    attempt, _ = threshold_attempts(5)
    data = json.loads(json.dumps(search_largest(attempt, bound=16).to_dict()))
    assert data["largest_ok"] == 5 and data["first_failing"]["rows"] == 6 and len(data["attempts"]) == 6


# --- the children -------------------------------------------------------------------------------

FAKE_PLAN_CHILD = r"""
import json, os, sys, time
for line in sys.stdin:
    n, h, w = map(int, line.split())
    if n == 13:
        sys.stderr.write("CUDA error: an illegal memory access was encountered\n"); sys.stderr.flush()
        os._exit(134)
    if n == 21:
        time.sleep(60)
    if n > 40:
        r = {"outcome": "refused", "detail": "ValueError: needs %d work items" % n, "healthy": True}
    elif n == 30:
        r = {"outcome": "refused", "detail": "RuntimeError: CUDA error", "healthy": False}
    else:
        r = {"outcome": "accepted", "detail": ""}
    print("RESULT " + json.dumps(dict(kind="plan", rows=n, heads=h, width=w, pid=os.getpid(), **r)), flush=True)
"""


def test_plan_worker_survives_crashes_hangs_and_restarts_after_unhealthy_refusals():
    with PlanWorker(timeout=3, command=[sys.executable, "-c", FAKE_PLAN_CHILD]) as worker:
        first = worker.attempt(5, 16)
        assert first.outcome == "accepted" and first.extra["width"] == PLAN_WIDTH
        assert worker.attempt(6, 16).extra["pid"] == first.extra["pid"], "a clean attempt replaced the child"
        crash = worker.attempt(13, 16)
        assert crash.outcome == "crashed" and "134" in crash.detail and "illegal memory access" in crash.detail
        after = worker.attempt(7, 16)
        assert after.outcome == "accepted" and after.extra["pid"] != first.extra["pid"]
        worker.timeout = 0.5  # the child is up and never answers this one: no need to wait long
        hang = worker.attempt(21, 16)
        assert hang.outcome == "timeout"
        worker.timeout = 3
        refused = worker.attempt(41, 128)
        assert refused.outcome == "refused" and refused.detail.startswith("ValueError") and refused.heads == 128
        assert worker.attempt(8, 16).extra["pid"] == refused.extra["pid"], "a healthy refusal replaced the child"
        unhealthy = worker.attempt(30, 16)
        assert unhealthy.outcome == "refused"
        assert worker.attempt(9, 16).extra["pid"] != unhealthy.extra["pid"], "the child kept running after a CUDA error"
        assert worker.started == 4


CRASHING_ABOVE_12 = r"""
import json, os, sys
for line in sys.stdin:
    n, h, w = map(int, line.split())
    if n > 12:
        os._exit(139)
    print("RESULT " + json.dumps(dict(kind="plan", rows=n, heads=h, outcome="accepted")), flush=True)
"""


def test_search_through_a_worker_goes_on_past_a_crash():
    with PlanWorker(timeout=10, command=[sys.executable, "-c", CRASHING_ABOVE_12]) as worker:
        search = search_largest(lambda n: worker.attempt(n, 16), bound=64)
    assert search.largest_ok == 12 and search.first_failing.outcome == "crashed"
    assert [a.rows for a in search.attempts] == [1, 2, 4, 8, 16, 12, 14, 13]
    assert [a.outcome for a in search.attempts][-1] == "crashed"


def fake_rows_child(body: str) -> list[str]:
    return [sys.executable, "-c", "import json, os, sys, time\n" + body]


def test_rows_attempt_reports_the_child_result():
    body = ('print("STAGE " + json.dumps({"stage": "run"}), flush=True)\n'
            'print("RESULT " + json.dumps({"kind": "rows", "rows": 7, "heads": 16, "outcome": "wrong", '
            '"detail": "2 of 7 rows", "summary": {"bad_rows": 2}}), flush=True)\n')
    attempt = run_rows_attempt(7, 16, command=fake_rows_child(body), timeout=30)
    assert attempt.outcome == "wrong" and attempt.extra["summary"] == {"bad_rows": 2}


def test_rows_attempt_names_the_stage_a_dead_child_reached():
    body = ('print("STAGE " + json.dumps({"stage": "plan"}), flush=True)\n'
            'print("STAGE " + json.dumps({"stage": "run"}), flush=True)\n'
            'sys.stderr.write("RuntimeError: CUDA error: an illegal memory access\\n"); sys.stderr.flush()\n'
            'os._exit(1)\n')
    attempt = run_rows_attempt(9, 128, command=fake_rows_child(body), timeout=30)
    assert attempt.outcome == "crashed" and attempt.extra["stage"] == "run"
    assert "memory_retries" not in attempt.extra  # a crash, not a memory shortage: made once
    assert "illegal memory access" in attempt.detail and attempt.rows == 9 and attempt.heads == 128


def test_rows_attempt_times_out():
    body = 'print("STAGE " + json.dumps({"stage": "judge"}), flush=True)\ntime.sleep(60)\n'
    attempt = run_rows_attempt(3, 16, command=fake_rows_child(body), timeout=2)
    assert attempt.outcome == "timeout" and attempt.extra["stage"] == "judge"


#: A rows child that runs out of GPU memory the first ``{fails}`` times (counted in ``{marker}``).
OUT_OF_MEMORY_CHILD = """
from pathlib import Path
marker = Path({marker!r})
tries = int(marker.read_text()) + 1 if marker.exists() else 1
marker.write_text(str(tries))
print("STAGE " + json.dumps({{"stage": "judge"}}), flush=True)
if tries <= {fails}:
    sys.stderr.write("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB. "
                     "Process 3732 has 15.41 GiB memory in use.\\n")
    sys.stderr.flush()
    os._exit(1)
print("RESULT " + json.dumps({{"kind": "rows", "rows": 5, "heads": 16, "outcome": "right"}}), flush=True)
"""


def test_a_rows_child_that_ran_out_of_gpu_memory_is_made_again(tmp_path, monkeypatch):
    """The other workers' tests can hold the GPU's memory for a while: an attempt that ran out
    of it is made again in a fresh child; one that runs out every time ends as it did, its
    retries named (a memory problem of the code under test still shows)."""
    import harness.memory_retry

    monkeypatch.setattr(harness.memory_retry, "OOM_PAUSE_S", 0.0)
    once = fake_rows_child(OUT_OF_MEMORY_CHILD.format(marker=str(tmp_path / "once"), fails=1))
    attempt = run_rows_attempt(5, 16, command=once, timeout=30)
    assert attempt.outcome == "right" and attempt.extra["memory_retries"] == 1, attempt
    assert "made 2 times: out of GPU memory" in attempt.detail
    always = fake_rows_child(OUT_OF_MEMORY_CHILD.format(marker=str(tmp_path / "always"), fails=99))
    with WarmRowsChildren(1, command=always) as rows:
        attempt = rows.attempt(5, 16, timeout=30)
    assert attempt.outcome == "crashed" and attempt.extra["stage"] == "judge", attempt
    assert attempt.extra["memory_retries"] == harness.memory_retry.OOM_RETRIES
    assert (tmp_path / "always").read_text() == str(harness.memory_retry.OOM_RETRIES + 1)
    assert "made 3 times: out of GPU memory" in attempt.detail, attempt.detail


WARM_ROWS_CHILD = r"""
n, h, w, seed = map(int, sys.stdin.readline().split())
print("STAGE " + json.dumps({"stage": "plan"}), flush=True)
if n == 13:
    sys.stderr.write("CUDA error: an illegal memory access was encountered\n"); sys.stderr.flush()
    os._exit(134)
if n == 21:
    time.sleep(60)
print("RESULT " + json.dumps({"kind": "rows", "rows": n, "heads": h, "outcome": "right", "width": w, "seed": seed,
                              "pid": os.getpid()}), flush=True)
"""


def test_warm_rows_children_wait_for_their_size_and_each_serves_one_attempt():
    with WarmRowsChildren(2, command=fake_rows_child(WARM_ROWS_CHILD)) as rows:
        waiting = list(rows.waiting)
        first, second, third = rows.attempt(7, 16), rows.attempt(8, 128, width=64, seed=3), rows.attempt(9, 16)
        assert [(a.outcome, a.rows, a.heads) for a in (first, second, third)] == [
            ("right", 7, 16), ("right", 8, 128), ("right", 9, 16)]
        assert (second.extra["width"], second.extra["seed"]) == (64, 3)
        assert len({first.extra["pid"], second.extra["pid"], third.extra["pid"]}) == 3, "a child served two attempts"
        assert {first.extra["pid"], second.extra["pid"]} == {p.pid for p in waiting}, "the waiting children served"
        crash = rows.attempt(13, 16)
        assert crash.outcome == "crashed" and crash.extra["stage"] == "plan" and "illegal memory access" in crash.detail
        hang = rows.attempt(21, 16, timeout=0.5)
        assert hang.outcome == "timeout"
        left = rows._start()
        rows.waiting.append(left)
    assert left.poll() is not None and not rows.waiting, "a child left waiting outlived the search"


# --- what is checked, and the report ----------------------------------------------------------------


def test_checked_sizes_around_a_refusal_and_at_the_bound():
    attempt, _ = threshold_attempts(100)
    assert checked_sizes(search_largest(attempt, bound=1000)) == [99, 100, 101]
    assert checked_sizes(search_largest(attempt, bound=64)) == [63, 64], "nothing above the bound is tried"
    attempt, _ = threshold_attempts(0)
    assert checked_sizes(search_largest(attempt, bound=64)) == [1]


def fake_study(plan_limit: int, rows_right_up_to: int, bound: int, rows_search: bool = True,
               expected: int | None = None) -> dict:
    def plan(n, heads):
        return Attempt("plan", n, heads, "accepted" if n <= plan_limit else "refused",
                       "" if n <= plan_limit else "ValueError: FA MLA needs more work items")

    def rows(n, heads):
        return Attempt("rows", n, heads, "right" if n <= rows_right_up_to else "wrong",
                       "" if n <= rows_right_up_to else f"{n - rows_right_up_to} rows beyond the budget")

    return study_heads(16, bound=bound, plan_attempt_fn=plan, rows_attempt_fn=rows, rows_search=rows_search,
                       expected=expected)


def test_study_checks_the_rows_around_the_limit_and_keeps_the_refusal():
    entry = fake_study(plan_limit=100, rows_right_up_to=1000, bound=4096)
    checks = entry["row_checks"]
    assert [(c["kind"], c["rows"], c["outcome"]) for c in checks] == [
        ("rows", 99, "right"), ("rows", 100, "right"), ("plan", 101, "refused")]
    assert "rows_search" not in entry, "the rows search ran although every checked row was right"
    assert entry_finding(entry) == "refused above N=100; the rows at the limit are right"


def test_study_near_the_expected_limit_checks_the_same_rows():
    entry = fake_study(plan_limit=100, rows_right_up_to=1000, bound=4096, expected=100)
    assert [a["rows"] for a in entry["plan_search"]["attempts"]] == [100, 101]
    assert entry["row_checks"] == fake_study(plan_limit=100, rows_right_up_to=1000, bound=4096)["row_checks"]


def test_study_finds_accepted_plans_with_wrong_rows_and_where_they_start():
    entry = fake_study(plan_limit=10**9, rows_right_up_to=300, bound=1024)
    assert entry["plan_search"]["reached_bound"]
    assert [(c["rows"], c["outcome"]) for c in entry["row_checks"]] == [(1023, "wrong"), (1024, "wrong")]
    assert entry["rows_search"]["largest_ok"] == 300
    finding = entry_finding(entry)
    assert finding.startswith("FINDING: plan() accepted N=1023 and then gave wrong rows without an error")
    assert finding.endswith("every row right up to N=300")


def test_report_has_one_line_per_head_count_and_survives_json(tmp_path):
    report = {"schema": 1, "flashinfer": "0.6.18.post1", "device": "NVIDIA H200", "num_sm": 132, "width": PLAN_WIDTH,
              "bound": 1024, "work_capacity": FA3_WORK_CAPACITY,
              "results": [fake_study(10**9, 300, 1024), fake_study(100, 1000, 1024) | {"heads": 128}]}
    text = report_markdown(report)
    assert "## FlashInfer 0.6.18.post1 on NVIDIA H200 (132 SMs)" in text
    rows = [line for line in text.splitlines() if line.startswith("| 16 ") or line.startswith("| 128 ")]
    assert len(rows) == 2 and "1024 (the bound)" in rows[0] and "FINDING" in rows[0] and "| 300 |" in rows[0]
    assert "| 100 | refused: ValueError: FA MLA needs more work items |" in rows[1]
    json_path, md_path = write_report(report, str(tmp_path))
    assert json.load(open(json_path))["results"][0]["rows_search"]["largest_ok"] == 300
    assert open(md_path).read() == text and md_path.endswith("plan-limits-0.6.18.post1.md")


# --- the scheduler's work items ---------------------------------------------------------------------


def test_one_row_alone_is_split_into_many_work_items():
    # 2048 slots over 132 SMs: 16 per cluster, the chunk is 64 slots, 32 items.
    assert fa3_work_items([1], [2048], num_heads=16, num_sm=132) == 32


@pytest.mark.parametrize("heads", [16, 32, 64, 128])
@pytest.mark.parametrize("rows", [132, 1000, FA3_WORK_CAPACITY, FA3_WORK_CAPACITY + 1])
def test_from_a_few_hundred_rows_on_every_row_is_one_work_item(rows, heads):
    assert fa3_work_items([1] * rows, [PLAN_WIDTH] * rows, heads, num_sm=132) == rows


def test_rows_without_a_query_make_no_work_and_empty_rows_make_one():
    # padded rows (q_len 0) of a CUDA-graph plan; a row with kv_len 0 still gets an item
    assert fa3_work_items([1, 1, 0, 0], [0, 5, 0, 0], 16, 132) == 2


def test_cluster_size_follows_the_average_packed_query():
    # H 128: packed 128 > 64 -> clusters of 2 CTAs, tiles of 128 rows: 1 tile per row
    assert fa3_work_items([1] * 200, [2048] * 200, 128, 132) == 200
    # 4 query rows of one request at H 32: 128 packed rows, one tile of 128; 100 slots over 66
    # clusters is 2 per cluster, so chunks of 32 slots: 4 items
    assert fa3_work_items([4], [100], 32, 132) == 4


def test_work_capacity_rule():
    assert not exceeds_work_capacity(FA3_WORK_CAPACITY) and exceeds_work_capacity(FA3_WORK_CAPACITY + 1)
    assert INT32_ROWS_BOUND * PLAN_WIDTH < 2**31 <= (INT32_ROWS_BOUND + 1) * PLAN_WIDTH


# --- what a child does, through the CPU stand-in of the wrapper ------------------------------------


def test_plan_attempt_accepts_and_reports_a_refusal(stand_in):
    assert plan_attempt(5, 16, width=64, device="cpu")["outcome"] == "accepted"
    ReferenceWrapper.refuse = "FA MLA needs 5 work items including KV splits; native capacity is 4."
    try:
        refused = plan_attempt(5, 16, width=64, device="cpu")
    finally:
        ReferenceWrapper.refuse = None
    assert refused["outcome"] == "refused" and refused["healthy"]
    assert refused["exception_types"] == ["ValueError", "Exception"]
    assert refused["detail"] == "ValueError: FA MLA needs 5 work items including KV splits; native capacity is 4."


POOL = 512  # KV slots the CPU rows attempts read from (6 rows of 64: the production pool costs seconds on CPU)


def test_rows_attempt_judges_every_row(stand_in, monkeypatch):
    stages = []
    warm_up("cpu")  # a warm rows child: started, then its size read from a line
    result = rows_from_line("6 2 64 0\n", emit=stages.append, device="cpu", pool_slots=POOL)
    assert result["outcome"] == "right" and result["summary"]["rows"] == 6 and result["nonfinite_rows"] == 0
    assert [json.loads(s[len("STAGE "):])["stage"] for s in stages] == ["inputs", "plan", "run", "judge", "done"]
    # a kernel that writes a wrong row, silently
    real_run = ReferenceWrapper.run

    def one_wrong_row(self, q_nope, q_pe, ckv, kpe, *, out, lse, k_scale=1.0):
        real_run(self, q_nope, q_pe, ckv, kpe, out=out, lse=lse, k_scale=k_scale)
        out[4].mul_(1.05)

    monkeypatch.setattr(ReferenceWrapper, "run", one_wrong_row)
    wrong = rows_attempt(6, 2, width=64, device="cpu", emit=stages.append, pool_slots=POOL)
    assert wrong["outcome"] == "wrong" and wrong["summary"]["first_bad"] == [4]
    assert wrong["detail"].startswith("1 of 6 rows beyond the budget, no error")


def test_the_study_refuses_in_one_line_where_the_gpu_path_cannot_run(tmp_path, capsys):
    """Without an SM90 GPU and FlashInfer the study refuses before any attempt (exit status 2,
    one line), instead of reporting a largest accepted plan of 0."""
    import harness.availability

    if harness.availability.sm90_flashinfer_unavailable_reason() is None:
        pytest.skip("the SM90 FlashInfer path runs here: the study would run")
    from scripts.plan_limits import main

    assert main(["--out", str(tmp_path / "out"), "--heads", "16", "--bound", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("scripts.plan_limits: installed FlashInfer: the SM90 FlashInfer path "
                                               "cannot run here: "), err
    assert not (tmp_path / "out").exists(), "nothing is written"


def test_a_failing_environment_child_is_one_line_too():
    from harness.plan_limits import StudyUnavailable, environment_info

    with pytest.raises(StudyUnavailable, match="the environment child failed: SystemExit: no torch here"):
        environment_info([sys.executable, "-c", "raise SystemExit('SystemExit: no torch here')"])
