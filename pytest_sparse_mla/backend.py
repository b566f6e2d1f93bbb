"""``--backend NAME|module:factory``: the backends the seam's tests run every regime case and
batch situation through (tests that take the ``backend_under_test`` fixture, as
``tests/gpu/test_backends.py`` does), one parametrisation each; without it, the project's port on
FlashInfer's fa3 and on its fa2 kernel (``port-fa3``, ``port-fa2``).

NAME is one of ``backends.registry``'s names (``port-fa3``, ``port-fa2``, ``vllm`` or
``vllm-RELEASE``, ``flashmla`` or ``flashmla-RELEASE``; the last two need ``--vllm``);
``module:factory`` is a user's own whole backend, ``factory()`` returning an object with the
members of ``backends.seam.Backend``. Repeatable. The port runs the host stages of the
implementation under test (``--impl``), so the seam's tests of the port judge the user's host
stages as every other test of them does.

The controlling process checks every spec when the run starts, each a usage error of one line
before any test runs: a name without torch (so an xdist controller starts its workers as soon as
without ``--backend``), a factory by loading it and checking what it returns. Each test process
opens a backend once, when a test first asks for it.
"""

from __future__ import annotations

import pytest

from backends.registry import PORT_KERNELS, BackendError, is_factory_spec, name_problem, open_backend

from .impl import active_impl, is_controller
from .keys import GROUP
from .vllm import VLLM_SOURCE

#: What the seam's tests run without ``--backend``.
DEFAULT_BACKENDS = ("port-fa3", "port-fa2")
BACKEND_SPECS = pytest.StashKey[tuple]()
OPENED = pytest.StashKey[dict]()  # spec -> the backend this process opened


def pytest_addoption(parser):
    parser.getgroup(*GROUP).addoption(
        "--backend",
        action="append",
        default=[],
        metavar="NAME|MODULE:FACTORY",
        help="run the seam's tests (tests/gpu/test_backends.py) through this backend instead of port-fa3 and "
        "port-fa2 (repeatable): port-fa3, port-fa2, vllm[-RELEASE], flashmla[-RELEASE] (with --vllm), or "
        "module:factory returning an object with the members of backends.seam.Backend",
    )


def chosen_backends(given: list[str]) -> tuple[str, ...]:
    """The specs the run names, each once and in order, or :data:`DEFAULT_BACKENDS`."""
    return tuple(dict.fromkeys(given)) or DEFAULT_BACKENDS


def vllm_release(config) -> str | None:
    source = config.stash.get(VLLM_SOURCE, None)
    return source.version if source is not None else None


@pytest.hookimpl(trylast=True)  # after pytest_sparse_mla.vllm has resolved --vllm
def pytest_configure(config):
    config.stash[BACKEND_SPECS] = chosen_backends(config.getoption("--backend"))
    config.stash[OPENED] = {}
    if not is_controller(config):
        return
    for spec in config.stash[BACKEND_SPECS]:
        if is_factory_spec(spec):
            try:
                config.stash[OPENED][spec] = open_backend(spec)
            except BackendError as exc:
                raise pytest.UsageError(str(exc)) from None
            continue
        problem = name_problem(spec, vllm_release(config))
        if problem:
            raise pytest.UsageError(f"--backend: {problem}")


def pytest_report_header(config):
    if not is_controller(config) or not config.getoption("--backend"):
        return []
    return [f"backends under test (--backend): {', '.join(config.stash[BACKEND_SPECS])}"]


def pytest_generate_tests(metafunc):
    if "backend_under_test" in metafunc.fixturenames:
        specs = list(metafunc.config.stash[BACKEND_SPECS])
        metafunc.parametrize("backend_under_test", specs, indirect=True, scope="module", ids=specs)


def open_run_backend(config, spec: str):
    """The backend ``spec`` names, opened once per process with this run's ``--impl`` (the port's
    host stages) and ``--vllm``."""
    opened = config.stash[OPENED]
    if spec not in opened:
        impl = active_impl(config) if spec in PORT_KERNELS else None
        opened[spec] = open_backend(spec, config.stash.get(VLLM_SOURCE, None), impl=impl)
    return opened[spec]


def factory_backends(config) -> list:
    """The users' own backends the run names (``--backend module:factory``), opened."""
    return [open_run_backend(config, spec) for spec in config.stash[BACKEND_SPECS] if is_factory_spec(spec)]


@pytest.fixture(scope="module")
def backend_under_test(request):
    """One of the run's backends (``--backend``; default port-fa3 and port-fa2): a test taking it
    runs once per backend."""
    try:
        return open_run_backend(request.config, request.param)
    except BackendError as exc:
        pytest.fail(str(exc), pytrace=False)
