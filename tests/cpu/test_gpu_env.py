"""Per-worker GPU pinning: which device an xdist worker picks (no GPU needed)."""

from __future__ import annotations

import pytest

from harness.gpu_env import pick_gpu, worker_index


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


def test_each_worker_reports_the_gpu_it_was_pinned_to(pytester, monkeypatch):
    """Under xdist with two visible devices the workers split between them, and the run ends
    with a table naming each worker's device (no GPU needed: the pinning happens before CUDA)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    result = pytester.runpytest_subprocess(str(root / "tests/cpu/test_layouts.py"), "-n", "4", "-p", "no:cacheprovider",
                                           "--rootdir", str(root))
    out = "\n".join(result.outlines)
    assert result.ret == 0, out[-2000:]
    assert "GPU per xdist worker" in out, out[-2000:]
    for worker, device in (("gw0", "0"), ("gw1", "1"), ("gw2", "0"), ("gw3", "1")):
        assert f"{worker}: CUDA_VISIBLE_DEVICES={device} " in out, out[-2000:]
