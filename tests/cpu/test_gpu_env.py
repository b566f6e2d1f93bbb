"""Per-worker GPU pinning and thread share: which device an xdist worker picks and how many
intra-op threads it gets (no GPU needed). A real xdist run of pinned workers, and the table of
the device each used, is checked together with the GPU tier's reasons in one nested run
(tests/cpu/test_plugin_gating.py)."""

from __future__ import annotations

import os
import sys
import types
import warnings

import pytest

from harness import gpu_env
from harness.gpu_env import pick_gpu, worker_index
from mla_constants import KERNEL_VARIANTS
from pytest_sparse_mla.gpus import THREAD_ENV, available_cores, share_cores, threads_per_worker


@pytest.mark.parametrize(("worker", "count", "expected"), [
    ("gw0", 2, "0"), ("gw1", 2, "1"), ("gw2", 2, "0"), ("gw3", 2, "1"), ("gw5", 4, "1"),
])
def test_worker_index_mod_gpu_count(worker, count, expected):
    assert pick_gpu(worker, None, count) == expected


def test_user_visible_devices_are_respected():
    assert [pick_gpu(f"gw{i}", "3,5", 8) for i in range(4)] == ["3", "5", "3", "5"]
    assert pick_gpu("gw1", "GPU-aaaa, GPU-bbbb", 0) == "GPU-bbbb"


@pytest.mark.parametrize(("worker", "visible", "count"), [
    (None, None, 4),  # not under xdist
    ("gw3", None, 1),  # one GPU: nothing to choose
    ("gw3", None, 0),  # no GPU
    ("gw3", "2", 8),  # the user already chose one
])
def test_nothing_changes_without_a_choice(worker, visible, count):
    assert pick_gpu(worker, visible, count) is None


def test_worker_index_parsing():
    assert worker_index("gw12") == 12
    assert worker_index("master") is None
    assert worker_index(None) is None


@pytest.mark.parametrize(("cores", "workers", "threads"), [(16, 16, 1), (16, 4, 4), (16, 3, 5), (2, 4, 1), (8, 0, 8)])
def test_workers_share_the_cores(cores, workers, threads):
    assert threads_per_worker(cores, workers) == threads


def test_a_worker_with_torch_loaded_gets_its_share_of_the_cores(monkeypatch):
    import torch

    for name in THREAD_ENV:  # recorded first, so the values share_cores sets are undone too
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    before = torch.get_num_threads()
    try:
        share_cores(2)
        assert torch.get_num_threads() == threads_per_worker(available_cores(), 2)
    finally:
        torch.set_num_threads(before)


def test_the_users_thread_setting_wins(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.setenv("MKL_NUM_THREADS", "")
    monkeypatch.delenv("MKL_NUM_THREADS")
    share_cores(64)
    assert "MKL_NUM_THREADS" not in os.environ




class FakeNvml(types.ModuleType):
    """A pynvml with one H200; ``fail`` names the call that raises and ``error`` what it raises."""

    class NVMLError(Exception):
        pass

    def __init__(self, fail: str = "", error: type[Exception] | None = None):
        super().__init__("pynvml")
        self.fail, self.error, self.shut = fail, error, False

    def _call(self, name, value):
        if name == self.fail:
            raise (self.error or self.NVMLError)(f"{name} failed")
        return value

    def nvmlInit(self):
        return self._call("nvmlInit", None)

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetCount(self):
        return self._call("nvmlDeviceGetCount", 1)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self._call("nvmlDeviceGetHandleByIndex", i)

    def nvmlDeviceGetName(self, handle):
        return self._call("nvmlDeviceGetName", b"NVIDIA H200")

    def nvmlDeviceGetCudaComputeCapability(self, handle):
        return self._call("nvmlDeviceGetCudaComputeCapability", (9, 0))


@pytest.fixture
def no_nvidia_smi(monkeypatch):
    monkeypatch.setattr(gpu_env.shutil, "which", lambda name: None)


def test_nvml_lists_the_gpus(monkeypatch, no_nvidia_smi, recwarn):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    assert gpu_env.gpus_without_cuda() == [("NVIDIA H200", "9.0")]
    assert gpu_env.count_gpus_without_cuda() == 1
    assert not recwarn.list


@pytest.mark.parametrize("fail", ["nvmlInit", "nvmlDeviceGetName"])
def test_nvml_errors_fall_back_quietly(monkeypatch, no_nvidia_smi, recwarn, fail):
    """No driver, or a GPU NVML cannot read: NVML's own error; nvidia-smi is asked instead."""
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(fail))
    assert gpu_env.gpus_without_cuda() == []
    assert not recwarn.list


def test_no_pynvml_falls_back_quietly(monkeypatch, no_nvidia_smi, recwarn):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert gpu_env.gpus_without_cuda() == [] and gpu_env.count_gpus_without_cuda() == 0
    assert not recwarn.list


@pytest.mark.parametrize("fail", ["nvmlDeviceGetCount", "nvmlDeviceGetCudaComputeCapability"])
def test_an_unexpected_nvml_exception_is_reported(monkeypatch, no_nvidia_smi, fail):
    fake = FakeNvml(fail, TypeError)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with pytest.warns(RuntimeWarning, match=rf"NVML query failed unexpectedly \(TypeError: {fail} failed\)"):
        assert gpu_env.gpus_without_cuda() == []
    assert fake.shut, "NVML was not shut down after the failed query"


def test_prebuild_without_a_gpu_refuses_in_one_line(monkeypatch, capsys):
    """``python3 -m harness.port.prebuild`` (``sys.exit(main())``) where torch sees no CUDA GPU: one line
    naming why, non-zero exit. Its ``main`` in this process, torch's CUDA hidden for the call."""
    import torch

    from harness.port import prebuild

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning would be a second line
        status = prebuild.main([])
    captured = capsys.readouterr()
    lines = (captured.out + captured.err).splitlines()
    expected = ["harness.port.prebuild: nothing to build here: no CUDA GPU visible to torch"]
    assert status != 0 and lines == expected, f"exit {status}:\n" + "\n".join(lines)


# --- the background JIT build -------------------------------------------------------------------


def test_the_background_build_starts_only_on_a_gpu_machine_with_flashinfer_once_per_run():
    from pytest_sparse_mla.gpus import wants_background_build

    asked = []

    def yes(what):
        return lambda: asked.append(what) or True

    assert wants_background_build(None, False, yes("gpu"), yes("flashinfer"))
    assert not wants_background_build(None, False, lambda: False, yes("flashinfer"))
    assert not wants_background_build(None, False, yes("gpu"), lambda: False)
    asked.clear()
    assert not wants_background_build("started", False, yes("gpu"), yes("flashinfer"))  # a nested session
    assert not wants_background_build("0", False, yes("gpu"), yes("flashinfer"))  # turned off
    assert not wants_background_build(None, True, yes("gpu"), yes("flashinfer"))  # --collect-only
    assert asked == []  # nothing probed when the cheap checks already say no


def test_the_prebuild_finds_each_variant_missing_from_the_cache(tmp_path):
    """Module names as FlashInfer 0.7.4 writes them; a folder without its library is a build
    that did not finish; the fa3 module's name ends in ``_sm90``, the fa2 module's does not, and
    each stands only for its own kernel."""
    from harness.port.prebuild import VARIANTS, missing_variants
    from mla_constants import FA2_KERNEL_VARIANTS

    def module(kv: str, kpe: int, suffix: str = "_planabi2_sm90", built: bool = True) -> None:
        name = (f"batch_mla_attention_dtype_q_bf16_dtype_kv_{kv}_dtype_o_bf16_dtype_idx_i32_head_dim_ckv_512"
                f"_head_dim_kpe_{kpe}_profiler_False{suffix}")
        (tmp_path / name).mkdir()
        if built:
            (tmp_path / name / f"{name}.so").write_bytes(b"")

    assert VARIANTS == tuple(("fa3", *v) for v in KERNEL_VARIANTS) + tuple(("fa2", *v) for v in FA2_KERNEL_VARIANTS)
    assert missing_variants(tmp_path) == list(VARIANTS)
    module("bf16", 64)
    module("e4m3", 0)
    module("e4m3", 64, built=False)
    module("bf16", 0, suffix="_planabi2")
    assert missing_variants(tmp_path) == [("fa3", "float8_e4m3fn", True, 0.5), ("fa3", "bfloat16", False, 1.0),
                                          ("fa2", "bfloat16", True, 1.0), ("fa2", "float8_e4m3fn", True, 0.5)]
    module("bf16", 0, suffix="_sm90")
    module("e4m3", 64, suffix="_sm90")
    module("bf16", 64, suffix="")
    module("e4m3", 64, suffix="_planabi2")
    assert missing_variants(tmp_path) == []


def test_the_prebuild_builds_every_variant_the_input_space_draws():
    from harness.input_space import SPACE, VARIANT_KNOBS

    drawn = next(d.classes for d in SPACE if d.name == "variant")
    assert {VARIANT_KNOBS[name] for name in drawn} == set(KERNEL_VARIANTS)
