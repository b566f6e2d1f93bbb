"""How an xdist run's tests are dealt to the workers, and where its wall time went.

A run is as fast as its busiest worker, not as the sum of all tests divided by the workers.
xdist's load scheduling hands each worker a first block of consecutive tests, then more, in
collection order, as each runs short. So the tests expected to take seconds (the durations of
a recorded run, ``durations.json`` beside this module) go into the workers' first blocks,
heaviest first, each to the block expected to end first, and the short tests follow; a test the
file does not know counts as slow when it is marked ``gpu_large`` or ``suite_self_test`` or runs
a nested pytest session.

    python3 -m pytest_sparse_mla.worker_load JUNIT [JUNIT ...]

rewrites one device type's table from the junit xml of runs on it: ``--device cuda`` from warm
runs on a GPU runner (``scripts/gpu_runner.py`` keeps one per release and phase), ``--device cpu``
from CI's three steps on a CPU machine; a test's seconds are its longest of those given. A run
deals by the table of the device its tests run on (``--device``, resolved).

At the end of every run with two or more workers the "xdist workers" section says, per worker,
the seconds its tests took, when its first test started and its last one ended, and its
longest tests, the worker that ended last first.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

#: Recorded seconds per test id (setup + call + teardown), one table per kind of device the
#: tests run on (``cuda``: warm runs on a GPU runner; ``cpu``: CI's three steps on a CPU machine,
#: the simulated SM90 machine's included), since a test's cost differs by orders of magnitude
#: between the two (the GPU tier's cases on the simulated machine run their kernels' stand-ins
#: and references on the CPU).
DURATIONS_FILE = Path(__file__).with_name("durations.json")
#: The device types a table is kept for.
DEVICE_TYPES = ("cuda", "cpu")
#: Tests expected to take at least this long are dealt out first.
SLOW_S = 0.5
#: What an unrecorded test marked slow (or running a nested session) is expected to take.
UNRECORDED_SLOW_S = 5.0
SLOW_MARKERS = ("gpu_large", "suite_self_test")


# --- dealing the tests out ----------------------------------------------------------------------


def read_tables(path: Path = DURATIONS_FILE) -> dict[str, dict]:
    """Every device type's table (``{"from": [...], "seconds": {...}}``); none where the file is
    missing."""
    try:
        return json.loads(path.read_text())["devices"]
    except FileNotFoundError:
        return {}


def read_durations(device_type: str, path: Path = DURATIONS_FILE) -> dict[str, float]:
    """The seconds recorded per test id on ``device_type`` (``cuda`` or ``cpu``); none where the
    file or its table is missing."""
    return read_tables(path).get(device_type, {}).get("seconds", {})


def marked_slow(item) -> bool:
    """A test that takes seconds by its kind: the largest plans, the suite's self-tests and every
    test that runs a nested pytest session."""
    return any(item.get_closest_marker(m) for m in SLOW_MARKERS) or "pytester" in getattr(item, "fixturenames", ())


def expected_seconds(nodeid: str, slow_by_kind: bool, recorded: dict[str, float]) -> float:
    """The recorded seconds of a test, or a guess from its kind where none were recorded."""
    if nodeid in recorded:
        return recorded[nodeid]
    return UNRECORDED_SLOW_S if slow_by_kind else 0.0


def first_block(num_items: int, workers: int) -> int:
    """How many tests xdist's load scheduling hands each worker at the start: a quarter of all
    tests, in consecutive blocks of equal size."""
    return max(1, num_items // 4 // max(workers, 1))


def first_blocks(slow: list[int], seconds: list[float], workers: int, block: int) -> tuple[list[list[int]], list[int]]:
    """The slow tests (heaviest first) dealt into the workers' first blocks, each to the block
    with the fewest expected seconds that has room (longest processing time first), and those
    that find no room."""
    blocks: list[list[int]] = [[] for _ in range(workers)]
    loads = [0.0] * workers
    left: list[int] = []
    for i in slow:
        open_blocks = [w for w in range(workers) if len(blocks[w]) < block]
        if not open_blocks:
            left.append(i)
            continue
        w = min(open_blocks, key=lambda k: (loads[k], k))
        blocks[w].append(i)
        loads[w] += seconds[i]
    return blocks, left


def deal_order(items: list, seconds: list[float], workers: int) -> list:
    """``items`` in the order to deal them to ``workers``: every test expected to take
    ``SLOW_S`` or more goes into a worker's first block (xdist hands block k to worker k),
    heaviest first, each to the block with the fewest expected seconds; the blocks are filled to
    their size with the others, in their own order; then any slow test that found no room,
    heaviest first, and the other tests. What xdist deals out after the first blocks is then
    short tests, in chunks that shrink as the run ends, so no worker is left with a queue of long
    ones while another idles."""
    block = first_block(len(items), workers)
    slow = sorted((i for i, s in enumerate(seconds) if s >= SLOW_S), key=lambda i: (-seconds[i], i))
    fast = [i for i, s in enumerate(seconds) if s < SLOW_S]
    blocks, left = first_blocks(slow, seconds, workers, block)
    rest = left + fast
    order: list[int] = []
    for dealt in blocks:  # each block filled to its size, so that block k stays worker k's
        filler = block - len(dealt)
        order += dealt + rest[:filler]
        del rest[:filler]
    return [items[i] for i in order + rest]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Under xdist (every worker computes the same order), the tests dealt heaviest first."""
    workers = (getattr(config, "workerinput", None) or {}).get("workercount")
    if not workers or workers < 2:
        return
    from .impl import run_device

    recorded = read_durations(run_device(config).type)  # the same on every worker of a run
    seconds = [expected_seconds(item.nodeid, marked_slow(item), recorded) for item in items]
    items[:] = deal_order(items, seconds, workers)


# --- where the time went ------------------------------------------------------------------------

#: Longest tests named per worker.
LONGEST_PER_WORKER = 3


@dataclass
class WorkerLoad:
    """One worker's share of a run."""

    worker: str
    tests: int = 0
    busy_s: float = 0.0
    #: Seconds from the session's start to this worker's first test's start and last test's end.
    starts_at_s: float = 0.0
    ends_at_s: float = 0.0
    longest: list[tuple[float, str]] = field(default_factory=list)


def worker_loads(phases: list[tuple[str, str, float, float, float]], session_start: float) -> list[WorkerLoad]:
    """``phases``: (worker, nodeid, start, stop, duration) of every setup, call and teardown;
    ``session_start``: when the session began, on the same clock. Per worker: its tests, the
    seconds they took, when its first one started and its last one ended, and its longest
    tests; the worker that ends last first."""
    per_test: dict[tuple[str, str], float] = defaultdict(float)
    starts: dict[str, float] = {}
    ends: dict[str, float] = defaultdict(float)
    for worker, nodeid, start, stop, duration in phases:
        per_test[(worker, nodeid)] += duration
        starts[worker] = min(starts.get(worker, start - session_start), start - session_start)
        ends[worker] = max(ends[worker], stop - session_start)
    loads: dict[str, WorkerLoad] = {}
    for (worker, nodeid), seconds in per_test.items():
        load = loads.setdefault(worker, WorkerLoad(worker, starts_at_s=starts[worker], ends_at_s=ends[worker]))
        load.tests += 1
        load.busy_s += seconds
        load.longest.append((seconds, nodeid))
    for load in loads.values():
        load.longest = sorted(load.longest, reverse=True)[:LONGEST_PER_WORKER]
    return sorted(loads.values(), key=lambda w: (-w.ends_at_s, w.worker))


def short_name(nodeid: str) -> str:
    """``tests/cpu/test_x.py::test_y[p]`` as ``test_x::test_y[p]``."""
    path, _, rest = nodeid.partition("::")
    stem = path.rsplit("/", 1)[-1].removesuffix(".py")
    return f"{stem}::{rest}" if rest else stem


def load_lines(loads: list[WorkerLoad]) -> list[str]:
    """One line per worker (seconds counted from the session's start), then one for the run:
    when the first test started (what starting the workers and collecting cost), the sum of
    all tests' seconds over the workers (the wall a perfect split would add) and when the last
    worker ended."""
    lines = []
    for w in loads:
        longest = ", ".join(f"{short_name(n)} {s:.1f} s" for s, n in w.longest)
        lines.append(f"{w.worker}: {w.tests} tests, {w.busy_s:.1f} s busy from {w.starts_at_s:.1f} s to"
                     f" {w.ends_at_s:.1f} s; longest: {longest}")
    total = sum(w.busy_s for w in loads)
    first = min(w.starts_at_s for w in loads)
    lines.append(f"all workers: first test at {first:.1f} s; {total:.1f} test-seconds,"
                 f" {total / len(loads):.1f} s each if split evenly; the last worker ended at"
                 f" {loads[0].ends_at_s:.1f} s ({loads[0].worker})")
    return lines


class WorkerLoadReport:
    """Registered on the controlling process of an xdist run."""

    def __init__(self, session_start: float):
        self.session_start = session_start
        self.phases: list[tuple[str, str, float, float, float]] = []

    def pytest_runtest_logreport(self, report):
        node = getattr(report, "node", None)
        worker = getattr(getattr(node, "gateway", None), "id", None)
        start, stop = getattr(report, "start", None), getattr(report, "stop", None)
        if worker is not None and start is not None and stop is not None:
            self.phases.append((worker, report.nodeid, start, stop, report.duration))

    def pytest_terminal_summary(self, terminalreporter, exitstatus, config):
        loads = worker_loads(self.phases, self.session_start)
        if len(loads) >= 2:
            terminalreporter.section("xdist workers (the first ends the run)")
            for line in load_lines(loads):
                terminalreporter.write_line(line)


def pytest_configure(config):
    if not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None):
        config.pluginmanager.register(WorkerLoadReport(time.time()), "sparse-mla-worker-load")


# --- recording the durations ---------------------------------------------------------------------


def node_id(classname: str, name: str, is_file: Callable[[str], bool]) -> str:
    """The pytest node id of a junit test case: ``classname`` is the module's dotted path, then
    any classes; the longest prefix naming a file is the module."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if is_file(path):
            return "::".join([path, *parts[cut:], name])
    raise ValueError(f"no test file for junit classname {classname!r}")


def junit_seconds(text: str, is_file: Callable[[str], bool]) -> dict[str, float]:
    """Seconds per node id (junit's time: setup, call and teardown) of one junit xml."""
    out = {}
    for case in ET.fromstring(text).iter("testcase"):
        out[node_id(case.get("classname", ""), case.get("name", ""), is_file)] = float(case.get("time") or 0.0)
    return out


def merged(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each test's longest seconds over the runs, to a tenth of a second, sorted by id."""
    seconds: dict[str, float] = {}
    for run in runs:
        for nodeid, s in run.items():
            seconds[nodeid] = max(seconds.get(nodeid, 0.0), s)
    return {nodeid: round(seconds[nodeid], 1) for nodeid in sorted(seconds)}


def main(argv: list[str] | None = None) -> int:
    """Rewrite one device type's table of ``durations.json`` (or ``-o``) from junit xml files,
    keeping the other's."""
    parser = argparse.ArgumentParser(prog="python3 -m pytest_sparse_mla.worker_load",
                                     description="Record each test's seconds from runs' junit xml.")
    parser.add_argument("--device", required=True, choices=DEVICE_TYPES,
                        help="the device type the runs' tests ran on (cuda: a GPU runner; cpu: a CPU machine)")
    parser.add_argument("junit", nargs="+", type=Path)
    parser.add_argument("-o", "--out", type=Path, default=DURATIONS_FILE)
    args = parser.parse_args(argv)
    root = Path(__file__).resolve().parent.parent

    def is_file(path: str) -> bool:
        return (root / path).is_file()

    seconds = merged([junit_seconds(p.read_text(), is_file) for p in args.junit])
    tables = read_tables(args.out)
    tables[args.device] = {"from": [p.name for p in args.junit], "seconds": seconds}
    args.out.write_text(json.dumps({"devices": tables}, indent=0) + "\n")
    slow = sum(s >= SLOW_S for s in seconds.values())
    print(f"{args.out} ({args.device}): {len(seconds)} tests, {slow} of them {SLOW_S} s or more, "
          f"{sum(seconds.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
