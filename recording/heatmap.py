"""Error heatmaps of a replayed fixture: max |out - ref(b)| per (row, head), one PNG per output,
written beside the fixture after the verdict. Writing one can never change a verdict: every
problem (matplotlib missing, a folder that cannot be written) comes back as a line of text.

What a heatmap shows: finite errors on a colour scale whose bar marks the error budget's max
threshold (``MAX_FACTOR x max|lowp - truth| + ABS_FLOOR``, reference/budget.py); NaN and Inf
cells in colours of their own, named with their counts in a legend; rows with integer ticks
and their regime. matplotlib is optional (the ``plot`` extra).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from reference.budget import ABS_FLOOR, FACTORS

NAN_COLOUR = "#00c0ff"
INF_COLOUR = "#30ff30"
MAX_ROW_TICKS = 48


def error_grid(out: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """``[rows, heads]`` float64: the max abs error of each (row, head); NaN where the output
    or the reference holds a NaN there, +Inf where an error is infinite."""
    diff = (out.double() - truth.double()).abs()
    if not diff.numel():
        return torch.zeros(out.shape[:2], dtype=torch.float64)
    nan = torch.isnan(diff)
    grid = torch.where(nan, torch.zeros_like(diff), diff).amax(dim=-1)
    return torch.where(nan.any(dim=-1), torch.full_like(grid, float("nan")), grid)


def budget_threshold(truth: torch.Tensor, lowp: torch.Tensor, kv_dtype: str) -> float:
    """The largest max error the budget accepts for this case."""
    err = (lowp.double() - truth.double()).abs()
    finite = err[torch.isfinite(err)]
    return FACTORS[kv_dtype][0] * (float(finite.max()) if finite.numel() else 0.0) + ABS_FLOOR


def legend_labels(grid: torch.Tensor) -> list[str]:
    """The legend entries of the cells off the colour scale (none when every cell is finite)."""
    labels = []
    nan, inf = int(torch.isnan(grid).sum()), int(torch.isinf(grid).sum())
    if nan:
        labels.append(f"NaN ({nan} cells)")
    if inf:
        labels.append(f"Inf ({inf} cells)")
    return labels


def row_ticks(rows: int, regimes: list[str]) -> tuple[list[int], list[str]]:
    """Integer row ticks (every row up to MAX_ROW_TICKS rows, else evenly spaced) labelled
    with the row's regime."""
    step = max(1, math.ceil(rows / MAX_ROW_TICKS))
    ticks = list(range(0, rows, step))
    return ticks, [f"{r} ({regimes[r]})" if r < len(regimes) else str(r) for r in ticks]


def colour_limit(grid: torch.Tensor, threshold: float) -> float:
    finite = grid[torch.isfinite(grid)]
    top = float(finite.max()) if finite.numel() else 0.0
    return max(top, 1.25 * threshold, 1e-12)


def write_heatmap(path: Path, grid: torch.Tensor, *, regimes: list[str], threshold: float, title: str) -> Path:
    """Draw ``grid`` (rows x heads) into ``path``; raises ImportError without matplotlib and
    OSError where the file cannot be written."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rows, heads = grid.shape
    values = grid.numpy()
    finite = np.isfinite(values)
    fig = Figure(figsize=(7, max(3.0, min(14.0, 0.22 * rows + 1.5))))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(np.where(finite, values, np.nan), aspect="auto", interpolation="nearest", cmap="magma",
                   vmin=0.0, vmax=colour_limit(grid, threshold))
    handles = []
    for mask, colour, label in ((np.isnan(values), NAN_COLOUR, "NaN"), (np.isinf(values), INF_COLOUR, "Inf")):
        if mask.any():
            ax.imshow(
                np.where(mask, 1.0, np.nan),
                aspect="auto",
                interpolation="nearest",
                cmap=ListedColormap([colour]),
                vmin=0.0,
                vmax=1.0,
            )
            handles.append(Patch(facecolor=colour, label=f"{label} ({int(mask.sum())} cells)"))
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.55, 1.0), fontsize=8)
    ticks, labels = row_ticks(rows, regimes)
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_ylabel("row (regime)")
    ax.set_xlabel("head")
    ax.set_title(title, fontsize=9)
    bar = fig.colorbar(im, ax=ax)
    bar.set_label("max |out - ref(b)| over the 512 dims")
    bar.ax.axhline(threshold, color="cyan", linewidth=2)
    ticks = [
        t for t in bar.get_ticks() if 0 <= t <= colour_limit(grid, threshold) and abs(t - threshold) > 0.06 * threshold
    ]
    bar.set_ticks([*ticks, threshold])
    bar.set_ticklabels([f"{t:.3g}" for t in ticks] + [f"budget {threshold:.3g}"])
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path


def write_heatmaps(report) -> list[str]:
    """One heatmap per output of a :class:`recording.replay.ReplayReport` (recorded versions and
    a re-run) beside its fixture; the lines to print: each path written, or why not."""
    fx = report.fixture
    rerun = report.rerun
    if fx.path is None or fx.num_rows == 0 or not (fx.outputs or (rerun is not None and rerun.out is not None)):
        return []  # no output to draw: matplotlib is not even imported
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return []  # said once for the whole run by the plugin
    from .replay import reference_outputs, with_plan

    kv_dtype = fx.meta.get("kv_dtype", "bfloat16")
    regimes = report.regimes
    outputs = [(version, fx, out) for version, (out, _) in fx.outputs.items()]
    if rerun is not None and rerun.out is not None:
        outputs.append((rerun.label, with_plan(fx, rerun.plan) if rerun.plan is not None else fx, rerun.out.cpu()))
    lines = []
    for version, planned, out in outputs:
        path = fx.path.with_name(f"{fx.path.stem}.{version.replace(' ', '-')}.err.png")
        try:
            truth, _ = reference_outputs(planned, "planned", "float64")
            lowp, _ = reference_outputs(planned, "planned", "lowp")
            write_heatmap(
                path,
                error_grid(out, truth),
                regimes=regimes,
                threshold=budget_threshold(truth, lowp, kv_dtype),
                title=f"{fx.name} [{version}] max |out - ref(b)|",
            )
            lines.append(f"  heatmap [{version}]: {path}")
        except Exception as exc:  # the heatmap is a picture: it never decides anything
            lines.append(f"  WARNING: heatmap [{version}] not written to {path}: {type(exc).__name__}: {exc}")
    return lines
