#!/usr/bin/env python3
"""The main job (`pytest -n auto`, unfiltered) on a GPU machine, once per FlashInfer release,
with one table last.

    python3 scripts/gpu_runner.py [--wheels DIR] [--release V ...] [--cold-and-warm | --warm-only]
                                  [--vllm PATH ...] [--pair VLLM:RELEASE ...]
                                  [--jit-cache DIR] [--work DIR] [--out DIR] [-- extra pytest args]

--wheels DIR: install each release offline from DIR/common/*.whl (apache-tvm-ffi) and
DIR/<release>/*.whl (`pip install --no-index --no-deps --target`) into a folder of its own, put
it on PYTHONPATH and give the release a JIT cache of its own (FLASHINFER_WORKSPACE_BASE).
Without --wheels the installed FlashInfer runs, labelled "installed". --release defaults to
every release folder in DIR. --cold-and-warm (default): empty the release's JIT cache, run,
then run again on the cache that run left (the cold and the warm wall). --warm-only: one run on
whatever the cache holds (a CI runner that keeps --jit-cache between jobs). In the extra pytest
arguments `{release}` and `{phase}` (cold, warm) are filled in per run, so that every run can
record into a folder of its own: `-- --record-baseline=base/{release}-{phase}`.

--vllm PATH (repeatable): a vLLM wheel, or a folder holding the vllm package (a slice written by
`python3 -m backends.vllm_source slice WHEEL -o DIR`): each FlashInfer release then runs once
per vLLM, with `--vllm=PATH` (the vLLM axis of the table: one row per vLLM x FlashInfer).
--pair 0.33.0:0.7.2.post1 (repeatable) runs only the pairs named, by vLLM and FlashInfer
release. A pair whose vLLM design cannot run on that FlashInfer
(`backends.vllm_source.incompatibility`) is not run: its row names the incompatibility.

Each run's log, junit xml and FlashInfer's JIT build log go to --out (default out/gpu-runner);
the table is printed last and written as table.md and table.json there. Exit status 1 when a
run had failures or errors, when the GPU tier did not run (every test marked gpu skipped), or
when a release could not be installed; 2 for bad arguments.

A kept JIT cache (--jit-cache) skips the nvcc builds only if ninja finds every output up to
date, and ninja rebuilds when (seen with `ninja -d explain` on an H200):
- an input is newer than its output: the headers of the installed package are inputs, and pip
  stamps installed files with the time of installation, so a fresh install rebuilds everything;
- an output's mtime differs from the one in .ninja_deps: touching restored files rebuilds
  everything ("stored deps info out of date");
- the cache or the package sits at another path: .ninja_deps is keyed by absolute path ("deps
  missing") and the build commands change.
So the package folder and the cache keep fixed paths (--work, --jit-cache), every installed file
gets one fixed modification time (INSTALL_MTIME), and a restored cache must keep its mtimes
(tar does; never touch it).

The installed package is compiled to bytecode once, after its mtimes are set, as a plain
`pip install` does: where PYTHONDONTWRITEBYTECODE is set (as on many GPU images) Python never
writes it at import, and every process that imports FlashInfer (each xdist worker, each child
process of the scale and plan-limit cases) would compile the package again.

The runner is also a pytest plugin (`-p gpu_runner`, with this folder on PYTHONPATH): it
marks each test carrying the `gpu` marker with a junit property, so the table can say how
many GPU tests ran.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GPU_PROPERTY = "gpu_runner_marker_gpu"
# One modification time for every installed file (2001-09-09): the same on every run, and
# older than any build output, so ninja keeps a kept cache's outputs.
INSTALL_MTIME = 1_000_000_000
INSTALLED = "installed"


# --- pytest plugin side --------------------------------------------------------------------


def pytest_collection_modifyitems(config, items):
    """Tag the tests marked gpu (junit shows properties, not markers)."""
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.user_properties.append((GPU_PROPERTY, "1"))


# --- junit parsing (pure) ------------------------------------------------------------------


@dataclass
class Counts:
    passed: int = 0
    failed: int = 0
    errors: int = 0
    xfailed: int = 0
    skipped: int = 0
    gpu_ran: int = 0
    gpu_skipped: int = 0
    slowest: list = field(default_factory=list)  # [(seconds, nodeid)], slowest first

    @property
    def total(self) -> int:
        return self.passed + self.failed + self.errors + self.xfailed + self.skipped


def case_outcome(case: ET.Element) -> str:
    """passed, failed, errors, xfailed or skipped for one junit <testcase>."""
    if case.find("failure") is not None:
        return "failed"
    if case.find("error") is not None:
        return "errors"
    skipped = case.find("skipped")
    if skipped is not None:
        return "xfailed" if skipped.get("type") == "pytest.xfail" else "skipped"
    return "passed"


def case_id(case: ET.Element) -> str:
    """classname "tests.gpu.test_x.TestY" and name "test_z[p]" -> "tests/gpu/test_x.py::TestY::test_z[p]"
    as far as the dotted classname allows (module path up to the first part starting with
    test_)."""
    parts = (case.get("classname") or "").split(".")
    name = case.get("name") or "?"
    for i, part in enumerate(parts):
        if part.startswith("test_") or part == "conftest":
            return "::".join(["/".join(parts[: i + 1]) + ".py", *parts[i + 1 :], name])
    return "::".join([p for p in (case.get("classname"), name) if p])


def is_gpu_case(case: ET.Element) -> bool:
    return any(p.get("name") == GPU_PROPERTY for p in case.iter("property"))


def parse_junit(text: str, slowest: int = 3) -> Counts:
    """Counts and the slowest cases (junit time: setup + call + teardown) of a junit xml."""
    root = ET.fromstring(text)
    counts = Counts()
    times = []
    for case in root.iter("testcase"):
        outcome = case_outcome(case)
        setattr(counts, outcome, getattr(counts, outcome) + 1)
        if is_gpu_case(case):
            if outcome == "skipped":
                counts.gpu_skipped += 1
            else:
                counts.gpu_ran += 1
        times.append((float(case.get("time") or 0.0), case_id(case)))
    times.sort(key=lambda t: (-t[0], t[1]))
    counts.slowest = times[:slowest]
    return counts


def jit_builds(lines: list[str], min_seconds: float = 1.0) -> tuple[int, float]:
    """(builds that compiled, their summed seconds) from FLASHINFER_JIT_BUILD_LOG lines; a
    build under min_seconds is ninja finding everything up to date."""
    builds = [json.loads(line) for line in lines if line.strip()]
    real = [b["seconds"] for b in builds if b.get("seconds", 0) >= min_seconds]
    return len(real), round(sum(real), 1)


# --- one run's result, the table (pure) ----------------------------------------------------


@dataclass
class Run:
    release: str
    phase: str  # cold, warm, or why nothing ran ("install failed")
    wall_s: float | None = None
    exit_code: int | None = None
    counts: Counts | None = None
    jit: tuple | None = None  # (builds, seconds) or None where FlashInfer wrote no build log
    log: str = ""
    incompatible: str | None = None  # why the pair was not run (a known incompatibility, not a failure)

    def problem(self) -> str | None:
        """Why this run makes the job fail, or None."""
        if self.incompatible:
            return None
        if self.counts is None:
            return self.phase if self.wall_s is None else f"no junit xml (pytest exit {self.exit_code})"
        c = self.counts
        if c.failed or c.errors:
            return f"{c.failed} failed, {c.errors} errors"
        if c.gpu_ran == 0:
            return "the GPU tier did not run" + (f" ({c.gpu_skipped} gpu tests skipped)" if c.gpu_skipped else "")
        if self.exit_code not in (0, None):
            return f"pytest exit {self.exit_code}"
        return None


def fmt_s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.0f} s"


def table_rows(runs: list[Run]) -> list[dict]:
    """One row per release: the last run's counts (warm when there is one), both walls."""
    rows = {}
    for run in runs:
        row = rows.setdefault(run.release, {"release": run.release, "cold": None, "warm": None, "runs": []})
        row["runs"].append(run)
        if run.phase in ("cold", "warm"):
            row[run.phase] = run.wall_s
    out = []
    for row in rows.values():
        last = next((r for r in reversed(row["runs"]) if r.counts is not None), row["runs"][-1])
        c = last.counts
        problems = [f"{r.phase}: {p}" for r in row["runs"] if (p := r.problem())]
        incompatible = [r.incompatible for r in row["runs"] if r.incompatible]
        jit = [f"{r.phase} {r.jit[0]} ({r.jit[1]:.0f} s)" for r in row["runs"] if r.jit is not None]
        out.append({
            "release": row["release"],
            "passed": c.passed if c else None,
            "failed": c.failed if c else None,
            "errors": c.errors if c else None,
            "xfailed": c.xfailed if c else None,
            "skipped": c.skipped if c else None,
            "gpu_ran": c.gpu_ran if c else None,
            "gpu_total": c.gpu_ran + c.gpu_skipped if c else None,
            "cold_wall_s": row["cold"],
            "warm_wall_s": row["warm"],
            "jit_builds": "; ".join(jit),
            "slowest": [(round(t, 1), n) for t, n in (c.slowest if c else [])],
            "problems": problems,
            "incompatible": incompatible[0] if incompatible else None,
        })
    return out


def markdown_table(rows: list[dict]) -> str:
    head = ["release", "passed", "failed", "errors", "xfailed", "skipped", "gpu ran", "cold wall", "warm wall",
            "jit builds", "slowest cases", "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        def n(key, r=r):
            return "-" if r[key] is None else str(r[key])
        gpu = "-" if r["gpu_total"] is None else f"{r['gpu_ran']}/{r['gpu_total']}"
        slow = ", ".join(f"{name.split('::')[-1][:50]} {t:.1f} s" for t, name in r["slowest"]) or "-"
        status = "; ".join(r["problems"]) or (f"not run: {r['incompatible']}" if r.get("incompatible") else "ok")
        lines.append("| " + " | ".join([r["release"], n("passed"), n("failed"), n("errors"), n("xfailed"), n("skipped"),
                                         gpu, fmt_s(r["cold_wall_s"]), fmt_s(r["warm_wall_s"]),
                                         r["jit_builds"] or "-", slow, status]) + " |")
    return "\n".join(lines)


# --- installing a release ------------------------------------------------------------------


def wheel_files(wheels: Path, release: str) -> list[Path]:
    """DIR/common/*.whl then DIR/<release>/*.whl; ValueError when the release has none."""
    own = sorted((wheels / release).glob("*.whl"))
    if not own:
        raise ValueError(f"no wheel in {wheels / release}")
    return sorted((wheels / "common").glob("*.whl")) + own


def releases_in(wheels: Path) -> list[str]:
    return sorted(p.name for p in wheels.iterdir() if p.is_dir() and p.name != "common" and any(p.glob("*.whl")))


def stamp_of(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for f in files:
        digest.update(f"{f.name}\0{f.stat().st_size}\0".encode())
    return digest.hexdigest()[:16]


def set_mtimes(root: Path, mtime: int = INSTALL_MTIME) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            os.utime(os.path.join(dirpath, name), (mtime, mtime), follow_symlinks=False)


def compile_bytecode(site: Path) -> None:
    """Write the bytecode of every module under site (timestamp pycs: valid while the sources
    keep INSTALL_MTIME). A module that does not compile is left to fail at import, if ever; the
    SyntaxWarnings of the example scripts some wheels ship are not shown."""
    quiet = ["-W", "ignore::SyntaxWarning", "-m", "compileall", "-q", "-q", "-j", "0"]
    subprocess.run([sys.executable, *quiet, str(site)],
                   env=dict(os.environ, PYTHONWARNINGS="ignore::SyntaxWarning"), stdout=subprocess.DEVNULL)


def install(files: list[Path], site: Path) -> None:
    """pip install --no-index --no-deps into site (kept when the same wheels are there already),
    every file stamped with INSTALL_MTIME, then compiled to bytecode."""
    stamp_file = site / ".gpu-runner-stamp"
    stamp = stamp_of(files) + "+pyc"
    if stamp_file.exists() and stamp_file.read_text() == stamp:
        return
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--disable-pip-version-check", "--target", str(site), *map(str, files)],
                   check=True, env=dict(os.environ, PIP_ROOT_USER_ACTION="ignore"))
    set_mtimes(site)
    compile_bytecode(site)
    stamp_file.write_text(stamp)


# --- running -------------------------------------------------------------------------------


def build_pytest_command(junit: Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-n", "auto", "-p", "no:cacheprovider", "-p", "gpu_runner",
            "--require-gpu-tier", f"--junitxml={junit}", "--durations=25", *extra]


def expand_placeholders(extra: list[str], release: str, phase: str) -> list[str]:
    """The extra pytest arguments with ``{release}`` and ``{phase}`` filled in, so that each run
    can write a folder of its own (``--record-baseline=base-{release}-{phase}``)."""
    return [arg.replace("{release}", file_label(release)).replace("{phase}", phase) for arg in extra]


def run_pytest(release: str, phase: str, env: dict, out: Path, extra: list[str], timeout: float) -> Run:
    name = file_label(release)
    junit = out / f"junit-{name}-{phase}.xml"
    log = out / f"log-{name}-{phase}.txt"
    build_log = out / f"jit-{name}-{phase}.jsonl"
    for f in (junit, build_log):
        f.unlink(missing_ok=True)
    table = out / f"flashmla-table-{name}-{phase}.jsonl"
    table.unlink(missing_ok=True)
    env = dict(env, FLASHINFER_JIT_BUILD_LOG=str(build_log), GPU_RUNNER_RUN=f"{name}-{phase}",
               PYTHONUNBUFFERED="1", SPARSE_MLA_FLASHMLA_TABLE=str(table))
    command = build_pytest_command(junit, expand_placeholders(extra, release, phase))
    print(f"=== {release} {phase}: {' '.join(command[1:])}", flush=True)
    started = time.monotonic()
    with open(log, "w") as sink:
        try:
            code = subprocess.run(command, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = 124
    wall = round(time.monotonic() - started, 1)
    counts = parse_junit(junit.read_text(), slowest=3) if junit.exists() else None
    jit = jit_builds(build_log.read_text().splitlines()) if build_log.exists() else None
    tail = log.read_text(errors="replace").splitlines()[-1:] or [""]
    print(f"    {wall:.0f} s, exit {code}: {tail[0][:150]}", flush=True)
    return Run(release, phase, wall, code, counts, jit, str(log))


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheels", type=Path, help="wheel folder: common/*.whl and <release>/*.whl")
    parser.add_argument("--release", action="append", default=[],
                        help="release folder under --wheels (repeatable; default: all)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--cold-and-warm", action="store_true",
                      help="empty JIT cache, then the same cache again (default)")
    mode.add_argument("--warm-only", action="store_true", help="one run on the JIT cache as it is")
    parser.add_argument("--jit-cache", type=Path, help="JIT caches, one folder per release (default: under --work)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "sparse-mla-gpu-runner",
                        help="installed releases (and JIT caches without --jit-cache); keep the path fixed")
    parser.add_argument("--out", type=Path, default=Path("out/gpu-runner"),
                        help="logs, junit xml, table.md, table.json")
    parser.add_argument("--timeout-s", type=float, default=900, help="limit per pytest run")
    parser.add_argument("--vllm", action="append", default=[], metavar="PATH",
                        help="a vLLM wheel or a folder holding the vllm package (repeatable): the vLLM axis")
    parser.add_argument("--pair", action="append", default=[], metavar="VLLM:RELEASE",
                        help="run only these vLLM x FlashInfer pairs (repeatable; default: every pair)")
    args = parser.parse_args(argv)
    if args.pair and not args.vllm:
        parser.error("--pair needs --vllm")
    if args.release and not args.wheels:
        parser.error("--release needs --wheels")
    return args, extra


@dataclass(frozen=True)
class VllmAxis:
    path: str  # what --vllm=PATH gets
    version: str
    design: str


def vllm_axis(paths: list[str]) -> list[VllmAxis | None]:
    """The vLLM entries of the axis (None: no --vllm, the project's own backend alone)."""
    if not paths:
        return [None]
    if str(REPO) not in sys.path:  # run as a script: its own folder is on the path, not the project
        sys.path.insert(0, str(REPO))
    from backends.vllm_source import design_of, resolve

    axis = []
    for path in paths:
        source = resolve(str(Path(path).resolve()))
        axis.append(VllmAxis(str(Path(path).resolve()), source.version, design_of(source)))
    return axis


def release_version(release: str) -> tuple[int, int, int]:
    """A release folder's FlashInfer version; the installed one for ``installed``."""
    from importlib.metadata import version

    text = version("flashinfer-python") if release == INSTALLED else release
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", text)
    if not match:
        raise ValueError(f"cannot read a FlashInfer version from {text!r}")
    return tuple(int(g) for g in match.groups())


def pair_label(release: str, vllm: VllmAxis | None) -> str:
    return release if vllm is None else f"vLLM {vllm.version} on {release}"


def file_label(label: str) -> str:
    """A run label as a file name part."""
    return re.sub(r"[^\w.+-]+", "_", label)


def pair_wanted(release: str, vllm: VllmAxis | None, pairs: list[str]) -> bool:
    return vllm is None or not pairs or f"{vllm.version}:{release}" in pairs


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = args.work.resolve()
    phases = ["warm"] if args.warm_only else ["cold", "warm"]
    base_env = dict(os.environ)
    here = str(Path(__file__).resolve().parent)
    pythonpath = [str(REPO), here] + ([base_env["PYTHONPATH"]] if base_env.get("PYTHONPATH") else [])
    runs: list[Run] = []
    releases = (args.release or releases_in(args.wheels)) if args.wheels else [INSTALLED]
    for release in releases:
        env = dict(base_env)
        cache = (args.jit_cache.resolve() if args.jit_cache else work / "jit") / release
        if args.wheels:
            site = work / "site" / release
            try:
                started = time.monotonic()
                install(wheel_files(args.wheels.resolve(), release), site)
                print(f"=== {release}: installed in {site} ({time.monotonic() - started:.0f} s)", flush=True)
            except (ValueError, OSError, subprocess.CalledProcessError) as exc:
                print(f"=== {release}: install failed: {exc}", flush=True)
                runs.append(Run(release, "install failed"))
                continue
            env["PYTHONPATH"] = os.pathsep.join([str(site), *pythonpath])
            env["FLASHINFER_WORKSPACE_BASE"] = str(cache)
            env.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
        else:
            env["PYTHONPATH"] = os.pathsep.join(pythonpath)
        env["FLASHINFER_WORKSPACE_BASE"] = str(cache)
        for vllm in vllm_axis(args.vllm):
            if not pair_wanted(release, vllm, args.pair):
                continue
            label = pair_label(release, vllm)
            if vllm is not None:
                from backends.vllm_source import incompatibility

                reason = incompatibility(vllm.design, release_version(release))
                if reason:
                    print(f"=== {label}: not run: {reason}", flush=True)
                    runs.append(Run(label, "not run", incompatible=reason))
                    continue
            run_extra = extra if vllm is None else [f"--vllm={vllm.path}", *extra]
            for phase in phases:
                if phase == "cold":
                    shutil.rmtree(cache, ignore_errors=True)
                cache.mkdir(parents=True, exist_ok=True)
                runs.append(run_pytest(label, phase, env, out, run_extra, args.timeout_s))
    rows = table_rows(runs)
    text = markdown_table(rows)
    (out / "table.md").write_text(text + "\n")
    (out / "table.json").write_text(json.dumps({"rows": rows, "runs": [
        {**{k: v for k, v in asdict(r).items() if k != "counts"}, "counts": asdict(r.counts) if r.counts else None}
        for r in runs]}, indent=1, default=str) + "\n")
    print(f"\nlogs, junit xml and JIT build logs: {out}\n")
    print(text)
    return 1 if any(r["problems"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
