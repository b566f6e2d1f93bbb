"""``--vllm=PATH``: a vLLM release's own SM90 sparse backend under test (``backends.vllm.sm90``).

PATH is a vLLM wheel, a folder holding the ``vllm`` package (an unpacked wheel, a checkout, a
slice written by ``python3 -m backends.vllm.source slice``), or ``installed``. Each process
resolves it when it starts (a wheel's files checked against its RECORD every time); the
controlling one first, so that anything it cannot use (missing, empty, not a vLLM wheel, a
corrupt one, a folder without the package) is a usage error of one line before any test or
worker starts. The header names the release. Tests marked ``vllm`` take the ``vllm_backend`` fixture; without
``--vllm`` they are skipped with that reason, and the header says no vLLM is under test.

The summary counts the rows whose executed KV length was read back from FlashInfer's schedule
(what tests report through ``regime_log.step``), names the vLLM release, and lists the outputs beyond the
error budget that were bit for bit the project's own FA3 path's on the same inputs
(``VLLM_TWIN_KEY``: the kernel's rounding, not vLLM's).
"""

from __future__ import annotations

import pytest

from backends.registry import (
    VllmSourceError,
    flashmla_absence,
    open_backend,
    resolve_vllm_source,
    vllm_judged_as,
    vllm_v2_runner,
)

from .keys import GROUP, REGIME_KEY

VLLM_SOURCE = pytest.StashKey[object]()
# (max, mean error ratio) of an output beyond the budget that was bit for bit the project's FA3 path's
VLLM_TWIN_KEY = "sparse_mla_vllm_kernel_twin"
NO_VLLM = "no vLLM under test: give --vllm=WHEEL|DIR|installed to run vLLM's own SM90 backend"


def pytest_addoption(parser):
    parser.getgroup(*GROUP).addoption(
        "--vllm",
        default=None,
        metavar="PATH",
        help="run vLLM's own SM90 sparse backend from PATH: a vLLM wheel, a folder holding the vllm package, "
        "or 'installed'",
    )


#: The markers a test carries when it drives what these fixtures open (a marker of its own, so that
#: ``-m vllm`` selects every test that depends on the vLLM release, and ``-m "not flashmla"`` every
#: one that does not drive FlashMLA's kernels): a test that opens them unmarked fails.
MARKED_FIXTURES = {
    "vllm": {"vllm_backend", "vllm_runner", "vllm_pairing", "vllm_on_gpu", "vllm_on_stand_in", "flashmla_source",
             "flashmla_load", "flashmla_on_gpu", "flashmla_backend", "flashmla_on_stand_in"},
    "flashmla": {"flashmla_source", "flashmla_load", "flashmla_on_gpu", "flashmla_backend", "flashmla_on_stand_in"},
}


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: drives a vLLM release's own SM90 backend (needs --vllm)")
    config.addinivalue_line("markers", "flashmla: drives FlashMLA's kernels through a vLLM release's FLASHMLA_SPARSE "
                            "(needs --vllm; marked vllm too)")
    spec = config.getoption("--vllm")
    if spec is None:
        return
    try:
        config.stash[VLLM_SOURCE] = resolve_vllm_source(spec)
    except VllmSourceError as exc:
        raise pytest.UsageError(str(exc)) from exc


def pytest_report_header(config):
    source = config.stash.get(VLLM_SOURCE, None)
    if not source:
        return [NO_VLLM]
    absent = flashmla_absence(source)
    under_test = "FlashMLA under test: the release's FLASHMLA_SPARSE on its own kernels (a stand-in without CUDA)"
    return [f"vLLM under test: {source.describe()}", f"vLLM judged as: {vllm_judged_as(source)}", absent or under_test]


def pytest_collection_modifyitems(config, items):
    if config.stash.get(VLLM_SOURCE, None) is not None:
        return
    skip = pytest.mark.skip(reason=NO_VLLM)
    for item in items:
        if item.get_closest_marker("vllm"):
            item.add_marker(skip)


def unmarked_use(used_fixtures, has_marker) -> list[str]:
    """The markers a test lacks for the fixtures it used (:data:`MARKED_FIXTURES`)."""
    used = set(used_fixtures)
    return [m for m, fixtures in MARKED_FIXTURES.items() if used & fixtures and not has_marker(m)]


@pytest.fixture(autouse=True)
def marked_for_what_it_drives(request):
    """After each test: a test that opened vLLM's or FlashMLA's backend carries the marker that
    selects it (:data:`MARKED_FIXTURES`), or it fails, so that ``-m vllm`` and ``-m "not flashmla"``
    (the matrix's sessions, ``scripts/gpu_runner.py --matrix``) leave out nothing they should hold."""
    yield
    lacking = unmarked_use(request.fixturenames, lambda m: request.node.get_closest_marker(m) is not None)
    if lacking:
        pytest.fail(f"{request.node.nodeid} opens what the marker(s) {', '.join(lacking)} select but is not marked "
                    f"so: add pytest.mark.{lacking[0]} (a session narrowed by -m would leave it out)", pytrace=False)


@pytest.fixture(scope="session")
def vllm_backend(pytestconfig):
    """The vLLM release's SM90 backend (loaded once per test process)."""
    source = pytestconfig.stash.get(VLLM_SOURCE, None)
    if source is None:
        pytest.skip(NO_VLLM)
    return open_backend("vllm", source)


@pytest.fixture(scope="session")
def vllm_runner(pytestconfig):
    """The vLLM release's V2 model runner, building a step's attention metadata from its own files
    (``backends.vllm.v2_runner``; loaded once per test process)."""
    source = pytestconfig.stash.get(VLLM_SOURCE, None)
    if source is None:
        pytest.skip(NO_VLLM)
    return vllm_v2_runner(source)


@pytest.fixture(scope="session")
def flashmla_source(pytestconfig):
    """The vLLM release ``--vllm`` names, for FlashMLA's backend (skipped without it, and where
    its files lack FlashMLA's modules or kernels: the reason is in the run's header)."""
    source = pytestconfig.stash.get(VLLM_SOURCE, None)
    if source is None:
        pytest.skip(NO_VLLM)
    absent = flashmla_absence(source)
    if absent:
        pytest.skip(absent)
    return source


def rows_read_back(reports) -> dict[str, tuple[int, int]]:
    """Per backend: (tests, rows) whose executed length was read back from the kernel's schedule,
    over the test reports (the ``backends`` entry ``regime_log.step`` records)."""
    rows: dict[str, tuple[int, int]] = {}
    for report in reports:
        for key, value in getattr(report, "user_properties", ()):
            if key != REGIME_KEY:
                continue
            for name, counts in (value.get("backends") or {}).items():
                if counts.get("read_back"):
                    tests, total = rows.get(name, (0, 0))
                    rows[name] = (tests + 1, total + int(counts["read_back"]))
    return rows


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput"):
        return
    source = config.stash.get(VLLM_SOURCE, None)
    if source is None:
        return  # the header said so; the skipped tests give the reason
    reports = [r for stat in terminalreporter.stats.values() for r in stat if getattr(r, "when", "") == "call"]
    ran, rows = rows_read_back(reports).get(f"vllm-{source.version}", (0, 0))
    terminalreporter.write_line(
        f"vLLM under test: {source.describe()}: {ran} tests read FlashInfer's schedule back, "
        f"{rows} rows' executed KV length checked against their valid count"
    )
    twins = [v for r in reports for k, v in getattr(r, "user_properties", ()) if k == VLLM_TWIN_KEY]
    if twins:
        worst = max(t[0] for t in twins)
        terminalreporter.write_line(
            f"vLLM under test: {len(twins)} outputs beyond the error budget (worst max-error ratio {worst:.2f}) were "
            "bit for bit FlashInfer's output through the project's own path on the same inputs: the kernel's "
            "rounding there, not vLLM's", yellow=True)
