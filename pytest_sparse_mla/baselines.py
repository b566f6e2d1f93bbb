"""Upgrade validation: ``--record-baseline DIR`` records every GPU-tier case on the installed
FlashInfer, ``--compare-baseline DIR`` records this run into ``--baseline-out`` and compares it
with DIR (the record format and the comparison: ``recording.baseline``). Tests hand what they
measured to the ``baseline`` fixture; the record is written with the teardown report, which
carries every property the test attached."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .keys import GROUP, WARNING_KEY


def pytest_addoption(parser):
    group = parser.getgroup(*GROUP)
    group.addoption(
        "--record-baseline",
        default=None,
        metavar="DIR",
        help="record every GPU-tier case's outputs, error ratios, times and FlashInfer warnings into DIR",
    )
    group.addoption(
        "--compare-baseline",
        default=None,
        metavar="DIR",
        help="compare the installed FlashInfer against a recorded baseline; report into --baseline-out",
    )
    group.addoption(
        "--baseline-out",
        default="baseline-compare",
        metavar="DIR",
        help="where --compare-baseline records this run and writes report.md / report.json (default: baseline-compare)",
    )


def baseline_directory(config) -> Path | None:
    """Where this run's case records go, or None when no baseline option is given."""
    if config.getoption("--record-baseline"):
        return Path(config.getoption("--record-baseline"))
    if config.getoption("--compare-baseline"):
        return Path(config.getoption("--baseline-out")) / "current"
    return None


class BaselineNote:
    """What a GPU-tier case measured, kept for ``--record-baseline`` / ``--compare-baseline``."""

    def __init__(self):
        self.fields: dict = {}
        self.outputs: dict = {}

    def note(self, *, outputs=None, **fields) -> None:
        self.fields.update({k: v for k, v in fields.items() if v is not None})
        self.outputs.update({k: v.detach().cpu() for k, v in (outputs or {}).items()})


BASELINE = pytest.StashKey[BaselineNote]()
OUTCOME = pytest.StashKey[str]()  # the test's outcome, kept for its teardown report
BASELINE_REPORT = pytest.StashKey[tuple]()  # (report.md path, nothing regressed)


@pytest.fixture
def baseline(request) -> BaselineNote:
    """``baseline.note(ratios=..., kernel_us=..., plan_us=..., error=..., outputs={...})``."""
    note = BaselineNote()
    request.node.stash[BASELINE] = note
    return note


def gpu_sharing_workers() -> int:
    """Test processes sharing this process's GPU (xdist workers over the visible GPUs)."""
    from harness.gpu_env import count_gpus_without_cuda

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    return max(1, -(-workers // max(count_gpus_without_cuda(), 1)))


def _write_baseline_record(item, report, outcome: str) -> None:
    directory = baseline_directory(item.config)
    note = item.stash.get(BASELINE, None)
    if directory is None or note is None:
        return
    from recording.baseline import CaseRecord, write_record
    from recording.environment import flashinfer_version

    warnings = [w for k, v in report.user_properties if k == WARNING_KEY for w in v]
    record = CaseRecord(case=item.nodeid, outcome=outcome, flashinfer=flashinfer_version(), warnings=warnings,
                        timing_workers=gpu_sharing_workers(),
                        **{k: v for k, v in note.fields.items() if k in ("error", "ratios", "kernel_us", "plan_us")})
    write_record(directory, record, note.outputs)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        item.stash[OUTCOME] = "xfailed" if hasattr(report, "wasxfail") else report.outcome
    elif report.when == "teardown" and OUTCOME in item.stash:
        _write_baseline_record(item, report, item.stash[OUTCOME])


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    base = config.getoption("--compare-baseline")
    if not base or hasattr(config, "workerinput"):
        return
    from recording.baseline import compare_directories, read_records, write_report

    current = baseline_directory(config)
    before = {r.flashinfer for r in read_records(Path(base)).values()} - {None}
    after = {r.flashinfer for r in read_records(current).values()} - {None} if current.exists() else set()
    ok = write_report(compare_directories(Path(base), current), current.parent, ",".join(sorted(before)) or "?",
                      ",".join(sorted(after)) or "?")
    config.stash[BASELINE_REPORT] = (str(current.parent / "report.md"), ok)
    if not ok and session.exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if BASELINE_REPORT in config.stash:
        path, ok = config.stash[BASELINE_REPORT]
        terminalreporter.write_line(f"upgrade report: {path} ({'no regression' if ok else 'REGRESSIONS: exit status 1'})")
