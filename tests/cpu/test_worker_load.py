"""The "xdist workers" section: which worker ends the run, and with which tests."""

from types import SimpleNamespace

from pytest_sparse_mla.worker_load import WorkerLoadReport, load_lines, short_name, worker_loads


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
