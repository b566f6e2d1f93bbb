"""The run's header and summary on where the convert kernel runs and whether the GPU tier
runs, also under xdist; ``--require-gpu-tier`` and ``--device`` misuse as failures before any
test runs. Every nested run here runs in this process (the controlling one, under xdist too);
only xdist workers are processes of their own, and only one nested run starts them. The runs of
GPU_TEST are on a simulated machine: the CUDA-free GPU discovery
(``harness.gpu_env.gpus_without_cuda``) reports what the test says, torch sees no CUDA GPU and
the convert kernel counts as interpreted, patched in this process for the run and, through the
nested run's conftest, in each xdist worker; so these tests say the same on a CPU-only machine
and on a GPU runner."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from fast import convert as fast_convert
from harness import availability, gpu_env
from pytest_sparse_mla.gpus import THREAD_ENV, available_cores, threads_per_worker
from pytest_sparse_mla.impl import resolve_device
from pytest_sparse_mla.regimes import EDGE_LABEL
from tests.support.child_runs import (
    LAUNCH_SUITE,
    assert_one_usage_error,
    refused_column,
    summary_table,
    usage_run,
)

ROOT = Path(__file__).resolve().parents[2]
H200 = [("NVIDIA H200", "9.0")]

GPU_TEST = """
import pytest

@pytest.mark.gpu
def test_needs_the_gpu():
    pass

def test_runs_anywhere(device):
    assert device.type == "cpu"
"""

#: The nested run's conftest: the plugin, and in each xdist worker (a process of its own) the
#: simulated machine that :func:`simulate_machine` makes in this process.
SIMULATING_CONFTEST = """
import torch

import harness.availability
import harness.gpu_env

pytest_plugins = ("pytest_sparse_mla",)


def pytest_configure(config):
    if not hasattr(config, "workerinput"):
        return  # this process, simulated by the test that runs it
    torch.cuda.is_available = lambda: False
    harness.gpu_env.gpus_without_cuda = lambda: {gpus!r}
    if {gpus!r}:
        torch.version.cuda = None  # a CPU-only torch build beside the GPU
    if not {controller_reason!r}:
        harness.availability.reason_without_cuda = lambda gpus: None
"""


def simulate_machine(monkeypatch, gpus, controller_reason: bool) -> None:
    """This process as the controller of a machine where NVML reports ``gpus`` (beside a CPU-only
    torch build where it reports any), torch sees no CUDA GPU and the convert kernel is
    interpreted (``TRITON_INTERPRET=1`` also for the xdist workers it starts). All undone after
    the test. ``controller_reason=False``: a controller that finds nothing wrong without CUDA."""
    monkeypatch.setattr(gpu_env, "gpus_without_cuda", lambda: list(gpus))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if gpus:
        monkeypatch.setattr(torch.version, "cuda", None)
    if not controller_reason:
        monkeypatch.setattr(availability, "reason_without_cuda", lambda gpus: None)
    monkeypatch.setattr(fast_convert, "INTERPRETED", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


#: Options of every nested run here: no cache, no benchmark plugin, and for the xdist workers
#: (processes of their own, each starting pytest, torch and the plugin) no work that these checks
#: do not need: plain asserts (no rewriting of the plugins' modules where no bytecode cache is
#: written) and no search for unraisable exceptions at exit (repeated garbage collections).
NESTED_OPTIONS = ("-p", "no:cacheprovider", "-p", "no:benchmark", "--assert=plain", "-p", "no:unraisableexception")


def nested_run(pytester, monkeypatch, *args: str, gpus=(), controller_reason: bool = True, visible: str | None = None):
    """Run GPU_TEST with the plugin on a simulated machine (:func:`simulate_machine`): in this
    process, its xdist workers (where ``args`` asks for them) in processes of their own.
    ``controller_reason=False``: a controller that finds nothing wrong without CUDA (so only
    the test processes' full check can say why). ``visible``: ``CUDA_VISIBLE_DEVICES`` (unset
    when None)."""
    pytester.makeconftest(SIMULATING_CONFTEST.format(gpus=list(gpus), controller_reason=controller_reason))
    pytester.makepyfile(test_gating=GPU_TEST)
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs the GPU tier\n")
    simulate_machine(monkeypatch, gpus, controller_reason)
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    # xdist workers, if any, find the repository on PYTHONPATH
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    result = pytester.runpytest_inprocess(*NESTED_OPTIONS, "-rs", *args)
    return result, "\n".join(result.outlines + result.errlines)


# --- pure parts -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("choice", "cuda", "interpreted", "expected"), [
    ("auto", True, False, "cuda"),
    ("auto", True, True, "cpu"),  # TRITON_INTERPRET=1 on a GPU machine: the interpreter on the host
    ("auto", False, True, "cpu"),
    ("cpu", True, True, "cpu"),
    ("cuda", True, True, "cuda"),
])
def test_device_choice(choice, cuda, interpreted, expected):
    assert resolve_device(choice, cuda_available=cuda, interpreted=interpreted) == expected


@pytest.mark.parametrize(
    ("gpus", "cuda_version", "hidden", "expected"),
    [
        ([], "12.8", None, "no NVIDIA GPU found"),
        (H200, None, None, "build without CUDA"),
        (H200, "12.8", "", "hides every GPU"),
        (
            [("NVIDIA A100-SXM4-80GB", "8.0")],
            "12.8",
            None,
            "GPU is sm_80 (NVIDIA A100-SXM4-80GB), the fa3 path needs sm_90",
        ),
    ],
)
def test_reason_without_cuda(monkeypatch, gpus, cuda_version, hidden, expected):
    monkeypatch.setattr(torch.version, "cuda", cuda_version)
    if hidden is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
    assert expected in availability.reason_without_cuda(gpus)


def test_reason_without_cuda_finds_a_missing_flashinfer_without_importing_it(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(availability.importlib.util, "find_spec", lambda name: None)
    assert availability.reason_without_cuda(H200).startswith("flashinfer is not installed")
    monkeypatch.setattr(availability.importlib.util, "find_spec", lambda name: object())
    assert availability.reason_without_cuda(H200) is None


# --- header and summary ---------------------------------------------------------------------------


def test_header_says_where_the_convert_kernel_runs_and_that_there_is_no_gpu(pytester, monkeypatch):
    result, out = nested_run(pytester, monkeypatch)
    assert result.ret == 0, out[-3000:]
    assert "convert kernel: Triton interpreter on CPU" in out, out[:1500]
    assert "GPU tier: not run here (no NVIDIA GPU found)" in out, out[:1500]


def test_a_visible_gpu_that_cannot_run_the_tier_is_said_plainly(pytester, monkeypatch):
    result, out = nested_run(pytester, monkeypatch, "-p", "no:xdist", gpus=H200)
    assert result.ret == 0, out[-3000:]
    assert "GPU tier: NOT RUN on this machine with 1 NVIDIA GPU (NVIDIA H200): torch" in out, out[:1500]
    assert "GPU tier NOT RUN on a machine with 1 NVIDIA GPU (NVIDIA H200): no CUDA GPU visible to torch" in out, out[
        -2000:
    ]


# --- --require-gpu-tier and --device --------------------------------------------------------------


def test_require_gpu_tier_fails_before_any_test_without_a_gpu(pytester, monkeypatch):
    result, out = nested_run(pytester, monkeypatch, "--require-gpu-tier")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, out[-3000:]
    assert "--require-gpu-tier: the GPU tier cannot run here: no NVIDIA GPU found" in out, out[-3000:]
    assert "passed" not in out and "skipped" not in out, out[-3000:]


def test_require_gpu_tier_fails_before_any_test_when_the_visible_gpu_cannot_run_it(pytester, monkeypatch):
    result, out = nested_run(pytester, monkeypatch, "--require-gpu-tier", "-p", "no:xdist", gpus=H200)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, out[-3000:]
    assert "--require-gpu-tier: the GPU tier cannot run here: torch" in out, out[-3000:]


#: Beside GPU_TEST (and LAUNCH_SUITE) in the xdist run: what each worker's environment holds when its
#: tests run.
WORKER_PROBE = """
import os

import pytest


@pytest.mark.parametrize("i", range(4))
def test_worker_environment(i):
    assert os.environ["CUDA_VISIBLE_DEVICES"] in ("0", "1")
    assert os.environ["OMP_NUM_THREADS"] == os.environ["MKL_NUM_THREADS"] == "{threads}"
"""


def test_under_xdist_what_the_workers_find_reaches_the_controller(pytester, monkeypatch):
    """One run with two xdist workers checks all that needs processes of their own.

    GPU pinning: with two visible devices the workers split between them, each with its share
    of the cores, and the run ends with a table naming each worker's device and threads (no GPU
    needed: the pinning happens before CUDA). The GPU tier: the controller finds nothing wrong
    without CUDA (as with a FlashInfer that is installed but fails to import); the workers' full
    check does: the summary says why, and under ``--require-gpu-tier`` the GPU test errors at
    setup instead of skipping. The regime summary: the rows and kernel launches of
    tests/cpu/test_regime_summary.py's LAUNCH_SUITE travel from the workers in the reports and are
    counted as in a run without xdist (a test ended at an expected refusal counts as refused)."""
    threads = threads_per_worker(available_cores(), 2)
    pytester.makepyfile(test_probe=WORKER_PROBE.format(threads=threads), test_launch_suite=LAUNCH_SUITE)
    for name in THREAD_ENV:  # set in this process when it is itself an xdist worker
        monkeypatch.delenv(name, raising=False)
    result, out = nested_run(pytester, monkeypatch, "--require-gpu-tier", "-n", "2", gpus=H200, controller_reason=False,
                             visible="0,1")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, out[-3000:]
    # GPU_TEST: its CPU test passed, its GPU test errored; the probe's 4 passed; LAUNCH_SUITE: 5 passed, 1 failed
    result.assert_outcomes(passed=10, failed=1, errors=1)
    assert "GPU per xdist worker" in out, out[-3000:]
    for worker, device in (("gw0", "0"), ("gw1", "1")):
        assert f"{worker}: CUDA_VISIBLE_DEVICES={device} (CUDA not used); {threads} intra-op threads" in out, out[
            -3000:
        ]
    assert "--require-gpu-tier: the GPU tier cannot run: no CUDA GPU visible to torch" in out, out[-3000:]
    assert "GPU tier NOT RUN on a machine with 1 NVIDIA GPU (NVIDIA H200): no CUDA GPU visible to torch" in out, out[
        -3000:
    ]
    counts, refused = summary_table(out), refused_column(out)
    assert counts["A"] == ("2", 1, 0, 0, 0) and refused["A"] == 1, out  # test_ran's 2 rows; the refused test's 3 not
    assert counts["B"] == ("1", 0, 1, 0, 0) and refused["B"] == 0, out  # failed after its refusal
    assert counts["C"] == ("0", 0, 0, 0, 0) and refused["C"] == 1, out  # refused before any row was checked
    assert counts[EDGE_LABEL.format("stale-slots")] == ("0", 0, 0, 0, 0), out
    assert refused[EDGE_LABEL.format("stale-slots")] == 1, out
    assert ("attention kernel: ran in 2 tests; 3 ended at a refusal the installed FlashInfer is expected to make "
            "(counted as refused, not passed)") in out, out


def test_device_cuda_without_cuda_is_a_usage_error(pytester, monkeypatch):
    result, out = nested_run(pytester, monkeypatch, "--device=cuda")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, out[-3000:]
    assert "--device=cuda, but torch sees no CUDA GPU here" in out, out[-3000:]


# --- --impl and --dump-failures checked at start-up -----------------------------------------------


@pytest.mark.parametrize(("spec", "message"), [
    (":default_impl", "--impl expects 'module:factory', got ':default_impl'"),
    ("fast.impl:", "--impl expects 'module:factory', got 'fast.impl:'"),
    ("fast.impl:default_impl:x", "cannot load the factory: module 'fast.impl' has no attribute 'default_impl:x'"),
], ids=["no-module", "no-factory", "two-colons"])
def test_an_impl_spec_is_its_module_before_the_first_colon_and_a_factory_after(spec, message):
    from fast.impl import load_impl

    with pytest.raises(ValueError) as excinfo:
        load_impl(spec)
    assert message in str(excinfo.value), str(excinfo.value)


@pytest.mark.parametrize(("spec", "line"), [
    ("fast.impl.default_impl", "--impl expects 'module:factory', got 'fast.impl.default_impl'"),
    ("no_such_backend:make",
     "--impl 'no_such_backend:make': cannot load the factory: No module named 'no_such_backend'"),
    ("bad_impls:raises", "--impl 'bad_impls:raises': the factory raised RuntimeError: this backend needs its server"),
    ("bad_impls:lacking", "--impl 'bad_impls:lacking': the object lacks ['kv_lens', 'planned_lens', 'request_ids', "
                          "'convert', 'kv_indptr', 'write_kv_indices'] (see fast.impl.SparseMLAImpl)"),
], ids=["no-colon", "no-module", "factory-raises", "not-the-seam"])
def test_a_bad_impl_is_one_usage_error_before_any_test(pytester, spec, line):
    result, out = usage_run(pytester, f"--impl={spec}")
    assert_one_usage_error(result, out, line)


#: The controller of an xdist run as xdist is about to start its workers: which of the heavy
#: modules it has imported; then the run ends there.
CONTROLLER_AT_START = """
import sys
from pathlib import Path

import pytest

pytest_plugins = ("pytest_sparse_mla",)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    Path("at_start.txt").write_text(" ".join(m for m in ("torch", "triton", "flashinfer") if m in sys.modules))
    pytest.exit("seen", returncode=0)
"""


def test_the_xdist_controller_imports_no_torch_before_it_starts_its_workers(pytester, monkeypatch):
    """Importing torch takes seconds every worker would wait for: the controller of an xdist run
    (a process of its own here) imports none of it before xdist starts the workers."""
    pytester.makeconftest(CONTROLLER_AT_START)
    pytester.makepyfile(test_one="def test_one():\n    pass\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2")
    assert result.ret == 0, result.outlines[-20:] + result.errlines[-20:]
    assert (pytester.path / "at_start.txt").read_text() == ""


@pytest.mark.parametrize(("spec", "line"), [
    ("no_such_backend:make",
     "--impl 'no_such_backend:make': cannot load the factory: No module named 'no_such_backend'"),
    ("bad_impls:raises", "--impl 'bad_impls:raises': the factory raised RuntimeError: this backend needs its server"),
], ids=["no-module", "factory-raises"])
def test_a_bad_impl_under_xdist_is_one_usage_error_before_any_worker_starts(pytester, monkeypatch, spec, line):
    """An ``--impl`` other than the default is loaded and checked before xdist starts a worker:
    the error is the run's only output, with no worker's start-up to wait for."""
    from xdist.workermanage import NodeManager

    started = []
    monkeypatch.setattr(NodeManager, "setup_nodes", lambda self, putevent: started.append(True) or [])
    result, out = usage_run(pytester, f"--impl={spec}", xdist=True)
    assert started == [], out[-3000:]
    assert_one_usage_error(result, out, line)


def test_the_default_impl_under_xdist_is_checked_once_the_workers_started(pytester, monkeypatch):
    """The default implementation (the project's own) is checked after xdist started the workers
    (here: none), so that they do not wait for torch to load in the controller first."""
    from xdist.workermanage import NodeManager

    import pytest_sparse_mla.impl as plugin_impl

    started, checked = [], []
    monkeypatch.setattr(NodeManager, "setup_nodes", lambda self, putevent: started.append(True) or [])
    monkeypatch.setattr(plugin_impl, "checked_impl", lambda spec: checked.append((spec, list(started))))
    usage_run(pytester, "-p", "no:benchmark", xdist=True)
    assert checked == [("fast.impl:default_impl", [True])]


# --- --vllm, and the upgrade check's options, checked at start-up ---------------------------------

#: What ``--vllm`` was expected to name, as its lines end.
EXPECTED_VLLM = "a vLLM wheel file, a folder holding the vllm package, or 'installed'"


def small_zip(path: Path, files: dict[str, str]) -> Path:
    import zipfile

    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return path


def test_vllm_naming_a_missing_path_is_one_usage_error(pytester):
    result, out = usage_run(pytester, "--vllm=no/such/vllm.whl")
    assert_one_usage_error(result, out, f"--vllm=no/such/vllm.whl: no such file or folder (expected {EXPECTED_VLLM})")


def test_vllm_empty_is_one_usage_error(pytester):
    result, out = usage_run(pytester, "--vllm=")
    assert_one_usage_error(result, out, f"--vllm is empty: give {EXPECTED_VLLM}")


def test_vllm_naming_a_folder_without_vllm_is_one_usage_error(pytester, tmp_path):
    folder = tmp_path / "downloads"
    folder.mkdir()
    result, out = usage_run(pytester, f"--vllm={folder}")
    assert_one_usage_error(result, out, f"--vllm={folder}: a folder without a vllm package (no vllm/ in it; "
                                        f"expected {EXPECTED_VLLM})")


def test_vllm_naming_a_file_that_is_not_a_wheel_is_one_usage_error(pytester, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("")
    result, out = usage_run(pytester, f"--vllm={notes}")
    assert_one_usage_error(result, out,
                           f"--vllm={notes}: a file that is not a wheel (*.whl) (expected {EXPECTED_VLLM})")
    broken = tmp_path / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    broken.write_bytes(b"<html>a proxy's error page</html>")
    result, out = usage_run(pytester, f"--vllm={broken}")
    assert_one_usage_error(result, out, f"--vllm={broken}: not a wheel: not a zip archive")


def test_vllm_naming_another_projects_wheel_is_one_usage_error_naming_it(pytester, tmp_path):
    wheel = small_zip(tmp_path / "flashinfer_python-0.7.4-py3-none-any.whl", {
        "flashinfer/__init__.py": "",
        "flashinfer_python-0.7.4.dist-info/METADATA": "Metadata-Version: 2.1\nName: flashinfer-python\n"
                                                      "Version: 0.7.4\n",
    })
    result, out = usage_run(pytester, f"--vllm={wheel}")
    assert_one_usage_error(result, out, f"--vllm={wheel}: not a vLLM wheel: it is flashinfer-python 0.7.4")


def test_vllm_naming_a_release_without_the_sm90_backend_is_one_usage_error(pytester, tmp_path):
    """A vLLM wheel whose files are intact (its RECORD fits) but that has no SM90 sparse backend."""
    import base64
    import hashlib

    metadata = "Metadata-Version: 2.1\nName: vllm\nVersion: 0.10.0\n"
    digest = base64.urlsafe_b64encode(hashlib.sha256(metadata.encode()).digest()).rstrip(b"=").decode()
    wheel = small_zip(tmp_path / "vllm-0.10.0-cp38-abi3-manylinux1_x86_64.whl", {
        "vllm/__init__.py": "",
        "vllm-0.10.0.dist-info/METADATA": metadata,
        "vllm-0.10.0.dist-info/RECORD": f"vllm-0.10.0.dist-info/METADATA,sha256={digest},{len(metadata)}\n"
                                        "vllm-0.10.0.dist-info/RECORD,,\n",
    })
    result, out = usage_run(pytester, f"--vllm={wheel}")
    from backends.vllm.source import MODULE_FILES

    assert_one_usage_error(result, out, f"--vllm={wheel}: vLLM 0.10.0 lacks {list(MODULE_FILES)}; a vLLM release "
                                        "without the SM90 sparse backend")


@pytest.mark.parametrize(("args", "line"), [
    (["--baseline-out=upgrade"], "--baseline-out names where --compare-baseline records this run and writes its "
                                 "report: give it with --compare-baseline"),
    (["--record-baseline=base", "--baseline-out=upgrade"],
     "--baseline-out names where --compare-baseline records this run and writes its report: give it with "
     "--compare-baseline (--record-baseline writes into the folder it names)"),
    (["--baseline-timing=off"], "--baseline-timing decides the timing pass of the upgrade check: give it with "
                                "--record-baseline or --compare-baseline"),
], ids=["out-alone", "out-with-record", "timing-alone"])
def test_an_upgrade_check_option_without_the_check_is_one_usage_error(pytester, args, line):
    result, out = usage_run(pytester, *args)
    assert_one_usage_error(result, out, line)
    assert not (pytester.path / "upgrade").exists() and not (pytester.path / "base").exists()


def test_dump_failures_into_what_cannot_be_a_folder_is_a_usage_error(pytester, tmp_path):
    existing = tmp_path / "a-file"
    existing.write_text("")
    result, out = usage_run(pytester, f"--dump-failures={existing}")
    assert_one_usage_error(result, out, f"--dump-failures={existing}: exists and is not a folder")
    result, out = usage_run(pytester, f"--dump-failures={tmp_path / 'dumps' / 'case'}")
    assert result.ret == 0 and not (tmp_path / "dumps").exists(), out[-3000:]  # checked, and nothing left behind
    result, out = usage_run(pytester, "--dump-failures=/proc/sparse-mla-dump")
    assert_one_usage_error(result, out, "--dump-failures=/proc/sparse-mla-dump: cannot make the folder: ", exact=False)
