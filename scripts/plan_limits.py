"""The largest plan each FlashInfer release accepts, and every row of the plans around it
(docs/edges.md#plan-limits).

    python3 -m scripts.plan_limits [--heads 16 128] [--bound N] [--no-rows-search] [--out DIR]
                                   [--runner-work DIR --release V ...]

For each head count: grow the plan (N rows, each its own request, page size 1, 2048 slots per
row) by doubling from 1 and bisect to the largest N plan() accepts, up to --bound (default: the
largest N whose kv_indptr fits int32, 1048575); then plan, run and judge every row of the plans
just below, at and just above that N. Where an accepted plan gives a wrong row, crashes or hangs
(a finding), search the largest N whose rows are all right too (--no-rows-search skips it).
Every attempt runs in a child process (harness.plan_limits), so a crash is an outcome.

Without --release the FlashInfer importable here runs. With --runner-work DIR --release V (as
installed by scripts/gpu_runner.py --work DIR: DIR/site/V, JIT cache DIR/jit/V) each release
runs in turn. Writes plan-limits-<version>.json and .md per release and plan-limits.md (all of
them) into --out (default out/plan-limits), and prints the tables. Exit status 1 when a release
shows a finding (an accepted plan with wrong rows, a crash or a hang), 2 (one line on stderr,
before any attempt) where the SM90 FlashInfer path cannot run, else 0.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from harness.plan_limits import (
    DEFAULT_HEADS,
    INT32_ROWS_BOUND,
    PLAN_TIMEOUT_S,
    REPO_ROOT,
    ROWS_TIMEOUT_S,
    StudyUnavailable,
    entry_finding,
    report_markdown,
    study,
    write_report,
)


@contextmanager
def release_environment(work: Path | None, release: str | None):
    """The children see the release installed under ``work`` (and its JIT cache); nothing
    changes without one."""
    if release is None:
        yield
        return
    saved = dict(os.environ)
    site, cache = work / "site" / release, work / "jit" / release
    if not site.is_dir():
        raise SystemExit(f"{site} does not exist: install the release with scripts/gpu_runner.py --work {work} first")
    before = [saved["PYTHONPATH"]] if saved.get("PYTHONPATH") else []
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), REPO_ROOT, *before])
    os.environ["FLASHINFER_WORKSPACE_BASE"] = str(cache)
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def has_finding(report: dict) -> bool:
    return any(entry_finding(entry).startswith("FINDING") for entry in report["results"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, nargs="+", default=list(DEFAULT_HEADS))
    parser.add_argument("--bound", type=int, default=INT32_ROWS_BOUND, help="largest N tried")
    parser.add_argument("--no-rows-search", action="store_true", help="skip the largest all-right plan search")
    parser.add_argument("--rows-workers", type=int, default=2, help="rows checks at once (one child each)")
    parser.add_argument("--plan-timeout-s", type=float, default=PLAN_TIMEOUT_S)
    parser.add_argument("--rows-timeout-s", type=float, default=ROWS_TIMEOUT_S)
    parser.add_argument("--out", type=Path, default=Path("out/plan-limits"))
    parser.add_argument("--runner-work", type=Path, help="scripts/gpu_runner.py --work folder holding site/<release>")
    parser.add_argument("--release", action="append", default=[], help="release under --runner-work (repeatable)")
    args = parser.parse_args(argv)
    if args.release and not args.runner_work:
        parser.error("--release needs --runner-work")
    if not 1 <= args.bound <= INT32_ROWS_BOUND:
        parser.error(f"--bound must be in 1..{INT32_ROWS_BOUND}")
    reports = []
    for release in args.release or [None]:
        with release_environment(args.runner_work.resolve() if args.runner_work else None, release):
            try:
                report = study(args.heads, bound=args.bound, rows_search=not args.no_rows_search,
                               plan_timeout=args.plan_timeout_s, rows_timeout=args.rows_timeout_s,
                               rows_workers=args.rows_workers)
            except StudyUnavailable as e:
                print(f"scripts.plan_limits: {release or 'installed FlashInfer'}: {e}", file=sys.stderr)
                return 2
        report["release"] = release or "installed"
        paths = write_report(report, str(args.out))
        print(f"{report['release']}: {paths[1]}", flush=True)
        reports.append(report)
    text = "\n".join(report_markdown(r) for r in reports)
    (args.out / "plan-limits.md").write_text(text)
    print("\n" + text)
    return 1 if any(has_finding(r) for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
