"""Per-worker GPU pinning: which device an xdist worker picks (no GPU needed)."""

from __future__ import annotations

import pytest

from tests.gpu_env import pick_gpu, worker_index


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
