"""The whole plan-limit study of the FlashInfer installed here: for each head count the plan
search, then every row of the plans around the limit; the environment asked of a child, so
this process stays off CUDA."""

from __future__ import annotations

import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

from mla_constants import FA3_WORK_CAPACITY

from .children import (
    PLAN_TIMEOUT_S,
    REPO_ROOT,
    ROWS_TIMEOUT_S,
    PlanWorker,
    child_command,
    child_env,
    run_rows_attempt,
)
from .search import INT32_ROWS_BOUND, PLAN_WIDTH, checked_sizes, search_largest, search_near

DEFAULT_HEADS = (16, 128)


def study_heads(heads: int, *, bound: int, plan_attempt_fn, rows_attempt_fn, rows_search: bool = False,
                rows_search_start: int = 1024, rows_workers: int = 1, expected: int | None = None) -> dict:
    """For one head count: the plan search (from 1, or :func:`search_near` ``expected``), then
    every row of the plans just below, at and just above the limit (:func:`checked_sizes`; one
    that plan() did not accept is recorded as the search saw it), ``rows_workers`` children at
    once. With ``rows_search``, where a checked plan was accepted and its rows were not all
    right, the largest N whose rows are (growing from ``rows_search_start``, up to the smallest
    such plan)."""
    plan = lambda n: plan_attempt_fn(n, heads)  # noqa: E731
    plans = search_largest(plan, bound=bound) if expected is None else search_near(plan, bound=bound,
                                                                                   expected=expected)
    failed = plans.first_failing
    sizes = checked_sizes(plans)
    to_run = [n for n in sizes if failed is None or n != failed.rows]
    with ThreadPoolExecutor(max_workers=max(1, rows_workers)) as pool:
        ran = dict(zip(to_run, pool.map(lambda n: rows_attempt_fn(n, heads), to_run), strict=True))
    checks = [ran[n] if n in ran else failed for n in sizes]
    entry = {"heads": heads, "plan_search": plans.to_dict(), "row_checks": [asdict(c) for c in checks]}
    wrong = [c for c in checks if c.kind == "rows" and not c.ok and c.outcome != "not-run"]
    if rows_search and wrong:
        top = min(c.rows for c in wrong)
        entry["rows_search"] = search_largest(lambda n: rows_attempt_fn(n, heads), bound=top,
                                              start=min(rows_search_start, top)).to_dict()
    return entry


def study(heads_list=DEFAULT_HEADS, *, bound: int = INT32_ROWS_BOUND, rows_search: bool = False,
          plan_timeout: float = PLAN_TIMEOUT_S, rows_timeout: float = ROWS_TIMEOUT_S, rows_workers: int = 1) -> dict:
    """The plan limits of the FlashInfer installed here, for each head count (children on this
    machine's GPU); :class:`StudyUnavailable` before any attempt where it cannot run."""
    info = environment_info()
    entries = []
    with PlanWorker(timeout=plan_timeout) as worker:
        for heads in heads_list:
            started = time.perf_counter()
            entry = study_heads(heads, bound=bound, plan_attempt_fn=worker.attempt,
                                rows_attempt_fn=lambda n, h: run_rows_attempt(n, h, timeout=rows_timeout),
                                rows_search=rows_search, rows_workers=rows_workers)
            entry["seconds"] = round(time.perf_counter() - started, 1)
            entries.append(entry)
        info["plan_children"] = worker.started
    return {"schema": 1, **info, "width": PLAN_WIDTH, "bound": bound, "work_capacity": FA3_WORK_CAPACITY,
            "results": entries}


class StudyUnavailable(RuntimeError):
    """The study cannot run here (no SM90 GPU, no FlashInfer); the message says why, in one line."""


def environment_info(command=None) -> dict:
    """FlashInfer version and the GPU, asked of a child (this process stays off CUDA);
    :class:`StudyUnavailable` where the SM90 FlashInfer path cannot run there."""
    cmd = command or child_command("--environment")
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, env=child_env(), timeout=120)
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not results:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        raise StudyUnavailable(f"the environment child failed: {tail[0][-300:]}")
    info = json.loads(results[-1][len("RESULT "):])
    if "unavailable" in info:
        raise StudyUnavailable(f"the SM90 FlashInfer path cannot run here: {info['unavailable']}")
    return info
