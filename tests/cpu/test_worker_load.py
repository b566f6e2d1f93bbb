"""The "xdist workers" section: which worker ends the run, and with which tests."""

import functools
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from pytest_sparse_mla.worker_load import (
    UNRECORDED_SLOW_S,
    WorkerLoadReport,
    deal_order,
    expected_seconds,
    first_block,
    junit_seconds,
    load_lines,
    main,
    merged,
    node_id,
    read_durations,
    short_name,
    worker_loads,
)

ROOT = Path(__file__).resolve().parents[2]


def phase(worker, nodeid, start, stop):
    return (worker, nodeid, start, stop, stop - start)


def test_the_worker_whose_last_test_ends_last_comes_first_with_its_longest_tests():
    phases = [
        phase("gw0", "tests/a.py::t1", 100.0, 101.0),
        phase("gw0", "tests/a.py::t1", 101.0, 103.0),  # the call after the setup: one test
        phase("gw0", "tests/a.py::t2", 103.0, 104.0),
        phase("gw1", "tests/b.py::slow", 100.5, 120.5),
    ]
    gw1, gw0 = worker_loads(phases, session_start=90.0)
    assert (gw1.worker, gw1.tests, gw1.busy_s, gw1.starts_at_s, gw1.ends_at_s) == ("gw1", 1, 20.0, 10.5, 30.5)
    assert (gw0.worker, gw0.tests, gw0.busy_s, gw0.starts_at_s, gw0.ends_at_s) == ("gw0", 2, 4.0, 10.0, 14.0)
    assert gw0.longest == [(3.0, "tests/a.py::t1"), (1.0, "tests/a.py::t2")]
    lines = load_lines([gw1, gw0])
    assert lines[0] == "gw1: 1 tests, 20.0 s busy from 10.5 s to 30.5 s; longest: b::slow 20.0 s"
    assert lines[-1] == ("all workers: first test at 10.0 s; 24.0 test-seconds, 12.0 s each if split evenly;"
                         " the last worker ended at 30.5 s (gw1)")


def test_only_the_longest_three_are_named_and_nothing_is_said_of_an_empty_run():
    phases = [phase("gw0", f"tests/a.py::t{i}", 0.0, float(i)) for i in range(1, 6)]
    (load,) = worker_loads(phases, session_start=0.0)
    assert [n for _, n in load.longest] == ["tests/a.py::t5", "tests/a.py::t4", "tests/a.py::t3"]
    assert worker_loads([], session_start=0.0) == []


def test_the_report_reads_the_worker_of_each_xdist_report_and_skips_reports_without_one():
    report = WorkerLoadReport(session_start=0.0)
    node = SimpleNamespace(gateway=SimpleNamespace(id="gw3"))
    report.pytest_runtest_logreport(SimpleNamespace(node=node, nodeid="t::a", start=1.0, stop=3.5, duration=2.5))
    report.pytest_runtest_logreport(SimpleNamespace(nodeid="t::b", start=1.0, stop=2.0, duration=1.0))
    assert report.phases == [("gw3", "t::a", 1.0, 3.5, 2.5)]


def test_short_names_drop_the_folder_and_the_suffix():
    assert short_name("tests/cpu/test_x.py::test_y[p-1]") == "test_x::test_y[p-1]"
    assert short_name("tests/cpu/test_x.py") == "test_x"


# --- dealing the tests out ----------------------------------------------------------------------


def test_every_slow_test_goes_into_a_first_block_the_heaviest_to_the_emptiest():
    items = [f"t{i}" for i in range(40)]
    seconds = [0.0] * 40
    seconds[3], seconds[20], seconds[33], seconds[7] = 2.0, 9.0, 0.5, 8.0
    out = deal_order(items, seconds, workers=2)  # blocks of 40 // 4 // 2 = 5
    assert sorted(out) == sorted(items)
    assert out[:5] == ["t20", "t33", "t0", "t1", "t2"]  # 9 + 0.5 s
    assert out[5:10] == ["t7", "t3", "t4", "t5", "t6"]  # 8 + 2 s
    slow = ("t3", "t7", "t20", "t33")
    assert [t for t in out if t not in slow] == [t for t in items if t not in slow]


def test_slow_tests_beyond_the_first_blocks_lead_the_rest_heaviest_first():
    items = [f"t{i}" for i in range(8)]
    seconds = [1.0, 0.0, 3.0, 2.0, 0.0, 5.0, 4.0, 0.0]
    out = deal_order(items, seconds, workers=2)  # blocks of 2 // 2 -> 1
    assert out == ["t5", "t6", "t2", "t3", "t0", "t1", "t4", "t7"]


def test_the_deal_keeps_every_block_its_size_when_few_tests_are_short():
    items = [f"t{i}" for i in range(16)]
    out = deal_order(items, [1.0] * 16, workers=2)  # blocks of 2, every test slow
    assert sorted(out) == sorted(items) and len(out) == 16


def xdist_load_makespan(seconds: list[float], workers: int) -> float:
    """When the last of ``workers`` ends, running tests of ``seconds`` (in deal order) as xdist
    3.x's load scheduling deals them: a first block of ``len // workers // 4`` consecutive tests
    each, then, as a worker's queue falls under a quarter of its share of what is left (and its
    last test was short or its queue nearly empty), enough to fill it to half that share."""
    import heapq

    pending = list(range(len(seconds)))
    block = max(len(seconds) // workers // 4, 2)
    queues = [pending[k * block:(k + 1) * block] for k in range(workers)]
    del pending[:workers * block]
    events = [(seconds[q[0]], w) for w, q in enumerate(queues) if q]
    heapq.heapify(events)
    end = 0.0
    while events:
        now, w = heapq.heappop(events)
        done = queues[w].pop(0)
        end = max(end, now)
        if pending:
            share = len(pending) // workers
            if len(queues[w]) < max(2, share // 4) and not (seconds[done] >= 0.1 and len(queues[w]) >= 2):
                send = max(2, share // 2) - len(queues[w])
                queues[w] += pending[:send]
                del pending[:send]
        if queues[w]:
            heapq.heappush(events, (now + seconds[queues[w][0]], w))
    return end


def test_a_run_of_many_slow_tests_ends_close_to_its_ideal_on_two_workers():
    """The shape of the main job on CI (2 workers): thousands of short tests, a hundred of a few
    seconds and ten of 10 to 18. Dealt heaviest first in plain order, xdist's first block hands
    the first worker every slow test and it runs long after the other; dealt as
    :func:`deal_order` deals them, the run ends within 2 % of its ideal, for every draw."""
    import random

    for seed in range(3):
        rng = random.Random(seed)
        seconds = ([rng.uniform(0.0, 0.1) for _ in range(2300)] + [rng.uniform(0.5, 3.0) for _ in range(100)]
                   + [rng.uniform(10.0, 18.0) for _ in range(10)])
        ideal = sum(seconds) / 2
        dealt = deal_order(list(range(len(seconds))), seconds, workers=2)
        assert xdist_load_makespan([seconds[i] for i in dealt], 2) <= 1.02 * ideal
        assert xdist_load_makespan(sorted(seconds, reverse=True), 2) > 1.3 * ideal  # what the deal avoids


def test_two_long_tests_go_to_different_workers_under_xdist_load_scheduling():
    """The two longest lead two first blocks: xdist hands block k to worker k."""
    items = [f"t{i}" for i in range(160)]
    seconds = [0.01] * 160
    seconds[158], seconds[159] = 20.0, 17.0
    out = deal_order(items, seconds, workers=16)
    block = first_block(160, 16)
    assert out.index("t158") // block != out.index("t159") // block


def test_recorded_seconds_win_and_unrecorded_tests_are_guessed_from_their_kind():
    recorded = {"a": 0.1, "b": 7.0}
    assert expected_seconds("a", True, recorded) == 0.1
    assert expected_seconds("b", False, recorded) == 7.0
    assert expected_seconds("c", True, recorded) == UNRECORDED_SLOW_S
    assert expected_seconds("c", False, recorded) == 0.0


@functools.cache
def text_of_file(path: str) -> str | None:
    file = ROOT / path
    return file.read_text() if file.is_file() else None


def defines_test(nodeid: str) -> bool:
    """The test id's file exists under the project root and defines its test function."""
    path, _, rest = nodeid.partition("::")
    name = rest.split("::")[-1].split("[")[0]
    text = text_of_file(path)
    return text is not None and re.search(rf"^\s*def {re.escape(name)}\(", text, re.M) is not None


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_the_checked_in_durations_name_tests_of_this_suite(device_type):
    """Each device type's table holds most of the suite, and most recorded ids name a test
    function of it, whatever part of it this run collected (read from the test files, not from
    the run's own selection)."""
    recorded = read_durations(device_type)
    assert len(recorded) > 500 and all(s >= 0 for s in recorded.values())
    stale = [nodeid for nodeid in recorded if not defines_test(nodeid)]
    assert len(stale) < 0.2 * len(recorded), stale[:20]


def test_a_missing_durations_file_or_table_deals_by_kind(tmp_path):
    assert read_durations("cpu", tmp_path / "none.json") == {}
    (tmp_path / "d.json").write_text('{"devices": {"cuda": {"from": [], "seconds": {"t::a": 2.0}}}}')
    assert read_durations("cpu", tmp_path / "d.json") == {}
    assert read_durations("cuda", tmp_path / "d.json") == {"t::a": 2.0}


def test_recording_one_device_keeps_the_others_table(tmp_path):
    out = tmp_path / "d.json"
    out.write_text('{"devices": {"cuda": {"from": ["gpu.xml"], "seconds": {"t::a": 2.0}}}}')
    junit = tmp_path / "cpu.xml"
    junit.write_text('<testsuites><testsuite><testcase classname="tests.cpu.test_worker_load" '
                     'name="test_merged_runs_keep_each_tests_longest_time" time="0.5"/></testsuite></testsuites>')
    assert main(["--device", "cpu", str(junit), "-o", str(out)]) == 0
    assert read_durations("cuda", out) == {"t::a": 2.0}
    recorded = "tests/cpu/test_worker_load.py::test_merged_runs_keep_each_tests_longest_time"
    assert read_durations("cpu", out) == {recorded: 0.5}


JUNIT = """<testsuites><testsuite>
<testcase classname="tests.cpu.test_x" name="test_a[p.1]" time="1.26"/>
<testcase classname="tests.cpu.test_x.TestGroup" name="test_b" time="0.04"/>
</testsuite></testsuites>"""


def test_junit_cases_become_node_ids_with_their_seconds():
    def is_file(path):
        return path == "tests/cpu/test_x.py"

    assert junit_seconds(JUNIT, is_file) == {
        "tests/cpu/test_x.py::test_a[p.1]": 1.26,
        "tests/cpu/test_x.py::TestGroup::test_b": 0.04,
    }
    with pytest.raises(ValueError, match="no test file"):
        node_id("tests.gone", "test_c", is_file)


def test_merged_runs_keep_each_tests_longest_time():
    assert merged([{"b": 1.26, "a": 0.01}, {"b": 0.5, "c": 3.0}]) == {"a": 0.0, "b": 1.3, "c": 3.0}
