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
`python3 -m backends.vllm.source slice WHEEL -o DIR`): each FlashInfer release then runs once
per vLLM, with `--vllm=PATH` (the vLLM axis of the table: one row per vLLM x FlashInfer).
--pair 0.33.0:0.7.2.post1 (repeatable) runs only the pairs named, by vLLM and FlashInfer
release. A pair whose vLLM design cannot run on that FlashInfer
(`backends.vllm.source.incompatibility`) is not run: its row names the incompatibility.

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

--simulated: the same sessions on the simulated SM90 machine of a CPU-only machine
(tests/simulated_sm90.py: FlashInfer, FlashMLA's kernels and the device are its stand-ins; vLLM's
code, the convert kernels and the tests' own checks and bookkeeping run as on a GPU). Nothing is
installed or built; FlashInfer is not under test there, so the sessions are one per vLLM
release (with --matrix: each vLLM release the supported matrix names, from --vllm and
DIR/vllm), each running SIMULATED_FILES under `-m "not gpu_large"`, the first in full and the
others their vLLM tests alone (what does not depend on vLLM runs once), reported as warm runs. It
is what a development machine without a GPU can show of the matrix command, and CI's
simulated step.

The runner is also a pytest plugin (`-p gpu_runner`, with this folder on PYTHONPATH): it
marks each test carrying the `gpu` marker with a junit property, so the table can say how
many GPU tests ran.
"""

from __future__ import annotations

import argparse
import dataclasses
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
#: The release label of sessions on the simulated SM90 machine (--simulated).
SIMULATED = "simulated SM90"
#: What makes a session run on the simulated SM90 machine: the device its tests use and Triton's
#: interpreter for the convert kernels (read at import), the machine as a plugin.
SIMULATED_ENV = {"SPARSE_MLA_DEVICE": "cpu", "TRITON_INTERPRET": "1"}
SIMULATED_PLUGIN = ["-p", "tests.simulated_sm90"]
#: The GPU tier's files that run on the simulated SM90 machine: vLLM's SM90 backend, FlashMLA's
#: backend, the backends' seam, the length rule over holes and shared MTP rows, residues and
#: strides, plan history and attention state, and the main fa3 tier (every regime and batch
#: situation under the three kv_indices layouts, and the edges: the judge's checks before
#: launch, its bitwise rerun and the port's read-back of its state under the strided and packed
#: layouts). Left out: tests/gpu/test_flashmla_contract.py, which checks the real FlashMLA
#: kernels' own contracts (a stand-in only restates them), and the files that need CUDA itself
#: or whose families the main job's gpu_stand_in tests already run on this machine.
SIMULATED_FILES = ("tests/gpu/test_vllm_sm90.py", "tests/gpu/test_flashmla.py", "tests/gpu/test_backends.py",
                   "tests/gpu/test_topk_holes.py", "tests/gpu/test_shared_mtp_rows.py",
                   "tests/gpu/test_residues_and_strides.py", "tests/gpu/test_plan_history_and_state.py",
                   "tests/gpu/test_attention_regimes.py", "tests/gpu/test_edges.py")
#: The large batches (up to 132 rows, contexts to 128k) are left out there: on 2 cores they add
#: about a quarter to a session, nearly all of it building and packing their caches and computing
#: the references on the CPU; the same code paths run in the other cases (slot ids past 2**23 in
#: the input-space cases).
SIMULATED_MARKS = "not gpu_large"


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
    coverage: dict = field(default_factory=dict)  # the run's coverage lines (coverage_lines)
    incompatible: str | None = None  # why the pair was not run (a known incompatibility, not a failure)
    problem_text: str | None = None  # why the run could not happen (a failure of the job)

    def problem(self) -> str | None:
        """Why this run makes the job fail, or None."""
        if self.incompatible:
            return None
        if self.problem_text:
            return self.problem_text
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


#: The end-of-run lines of the main job that say what a run covered, by their first words.
COVERAGE_LINES = ("rows checked per backend:", "input space:", "transitions between steps:", "vLLM under test:",
                  "attention kernel:")


def coverage_lines(log: str) -> dict[str, str]:
    """The run's coverage lines (:data:`COVERAGE_LINES`) from its output, the last of each kind."""
    found = {}
    for line in log.splitlines():
        for head in COVERAGE_LINES:
            if line.startswith(head):
                found[head.rstrip(":")] = line[len(head):].strip()
    return found


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


def compile_bytecode(site: Path, env: dict | None = None) -> None:
    """Write the bytecode of every module under site (timestamp pycs: valid while the sources
    keep INSTALL_MTIME), into the bytecode cache ``env`` names (``PYTHONPYCACHEPREFIX``) where it
    names one. A module that does not compile is left to fail at import, if ever; the
    SyntaxWarnings of the example scripts some wheels ship are not shown."""
    quiet = ["-W", "ignore::SyntaxWarning", "-m", "compileall", "-q", "-q", "-j", "0"]
    subprocess.run([sys.executable, *quiet, str(site)],
                   env=dict(env or os.environ, PYTHONWARNINGS="ignore::SyntaxWarning"), stdout=subprocess.DEVNULL)


def install(files: list[Path], site: Path, env: dict | None = None) -> None:
    """pip install --no-index --no-deps into site (kept when the same wheels are there already),
    every file stamped with INSTALL_MTIME, then compiled to bytecode (into the cache ``env``'s
    ``PYTHONPYCACHEPREFIX`` names, where it names one)."""
    env = env or dict(os.environ)
    stamp_file = site / ".gpu-runner-stamp"
    stamp = stamp_of(files) + "+pyc" + (f"@{env['PYTHONPYCACHEPREFIX']}" if env.get("PYTHONPYCACHEPREFIX") else "")
    if stamp_file.exists() and stamp_file.read_text() == stamp:
        return
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--disable-pip-version-check", "--target", str(site), *map(str, files)],
                   check=True, env=dict(os.environ, PIP_ROOT_USER_ACTION="ignore"))
    set_mtimes(site)
    compile_bytecode(site, env)
    stamp_file.write_text(stamp)


# --- running -------------------------------------------------------------------------------


def build_pytest_command(junit: Path, extra: list[str], workers: str = "auto", simulated: bool = False) -> list[str]:
    """The session's pytest command: on a GPU machine the GPU tier is required
    (``--require-gpu-tier``); on the simulated machine its plugin stands in for the GPU."""
    machine = SIMULATED_PLUGIN if simulated else ["--require-gpu-tier"]
    return [sys.executable, "-m", "pytest", "-n", workers, "-p", "no:cacheprovider", "-p", "gpu_runner", *machine,
            f"--junitxml={junit}", "--durations=25", *extra]


def failure_lines(log: str, limit: int = 40) -> list[str]:
    """The FAILED and ERROR lines of a run's short test summary, at most ``limit`` of them."""
    return [line for line in log.splitlines() if line.startswith(("FAILED ", "ERROR "))][:limit]


def expand_placeholders(extra: list[str], release: str, phase: str) -> list[str]:
    """The extra pytest arguments with ``{release}`` and ``{phase}`` filled in, so that each run
    can write a folder of its own (``--record-baseline=base-{release}-{phase}``)."""
    return [arg.replace("{release}", file_label(release)).replace("{phase}", phase) for arg in extra]


def run_pytest(release: str, phase: str, env: dict, out: Path, extra: list[str], timeout: float,
               workers: str = "auto", simulated: bool = False) -> Run:
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
    command = build_pytest_command(junit, expand_placeholders(extra, release, phase), workers, simulated)
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
    text = log.read_text(errors="replace")
    tail = text.splitlines()[-1:] or [""]
    print(f"    {release} {phase}: {wall:.0f} s, exit {code}: {tail[0][:150]}", flush=True)
    for line in failure_lines(text) if code else []:
        print(f"      {line[:300]}", flush=True)
    return Run(release, phase, wall, code, counts, jit, str(log), coverage=coverage_lines(text))


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
    parser.add_argument("--matrix", action="store_true",
                        help="the supported vLLM x FlashInfer matrix (backends.vllm.source.SUPPORTED_MATRIX): one "
                        "session per FlashInfer release, each vLLM release after the first in a session of its "
                        "vLLM tests alone; vLLM from --vllm and DIR/vllm")
    parser.add_argument("--simulated", action="store_true",
                        help="the sessions on the simulated SM90 machine of a CPU-only machine: one per vLLM release, "
                        "nothing installed or built")
    parser.add_argument("--jobs", type=int, default=1,
                        help="sessions run at once, the machine's cores shared out among their xdist workers")
    args = parser.parse_args(argv)
    if args.pair and not args.vllm:
        parser.error("--pair needs --vllm")
    if args.release and not args.wheels:
        parser.error("--release needs --wheels")
    if args.matrix and not args.wheels and not args.simulated:
        parser.error("--matrix needs --wheels")
    if args.simulated and (args.release or args.pair or args.jit_cache or args.cold_and_warm):
        parser.error("--simulated installs and builds nothing and takes vLLM releases alone: "
                     "give it without --release, --pair, --jit-cache and --cold-and-warm")
    if args.matrix and args.pair:
        parser.error("--matrix runs every supported pair: give --pair without it")
    if args.jobs < 1:
        parser.error("--jobs takes 1 or more")
    return args, extra


@dataclass(frozen=True)
class VllmAxis:
    path: str  # what --vllm=PATH gets
    version: str
    design: str
    flashmla: bool = False  # the source carries FlashMLA's modules and kernels


def _project_on_path() -> None:
    if str(REPO) not in sys.path:  # run as a script: its own folder is on the path, not the project
        sys.path.insert(0, str(REPO))


def vllm_axis(paths: list[str]) -> list[VllmAxis | None]:
    """The vLLM entries of the axis (None: no --vllm, the project's own backend alone)."""
    if not paths:
        return [None]
    _project_on_path()
    from backends.vllm.source import design_of, missing_flashmla_files, resolve

    axis = []
    for path in paths:
        source = resolve(str(Path(path).resolve()))
        axis.append(VllmAxis(str(Path(path).resolve()), source.version, design_of(source),
                             not missing_flashmla_files(source)))
    return axis


def vllm_paths_in(wheels: Path) -> list[str]:
    """The vLLM wheels and slice folders in ``wheels/vllm`` (none where it is missing)."""
    folder = wheels / "vllm"
    if not folder.is_dir():
        return []
    return [str(p) for p in sorted(folder.iterdir()) if p.suffix == ".whl" or (p / "vllm").is_dir()]


def release_version(release: str) -> tuple[int, int, int] | None:
    """A release folder's FlashInfer version; the installed one for ``installed`` (None where
    none is installed: the run's GPU tier then says what stands in, or why it cannot run)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        text = version("flashinfer-python") if release == INSTALLED else release
    except PackageNotFoundError:
        return None
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", text)
    if not match:
        raise ValueError(f"cannot read a FlashInfer version from {text!r}")
    return tuple(int(g) for g in match.groups())


def file_label(label: str) -> str:
    """A run label as a file name part."""
    return re.sub(r"[^\w.+-]+", "_", label)


def pair_wanted(release: str, vllm: VllmAxis | None, pairs: list[str]) -> bool:
    return vllm is None or not pairs or f"{vllm.version}:{release}" in pairs


# --- sessions (pure) -------------------------------------------------------------------------


@dataclass(frozen=True)
class Session:
    """One pytest session of a run: a FlashInfer release, the vLLM it names (or none), the marker
    expression that narrows it (None: the main job unfiltered) and why it cannot run, if so."""

    release: str
    vllm: VllmAxis | None = None
    marks: str | None = None
    not_run: str | None = None  # a known incompatibility of the pair
    missing: str | None = None  # a pair of the matrix whose vLLM release was not given

    @property
    def judges_flashmla(self) -> bool:
        return self.vllm is not None and self.vllm.flashmla and "not flashmla" not in (self.marks or "")

    @property
    def vllm_tests_alone(self) -> bool:
        return "vllm" in (self.marks or "").split(" and ")

    @property
    def label(self) -> str:
        if self.vllm is None and self.missing is None:
            return self.release
        version = self.vllm.version if self.vllm else self.missing
        flashmla = " + FlashMLA" if self.judges_flashmla else ""
        narrowed = f" (-m '{self.marks}')" if self.marks else ""
        return f"vLLM {version}{flashmla} on {self.release}{narrowed}"

    @property
    def simulated(self) -> bool:
        return self.release == SIMULATED

    def pytest_args(self) -> list[str]:
        args = [] if self.vllm is None else [f"--vllm={self.vllm.path}"]
        files = list(SIMULATED_FILES) if self.simulated else []
        return files + args + (["-m", self.marks] if self.marks else [])


def narrowed(marks: list[str]) -> str | None:
    return " and ".join(marks) or None


def matrix_sessions(matrix: dict[str, tuple[str, ...]], flashmla_pair: tuple[str, str],
                    axis: list[VllmAxis]) -> list[Session]:
    """The sessions of the supported matrix: per FlashInfer release, the main job with its first vLLM
    release, then each further vLLM release in a session of the vLLM tests alone (``-m vllm``),
    so that what does not depend on vLLM runs once per FlashInfer release. FlashMLA is judged in
    the session of ``flashmla_pair`` alone (``not flashmla`` elsewhere). A vLLM release the matrix
    names and ``axis`` lacks is a session that is missing."""
    by_version = {a.version: a for a in axis}
    sessions = []
    for release, versions in matrix.items():
        for i, version in enumerate(versions):
            marks = [] if i == 0 else ["vllm"]
            vllm = by_version.get(version)
            if vllm is None:
                sessions.append(Session(release, marks=narrowed(marks), missing=version))
                continue
            if vllm.flashmla and (version, release) != tuple(flashmla_pair):
                marks.append("not flashmla")
            sessions.append(Session(release, vllm, narrowed(marks)))
    return sessions


def simulated_sessions(axis: list[VllmAxis | None], matrix: dict[str, tuple[str, ...]] | None = None,
                       flashmla_version: str | None = None) -> list[Session]:
    """The sessions on the simulated SM90 machine, the large batches left out of each. FlashInfer is
    a stand-in there, so what does not depend on vLLM runs once, in the first session that runs,
    and each further vLLM gets a session of its vLLM tests alone (``-m vllm``). One per vLLM
    of the axis; with ``matrix``, one per vLLM release it names, in its order (a release paired
    with several FlashInfer releases once), a release ``axis`` lacks a session that is missing,
    and FlashMLA judged with ``flashmla_version`` alone, as in the GPU matrix."""
    if matrix is None:
        wanted = [(a.version if a else None, a) for a in axis]
    else:
        by_version = {a.version: a for a in axis if a is not None}
        wanted = [(v, by_version.get(v)) for v in dict.fromkeys(v for vs in matrix.values() for v in vs)]
    sessions = []
    for version, vllm in wanted:
        if vllm is None and matrix is not None:
            sessions.append(Session(SIMULATED, marks=SIMULATED_MARKS, missing=version))
            continue
        marks = [SIMULATED_MARKS] + (["vllm"] if any(not s.missing for s in sessions) else [])
        if vllm is not None and vllm.flashmla and matrix is not None and version != flashmla_version:
            marks.append("not flashmla")
        sessions.append(Session(SIMULATED, vllm, narrowed(marks)))
    return sessions


def pair_sessions(release: str, axis: list[VllmAxis | None], pairs: list[str]) -> list[Session]:
    """Without --matrix: the main job unfiltered once per vLLM of the axis (or once, without one)."""
    return [Session(release, vllm) for vllm in axis if pair_wanted(release, vllm, pairs)]


def heaviest_first(sessions: list[Session]) -> list[Session]:
    """The order sessions start in when several run at once: the one judging FlashMLA first, then
    the main jobs, then the sessions of vLLM tests alone (the last to start should end soonest)."""
    return sorted(sessions, key=lambda s: (not s.judges_flashmla, s.vllm_tests_alone))


def workers_per_session(jobs: int, cores: int | None = None) -> str:
    """xdist's -n for each of ``jobs`` sessions at once: ``auto`` alone, else the cores shared out."""
    if jobs == 1:
        return "auto"
    return str(max(1, (cores or os.cpu_count() or 1) // jobs))


# --- installing, building, running ----------------------------------------------------------


def bytecode_env(env: dict, work: Path) -> dict:
    """Every process the runner starts (the sessions, their xdist workers, the children their tests
    start) reads and writes compiled bytecode in one cache under ``work``
    (``PYTHONPYCACHEPREFIX``): where a machine sets ``PYTHONDONTWRITEBYTECODE`` and its image ships
    torch without bytecode, each process would otherwise compile torch, the project and its test
    modules afresh."""
    env = dict(env, PYTHONPYCACHEPREFIX=str(work / "pycache"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def prebuild(releases: dict[str, dict], out: Path, phase: str) -> float:
    """Every kernel variant of every release built (or found built) at once, one
    ``python3 -m harness.port.prebuild --parallel --only-missing`` per release, each in its release's
    environment; their output to ``out/prebuild-<release>-<phase>.txt``. The wall of all."""
    started = time.monotonic()
    children = []
    for release, env in releases.items():
        sink = open(out / f"prebuild-{file_label(release)}-{phase}.txt", "w")  # closed once the child ends
        children.append((release, sink, subprocess.Popen(
            [sys.executable, "-m", "harness.port.prebuild", "--parallel", "--only-missing"], cwd=REPO, env=env,
            stdout=sink, stderr=subprocess.STDOUT)))
    for release, sink, child in children:
        code = child.wait()
        sink.close()
        if code not in (0, 2):  # 2: nothing can be built here (the tests then say why)
            print(f"=== {release} {phase}: the prebuild exited {code} (see {sink.name})", flush=True)
    wall = round(time.monotonic() - started, 1)
    print(f"=== {phase}: kernel builds of {len(releases)} release(s) at once: {wall:.0f} s", flush=True)
    return wall


def run_sessions(sessions: list[Session], envs: dict[str, dict], phase: str, out: Path, extra: list[str],
                 timeout: float, jobs: int) -> list[Run]:
    """Each runnable session of ``sessions`` in this phase, ``jobs`` at a time, in order."""
    from concurrent.futures import ThreadPoolExecutor

    workers = workers_per_session(jobs)

    def one(session: Session) -> Run:
        return run_pytest(session.label, phase, envs[session.release], out, [*session.pytest_args(), *extra],
                          timeout, workers, session.simulated)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        done = dict(zip(heaviest_first(sessions), pool.map(one, heaviest_first(sessions)), strict=True))
    return [done[s] for s in sessions]


def not_run(session: Session) -> Run:
    if session.missing:
        return Run(session.label, "missing", problem_text=f"vLLM {session.missing} not given (--vllm or DIR/vllm)")
    return Run(session.label, "not run", incompatible=session.not_run)


def with_incompatibility(session: Session) -> Session:
    if session.vllm is None or session.simulated:
        return session
    _project_on_path()
    from backends.vllm.source import incompatibility

    version = release_version(session.release)
    reason = incompatibility(session.vllm.design, version) if version is not None else None
    return dataclasses.replace(session, not_run=reason) if reason else session


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = args.work.resolve()
    phases = ["warm"] if args.warm_only or args.simulated else ["cold", "warm"]
    # bytecode in one cache of the runner's: for GPU images that do not write it (bytecode_env)
    base_env = dict(os.environ, **SIMULATED_ENV) if args.simulated else bytecode_env(dict(os.environ), work)
    here = str(Path(__file__).resolve().parent)
    pythonpath = [str(REPO), here] + ([base_env["PYTHONPATH"]] if base_env.get("PYTHONPATH") else [])
    runs: list[Run] = []
    if args.simulated:
        _project_on_path()
        from backends.vllm.source import FLASHMLA_PAIR, SUPPORTED_MATRIX

        releases = [SIMULATED]
        given = args.vllm + (vllm_paths_in(args.wheels.resolve()) if args.wheels else [])
        sessions = simulated_sessions(vllm_axis(given), SUPPORTED_MATRIX if args.matrix else None, FLASHMLA_PAIR[0])
    elif args.matrix:
        _project_on_path()
        from backends.vllm.source import FLASHMLA_PAIR, SUPPORTED_MATRIX

        releases = list(SUPPORTED_MATRIX)
        axis = [a for a in vllm_axis(args.vllm + vllm_paths_in(args.wheels.resolve())) if a is not None]
        sessions = matrix_sessions(SUPPORTED_MATRIX, FLASHMLA_PAIR, axis)
    else:
        releases = (args.release or releases_in(args.wheels)) if args.wheels else [INSTALLED]
        axis = vllm_axis(args.vllm)
        sessions = [s for release in releases for s in pair_sessions(release, axis, args.pair)]
    envs: dict[str, dict] = {}
    caches: dict[str, Path] = {}
    for release in releases:
        env = dict(base_env)
        if args.wheels and not args.simulated:
            site = work / "site" / release
            try:
                started = time.monotonic()
                install(wheel_files(args.wheels.resolve(), release), site, env)
                print(f"=== {release}: installed in {site} ({time.monotonic() - started:.0f} s)", flush=True)
            except (ValueError, OSError, subprocess.CalledProcessError) as exc:
                print(f"=== {release}: install failed: {exc}", flush=True)
                runs.append(Run(release, "install failed"))
                continue
            env["PYTHONPATH"] = os.pathsep.join([str(site), *pythonpath])
            env.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
        else:
            env["PYTHONPATH"] = os.pathsep.join(pythonpath)
        if not args.simulated:  # the simulated machine builds nothing
            cache = (args.jit_cache.resolve() if args.jit_cache else work / "jit") / release
            env["FLASHINFER_WORKSPACE_BASE"] = str(cache)
            caches[release] = cache
        envs[release] = env
    sessions = [with_incompatibility(s) for s in sessions if s.release in envs]
    runnable = [s for s in sessions if not (s.missing or s.not_run)]
    for session in sessions:
        if session.missing or session.not_run:
            print(f"=== {session.label}: not run: {session.not_run or 'vLLM ' + session.missing + ' not given'}",
                  flush=True)
            runs.append(not_run(session))
    building = {r: envs[r] for r in dict.fromkeys(s.release for s in runnable) if r in caches}
    walls: dict[str, dict] = {}
    for phase in phases:
        started = time.monotonic()
        if phase == "cold":
            for release in building:
                shutil.rmtree(caches[release], ignore_errors=True)
        for release in building:
            caches[release].mkdir(parents=True, exist_ok=True)
        builds = prebuild(building, out, phase) if building and args.wheels else None
        runs += run_sessions(runnable, envs, phase, out, extra, args.timeout_s, args.jobs)
        walls[phase] = {"builds_s": builds, "wall_s": round(time.monotonic() - started, 1)}
        print(f"=== {phase}: {len(runnable)} session(s) in {walls[phase]['wall_s']:.0f} s"
              + (f" (builds {builds:.0f} s)" if builds is not None else ""), flush=True)
    rows = table_rows(runs)
    text = markdown_table(rows) + "\n\n" + phase_lines(walls) + "\n\n" + coverage_section(runs)
    (out / "table.md").write_text(text + "\n")
    (out / "table.json").write_text(json.dumps({"rows": rows, "phases": walls, "runs": [
        {**{k: v for k, v in asdict(r).items() if k != "counts"}, "counts": asdict(r.counts) if r.counts else None}
        for r in runs]}, indent=1, default=str) + "\n")
    print(f"\nlogs, junit xml and JIT build logs: {out}\n")
    print(text)
    return 1 if any(r["problems"] for r in rows) else 0


def coverage_section(runs: list[Run]) -> str:
    """Per run that reported them, its coverage lines."""
    lines = []
    for run in runs:
        if run.coverage:
            lines.append(f"{run.release} ({run.phase}):")
            lines += [f"- {head}: {text}" for head, text in run.coverage.items()]
    return "\n".join(lines)


def phase_lines(walls: dict[str, dict]) -> str:
    """One line per phase: its wall from the start of its builds to the end of its last session."""
    return "\n".join(f"{phase}: {fmt_s(w['wall_s'])} in all" + (f", of which kernel builds {fmt_s(w['builds_s'])}"
                                                                if w["builds_s"] is not None else "")
                     for phase, w in walls.items())


if __name__ == "__main__":
    sys.exit(main())
