"""Mutation testing of the host side of ``fast/`` with mutmut (config: ``[tool.mutmut]`` in
pyproject.toml; needs the ``mutation`` extra):

    python3 -m scripts.mutation [--vllm PATH] [--only GLOB] [--max-children N] [--report-only]
                                [--retest-survivors]

runs ``mutmut run`` over fast/kvlen.py, fast/layouts.py, convert's host functions and
fast/impl.py, and over the adapter that drives vLLM's own backend (backends/vllm/sm90.py and
the schedule read-back, backends/flashinfer/fa3_schedule.py), with the CPU tests that exercise them, then
prints the score (killed among the mutants some test reaches) per area and in all, the mutants
no test reaches, and each survivor with its diff. The adapter's tests need a vLLM
(``--vllm PATH``, handed to pytest through ``PYTEST_ADDOPTS``); without one they skip and its
mutants are not reached. ``--only 'backends.*'`` runs the mutants whose names match. The
survivors that no behaviour tells apart from the code are listed in docs/mutation.md with why.
mutmut keeps its results in ``mutants/`` (ignored by git): a second run re-tests only what changed.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: mutmut's statuses that count as caught by the tests.
CAUGHT = ("killed", "timeout", "segfault", "caught by type check")


def mutmut(*args: str, check: bool = True) -> str:
    """Run one mutmut command in the repository root; its standard output."""
    proc = subprocess.run([sys.executable, "-m", "mutmut", *args], cwd=ROOT, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise SystemExit(f"mutmut {' '.join(args)} exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def statuses(results_text: str) -> dict[str, str]:
    """``mutant name -> status`` from the lines of ``mutmut results --all true``."""
    found = {}
    for line in results_text.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and name:
            found[name] = status
    return found


def survivors(by_status: dict[str, str]) -> list[str]:
    return sorted(name for name, status in by_status.items() if status == "survived")


def score_lines(by_status: dict[str, str], label: str = "mutation score") -> list[str]:
    """The score: mutants caught among those some test reaches, and those no test reaches."""
    counts: dict[str, int] = {}
    for status in by_status.values():
        counts[status] = counts.get(status, 0) + 1
    caught = sum(counts.get(s, 0) for s in CAUGHT)
    survived = counts.get("survived", 0)
    reached = caught + survived
    score = 100.0 * caught / reached if reached else 0.0
    timed_out = counts.get("timeout", 0)
    lines = [f"{label}: {score:.1f} % ({caught} of {reached} mutants reached by a test caught"
             + (f", {timed_out} of them by a timeout" if timed_out else "") + f"; {survived} survived)",
             f"not reached by any test: {counts.get('no tests', 0)}; all mutants: {len(by_status)}"]
    others = {s: n for s, n in counts.items() if s not in (*CAUGHT, "survived", "no tests")}
    if others:
        lines.append("other outcomes: " + ", ".join(f"{s} {n}" for s, n in sorted(others.items())))
    return lines


def by_area(by_status: dict[str, str]) -> dict[str, dict[str, str]]:
    """The statuses per top-level package of the mutated code (``fast``, ``backends``)."""
    areas: dict[str, dict[str, str]] = {}
    for name, status in by_status.items():
        areas.setdefault(name.split(".", 1)[0], {})[name] = status
    return areas


#: Threads of torch's intra-op pools in mutmut's processes. Each mutant's process is forked from a
#: server that has run torch; with pools of several threads, a forked process can park for good on
#: a lock a thread of the server held (a test's torch call waiting on a futex, using no CPU, which
#: mutmut's CPU-time limit never ends and its wall limit counts as a timeout: caught).
MUTANT_THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def pytest_env(vllm: str | None) -> dict[str, str]:
    """The environment of mutmut's run: ``--vllm`` handed to each pytest session it starts, and
    torch's pools of one thread (:data:`MUTANT_THREADS`)."""
    env = dict(os.environ, **MUTANT_THREADS)
    if vllm:
        env["PYTEST_ADDOPTS"] = f"{env.get('PYTEST_ADDOPTS', '')} --vllm={Path(vllm).resolve()}".strip()
    return env


def to_retest(by_status: dict[str, str], survived: bool, timed_out: bool, only: list[str]) -> list[str]:
    """The mutants to run again: those that survived (``survived``) or timed out (``timed_out``),
    of them only those whose names match a glob of ``only`` where it names any."""
    wanted = {"survived"} if survived else set()
    wanted |= {"timeout"} if timed_out else set()
    return sorted(name for name, status in by_status.items()
                  if status in wanted and (not only or any(fnmatch.fnmatchcase(name, glob) for glob in only)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 1, help="mutants tested at once")
    parser.add_argument("--report-only", action="store_true", help="print the last run's results without running")
    parser.add_argument("--no-diffs", action="store_true", help="name the survivors without their diffs")
    parser.add_argument("--retest-survivors", action="store_true",
                        help="run again only the mutants that survived the last run (mutmut keeps a mutant's result "
                             "until its code changes, so new tests reach the survivors only this way)")
    parser.add_argument("--retest-timeouts", action="store_true",
                        help="run again only the mutants that timed out (a timeout counts as caught: a mutant that "
                             "makes a test loop forever; a run whose processes hung for another reason would count "
                             "as caught too)")
    parser.add_argument("--vllm", metavar="PATH", help="the vLLM (wheel, folder or slice) the adapter's tests run "
                                                         "with; without it they skip")
    parser.add_argument("--only", metavar="GLOB", action="append", default=[],
                        help="run only the mutants whose names match (repeatable), e.g. 'backends.*'; with "
                        "--retest-survivors or --retest-timeouts, only those of them")
    args = parser.parse_args(argv)
    if not args.report_only:
        names = list(args.only)
        if args.retest_survivors or args.retest_timeouts:
            found = statuses(mutmut("results", "--all", "true"))
            names = to_retest(found, args.retest_survivors, args.retest_timeouts, args.only)
        proc = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(args.max_children),
                               *names], cwd=ROOT, env=pytest_env(args.vllm))
        if proc.returncode != 0:
            return proc.returncode
    by_status = statuses(mutmut("results", "--all", "true"))
    if not by_status:
        print("no mutmut results: run without --report-only first")
        return 1
    print("\n".join(score_lines(by_status)))
    for area, statuses_of_area in sorted(by_area(by_status).items()):
        print("\n".join(score_lines(statuses_of_area, f"  {area}/")))
    for name in survivors(by_status):
        print(f"\nsurvived: {name}" if args.no_diffs else "\n" + mutmut("show", name).rstrip())
    (ROOT / "mutants" / "score.json").write_text(json.dumps({"statuses": by_status}, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
