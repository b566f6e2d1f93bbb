"""scripts/gpu_runner.py's pure parts: junit parsing, the JIT build log, the table, arguments."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "gpu_runner.py"
_spec = importlib.util.spec_from_file_location("gpu_runner_under_test", _PATH)
runner = sys.modules.setdefault(_spec.name, importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(runner)

GPU = f'<properties><property name="{runner.GPU_PROPERTY}" value="1"/></properties>'
JUNIT = f"""<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="7">
 <testcase classname="tests.cpu.test_a" name="test_ok" time="0.50"/>
 <testcase classname="tests.cpu.test_a" name="test_bad[x]" time="2.25">
  <failure message="assert 0">boom</failure></testcase>
 <testcase classname="tests.cpu.test_a.TestGroup" name="test_err" time="0.10">
  <error message="fixture">e</error></testcase>
 <testcase classname="tests.gpu.test_b" name="test_kernel[1]" time="9.00">{GPU}</testcase>
 <testcase classname="tests.gpu.test_b" name="test_known[2]" time="3.00">{GPU}
  <skipped type="pytest.xfail" message="docs/findings.md#regime-c-packed"/></testcase>
 <testcase classname="tests.gpu.test_b" name="test_skipped" time="0.00">{GPU}
  <skipped type="pytest.skip" message="GPU tier: no GPU"/></testcase>
 <testcase classname="tests.cpu.test_c" name="test_plain_skip" time="0.00">
  <skipped type="pytest.skip" message="x"/></testcase>
</testsuite></testsuites>"""


def test_parse_junit_counts_each_outcome_and_the_gpu_tier():
    c = runner.parse_junit(JUNIT, slowest=2)
    assert (c.passed, c.failed, c.errors, c.xfailed, c.skipped) == (2, 1, 1, 1, 2)
    assert (c.gpu_ran, c.gpu_skipped) == (2, 1)
    assert c.total == 7
    assert c.slowest == [(9.0, "tests/gpu/test_b.py::test_kernel[1]"), (3.0, "tests/gpu/test_b.py::test_known[2]")]


def test_case_id_rebuilds_the_node_id_with_classes():
    c = runner.parse_junit(JUNIT, slowest=7)
    assert "tests/cpu/test_a.py::TestGroup::test_err" in [name for _, name in c.slowest]


def test_jit_builds_counts_only_real_builds():
    lines = [json.dumps({"name": "a", "seconds": 21.5}), json.dumps({"name": "a", "seconds": 0.01}), "",
             json.dumps({"name": "b", "seconds": 19.0})]
    assert runner.jit_builds(lines) == (2, 40.5)
    assert runner.jit_builds([]) == (0, 0)


def _run(phase, wall, text=JUNIT, jit=None, release="0.7.4", code=1):
    return runner.Run(release, phase, wall, code, runner.parse_junit(text) if text else None, jit)


def test_table_has_one_row_per_release_with_both_walls_and_the_problems():
    green = JUNIT.replace('<failure message="assert 0">boom</failure>', "").replace(
        '<error message="fixture">e</error>', ""
    )
    runs = [_run("cold", 118.4, jit=(3, 70.0)), _run("warm", 95.0, green, jit=(0, 0.0), code=0),
            runner.Run("0.6.18.post1", "install failed")]
    rows = runner.table_rows(runs)
    assert [r["release"] for r in rows] == ["0.7.4", "0.6.18.post1"]
    first = rows[0]
    assert (first["cold_wall_s"], first["warm_wall_s"]) == (118.4, 95.0)
    assert (first["passed"], first["failed"], first["gpu_ran"], first["gpu_total"]) == (4, 0, 2, 3)
    assert first["problems"] == ["cold: 1 failed, 1 errors"]
    assert rows[1]["problems"] == ["install failed: install failed"]
    text = runner.markdown_table(rows)
    lines = text.splitlines()
    assert lines[0].startswith("| release | passed | failed |") and len(lines) == 4
    assert "118 s" in lines[2] and "95 s" in lines[2] and "cold 3 (70 s); warm 0 (0 s)" in lines[2]
    assert "| 2/3 |" in lines[2]
    assert lines[3].startswith("| 0.6.18.post1 | - |")


def test_a_run_where_every_gpu_test_skipped_is_a_problem():
    all_skipped = JUNIT.replace(f'{GPU}</testcase>', f'{GPU}<skipped type="pytest.skip" message="no GPU"/></testcase>')
    all_skipped = all_skipped.replace('<failure message="assert 0">boom</failure>', "").replace(
        '<error message="fixture">e</error>', ""
    )
    run = runner.Run("installed", "warm", 10.0, 0, runner.parse_junit(all_skipped))
    assert run.counts.gpu_ran == 1  # the xfailed one ran
    no_gpu = all_skipped.replace('type="pytest.xfail"', 'type="pytest.skip"')
    run = runner.Run("installed", "warm", 10.0, 0, runner.parse_junit(no_gpu))
    assert run.problem() == "the GPU tier did not run (3 gpu tests skipped)"
    assert runner.Run("installed", "warm", 10.0, 4, None).problem() == "no junit xml (pytest exit 4)"


def test_arguments_split_off_the_extra_pytest_args():
    args, extra = runner.parse_args(["--wheels", "w", "--release", "0.7.4", "--warm-only", "--", "-k", "regime", "-x"])
    assert args.wheels == Path("w") and args.release == ["0.7.4"] and args.warm_only
    assert extra == ["-k", "regime", "-x"]
    command = runner.build_pytest_command(Path("j.xml"), extra)
    assert command[1:8] == ["-m", "pytest", "-n", "auto", "-p", "no:cacheprovider", "-p"]
    assert command[-3:] == ["-k", "regime", "-x"]
    assert "--require-gpu-tier" in command, "a GPU runner must not pass as a green run of skips"
    with pytest.raises(SystemExit):
        runner.parse_args(["--release", "0.7.4"])
    with pytest.raises(SystemExit):
        runner.parse_args(["--cold-and-warm", "--warm-only"])


def test_wheel_folders_and_fixed_mtimes(tmp_path):
    for d, name in (("common", "tvm.whl"), ("0.7.4", "fi-0.7.4.whl"), ("0.6.18.post1", "fi-0.6.whl")):
        (tmp_path / d).mkdir()
        (tmp_path / d / name).write_text("x")
    (tmp_path / "empty").mkdir()
    assert runner.releases_in(tmp_path) == ["0.6.18.post1", "0.7.4"]
    assert [f.name for f in runner.wheel_files(tmp_path, "0.7.4")] == ["tvm.whl", "fi-0.7.4.whl"]
    with pytest.raises(ValueError):
        runner.wheel_files(tmp_path, "empty")
    runner.set_mtimes(tmp_path)
    assert {int(os.stat(f).st_mtime) for f in tmp_path.rglob("*.whl")} == {runner.INSTALL_MTIME}


def test_an_installed_module_gets_bytecode_that_stays_valid_at_the_fixed_mtime(tmp_path, monkeypatch):
    """Python checks a timestamp pyc against its source's mtime: ``install`` must write the
    bytecode after it fixes the mtimes, so that imports use it where PYTHONDONTWRITEBYTECODE
    forbids writing. pip is replaced by a stand-in that installs one module."""
    import subprocess

    real_run = subprocess.run

    def run(cmd, **kwargs):
        if cmd[1:3] == ["-m", "pip"]:
            site = Path(cmd[cmd.index("--target") + 1])
            (site / "pkg").mkdir(parents=True)
            (site / "pkg" / "mod.py").write_text("VALUE = 1\n")
            return subprocess.CompletedProcess(cmd, 0)
        return real_run(cmd, **kwargs)

    monkeypatch.setattr(runner.subprocess, "run", run)
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    wheel.write_text("x")
    site = tmp_path / "site"
    runner.install([wheel], site)
    source = site / "pkg" / "mod.py"
    header = Path(importlib.util.cache_from_source(str(source))).read_bytes()[:16]
    assert header[:4] == importlib.util.MAGIC_NUMBER and int.from_bytes(header[4:8], "little") == 0
    assert int.from_bytes(header[8:12], "little") == runner.INSTALL_MTIME == int(source.stat().st_mtime)


def test_extra_arguments_name_a_folder_per_run():
    extra = ["--record-baseline=base/{release}-{phase}", "-k", "not slow"]
    assert runner.expand_placeholders(extra, "0.7.4", "cold") == ["--record-baseline=base/0.7.4-cold", "-k", "not slow"]
    assert runner.expand_placeholders(extra, "0.7.4", "warm")[0] == "--record-baseline=base/0.7.4-warm"


def _axis(version: str, flashmla: bool = False, design: str = "bounded"):
    return runner.VllmAxis(f"/w/vllm-{version}", version, design, flashmla)


MATRIX = {"0.6.18.post1": ("0.30.0",), "0.7.0.post1": ("0.31.0", "0.32.0"), "0.7.4": ("0.33.0", "0.34.0")}


def test_the_matrix_runs_what_does_not_depend_on_vllm_once_per_flashinfer_release():
    """The first vLLM release of each FlashInfer release rides the main job unfiltered; each further
    one gets a session of its vLLM tests alone; FlashMLA is judged in its pair's session only."""
    axis = [_axis("0.30.0", design="exact"), _axis("0.31.0"), _axis("0.32.0"), _axis("0.33.0", flashmla=True),
            _axis("0.34.0", flashmla=True)]
    sessions = runner.matrix_sessions(MATRIX, ("0.33.0", "0.7.4"), axis)
    assert [(s.release, s.vllm.version, s.marks) for s in sessions] == [
        ("0.6.18.post1", "0.30.0", None),
        ("0.7.0.post1", "0.31.0", None),
        ("0.7.0.post1", "0.32.0", "vllm"),
        ("0.7.4", "0.33.0", None),
        ("0.7.4", "0.34.0", "vllm and not flashmla"),
    ]
    assert sessions[2].pytest_args() == ["--vllm=/w/vllm-0.32.0", "-m", "vllm"]
    assert sessions[3].label == "vLLM 0.33.0 + FlashMLA on 0.7.4"
    assert sessions[4].label == "vLLM 0.34.0 on 0.7.4 (-m 'vllm and not flashmla')"
    elsewhere = runner.matrix_sessions({"0.7.2.post1": ("0.33.0",)}, ("0.33.0", "0.7.4"), axis)
    assert elsewhere[0].marks == "not flashmla"
    assert elsewhere[0].label == "vLLM 0.33.0 on 0.7.2.post1 (-m 'not flashmla')"


def test_a_matrix_pair_whose_vllm_was_not_given_fails_the_job():
    sessions = runner.matrix_sessions(MATRIX, ("0.33.0", "0.7.4"), [_axis("0.30.0", design="exact")])
    missing = [s for s in sessions if s.missing]
    assert [(s.release, s.missing) for s in missing] == [("0.7.0.post1", "0.31.0"), ("0.7.0.post1", "0.32.0"),
                                                          ("0.7.4", "0.33.0"), ("0.7.4", "0.34.0")]
    run = runner.not_run(missing[0])
    assert run.problem() == "vLLM 0.31.0 not given (--vllm or DIR/vllm)"
    rows = runner.table_rows([run])
    assert rows[0]["problems"] == ["missing: vLLM 0.31.0 not given (--vllm or DIR/vllm)"]


def test_the_simulated_matrix_runs_each_vllm_release_once_and_the_rest_once_in_all():
    """On the simulated SM90 machine FlashInfer is a stand-in: a vLLM release paired with several
    FlashInfer releases runs once, what does not depend on vLLM runs in the first session only,
    FlashMLA with its pair's release only; every session runs the simulated machine's files
    without the large batches and without asking for a GPU; a release the matrix names and
    nobody gave is missing, and fails the job."""
    matrix = {"0.6.18.post1": ("0.30.0",), "0.7.0.post1": ("0.31.0",), "0.7.2.post1": ("0.33.0",),
              "0.7.4": ("0.33.0", "0.34.0")}
    axis = [_axis("0.33.0", flashmla=True), _axis("0.30.0", design="exact"), _axis("0.34.0", flashmla=True)]
    sessions = runner.simulated_sessions(axis, matrix, "0.33.0")
    assert [(s.vllm.version if s.vllm else None, s.missing, s.marks) for s in sessions] == [
        ("0.30.0", None, "not gpu_large"), (None, "0.31.0", "not gpu_large"),
        ("0.33.0", None, "not gpu_large and vllm"),
        ("0.34.0", None, "not gpu_large and vllm and not flashmla")]
    assert all(s.simulated for s in sessions)
    assert sessions[2].label == "vLLM 0.33.0 + FlashMLA on simulated SM90 (-m 'not gpu_large and vllm')"
    assert sessions[2].pytest_args() == [*runner.SIMULATED_FILES, "--vllm=/w/vllm-0.33.0", "-m",
                                         "not gpu_large and vllm"]
    assert runner.not_run(sessions[1]).problem() == "vLLM 0.31.0 not given (--vllm or DIR/vllm)"
    assert runner.with_incompatibility(sessions[0]) == sessions[0]  # no FlashInfer release to be incompatible with
    command = runner.build_pytest_command(Path("j.xml"), sessions[2].pytest_args(), simulated=True)
    assert "--require-gpu-tier" not in command and command[command.index("tests.simulated_sm90") - 1] == "-p"
    assert "--require-gpu-tier" in runner.build_pytest_command(Path("j.xml"), [])
    first_missing = runner.simulated_sessions([_axis("0.31.0")], {"a": ("0.30.0", "0.31.0")}, "0.33.0")
    assert [s.marks for s in first_missing] == ["not gpu_large", "not gpu_large"]  # the first that runs is in full
    alone = runner.simulated_sessions([_axis("0.33.0", flashmla=True)])
    assert [s.marks for s in alone] == ["not gpu_large"]  # CI's one wheel: everything, FlashMLA included
    without = runner.simulated_sessions([None])
    assert [(s.vllm, s.pytest_args()) for s in without] == [(None, [*runner.SIMULATED_FILES, "-m", "not gpu_large"])]


def test_the_simulated_files_are_the_gpu_tiers():
    root = _PATH.parents[1]
    assert all((root / f).is_file() and f.startswith("tests/gpu/") for f in runner.SIMULATED_FILES)


@pytest.mark.parametrize("argv", [["--simulated", "--release", "0.7.4", "--wheels", "w"],
                                  ["--simulated", "--vllm", "v", "--pair", "0.33.0:0.7.4"],
                                  ["--simulated", "--cold-and-warm"], ["--simulated", "--jit-cache", "j"]])
def test_the_simulated_machine_refuses_what_it_cannot_do(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        runner.parse_args(argv)
    assert exited.value.code == 2
    assert "--simulated installs and builds nothing" in capsys.readouterr().err


def test_a_failed_run_prints_its_failing_tests():
    log = "\n".join(["....F", "FAILED tests/gpu/test_a.py::test_x[p] - AssertionError: regime C row 3",
                     "ERROR tests/gpu/test_b.py::test_y - RuntimeError", "  FAILED inside a message", "1 failed"])
    assert runner.failure_lines(log) == ["FAILED tests/gpu/test_a.py::test_x[p] - AssertionError: regime C row 3",
                                         "ERROR tests/gpu/test_b.py::test_y - RuntimeError"]
    assert runner.failure_lines(log, limit=1) == runner.failure_lines(log)[:1]


def test_sessions_at_once_start_with_the_heaviest():
    axis = [_axis("0.31.0"), _axis("0.32.0"), _axis("0.33.0", flashmla=True), _axis("0.34.0", flashmla=True)]
    sessions = runner.matrix_sessions({"0.7.0.post1": ("0.31.0", "0.32.0"), "0.7.4": ("0.33.0", "0.34.0")},
                                      ("0.33.0", "0.7.4"), axis)
    assert [s.vllm.version for s in runner.heaviest_first(sessions)] == ["0.33.0", "0.31.0", "0.32.0", "0.34.0"]


def test_sessions_at_once_share_the_cores_out():
    assert runner.workers_per_session(1, 16) == "auto"
    assert runner.workers_per_session(2, 16) == "8"
    assert runner.workers_per_session(3, 2) == "1"


def test_every_process_the_runner_starts_keeps_its_bytecode_in_one_cache(tmp_path):
    env = runner.bytecode_env({"PYTHONDONTWRITEBYTECODE": "1", "PATH": "/bin"}, tmp_path)
    assert env == {"PYTHONPYCACHEPREFIX": str(tmp_path / "pycache"), "PATH": "/bin"}


def test_vllm_paths_are_found_in_the_wheel_folder(tmp_path):
    (tmp_path / "vllm" / "0.31.0" / "vllm").mkdir(parents=True)
    wheel = tmp_path / "vllm" / "vllm-0.30.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"")
    (tmp_path / "vllm" / "notes").mkdir()
    assert runner.vllm_paths_in(tmp_path) == [str(tmp_path / "vllm" / "0.31.0"), str(wheel)]
    assert runner.vllm_paths_in(tmp_path / "nothing") == []


def test_the_matrix_is_the_supported_one():
    from backends.flashinfer.compat import RELEASES_READ
    from backends.vllm.source import FLASHMLA_PAIR, SUPPORTED_MATRIX

    assert tuple(SUPPORTED_MATRIX) == RELEASES_READ
    assert FLASHMLA_PAIR[0] in SUPPORTED_MATRIX[FLASHMLA_PAIR[1]]


def test_a_runs_coverage_lines_are_kept_for_the_table():
    log = "\n".join(["x", "rows checked per backend: port-fa3 10 rows in 2 tests", "input space: 4 distinct cases",
                     "E   input space: inside a failure message", "transitions between steps: 8/12 checked",
                     "1 passed in 1.0s"])
    found = runner.coverage_lines(log)
    assert found == {"rows checked per backend": "port-fa3 10 rows in 2 tests", "input space": "4 distinct cases",
                     "transitions between steps": "8/12 checked"}
    run = runner.Run("0.7.4", "warm", 1.0, 0, None, coverage=found)
    section = runner.coverage_section([run]).splitlines()
    assert section[:2] == ["0.7.4 (warm):", "- rows checked per backend: port-fa3 10 rows in 2 tests"]


def test_a_vllm_session_on_a_machine_without_flashinfer_runs_and_lets_its_tests_say_why(monkeypatch):
    """No FlashInfer installed (the simulated SM90 machine, or a broken image): no version to
    judge the pair's incompatibility by, so the session runs (its GPU tier says what stands in or
    why it cannot run), not a traceback of the runner; an installed one is still judged."""
    import importlib.metadata

    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    session = runner.Session(runner.INSTALLED, _axis("0.33.0"))
    monkeypatch.setattr(importlib.metadata, "version", absent)
    assert runner.release_version(runner.INSTALLED) is None
    assert runner.with_incompatibility(session) == session
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.6.18.post1")
    assert "FlashInfer 0.6.18 lacks" in runner.with_incompatibility(session).not_run


def test_a_journey_that_cannot_reach_the_gpu_tier_says_why_instead_of_finding_nothing(tmp_path, monkeypatch):
    """gpu_journeys.py where the GPU tier cannot run (here: no GPU; on a runner: FlashInfer not
    installed): each journey is NOT RUN with pytest's one-line reason, not 'found 0, written 0'."""
    import subprocess

    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_journeys.py"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    done = subprocess.run([sys.executable, str(script), "--out", str(tmp_path), "--workers", "0"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("journey=")]
    assert [r.split()[0] for r in rows] == ["journey=plan", "journey=kernel-input", "journey=stateful"]
    assert all("status=NOT RUN: --require-gpu-tier: the GPU tier cannot run here:" in r for r in rows), rows
