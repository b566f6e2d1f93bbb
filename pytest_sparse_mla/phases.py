"""``--profile-phases=FILE``: where a run's test time goes, per test family (test module) and
phase, by sampling each test process's main thread.

Every ``SAMPLE_S`` seconds a thread of each test process looks at the stack of the test that is
running and counts the time since its last look for the innermost frame that belongs to a phase (:data:`PHASES`:
the oracle, input building, FlashInfer's plan and its run, the Triton kernels, vLLM's code,
the judge, the backends' host stages, dump and replay bookkeeping, reporting, child processes,
pytest itself); a stack with none of them is the test's own body. A sample is a test's time
in that phase, waits for the GPU included: a kernel's time shows where its result is waited for.
Start-up and collection come before the first test (the "xdist workers" section has when it
started).

Each process writes its counts beside FILE (``FILE.<worker>``); the controlling process adds
them up into FILE (JSON: seconds per family and phase) and prints the families that took longest.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

from .keys import GROUP

SAMPLE_S = 0.005
#: (phase, fragments of a frame's file path, or of "path:function" for FlashInfer's plan): the
#: innermost frame that matches names the phase of a sample.
PHASES = (
    ("FlashInfer plan", ("/flashinfer/:plan",)),
    ("FlashInfer run", ("/flashinfer/",)),
    ("Triton kernels", ("/triton/",)),
    ("FlashMLA kernels", ("/flashmla/", "flash_mla_interface")),
    ("vLLM's code", ("/vllm/",)),
    ("oracle and reference models", ("/reference/",)),
    ("input building", ("/harness/builder.py", "/harness/hashed_values.py", "/harness/device_inputs.py",
                        "/harness/indexer_fill.py", "/harness/scenario.py", "/harness/spec.py", "/harness/cases.py",
                        "/harness/input_space.py", "/hypothesis/")),
    ("judge", ("/harness/",)),
    ("backends' host stages", ("/backends/", "/fast/")),
    ("dump and replay bookkeeping", ("/recording/",)),
    ("reporting", ("/pytest_sparse_mla/",)),
    ("child processes", ("/subprocess.py", "/selectors.py")),
    ("pytest", ("/_pytest/", "/pluggy/", "/xdist/")),
)
BODY = "test body and the rest"
PHASE_KEY = pytest.StashKey[object]()


def phase_of(frames, test_file: str | None = None) -> str:
    """The phase of a stack, ``frames`` as ``(file, function)`` innermost first: the first frame
    that belongs to a phase, or the test's own body where a frame of its module ``test_file``
    comes first."""
    for filename, function in frames:
        path = filename.replace(os.sep, "/")
        if test_file and path.endswith("/" + test_file.lstrip("/")):
            return BODY
        for phase, fragments in PHASES:
            for fragment in fragments:
                where, _, name = fragment.partition(":")
                if where in path and (not name or name in function):
                    return phase
    return BODY


def family_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def stack_of(frame) -> list[tuple[str, str]]:
    out = []
    while frame is not None:
        out.append((frame.f_code.co_filename, frame.f_code.co_name))
        frame = frame.f_back
    return out


class Sampler(threading.Thread):
    """Counts, per (family, phase), the samples of the main thread while a test runs."""

    def __init__(self, interval: float = SAMPLE_S):
        super().__init__(name="sparse-mla-phase-sampler", daemon=True)
        self.interval = interval
        self.main = threading.main_thread().ident
        self.family: str | None = None
        self.samples: dict[tuple[str, str], float] = defaultdict(float)
        self.done = threading.Event()

    def run(self) -> None:
        last = time.perf_counter()
        while not self.done.wait(self.interval):
            now = time.perf_counter()
            family = self.family
            frame = sys._current_frames().get(self.main)
            if family is not None and frame is not None:
                # the time since the last sample (a wake-up the interpreter's lock delayed counts in full)
                self.samples[(family, phase_of(stack_of(frame), family))] += now - last
            last = now

    def seconds(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = defaultdict(dict)
        for (family, phase), seconds in sorted(self.samples.items()):
            out[family][phase] = round(seconds, 2)
        return dict(out)


def added_up(parts: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    total: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for part in parts:
        for family, phases in part.items():
            for phase, seconds in phases.items():
                total[family][phase] += seconds
    return {f: {p: round(s, 2) for p, s in sorted(ph.items(), key=lambda kv: -kv[1])}
            for f, ph in sorted(total.items(), key=lambda kv: -sum(kv[1].values()))}


def summary_lines(profile: dict[str, dict[str, float]], families: int = 15) -> list[str]:
    lines = []
    for family, phases in list(profile.items())[:families]:
        total = sum(phases.values())
        top = ", ".join(f"{p} {s:.1f}" for p, s in list(phases.items())[:4])
        lines.append(f"{total:8.1f} s  {family}: {top}")
    return lines


def pytest_addoption(parser):
    parser.getgroup(*GROUP).addoption(
        "--profile-phases", default=None, metavar="FILE",
        help="sample where each test's time goes (per test module and phase) and write it to FILE as JSON")


def pytest_configure(config):
    if config.getoption("--profile-phases") and not config.getoption("--collect-only", False):
        sampler = Sampler()
        sampler.start()
        config.stash[PHASE_KEY] = sampler


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    sampler = item.config.stash.get(PHASE_KEY, None)
    if sampler is not None:
        sampler.family = family_of(item.nodeid)
    yield
    if sampler is not None:
        sampler.family = None


def pytest_unconfigure(config):
    sampler = config.stash.get(PHASE_KEY, None)
    if sampler is None:
        return
    sampler.done.set()
    worker = getattr(config, "workerinput", {}).get("workerid")
    if worker is not None:  # the controller of a run without workers adds its own up at the summary
        target = Path(config.getoption("--profile-phases"))
        target.with_name(f"{target.name}.{worker}").write_text(json.dumps(sampler.seconds()))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The controller's sum of every process's counts (the workers have ended by now)."""
    target = config.getoption("--profile-phases")
    if not target or hasattr(config, "workerinput"):
        return
    sampler = config.stash.get(PHASE_KEY, None)
    parts = [sampler.seconds()] if sampler is not None and not getattr(config.option, "numprocesses", None) else []
    target = Path(target)
    for part in sorted(target.parent.glob(f"{target.name}.gw*")):
        parts.append(json.loads(part.read_text()))
        part.unlink()
    profile = added_up(parts)
    target.write_text(json.dumps(profile, indent=1) + "\n")
    terminalreporter.section("where the test time went (--profile-phases)")
    for line in summary_lines(profile):
        terminalreporter.write_line(line)
    terminalreporter.write_line(f"seconds per test module and phase: {target} (sampled every {SAMPLE_S * 1000:.0f} ms)")
