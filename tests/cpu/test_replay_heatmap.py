"""The replay's error heatmaps: written after the verdict and never changing it (a folder that
cannot be written, Inf in the output), their paths printed, NaN and Inf cells named in a
legend, the budget marked, rows with integer ticks and their regime; without matplotlib the
run says so once."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from recording.fixture import load_fixture, save_fixture
from recording.heatmap import error_grid, legend_labels, row_ticks, write_heatmaps
from recording.replay import replay

ROOT = Path(__file__).resolve().parents[2]
GOOD = ROOT / "fixtures" / "a-identity-fill-bf16.safetensors"  # 4 rows x 16 heads, regime A


def inf_output_fixture(folder: Path) -> Path:
    """The good fixture with Inf in one recorded output (row 1, head 2) and NaN in another (row 3)."""
    fx = load_fixture(GOOD)
    out, lse = fx.outputs["0.7.4"]
    out = out.clone()
    out[1, 2, 0] = float("inf")
    out[3, :, 5] = float("nan")
    fx.outputs["0.7.4"] = (out, lse)
    return save_fixture(folder / "inf-out.safetensors", fx)


def unwritable(folder: Path, fixture: Path) -> None:
    """Make the heatmap paths of ``fixture`` unwritable, also for root: a folder where each
    PNG would go, and the folder itself read-only."""
    for version in load_fixture(fixture).outputs:
        (folder / f"{fixture.stem}.{version}.err.png").mkdir()
    os.chmod(folder, 0o555)


def test_error_grid_keeps_nan_and_inf_cells_and_the_legend_names_them():
    truth = torch.zeros(3, 2, 4, dtype=torch.float64)
    out = torch.zeros(3, 2, 4)
    out[0, 1, 2] = float("nan")
    out[2, 0, 0] = float("inf")
    out[1, 1, 3] = 0.5
    grid = error_grid(out, truth)
    assert torch.isnan(grid[0, 1]) and torch.isinf(grid[2, 0]) and float(grid[1, 1]) == 0.5
    assert legend_labels(grid) == ["NaN (1 cells)", "Inf (1 cells)"]
    assert legend_labels(torch.zeros(2, 2)) == []


def test_row_ticks_are_integers_labelled_with_their_regime():
    ticks, labels = row_ticks(4, ["A", "C", "G", "H"])
    assert ticks == [0, 1, 2, 3] and labels == ["0 (A)", "1 (C)", "2 (G)", "3 (H)"]
    ticks, labels = row_ticks(500, ["E"] * 500)
    assert all(isinstance(t, int) for t in ticks) and len(ticks) <= 48 and labels[1] == f"{ticks[1]} (E)"


def test_inf_in_the_output_fails_the_kernel_check_and_the_heatmap_shows_it(tmp_path):
    pytest.importorskip("matplotlib")
    report = replay(load_fixture(inf_output_fixture(tmp_path)))
    verdict = report.failures()
    assert verdict and "kernel != as-planned reference" in verdict[0]
    lines = write_heatmaps(report)
    assert report.failures() == verdict
    assert lines == [f"  heatmap [{v}]: {tmp_path}/inf-out.{v}.err.png" for v in ("0.6.18.post1", "0.7.4")], lines
    assert all(Path(line.split(": ", 1)[1]).stat().st_size > 0 for line in lines)


def test_a_folder_that_cannot_be_written_gives_a_warning_line_and_the_same_verdict(tmp_path):
    pytest.importorskip("matplotlib")
    folder = tmp_path / "ro"
    folder.mkdir()
    path = inf_output_fixture(folder)
    unwritable(folder, path)
    try:
        report = replay(load_fixture(path))
        verdict = report.failures()
        lines = write_heatmaps(report)
    finally:
        os.chmod(folder, 0o755)
    assert report.failures() == verdict and verdict
    assert len(lines) == 2 and all(
        line.startswith("  WARNING: heatmap [") and "not written" in line for line in lines
    ), lines


def run_pytest(pytester, *args: str):
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "--rootdir", str(ROOT), *args)


def test_replay_run_in_a_read_only_folder_keeps_each_verdict(pytester, tmp_path):
    pytest.importorskip("matplotlib")
    folder = tmp_path / "ro"
    folder.mkdir()
    (folder / "good.safetensors").write_bytes(GOOD.read_bytes())
    bad = inf_output_fixture(folder)
    unwritable(folder, bad)
    unwritable_good = [folder / f"good.{v}.err.png" for v in ("0.6.18.post1", "0.7.4")]
    os.chmod(folder, 0o755)
    for p in unwritable_good:
        p.mkdir()
    os.chmod(folder, 0o555)
    try:
        result = run_pytest(
            pytester, str(ROOT / "tests/test_replay.py"), f"--replay={folder}", "--replay-recorded-only",
            "--replay-heatmaps",
        )
    finally:
        os.chmod(folder, 0o755)
    out = "\n".join(result.outlines + result.errlines)
    assert result.ret == 1 and "1 failed, 1 passed" in out, out[-3000:]
    assert "FAILED" in out and "inf-out.safetensors" in out and "kernel != as-planned reference" in out, out[-3000:]
    assert out.count("WARNING: heatmap [") >= 4, out[-3000:]


def test_without_matplotlib_the_run_says_so_once(pytester, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    folder = tmp_path / "cases"
    folder.mkdir()
    for name in ("a.safetensors", "b.safetensors"):
        (folder / name).write_bytes(GOOD.read_bytes())
    result = run_pytest(pytester, str(ROOT / "tests/test_replay.py"), f"--replay={folder}", "--replay-recorded-only")
    out = "\n".join(result.outlines + result.errlines)
    assert result.ret == 0, out[-3000:]
    assert out.count("error heatmaps not written: matplotlib is not installed") == 1, out[-3000:]
    assert not list(folder.glob("*.png"))
