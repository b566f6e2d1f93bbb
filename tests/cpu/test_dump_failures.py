"""``--dump-failures``: a wrong implementation through ``--impl`` makes differential tests fail;
each failing case writes one fixture (whether or not the test armed ``failure_dump``), its
failure message ends with the command that replays it, and replaying the file fails on the
same rows."""

from __future__ import annotations

import re
from pathlib import Path

from recording.fixture import load_fixture
from recording.replay import replay

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
    files = sorted(dump.glob("*.safetensors"))
    assert len(files) == failed, "\n".join(out[-30:])
    blocks = failure_blocks(out)
    assert len(blocks) == failed
    for name, block in blocks.items():
        last = [line for line in block if line.strip()][-1]
        match = REPLAY_LINE.match(last)
        assert match, f"{name}: the failure message ends with {last!r}"
        fx = load_fixture(match.group(1))
        assert fx.meta["impl"] == "tests.bugs:KpoolFromWrongSpec" and fx.meta["nodeid"].endswith(name)
        rows = sorted({int(r) for r in re.findall(r"^E\s+row (\d+): regime", "\n".join(block), re.M)})
        report = replay(fx)
        assert rows and report.plan_mismatch_rows == rows, f"{name}: replay fails on {report.plan_mismatch_rows}, the test on {rows}"
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
