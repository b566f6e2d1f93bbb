"""FlashMLA's per-case error table: each differential case of the GPU tier writes one JSON line
(FlashMLA's and FA3's errors against the oracle, and how far the two differ);
``scripts/flashmla_table.py`` makes the markdown table of one run."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest

TABLE_ENV = "SPARSE_MLA_FLASHMLA_TABLE"
_RUN_IDS: dict[int, str] = {}


def table_path(config) -> Path:
    """Where the GPU tier's per-case errors go: ``$SPARSE_MLA_FLASHMLA_TABLE``, else the pytest
    cache (``.pytest_cache/d/sparse-mla/flashmla-table.jsonl``), which is the same folder under
    the rootdir where the cache plugin is off (``-p no:cacheprovider``, as scripts/gpu_runner.py
    runs)."""
    named = os.environ.get(TABLE_ENV)
    if named:
        return Path(named)
    cache = getattr(config, "cache", None)
    folder = cache.mkdir("sparse-mla") if cache is not None else config.rootpath / ".pytest_cache" / "d" / "sparse-mla"
    return folder / "flashmla-table.jsonl"


def table_problem(path: Path) -> str | None:
    """Why the table cannot be written at ``path`` (the folder cannot be made, or the file not
    opened for appending), or None."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        return f"{TABLE_ENV}={path}: FlashMLA's table cannot be written there ({exc.strerror or exc})"
    return None


def pytest_configure(config):
    """A table path the run cannot write is a usage error before any test, not a failure of the
    last GPU case."""
    named = os.environ.get(TABLE_ENV)
    problem = table_problem(Path(named)) if named else None
    if problem:
        raise pytest.UsageError(problem)


def run_id(config) -> str:
    """One id for every process of a run (xdist's run id, else one per session)."""
    return os.environ.get("PYTEST_XDIST_TESTRUNUID") or _RUN_IDS.setdefault(id(config), uuid.uuid4().hex)


def comparison_entry(comparisons) -> dict:
    return {f"{c.name}_{k}": getattr(c, k) for c in comparisons
            for k in ("ok", "max_err", "max_ratio", "mean_ratio", "rel_l2")}


def table_row(request, scenario, config, rows: int, kernels: dict[str, list],
              differences: dict[str, float]) -> dict:
    return {
        "run": run_id(request.config), "test": request.node.nodeid, "case": request.node.callspec.id,
        "variant": config.variant, "heads": config.num_heads, "k_scale": config.k_scale, "rows": rows,
        "regimes": "".join(sorted(set(scenario.row_regime[:rows]))),
        **{name: comparison_entry(c) for name, c in kernels.items()}, **differences,
    }


def write_table_row(request, row: dict) -> None:
    """Append one JSON line (one write of one line, so processes writing at once do not
    interleave)."""
    path = table_path(request.config)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(row, sort_keys=True) + "\n")


def max_difference(a, b) -> float:
    """max |a - b| over the positions where both tensors are finite (0 for no rows)."""
    a, b = a.double(), b.double()
    both = a.isfinite() & b.isfinite()
    return float((a - b).abs()[both].max()) if bool(both.any()) else 0.0
