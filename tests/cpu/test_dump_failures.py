"""``--dump-failures``: a wrong implementation through ``--impl`` makes differential tests fail;
each failing case writes one fixture (whether or not the test armed ``failure_dump``), its
failure message ends with the command that replays it, and replaying the file fails on the
same rows."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from recording.fixture import load_fixture
from recording.recipe import load_recipe, rebuild_fixture
from recording.replay import replay
from tests.bugs import KpoolFromWrongSpec

ROOT = Path(__file__).resolve().parents[2]
REPLAY_LINE = re.compile(r"^replay: pytest --replay=(\S+)$")


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


def test_a_wrong_kv_len_rule_writes_one_fixture_per_failing_case(pytester, tmp_path):
    dump = tmp_path / "dumps"
    result = run_pytest(pytester, str(ROOT / "tests/cpu/test_kvlen_regimes.py"), "--impl=tests.bugs:KpoolFromWrongSpec",
                        "-k", "test_kv_len_equals_valid_count and (ctx2049 or ctx4097 or decode-mixed or ctx5-kpool4)",
                        f"--dump-failures={dump}")
    out = result.outlines
    failed = result.parseoutcomes().get("failed", 0)
    assert result.ret == 1 and failed >= 3, "\n".join(out[-30:])
    files = sorted([*dump.glob("*.safetensors"), *dump.glob("*.recipe.json")])
    assert len(files) == failed, "\n".join(out[-30:])
    blocks = failure_blocks(out)
    assert len(blocks) == failed
    for name, block in blocks.items():
        last = [line for line in block if line.strip()][-1]
        match = REPLAY_LINE.match(last)
        assert match, f"{name}: the failure message ends with {last!r}"
        rows = sorted({int(r) for r in re.findall(r"^E\s+row (\d+): regime", "\n".join(block), re.M)})
        if match.group(1).endswith(".recipe.json"):
            recipe = load_recipe(match.group(1))
            assert recipe["impl"] == "tests.bugs:KpoolFromWrongSpec" and recipe["nodeid"].endswith(name)
            fx = rebuild_fixture(match.group(1), recipe, KpoolFromWrongSpec())
            original = list(range(fx.num_rows))
        else:
            fx = load_fixture(match.group(1))
            original = fx.meta["rows"]  # the shrunk fixture's rows in the failing batch
        assert fx.meta["impl"] == "tests.bugs:KpoolFromWrongSpec" and fx.meta["nodeid"].endswith(name)
        report = replay(fx)
        failing = [original[r] for r in report.plan_mismatch_rows]
        assert rows and failing and set(failing) <= set(rows), f"{name}: replay fails on {failing}, the test on {rows}"
        assert "plan != intent" in report.failures()


def test_passing_cases_and_runs_without_the_option_write_nothing(pytester, tmp_path):
    dump = tmp_path / "dumps"
    result = run_pytest(pytester, str(ROOT / "tests/cpu/test_kvlen_regimes.py"), "-k", "test_kv_len_equals_valid_count and ctx2049",
                        f"--dump-failures={dump}")
    assert result.ret == 0, "\n".join(result.outlines[-20:])
    assert not dump.exists()
    result = run_pytest(pytester, str(ROOT / "tests/cpu/test_kvlen_regimes.py"), "--impl=tests.bugs:KpoolFromWrongSpec",
                        "-k", "test_kv_len_equals_valid_count and ctx2049")
    assert result.ret == 1 and not any("replay: pytest --replay" in line for line in result.outlines)


# --- the CPU journey: dump, shrink, replay with and without the bug, standalone reproducer ---

MAX_FIXTURE_BYTES = 2_000_000
MAX_DUMP_BYTES = 20_000_000
PROJECT_MODULES = {"fast", "harness", "recording", "reference", "pytest_sparse_mla", "mla_constants", "scripts", "bench", "tests"}


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
    result = run_pytest(pytester, str(ROOT / "tests/cpu/test_kvlen_regimes.py"), bug, "-k", select, f"--dump-failures={dump}")
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
        assert shrunk["to"]["bytes"] < shrunk["from"]["bytes"] and shrunk["to"]["rows"] <= shrunk["from"]["rows"], shrunk
        assert fx.num_rows == shrunk["to"]["rows"] and set(fx.meta["regimes"]) == {"C"}, fx.meta["regimes"]
        repro = path.with_name(path.name.removesuffix(".safetensors") + ".repro.py")
        extra = imported_modules(repro.read_text()) - set(sys.stdlib_module_names)
        assert extra <= {"torch", "flashinfer", "safetensors"} and not extra & PROJECT_MODULES, f"{repro.name} imports {extra}"
    # Replayed on this machine, the host stages run through the implementation under test:
    # the bug fails every fixture, the fixed code passes them all.
    result = run_pytest(pytester, str(ROOT / "tests"), f"--replay={dump}", bug)
    out = "\n".join(result.outlines)
    assert result.ret == 1 and f"{failed} failed" in out and "plan != intent" in out, out[-3000:]
    result = run_pytest(pytester, str(ROOT / "tests"), f"--replay={dump}")
    assert result.ret == 0 and f"{failed} passed" in "\n".join(result.outlines), "\n".join(result.outlines[-30:])
