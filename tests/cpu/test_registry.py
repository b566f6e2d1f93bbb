"""The open backend registry (``backends.registry``) and ``--backend``: a backend is a name
(``port-fa3``, ``port-fa2``, ``vllm[-RELEASE]``, ``flashmla[-RELEASE]``) or a user's own whole
backend as ``module:factory``; a spec that cannot be opened is one line; the port runs the host
stages of ``--impl``, in the seam's tests and in the replay of a case written on the port."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from backends.registry import BackendError, missing_backend_members, name_problem, open_backend
from backends.seam import Backend
from fast.impl import FastImpl
from tests.bugs import KpoolFromWrongSpec
from tests.support.child_runs import assert_one_usage_error

ROOT = Path(__file__).resolve().parents[2]
KNOWN = "port-fa3, port-fa2, vllm[-RELEASE], flashmla[-RELEASE] or module:factory"

#: A user's module of backends: one whole backend of their own, and factories that go wrong.
OWN_BACKENDS = '''
class Own:
    name = "own-kernel"
    kernel = "own"
    returns_lse = False

    def describe(self):
        return "a backend of the user's own"

    def unsupported(self, config):
        return None

    def open_layer(self, config, device):
        raise NotImplementedError


class HalfDone:
    name = "half"
    kernel = "half"

    def describe(self):
        return "half a backend"


def make():
    return Own()


def raises():
    raise RuntimeError("this backend needs its server")


def lacking():
    return object()


def half_done():
    return HalfDone()
'''


@pytest.fixture
def own_backends(tmp_path, monkeypatch):
    """``own_backends``: :data:`OWN_BACKENDS`, importable (and forgotten after the test)."""
    (tmp_path / "own_backends.py").write_text(OWN_BACKENDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "own_backends", raising=False)
    yield "own_backends"
    sys.modules.pop("own_backends", None)


# --- names ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "kernel"), [("port-fa3", "fa3"), ("port-fa2", "fa2")])
def test_the_port_is_opened_by_name_on_its_kernel_with_the_projects_host_stages(name, kernel):
    backend = open_backend(name)
    assert isinstance(backend, Backend)
    assert (backend.name, backend.kernel, type(backend.impl)) == (name, kernel, FastImpl)
    assert "its own host stages" in backend.describe()


@pytest.mark.parametrize(("name", "vllm_release", "problem"), [
    ("port-fa3", None, None),
    ("port-fa2", "0.33.0", None),
    ("vllm", "0.33.0", None),
    ("vllm-0.33.0", "0.33.0", None),
    ("flashmla-0.33.0", "0.33.0", None),
    ("vllm", None, "backend 'vllm' runs a vLLM release's files: name one with --vllm"),
    ("flashmla-0.33.0", None, "backend 'flashmla-0.33.0' runs a vLLM release's files: name one with --vllm"),
    ("vllm-0.34.0", "0.33.0", "backend 'vllm-0.34.0' names vLLM 0.34.0, but --vllm gives vLLM 0.33.0"),
    ("port-fa4", None, f"unknown backend 'port-fa4'; known: {KNOWN}"),
    ("fa3", None, f"unknown backend 'fa3'; known: {KNOWN}"),
    ("vllm-", "0.33.0", f"unknown backend 'vllm-'; known: {KNOWN}"),
])
def test_a_name_is_checked_against_the_vllm_release_of_the_run(name, vllm_release, problem):
    assert name_problem(name, vllm_release) == problem


def test_a_name_that_cannot_be_opened_is_one_error_line():
    with pytest.raises(BackendError, match=r"^backend 'vllm' runs a vLLM release's files: name one with --vllm$"):
        open_backend("vllm")
    with pytest.raises(BackendError, match=r"^backend 'vllm-0.34.0' names vLLM 0.34.0, but --vllm gives vLLM 0.33.0$"):
        open_backend("vllm-0.34.0", SimpleNamespace(version="0.33.0"))


def test_names_are_checked_without_importing_torch():
    """An xdist controller checks ``--backend`` names before it starts its workers: importing
    torch there would make every worker wait for it."""
    probe = ("import sys; from backends.registry import name_problem; "
             "assert name_problem('vllm-0.33.0', '0.33.0') is None; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- a backend of the user's own -----------------------------------------------------------------


def test_a_factory_opens_a_backend_of_the_users_own(own_backends):
    backend = open_backend(f"{own_backends}:make")
    assert isinstance(backend, Backend)
    assert (backend.name, backend.kernel) == ("own-kernel", "own")


@pytest.mark.parametrize(("spec", "line"), [
    (":make", "--backend expects a name or 'module:factory', got ':make'"),
    ("own_backends:", "--backend expects a name or 'module:factory', got 'own_backends:'"),
    ("no_such_module:make", "--backend 'no_such_module:make': cannot load the factory: No module named "
                            "'no_such_module'"),
    ("own_backends:nope", "--backend 'own_backends:nope': cannot load the factory: module 'own_backends' has no "
                          "attribute 'nope'"),
    ("own_backends:raises", "--backend 'own_backends:raises': the factory raised RuntimeError: this backend needs its "
                            "server"),
    ("own_backends:lacking", "--backend 'own_backends:lacking': what the factory returned (object) lacks name, kernel, "
                             "returns_lse, describe, unsupported, open_layer (see backends.seam.Backend)"),
    ("own_backends:half_done", "--backend 'own_backends:half_done': what the factory returned (HalfDone) lacks "
                               "returns_lse, unsupported, open_layer (see backends.seam.Backend)"),
], ids=["no-module", "no-factory", "missing-module", "missing-factory", "factory-raises", "not-a-backend",
        "half-a-backend"])
def test_a_factory_that_gives_no_backend_is_one_error_line(own_backends, spec, line):
    with pytest.raises(BackendError) as excinfo:
        open_backend(spec)
    assert str(excinfo.value) == line


def test_the_members_checked_are_the_seams_backend_protocol(own_backends):
    """An object lacking any one member of ``backends.seam.Backend`` is no backend, and the error
    names that member."""
    import own_backends as module

    members = ("name", "kernel", "returns_lse", "describe", "unsupported", "open_layer")
    assert missing_backend_members(module.Own()) == []
    for member in members:
        lacking = type("Lacking", (), {m: getattr(module.Own, m) for m in members if m != member})()
        assert not isinstance(lacking, Backend)
        assert missing_backend_members(lacking) == [member]


# --- --impl reaches the port ---------------------------------------------------------------------


@pytest.mark.gpu_stand_in
def test_the_port_plans_with_the_host_stages_it_is_given(monkeypatch):
    """A regime G row (ctx = topk + kpool + 3, kpool 4) through the port on the simulated SM90
    machine, planned only: the project's host stages plan topk + r = 2051 slots; a kv_len rule
    that takes kpool as 1 (``tests.bugs:KpoolFromWrongSpec``) plans topk, and the port plans it."""
    from harness.backend_step import layer_config, step_input
    from harness.cases import case_scenario, context_case
    from tests import simulated_sm90

    for module, name, value in simulated_sm90.patches():
        monkeypatch.setattr(module, name, value)
    scenario = case_scenario(context_case(2048 + 4 + 3, 4), 0)
    config = layer_config(scenario.spec, max(scenario.topk_indices.shape[0], 1))
    planned = {}
    for impl in (None, KpoolFromWrongSpec()):
        backend = open_backend("port-fa3", impl=impl)
        outcome = backend.open_layer(config, "cpu").step(step_input(scenario, None))
        planned[type(backend.impl).__name__] = outcome.planned_lengths.tolist()
    rows = len(planned["FastImpl"])
    assert rows and planned == {"FastImpl": [2051] * rows, "KpoolFromWrongSpec": [2048] * rows}
    described = open_backend("port-fa2", impl=KpoolFromWrongSpec()).describe()
    assert "host stages of tests.bugs.KpoolFromWrongSpec" in described


def run_config(*, impl=None, specs=("port-fa3", "port-fa2")):
    """A run's config as the plugin leaves it: its ``--impl`` loaded, its ``--backend`` specs."""
    from pytest_sparse_mla.backend import BACKEND_SPECS, OPENED
    from pytest_sparse_mla.impl import IMPL, IMPL_SPEC

    stash = pytest.Stash()
    stash[IMPL_SPEC] = "tests.bugs:KpoolFromWrongSpec" if impl else "fast.impl:default_impl"
    stash[IMPL] = impl if impl is not None else FastImpl()
    stash[BACKEND_SPECS] = tuple(specs)
    stash[OPENED] = {}
    return SimpleNamespace(stash=stash)


def test_a_case_written_on_the_port_is_replayed_with_the_runs_host_stages():
    from pytest_sparse_mla.judge import backend_of_case

    bug = KpoolFromWrongSpec()
    backend, why = backend_of_case({"backend": {"name": "port-fa2"}}, run_config(impl=bug))
    assert why is None and backend.name == "port-fa2" and backend.impl is bug


def test_a_case_written_on_a_users_backend_is_replayed_on_the_factory_the_run_names(own_backends):
    from pytest_sparse_mla.judge import backend_of_case

    config = run_config(specs=("port-fa3", f"{own_backends}:make"))
    backend, why = backend_of_case({"backend": {"name": "own-kernel"}}, config)
    assert why is None and backend.name == "own-kernel"
    backend, why = backend_of_case({"backend": {"name": "own-kernel"}}, run_config())
    assert backend is None
    assert why == ("the case was written on own-kernel, a backend of its user's own: name its factory with "
                   "--backend=module:factory")


# --- --backend ------------------------------------------------------------------------------------

#: A seam test: which backend it got, and whose host stages, one line per backend.
SEAM_TEST = """
from pathlib import Path


def test_step(backend_under_test):
    impl = getattr(backend_under_test, "impl", None)
    with Path("seen.txt").open("a") as seen:
        seen.write(f"{backend_under_test.name} {type(impl).__name__ if impl is not None else '-'}\\n")
"""


def seam_run(pytester, *args: str):
    """SEAM_TEST with the plugin and ``args``, in this process, without xdist."""
    pytester.makeconftest("pytest_plugins = ('pytest_sparse_mla',)\n")
    pytester.makepyfile(test_seam=SEAM_TEST, own_backends=OWN_BACKENDS)
    pytester.syspathinsert()
    sys.modules.pop("own_backends", None)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist", "-v", *args)
    sys.modules.pop("own_backends", None)
    seen = pytester.path / "seen.txt"
    return result, "\n".join(result.outlines + result.errlines), seen.read_text().splitlines() if seen.exists() else []


def test_without_backend_the_seam_tests_run_the_port_on_fa3_and_fa2_with_the_runs_host_stages(pytester):
    result, out, seen = seam_run(pytester, "--impl=tests.bugs:KpoolFromWrongSpec")
    assert result.ret == 0, out[-3000:]
    assert seen == ["port-fa3 KpoolFromWrongSpec", "port-fa2 KpoolFromWrongSpec"]
    assert "test_step[port-fa3] PASSED" in out and "test_step[port-fa2] PASSED" in out
    assert "backends under test" not in out


def test_backend_names_the_backends_the_seam_tests_run(pytester):
    result, out, seen = seam_run(pytester, "--backend=port-fa2", "--backend=own_backends:make")
    assert result.ret == 0, out[-3000:]
    assert seen == ["port-fa2 FastImpl", "own-kernel -"]
    assert "test_step[own_backends:make] PASSED" in out and "port-fa3" not in out
    assert "backends under test (--backend): port-fa2, own_backends:make" in out


@pytest.mark.parametrize(("spec", "line"), [
    ("nope", f"--backend: unknown backend 'nope'; known: {KNOWN}"),
    ("vllm", "--backend: backend 'vllm' runs a vLLM release's files: name one with --vllm"),
    ("own_backends:lacking", "--backend 'own_backends:lacking': what the factory returned (object) lacks name, kernel, "
                             "returns_lse, describe, unsupported, open_layer (see backends.seam.Backend)"),
], ids=["unknown-name", "vllm-without-release", "not-a-backend"])
def test_a_bad_backend_is_one_usage_error_before_any_test(pytester, spec, line):
    result, out, seen = seam_run(pytester, f"--backend={spec}")
    assert_one_usage_error(result, out, line)
    assert seen == []


def test_the_judge_reads_what_a_backend_declares_not_its_name():
    from types import SimpleNamespace

    from backends.seam import declares
    from harness.judge import executes_the_length_rule, kernel_reads_a_hole
    from harness.layer_modes import WrappedBackend

    named_like_the_port = SimpleNamespace(name="port-fa3", kernel="fa3")
    declaring = SimpleNamespace(name="mine", kernel="flashmla", hands_holes_to_the_kernel=True,
                                executes_valid_counts=False)
    assert not kernel_reads_a_hole(named_like_the_port) and executes_the_length_rule(named_like_the_port)
    assert kernel_reads_a_hole(declaring) and executes_the_length_rule(declaring)
    assert kernel_reads_a_hole(WrappedBackend(declaring, wrap=lambda layer: layer)), "a wrapper hands it on"
    with pytest.raises(ValueError, match="unknown capability 'reads_holes'"):
        declares(declaring, "reads_holes")
