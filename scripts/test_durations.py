"""Record how long each test took in a run, for dealing the tests out to xdist workers
heaviest first (``pytest_sparse_mla/worker_load.py``).

    python3 -m scripts.test_durations JUNIT [JUNIT ...] [-o pytest_sparse_mla/durations.json]

JUNIT: the junit xml of a warm run of the main job on a GPU runner (``scripts/gpu_runner.py``
keeps one per release and phase). Where several are given, a test's seconds are its longest.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "pytest_sparse_mla" / "durations.json"


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("junit", nargs="+", type=Path)
    parser.add_argument("-o", "--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    def is_file(path: str) -> bool:
        return (REPO / path).is_file()

    seconds = merged([junit_seconds(p.read_text(), is_file) for p in args.junit])
    record = {"from": [p.name for p in args.junit], "seconds": seconds}
    args.out.write_text(json.dumps(record, indent=0) + "\n")
    slow = sum(s >= 0.5 for s in seconds.values())
    print(f"{args.out}: {len(seconds)} tests, {slow} of them 0.5 s or more, {sum(seconds.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
