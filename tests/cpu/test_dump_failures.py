"""``--dump-failures``: a wrong implementation through ``--impl`` makes differential tests fail;
each failing case writes one fixture (whether or not the test armed ``failure_dump``), its
failure message ends with the command that replays it, and replaying the file fails on the
same rows."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from recording.commands import found_through_pythonpath, replay_command
from recording.fixture import load_fixture
from recording.recipe import load_recipe, rebuild_fixture
from recording.replay import replay
from recording.repro import main as repro_main
from tests import simulated_sm90
from tests.bugs import KpoolFromWrongSpec

ROOT = Path(__file__).resolve().parents[2]
REPLAY_LINE = re.compile(r"^replay: pytest --replay=(\S+)(?: --impl (\S+))?$")


def run_pytest(pytester, *args: str):
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "--rootdir", str(ROOT), *args)


def failure_blocks(lines: list[str]) -> dict[str, list[str]]:
    """The failure section of each failing test: its name -> its lines."""
    blocks: dict[str, list[str]] = {}
    current = None
    for line in lines:
        head = re.match(r"^_{3,} (test_\S+) _{3,}$", line)
        if head:
            current = blocks.setdefault(head.group(1), [])
        elif re.match(r"^={3,}", line):
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def test_a_wrong_kv_len_rule_writes_one_fixture_per_failing_case(pytester, tmp_path, device):
    dump = tmp_path / "dumps"
    result = run_pytest(pytester, str(ROOT / "tests/cpu/test_kvlen_regimes.py"), "--impl=tests.bugs:KpoolFromWrongSpec",
                        "-k", "test_kv_len_equals_valid_count and (ctx2049 or ctx4097 or decode-mixed or ctx5-kpool4)",
                        f"--dump-failures={dump}")
    out = result.outlines
    failed = result.parseoutcomes().get("failed", 0)
    assert result.ret == 1 and failed >= 3, "\n".join(out[-30:])
    files = sorted([*dump.glob("*.safetensors"), *dump.glob("*.recipe.json")])
    assert len(files) == failed, "\n".join(out[-30:])
    # the run ends saying what was written and what writing and shrinking cost, apart from the tests
    total = sum(f.stat().st_size for f in files) / 1e6
    summary = [line for line in out if line.startswith(f"--dump-failures={dump}: ")]
    assert len(summary) == 1 and summary[0].startswith(
        f"--dump-failures={dump}: {failed} failing cases written ({total:.1f} MB); writing and shrinking took "
    ), "\n".join(out[-30:])
    blocks = failure_blocks(out)
    assert len(blocks) == failed
    for name, block in blocks.items():
        last = [line for line in block if line.strip()][-1]
        match = REPLAY_LINE.match(last)
        assert match and match.group(2) == "tests.bugs:KpoolFromWrongSpec", f"{name}: the message ends with {last!r}"
        written = [line for line in block if line.startswith(f"failing case written to {match.group(1)} (")]
        assert len(written) == 1 and re.search(r"\(\d+ KB, written and shrunk in [\d.]+ s\)$", written[0]), block
        rows = sorted({int(r) for r in re.findall(r"^E\s+row (\d+): regime", "\n".join(block), re.M)})
        if match.group(1).endswith(".recipe.json"):
            recipe = load_recipe(match.group(1))
            assert recipe["impl"] == "tests.bugs:KpoolFromWrongSpec" and recipe["nodeid"].endswith(name)
            fx = rebuild_fixture(match.group(1), recipe, KpoolFromWrongSpec(), device)
        else:
            fx = load_fixture(match.group(1))
        original = fx.meta.get("rows") or list(range(fx.num_rows))  # the fixture's rows in the failing batch
        assert fx.meta["impl"] == "tests.bugs:KpoolFromWrongSpec" and fx.meta["nodeid"].endswith(name)
        report = replay(fx)
        failing = [original[r] for r in report.plan_mismatch_rows]
        assert rows and failing and set(failing) <= set(rows), f"{name}: replay fails on {failing}, the test on {rows}"
        assert "plan != intent" in report.failures()


def test_passing_cases_and_runs_without_the_option_write_nothing(pytester, tmp_path):
    dump = tmp_path / "dumps"
    result = run_pytest(
        pytester,
        str(ROOT / "tests/cpu/test_kvlen_regimes.py"),
        "-k",
        "test_kv_len_equals_valid_count and ctx2049",
        f"--dump-failures={dump}",
    )
    assert result.ret == 0, "\n".join(result.outlines[-20:])
    assert not dump.exists()
    assert f"--dump-failures={dump}: no failing case written" in result.outlines, "\n".join(result.outlines[-20:])
    result = run_pytest(pytester, str(ROOT / "tests/cpu/test_kvlen_regimes.py"), "--impl=tests.bugs:KpoolFromWrongSpec",
                        "-k", "test_kv_len_equals_valid_count and ctx2049")
    assert result.ret == 1 and not any("replay: pytest --replay" in line for line in result.outlines)


def test_the_dump_summary_tells_written_unwritable_and_nothing_to_write_apart():
    from pytest_sparse_mla.replay import dump_summary_lines

    dumps = [
        {"nodeid": "tests/x.py::test_a[big]", "path": "D/a.safetensors", "problem": None, "bytes": 2_500_000,
         "seconds": 41.0},
        {"nodeid": "tests/x.py::test_b", "path": "D/b.recipe.json", "problem": None, "bytes": 1_500, "seconds": 0.2},
        {"nodeid": "tests/x.py::test_c", "path": None, "problem": "could not write ...: OSError()", "bytes": 0,
         "seconds": 0.1},
        {"nodeid": "tests/x.py::test_limits", "path": None, "problem": None, "nothing": "it noted no case",
         "bytes": 0, "seconds": 0.0},
    ]
    assert dump_summary_lines("D", dumps) == [
        "--dump-failures=D: 2 failing cases written (2.5 MB); writing and shrinking took 41.3 s after the tests' "
        "own time (longest: test_a[big], 41.0 s)",
        "  1 failing cases could not be written (their failure messages say why)",
        "  nothing written for test_limits: it noted no case",
    ]
    assert dump_summary_lines("D", []) == ["--dump-failures=D: no failing case written"]


# --- the CPU journey: dump, shrink, replay with and without the bug, standalone reproducer ---

MAX_FIXTURE_BYTES = 2_000_000
MAX_DUMP_BYTES = 20_000_000
PROJECT_MODULES = {
    "fast",
    "harness",
    "recording",
    "reference",
    "pytest_sparse_mla",
    "mla_constants",
    "scripts",
    "bench",
    "tests",
}


def imported_modules(source: str) -> set[str]:
    """Top-level names of every module a script imports (parsed, never run)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a relative import"
            names.add(node.module.split(".")[0])
    return names


def test_cpu_journey_dump_shrink_replay_and_a_reproducer_of_nothing_of_the_project(pytester, tmp_path):
    dump = tmp_path / "dumps"
    bug = "--impl=tests.bugs:CompactionPlansPrefix"
    select = "test_plan_reads_the_intended_slots and compacted and kpool4 and (ctx3 or ctx5 or decode-mixed)"
    result = run_pytest(
        pytester, str(ROOT / "tests/cpu/test_kvlen_regimes.py"), bug, "-k", select, f"--dump-failures={dump}"
    )
    failed = result.parseoutcomes().get("failed", 0)
    assert result.ret == 1 and failed >= 3, "\n".join(result.outlines[-30:])
    fixtures = sorted(dump.glob("*.safetensors"))
    assert len(fixtures) == failed, sorted(p.name for p in dump.iterdir())
    total = sum(p.stat().st_size for p in dump.iterdir())
    assert total <= MAX_DUMP_BYTES, f"the dump folder holds {total} bytes"
    for path in fixtures:
        fx = load_fixture(path)
        shrunk = fx.meta["shrunk"]
        assert path.stat().st_size <= MAX_FIXTURE_BYTES, f"{path.name}: {path.stat().st_size} bytes"
        assert shrunk["check"] == ["plan != intent"] and shrunk["candidates_tried"] >= 1, shrunk
        assert shrunk["to"]["bytes"] < shrunk["from"]["bytes"] and shrunk["to"]["rows"] <= shrunk["from"]["rows"], (
            shrunk
        )
        assert fx.num_rows == shrunk["to"]["rows"] and set(fx.meta["regimes"]) == {"C"}, fx.meta["regimes"]
        repro = path.with_name(path.name.removesuffix(".safetensors") + ".repro.py")
        extra = imported_modules(repro.read_text()) - set(sys.stdlib_module_names)
        assert extra <= {"torch", "flashinfer", "safetensors"} and not extra & PROJECT_MODULES, (
            f"{repro.name} imports {extra}"
        )
    # Replayed on this machine, the host stages run through the implementation under test:
    # the bug fails every fixture, the fixed code passes them all. The command each failure
    # printed is run as printed: it carries the implementation the case failed under.
    printed = [line.removeprefix("replay: ") for line in result.outlines if line.startswith("replay: ")]
    assert len(printed) == failed and all(line.endswith(" --impl tests.bugs:CompactionPlansPrefix") for line in printed)
    words = shlex.split(printed[0])
    assert words[0] == "pytest"
    result = run_pytest(pytester, str(ROOT / "tests"), *words[1:])
    out = "\n".join(result.outlines)
    assert result.ret == 1 and "1 failed" in out and "plan != intent" in out, out[-3000:]
    assert f"reproduce: {printed[0]} -p no:xdist -rA" in out, out[-3000:]
    result = run_pytest(pytester, str(ROOT / "tests"), f"--replay={dump}", bug)
    out = "\n".join(result.outlines)
    assert result.ret == 1 and f"{failed} failed" in out and "plan != intent" in out, out[-3000:]
    result = run_pytest(pytester, str(ROOT / "tests"), f"--replay={dump}")
    assert result.ret == 0 and f"{failed} passed" in "\n".join(result.outlines), "\n".join(result.outlines[-30:])


# A stand-in FlashInfer package for the reproducer, in the call forms of 0.6.18.post1 (flat) and
# 0.7.4 (canonical): plans like FlashInfer under CUDA graphs and computes each row over the
# slots its span reads in float32 (base-2 LSE unless asked for natural log).
FAKE_MLA = """
import math
import torch

{extra}


class BatchMLAPagedAttentionWrapper:
    def __init__(self, workspace, use_cuda_graph=False, qo_indptr=None, kv_indptr=None, kv_indices=None,
                 kv_len_arr=None, backend="auto"):
        assert backend == "fa3" and use_cuda_graph
        self.kv_indices = kv_indices

    def _plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
              causal, sm_scale, q_data_type, kv_data_type, lse_mode="base2"):
        assert page_size == 1 and not causal and kv_indices is self.kv_indices
        self.plan_args = (kv_indptr.clone(), kv_len_arr.clone(), float(sm_scale), lse_mode)

    def _run(self, q_nope, q_pe, ckv, kpe, out, lse, return_lse, base_e, ckv_scale=None, kpe_scale=None):
        indptr, lens, sm_scale, lse_mode = self.plan_args
        scale = 1.0 if ckv_scale is None else ckv_scale
        kv, kp = ckv[:, 0].float() * scale, kpe[:, 0].float() * scale
        for r in range(q_nope.shape[0]):
            idx = self.kv_indices[int(indptr[r]): int(indptr[r]) + int(lens[r])].long()
            s = (q_nope[r].float() @ kv[idx].T + q_pe[r].float() @ kp[idx].T) * sm_scale
            out[r] = (torch.softmax(s, -1) @ kv[idx] + OUT_OFFSET).to(out.dtype)
            lse[r] = torch.logsumexp(s, -1) / (1.0 if base_e or lse_mode == "basee" else math.log(2.0))
"""
FLAT = """
    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type, kv_data_type, use_profiler=False):
        self._plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
                   causal, sm_scale, q_data_type, kv_data_type)

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False, profiler_buffer=None,
            kv_len=None, page_table=None, ckv_scale=None, kpe_scale=None):
        self._run(q_nope, q_pe, ckv_cache, kpe_cache, out, lse, return_lse, False, ckv_scale, kpe_scale)
"""
CANONICAL = """
    def plan(self, metadata=None, *, query_layout, kv_cache_layout, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type, kv_data_type, lse_mode="base2"):
        assert query_layout == kv_cache_layout == "split"
        self._plan(*metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, q_data_type,
                   kv_data_type, lse_mode)

    def run(self, query=None, kv_cache=None, *, out=None, lse=None, return_lse=False, return_lse_base_on_e=False,
            ckv_scale=None, kpe_scale=None):
        self._run(*query, *kv_cache, out, lse, return_lse, return_lse_base_on_e, ckv_scale, kpe_scale)
"""
METADATA = '''
class MLAPlanMetadata(tuple):
    @classmethod
    def csr(cls, qo_indptr, kv_indptr, kv_indices, kv_len_arr):
        return cls((qo_indptr, kv_indptr, kv_indices, kv_len_arr))
'''


def fake_flashinfer(root: Path, version: str, out_offset: float = 0.0) -> Path:
    """The stand-in FlashInfer of ``version``; ``out_offset`` added to every output element
    makes it a FlashInfer whose output is wrong."""
    canonical = version.startswith("0.7")
    package = root / f"{version}-{out_offset}" / "flashinfer"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"__version__ = {version!r}\n")
    extra = f"OUT_OFFSET = {out_offset!r}\n" + (METADATA if canonical else "")
    text = FAKE_MLA.replace("{extra}", extra) + (CANONICAL if canonical else FLAT)
    (package / "mla.py").write_text(text)
    return package.parent


#: Runs each reproducer in turn in one process of its own (one torch start for all), each with
#: its stand-in FlashInfer first on the path and none of the project: the exit status and output
#: of each, as JSON.
REPRO_DRIVER = """
import contextlib, io, json, runpy, sys
results = []
for script, flashinfer_root in json.loads(sys.argv[1]):
    sys.path.insert(0, flashinfer_root)
    for name in [m for m in sys.modules if m == "flashinfer" or m.startswith("flashinfer.")]:
        del sys.modules[name]
    sys.argv = [script]
    text = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    sys.path.remove(flashinfer_root)
    results.append({"code": code, "text": text.getvalue()})
print("RESULTS " + json.dumps(results))
"""

REPRO_CASES = [
    # the regime C finding: the packed plan reads an invalid entry, the caller's bug (exit 3), not FlashInfer's
    ("c-packed-finding-bf16", "0.6.18.post1", 3),
    ("c-compacted-fp8", "0.7.4", 0),
]


def test_the_reproducer_runs_each_call_form_with_nothing_of_the_project(tmp_path, capsys):
    """Each release's call form (flat on 0.6, canonical on 0.7) through a stand-in FlashInfer of
    that release, from an empty folder without the project on the path: the regime C finding
    fails, a good fixture passes. Both run in one child process, the stand-in swapped between."""
    runs = []
    for fixture, version, _ in REPRO_CASES:
        out = tmp_path / "repro"
        assert repro_main([str(ROOT / "fixtures" / f"{fixture}.safetensors"), "-o", str(out)]) == 0
        script = out / f"{fixture}.repro.py"
        assert f"run: python3 {script}" in capsys.readouterr().out
        assert imported_modules(script.read_text()) - set(sys.stdlib_module_names) <= {
            "torch", "flashinfer", "safetensors"
        }
        runs.append((str(script), str(fake_flashinfer(tmp_path, version))))
    # Run from an empty folder with only the stand-in FlashInfer added: the project is not on the path.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(REPRO_DEVICE="cpu", PYTHONSAFEPATH="1")
    run = subprocess.run([sys.executable, "-c", REPRO_DRIVER, json.dumps(runs)], capture_output=True, text=True,
                         cwd=tmp_path, env=env)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULTS ")]
    assert run.returncode == 0 and lines, run.stdout + run.stderr
    for (fixture, version, verdict), result in zip(REPRO_CASES, json.loads(lines[-1][8:]), strict=True):
        text = result["text"]
        assert result["code"] == verdict, f"{fixture} on {version}:\n{text}"
        assert f"flashinfer {version} ({'canonical' if version.startswith('0.7') else 'flat'} plan" in text, text
        if verdict:
            assert "FAIL (the caller's plan): the plan is not the intended selection on rows [0, 1, 2]" in text, text
            assert "regime C" in text and "invalid (-1, read as NaN)" in text and "FlashInfer)" not in text, text
        else:
            assert "PASS: the plan is the intended selection and FlashInfer is within the error budget" in text, text


def run_reproducers(tmp_path: Path, runs: list[tuple[str, str]]) -> list[dict]:
    """Each (script, stand-in FlashInfer folder) run from an empty folder without the project on
    the path: its exit status and output."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(REPRO_DEVICE="cpu", PYTHONSAFEPATH="1")
    run = subprocess.run([sys.executable, "-c", REPRO_DRIVER, json.dumps(runs)], capture_output=True, text=True,
                         cwd=tmp_path, env=env)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULTS ")]
    assert run.returncode == 0 and lines, run.stdout + run.stderr
    return json.loads(lines[-1][8:])


def test_the_reproducer_tells_the_callers_plan_from_flashinfers_output(tmp_path, device):
    """A plan that reads valid slots other than the intended ones (kv_len short by ctx % kpool)
    run on a right FlashInfer is the caller's bug (exit 3): the kernel is judged on the slots it
    was given, so it is not blamed. A FlashInfer whose output is off fails as FlashInfer's
    (exit 1), on a right plan and on the wrong one. The script's docstring names the command
    that replays the fixture through the implementation it was recorded with."""
    from fast.impl import default_impl
    from harness.pipeline import prepare_step
    from harness.scenario import batch, build_attention_inputs, build_scenario
    from recording.case_log import fixture_from_step
    from recording.fixture import save_fixture
    from recording.repro import write_repro

    scripts = {}
    for name, impl in (("short", KpoolFromWrongSpec()), ("right", None)):
        scenario = build_scenario(batch((2049 + 2, 1), (5, 1), kpool=4, topk=2048), 11)
        step = prepare_step(impl or default_impl(), scenario, "compacted", device)
        fx = fixture_from_step(step, build_attention_inputs(scenario), name=name,
                               impl="tests.bugs:KpoolFromWrongSpec" if impl else None)
        path = save_fixture(tmp_path / f"{name}.safetensors", fx)
        scripts[name] = str(write_repro(fx, path))
    assert "pytest --replay=short.safetensors --impl tests.bugs:KpoolFromWrongSpec" in Path(
        scripts["short"]).read_text()
    assert "pytest --replay=right.safetensors\n" in Path(scripts["right"]).read_text()
    right = str(fake_flashinfer(tmp_path, "0.7.4"))
    off = str(fake_flashinfer(tmp_path, "0.7.4", out_offset=0.25))
    cases = [("short", right, 3), ("right", right, 0), ("right", off, 1), ("short", off, 1)]
    results = run_reproducers(tmp_path, [(scripts[name], fi) for name, fi, _ in cases])
    for (name, fi, verdict), result in zip(cases, results, strict=True):
        text = result["text"]
        assert result["code"] == verdict, f"{name} on {fi}:\n{text}"
        if verdict == 3:
            assert "FAIL (the caller's plan): the plan is not the intended selection on rows [0]" in text, text
            assert "planned 2048 slots, 0 of them invalid" in text and "intended 2051" in text, text
            assert "out: max err" in text and "OVER BUDGET" not in text, text
        if verdict == 1:
            assert "FAIL (FlashInfer): FlashInfer's output differs from the float64 reference of the slots it was " \
                   "given" in text and "OVER BUDGET" in text, text
            assert ("the plan is also not the intended selection on rows [0]" in text) == (name == "short"), text


def test_the_printed_commands_carry_the_implementation_and_vllm_of_the_run():

    assert replay_command("D/a b.safetensors") == "pytest --replay='D/a b.safetensors'"
    assert replay_command("D", "fast.impl:default_impl") == "pytest --replay=D"
    assert replay_command("D", "tests.bugs:ContextIsPosition", "/w/vllm-0.33.whl") == (
        "pytest --replay=D --impl tests.bugs:ContextIsPosition --vllm=/w/vllm-0.33.whl")


def test_an_implementation_that_kills_its_process_fails_one_test_and_leaves_a_recipe(pytester, tmp_path):
    dump = tmp_path / "dumps"
    crash = "--impl=tests.bugs:ConvertReadsTheTableOfInvalidEntries"
    # In process: were the stages not run apart, the segfault would end this very test run.
    result = run_pytest(
        pytester, str(ROOT / "tests/cpu/test_convert.py"), crash, "-k", "empty_block_table", f"--dump-failures={dump}"
    )
    out = "\n".join(result.outlines)
    assert result.ret == 1 and "1 failed" in out, out[-2000:]
    assert "killed its process (SIGSEGV) at stage convert" in out, out[-2000:]
    recipes = list(dump.glob("*.recipe.json"))
    assert len(recipes) == 1 and recipes[0].stat().st_size < 10_000
    recipe = load_recipe(recipes[0])
    assert recipe["crashed_at"] == "convert" and recipe["impl"] == "tests.bugs:ConvertReadsTheTableOfInvalidEntries"
    result = run_pytest(pytester, str(ROOT / "tests"), f"--replay={dump}", crash)
    out = "\n".join(result.outlines)
    assert result.ret == 1 and "killed its process (SIGSEGV) at stage convert" in out, out[-2000:]
    result = run_pytest(pytester, str(ROOT / "tests"), f"--replay={dump}")
    assert result.ret == 0 and "1 passed" in "\n".join(result.outlines), "\n".join(result.outlines[-20:])


def test_a_changed_recipe_is_a_fixture_error(tmp_path):
    from harness.scenario import batch, build_scenario
    from recording.fixture import FixtureError
    from recording.recipe import recipe_of_scenario, save_recipe

    path = save_recipe(
        tmp_path / "case.recipe.json",
        recipe_of_scenario(build_scenario(batch((9, 1), kpool=4, topk=256), 3), "compacted", name="case"),
    )
    assert load_recipe(path)["seed"] == 3
    path.write_text(path.read_text().replace('"seed": 3', '"seed": 4'))
    with pytest.raises(FixtureError, match="does not match its content digest"):
        load_recipe(path)


def test_a_step_too_large_to_build_is_written_as_its_failing_rows_or_else_as_a_recipe(
    pytester, tmp_path, monkeypatch, device
):
    """A failing batch too large to build whole (tens of thousands of rows, say) is never built:
    where its plan is wrong on some rows it is the fixture of those rows, built from the
    scenario; where the plan is right on every row (the failure is in the kernel run of the
    whole batch) a recipe that says why."""
    import recording.dump
    import recording.step_size

    monkeypatch.setattr(recording.step_size, "MAX_BUILD_BYTES", 0)  # as a batch of tens of thousands of rows
    select = ("--impl=tests.bugs:CompactionPlansPrefix", "-k",
              "test_plan_reads_the_intended_slots and compacted and kpool4 and ctx5")
    dump = tmp_path / "rows"
    result = run_pytest(pytester, str(ROOT / "tests/cpu/test_kvlen_regimes.py"), *select, f"--dump-failures={dump}")
    assert result.ret == 1, "\n".join(result.outlines[-20:])
    written = sorted(p.name for p in dump.iterdir())
    assert len(written) == 2 and written[1].endswith(".safetensors"), written
    fx = load_fixture(dump / written[1])
    assert fx.meta["why"] == recording.dump.WHY_FAILING_ROWS and fx.meta["shrunk"]["from"]["rows"] == 2, fx.meta
    assert fx.meta["regimes"] == ["C"] and "plan != intent" in replay(fx).failures()

    monkeypatch.setattr(recording.dump, "plan_failing_rows", lambda step: [])  # as a kernel failure at scale
    dump = tmp_path / "recipe"
    result = run_pytest(pytester, str(ROOT / "tests/cpu/test_kvlen_regimes.py"), *select, f"--dump-failures={dump}")
    assert result.ret == 1, "\n".join(result.outlines[-20:])
    written = list(dump.iterdir())
    assert len(written) == 1 and written[0].name.endswith(".recipe.json"), written
    recipe = load_recipe(written[0])
    assert recipe["too_large_to_build"] > 0 and recipe["why"] == recording.dump.WHY_TOO_LARGE, recipe
    # Replayed where no kernel runs, it is not built whole either: the rows whose plan is wrong now.
    from tests.bugs import CompactionPlansPrefix

    fx = rebuild_fixture(written[0], recipe, CompactionPlansPrefix(), device, whole=False)
    assert fx.meta["rows"] == [0] and "plan != intent" in replay(fx).failures(), fx.meta


def test_a_recipe_of_failing_rows_rebuilds_them_with_the_inputs_their_test_built(tmp_path, device):
    """A failing case whose shrunk fixture is still too large is written as a recipe naming its
    failing rows; rebuilt on replay, those rows hold the q, the KV slots and the plan of the
    fixture the failing test built (not q drawn per row, as for a scale case), so a failure in
    the kernel's output replays too."""
    from harness.bits import bitwise_equal
    from harness.pipeline import prepare_step
    from harness.scenario import batch, build_attention_inputs, build_scenario
    from recording.case_log import fixture_from_step
    from recording.dump import why_shrunk_too_large
    from recording.fixture import subset_fixture
    from recording.recipe import recipe_of_step, save_recipe
    from tests.bugs import CompactionPlansPrefix

    spec = batch((5, 1), (3000, 1), (2049, 1), (9, 2), kpool=4, topk=2048)
    scenario = build_scenario(spec, 3)
    step = prepare_step(CompactionPlansPrefix(), scenario, "compacted", device)
    rows = [0, 2]
    path = save_recipe(tmp_path / "case.recipe.json",
                       recipe_of_step(step, name="case", why=why_shrunk_too_large(None, 2_400_000),
                                                    failing_rows=rows))
    fx = rebuild_fixture(path, load_recipe(path), CompactionPlansPrefix(), device, whole=False)
    expected = subset_fixture(fixture_from_step(step, build_attention_inputs(scenario)), rows)
    assert fx.meta["rows"] == rows
    for name in ("q_nope", "q_pe", "ckv", "kpe", "kv_indptr", "kv_indices", "kv_len", "intended"):
        assert bitwise_equal(fx.tensors[name].cpu(), expected.tensors[name].cpu()), name


def run_scale_case_apart(pytester, monkeypatch, rows: int, select: str, bug: str, dump: Path):
    """The scale case(s) of ``rows`` rows selected by ``select`` run in a child process, as the
    cases past the work capacity do, on the simulated SM90 machine, under ``tests.bugs:<bug>``
    with ``--dump-failures=dump``: the nested run's output lines and status."""
    import harness.port.scale

    if not simulated_sm90.can_simulate_in_process():
        pytest.skip("the simulated machine runs in this process only with the convert kernel in Triton's interpreter")
    monkeypatch.setattr(harness.port.scale, "exceeds_work_capacity", lambda n: n == rows)
    simulated_sm90.simulate_in_process(monkeypatch)
    with simulated_sm90.nested_failures_released():
        result = run_pytest(pytester, str(ROOT / "tests/gpu/test_scale.py"), "-p", "no:xdist", "-k", select,
                            f"--impl=tests.bugs:{bug}", f"--dump-failures={dump}")
    return "\n".join(result.outlines), result.ret


@pytest.mark.gpu_stand_in
def test_a_scale_case_whose_child_crashes_fails_naming_case_and_stage_and_leaves_a_recipe(
    pytester, tmp_path, monkeypatch
):
    """The scale cases past the work capacity run in a child process; one whose child dies in the
    stages of the implementation under test (not at the plan: no work-capacity finding) fails,
    naming the case and the stage, and leaves a recipe. Here the 1-row case runs apart."""
    import harness.port.scale

    dump = tmp_path / "dumps"
    out, ret = run_scale_case_apart(pytester, monkeypatch, 1, "rows1-kpool4", "ConvertKillsItsProcess", dump)
    case = next(c for c in harness.port.scale.scale_cases() if c.rows == 1 and c.kpool == 4)
    assert ret == 1 and "1 failed" in out, out[-3000:]
    assert f"{case.id}: crashed at stage convert" in out, out[-3000:]
    recipes = list(dump.glob("*.recipe.json"))
    assert len(recipes) == 1 and recipes[0].stat().st_size < 10_000, sorted(p.name for p in dump.iterdir())
    recipe = load_recipe(recipes[0])
    assert recipe["crashed_at"] == "convert" and recipe["scale_case"] == case.id, recipe


@pytest.mark.gpu_stand_in
def test_a_scale_case_run_apart_whose_plan_is_wrong_leaves_the_fixture_of_its_failing_rows(
    pytester, tmp_path, monkeypatch
):
    """A scale case past the work capacity runs in a child process, which reports a wrong plan
    (outcome invalid) without a step the dump could write: the test runs the host stages again
    and the dump writes the shrunk fixture of the failing rows. Here the 2-row case runs apart,
    under a bug that plans regime C rows as a prefix."""
    dump = tmp_path / "dumps"
    case = "rows2-kpool4-bf16-rope64-h128"
    out, ret = run_scale_case_apart(pytester, monkeypatch, 2, case, "CompactionPlansPrefix", dump)
    assert ret == 1 and "1 failed" in out, out[-3000:]
    assert "invalid at stage selection" in out, out[-3000:]
    fixtures = list(dump.glob("*.safetensors"))
    assert len(fixtures) == 1 and not list(dump.glob("*.recipe.json")), sorted(p.name for p in dump.iterdir())
    meta = load_fixture(fixtures[0]).meta
    assert meta["scale_case"] == case and meta["shrunk"]["check"] == ["plan != intent"], meta


@pytest.mark.parametrize("layout", ["compacted", "strided"])
def test_the_fixture_of_some_rows_is_the_whole_fixtures_rows_bit_for_bit(device, layout):
    """A batch too large to build whole is dumped as the fixture of its failing rows, built from
    the scenario alone: bit for bit the rows of the fixture of the whole batch (q drawn per row
    as the scale cases draw it, poisoned slots included)."""
    from harness.pipeline import prepare_step
    from harness.scenario import batch, build_attention_inputs_on, build_scenario
    from recording.case_log import fixture_from_step, fixture_of_rows
    from recording.fixture import subset_fixture
    from tests.bugs import CompactionPlansPrefix

    spec = batch((5, 1), (3000, 1), (2049, 1), (9, 2), kpool=4, topk=2048, kv_dtype="float8_e4m3fn", k_scale=0.5)
    scenario = build_scenario(spec, 3)
    step = prepare_step(CompactionPlansPrefix(), scenario, layout, device)
    rows = [0, 2]
    whole = subset_fixture(fixture_from_step(step, build_attention_inputs_on(scenario, "cpu")), rows)
    part = fixture_of_rows(step, rows)
    assert part.meta["rows"] == rows and part.meta["regimes"] == whole.meta["regimes"]
    assert set(part.tensors) == set(whole.tensors)
    for name, t in whole.tensors.items():
        assert torch.equal(part[name].view(torch.uint8), t.view(torch.uint8)) if t.is_floating_point() \
            else torch.equal(part[name], t), name
    assert replay(part).failures() == replay(whole).failures()
    if layout == "compacted":  # the bug plans regime C as a prefix there: its row reads a poisoned slot
        assert replay(part).failures() == ["plan != intent"]
        assert torch.isnan(part["ckv"].float()).any(), "no poisoned slot read: a weak case"


def test_a_crash_recipe_of_a_scale_case_replays_its_stages_apart_even_where_a_kernel_runs(monkeypatch, tmp_path):
    """The recipe of a scale case whose child died in the stages of the implementation under
    test replays those stages in a child process of their own, as it was dumped; it is not run
    whole (past the work capacity, a whole run is the work-capacity finding on every release, so
    its replay could never pass)."""
    import harness.pipeline
    import harness.port.scale
    from pytest_sparse_mla import replay_case
    from pytest_sparse_mla.impl import IMPL_SPEC

    calls = []

    def stages_apart(*args):
        calls.append("stages apart")
        return {"outcome": "crashed", "detail": "died at convert"}

    def whole(*args):
        calls.append("whole")
        return {"outcome": "refused"}

    recipe = {"spec": {}, "seed": 0, "layout": "compacted", "scale_case": "rows32768-kpool4-bf16-rope64-h16",
              "crashed_at": "convert"}
    monkeypatch.setattr(replay_case, "rerun_unavailable_reason", lambda config: None)  # as where a kernel runs
    monkeypatch.setattr(replay_case, "is_recipe", lambda path: True)
    monkeypatch.setattr(replay_case, "load_recipe", lambda path: recipe)
    monkeypatch.setattr(harness.pipeline, "run_step_in_child", stages_apart)
    monkeypatch.setattr(harness.port.scale, "run_case_in_child", whole)
    monkeypatch.setattr("harness.scenario.spec_from_dict", lambda spec: spec)
    path = tmp_path / "case.recipe.json"

    class Request:
        config = SimpleNamespace(stash={IMPL_SPEC: "tests.bugs:CompactionPlansPrefix"})

        @staticmethod
        def getfixturevalue(name):
            return "cpu"

    with pytest.raises(pytest.fail.Exception, match="died at convert"):
        replay_case.load_case(path, Request())
    assert calls == ["stages apart"]


def test_nested_case_logs_close_their_own_log():
    """A test that runs a session of its own (a suite self-test under ``--dump-failures``) opens
    a log inside the one its own test opened; each block closes its own, even while both hold
    the same notes, and notes go to the innermost."""
    from harness.case_log import note_sequence
    from recording.case_log import logging_cases

    with logging_cases() as outer:
        with logging_cases() as inner:
            assert inner is not outer
        note_sequence("reused-buffers", "packed", 8)
    assert outer.sequence is not None and inner.sequence is None


#: The main fa3 tier's strided and packed cases of one context (tests/gpu/test_attention_regimes.py).
STRIDED_AND_PACKED = "test_kernel_matches_as_implemented_reference and ctx2051-kpool4 and (strided or packed)"


@pytest.mark.gpu_stand_in
@pytest.mark.suite_self_test
@pytest.mark.parametrize(("bug", "message"), [
    ("KpoolFromWrongSpec", r"invariant violations \(kernel not launched\)"),  # a plan bug: caught before launch
    ("QPeHeadsRolled", r"port-fa3's output vs \(a\) beyond the error budget"),  # a kernel-input bug: in the output
])
def test_a_strided_or_packed_port_case_is_a_backend_case_that_replays_red_and_green_on_a_simulated_machine(
    pytester, monkeypatch, tmp_path, bug, message
):
    """A planted bug fails the main tier's strided and packed cases; each is written as a backend case
    whose record names the port's layout, which its replay reopens: red under the bug, naming the
    layout, and green without it (on a simulated SM90 machine: FlashInfer's wrapper replaced by the
    reference)."""
    from tests.support.child_runs import run_gpu_family

    dump, impl = tmp_path / "dumps", f"--impl=tests.bugs:{bug}"
    result = run_gpu_family(pytester, monkeypatch, "tests/gpu/test_attention_regimes.py", STRIDED_AND_PACKED, impl,
                            f"--dump-failures={dump}", simulated=True)
    output = "\n".join(result.outlines + result.errlines)
    assert result.ret == 1 and result.parseoutcomes().get("failed") == 2, output[-3000:]
    written = sorted(dump.iterdir())
    assert [p.name.endswith(".case.json") for p in written] == [True, True], (written, output[-3000:])
    layouts = {json.loads(p.read_text())["backend"]["layout"] for p in written}
    assert layouts == {"strided", "packed"}, layouts
    red = run_gpu_family(pytester, monkeypatch, "tests/test_replay.py", "", f"--replay={dump}", impl, simulated=True)
    red_text = "\n".join(red.outlines + red.errlines)
    assert red.ret == 1 and red.parseoutcomes().get("failed") == 2, red_text[-3000:]
    for layout in layouts:
        assert re.search(rf"{message}.*{layout} layout", red_text), (layout, red_text[-3000:])
    green = run_gpu_family(pytester, monkeypatch, "tests/test_replay.py", "", f"--replay={dump}", simulated=True)
    green_text = "\n".join(green.outlines + green.errlines)
    assert green.ret == 0 and green.parseoutcomes().get("passed") == 2, green_text[-3000:]


@pytest.mark.parametrize(("missing", "env", "said"), [
    ("flashinfer", {"REPRO_DEVICE": "cpu"}, "flashinfer is not importable"),
    ("safetensors", {"REPRO_DEVICE": "cpu"}, "safetensors is not importable"),
    ("no_such_module", {"REPRO_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": ""}, "no CUDA device (REPRO_DEVICE=cuda)"),
], ids=["no-flashinfer", "no-safetensors", "no-cuda"])
def test_a_reproducer_that_cannot_run_here_says_so_in_one_line_and_blames_no_kernel(tmp_path, missing, env, said):
    """Exit status 4 and one line on stderr, never a traceback and status 1 (FlashInfer is wrong)."""
    out = tmp_path / "repro"
    assert repro_main([str(ROOT / "fixtures" / "c-compacted-fp8.safetensors"), "-o", str(out)]) == 0
    run = subprocess.run([sys.executable, "-m", "tests.run_without", missing, str(out / "c-compacted-fp8.repro.py")],
                         capture_output=True, text=True, cwd=ROOT, env={**os.environ, **env}, timeout=300)
    assert run.returncode == 4, run.stdout + run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"cannot run here: {said}") and \
        lines[0].endswith("; nothing was judged"), run.stderr


def test_the_pythonpath_an_impl_was_found_through_is_carried_by_the_printed_replay(tmp_path, monkeypatch):
    mine = tmp_path / "mine"
    (mine / "mybugs").mkdir(parents=True)
    (mine / "mybugs" / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(mine), str(ROOT)]))
    assert found_through_pythonpath(["mybugs.kv:Bug", "tests.bugs:KpoolFromWrongSpec", "absent:x"]) == (str(mine),)
    assert replay_command("D", "mybugs.kv:Bug", search_path=(str(mine),)) == \
        f"PYTHONPATH={mine} pytest --replay=D --impl mybugs.kv:Bug"


def test_a_printed_replay_line_runs_as_printed_with_an_impl_found_through_pythonpath(tmp_path):
    """A bug of the user's own, in a module found only through PYTHONPATH: the replay line the
    failure prints, run as printed from a shell without that PYTHONPATH, replays the case red
    (not a usage error: no module named ...)."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "mybug.py").write_text("from tests.bugs import KpoolFromWrongSpec as OneShort  # noqa: F401\n")
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": str(mine)}
    dumps = tmp_path / "dumps"
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q",
                          "--impl", "mybug:OneShort", "tests/cpu/test_kvlen_regimes.py", "-k",
                          "test_kv_len_equals_valid_count and ctx2049-kpool4", f"--dump-failures={dumps}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    printed = [line.strip().removeprefix("replay: ") for line in run.stdout.splitlines()
               if line.strip().startswith("replay: ")]
    assert run.returncode == 1 and printed, run.stdout[-3000:]
    assert printed[0].startswith(f"PYTHONPATH={mine} pytest --replay="), printed
    without = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    again = subprocess.run(printed[0] + " -p no:cacheprovider -p no:xdist -q", shell=True, cwd=ROOT, env=without,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 1 and "failed" in again.stdout.splitlines()[-1], again.stdout[-3000:] + again.stderr


def child_pytest(*args: str) -> tuple[int, str]:
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q", "-rxXf",
                          *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    return run.returncode, run.stdout + run.stderr


def test_a_recipe_replays_green_once_its_bug_is_fixed_with_the_finding_its_test_expected_named(tmp_path):
    """A case of the regime C finding's own layout (packed: its regime C row is planned as a
    prefix, a strict xfail in the test that wrote it) failing on another row under a bug: red
    under the bug, and without it the finding, named, not "plan != intent"."""
    dumps = tmp_path / "dumps"
    status, out = child_pytest("--impl", "tests.bugs:KpoolFromWrongSpec", "tests/cpu/test_kvlen_regimes.py", "-k",
                               "test_plan_reads_the_intended_slots and ctx1-kpool4-packed", f"--dump-failures={dumps}")
    assert status == 1 and "1 failed" in out, out[-3000:]
    (recipe,) = sorted(dumps.glob("*.recipe.json"))
    status, out = child_pytest(f"--replay={recipe}", "--impl", "tests.bugs:KpoolFromWrongSpec")
    assert status == 1 and "1 failed" in out and "plan != intent" in out, out[-3000:]
    status, out = child_pytest(f"--replay={recipe}")
    assert status == 0 and "1 xfailed" in out, out[-3000:]
    assert "expected finding (the plan is off on regime C rows only): regime C rows planned as a prefix under packed" \
        in out and "XFAIL" in out, out[-3000:]


def test_a_case_written_on_a_stand_in_flashinfer_replays_on_the_stand_in_it_names(monkeypatch):
    """The case's ``flashinfer`` field names the stand-in's wrapper as ``module:Class``: the replay
    installs that stand-in through its module's ``install``; a case written on FlashInfer itself
    installs nothing, and a stand-in that cannot be loaded fails in one line naming it."""
    import sys

    from pytest_sparse_mla.replay_case import install_recorded_stand_in
    from tests import fa3_stand_in

    monkeypatch.delitem(sys.modules, "flashinfer.mla", raising=False)
    install_recorded_stand_in("flashinfer 0.7.4", monkeypatch)
    assert "flashinfer.mla" not in sys.modules
    install_recorded_stand_in("tests.fa3_stand_in:StandInWrapper", monkeypatch)
    assert sys.modules["flashinfer.mla"].BatchMLAPagedAttentionWrapper is fa3_stand_in.StandInWrapper
    with pytest.raises(pytest.fail.Exception, match=r"^the case was written on the stand-in FlashInfer "
                       r"tests\.fa3_stand_in:NoSuchWrapper, which cannot be loaded here: .*NoSuchWrapper"):
        install_recorded_stand_in("tests.fa3_stand_in:NoSuchWrapper", monkeypatch)
