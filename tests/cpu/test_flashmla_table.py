"""The GPU tier's FlashMLA-against-FA3 table: the rows the differential test writes
(``pytest_sparse_mla.flashmla_table``) and the markdown ``scripts/flashmla_table.py`` makes of one run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from harness.cases import KernelConfig
from pytest_sparse_mla.flashmla_table import TABLE_ENV, table_path, table_row, write_table_row
from reference.budget import Comparison
from scripts import flashmla_table


def comparison(name: str, max_ratio: float, ok: bool = True) -> Comparison:
    return Comparison(name=name, ok=ok, max_ratio=max_ratio, mean_ratio=max_ratio / 2, max_err=max_ratio * 1e-3,
                      mean_err=1e-4, rel_l2=2e-3)


def fake_request(test: str, case: str):
    config = SimpleNamespace(cache=None)
    return SimpleNamespace(config=config, node=SimpleNamespace(nodeid=test, callspec=SimpleNamespace(id=case)))


FP8 = KernelConfig("float8_e4m3fn", True, 64, 0.5)


def write(monkeypatch, tmp_path, test, case, run, flashmla_ok=True, config=FP8):
    monkeypatch.setenv(TABLE_ENV, str(tmp_path / "table.jsonl"))
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", run)
    scenario = SimpleNamespace(row_regime=["B", "H", "B"])
    kernels = {"flashmla": [comparison("out", 1.5 if flashmla_ok else 9.0, flashmla_ok), comparison("lse", 1.2)],
               "fa3": [comparison("out", 1.1), comparison("lse", 1.3)]}
    request = fake_request(test, case)
    write_table_row(request, table_row(request, scenario, config, 2, kernels,
                                       {"out_max_diff": 0.004, "lse_max_diff": 1e-5}))


def test_one_run_is_tabulated_with_the_last_row_of_each_test(monkeypatch, tmp_path):
    write(monkeypatch, tmp_path, "t::a", "ctx1-kpool1-fp8-rope64-h64-k0.5", "run-1", flashmla_ok=False)
    write(monkeypatch, tmp_path, "t::a", "ctx1-kpool1-fp8-rope64-h64-k0.5", "run-2")
    write(monkeypatch, tmp_path, "t::b", "ctx2-kpool1-fp8-rope64-h64-k0.5", "run-2", flashmla_ok=False)
    rows = flashmla_table.rows_of_run(flashmla_table.read_rows(tmp_path / "table.jsonl"))
    assert sorted(r["test"] for r in rows) == ["t::a", "t::b"] and {r["run"] for r in rows} == {"run-2"}
    text = flashmla_table.render(rows)
    assert "### fp8-rope64, k_scale 0.5" in text
    assert "| ctx2-kpool1-fp8-rope64-h64-k0.5 | 64 | 2 | BH | **0.009 (9.00x)** |" in text
    assert "FlashMLA beyond budget" in text and "both within budget" in text
    summary = next(line for line in text.splitlines() if line.startswith("| fp8-rope64 |"))
    assert summary == "| fp8-rope64 | 0.5 | 2 | 9.00x | 1.20x | 1 | 1.10x | 1.30x | 0 |"


def test_an_earlier_run_can_be_named(monkeypatch, tmp_path):
    write(monkeypatch, tmp_path, "t::a", "case-a", "run-1")
    write(monkeypatch, tmp_path, "t::b", "case-b", "run-2")
    rows = flashmla_table.rows_of_run(flashmla_table.read_rows(tmp_path / "table.jsonl"), "run-1")
    assert [r["case"] for r in rows] == ["case-a"]


def test_a_missing_file_is_an_error(tmp_path, capsys):
    assert flashmla_table.main([str(tmp_path / "none.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_without_the_cache_plugin_the_table_goes_to_the_rootdirs_cache_folder(monkeypatch, tmp_path):
    """``-p no:cacheprovider`` (as scripts/gpu_runner.py runs) leaves the config without a cache:
    the table still has a place, the folder the cache plugin would have used."""
    monkeypatch.delenv(TABLE_ENV, raising=False)
    config = SimpleNamespace(rootpath=tmp_path)  # no ``cache`` attribute, as under no:cacheprovider
    assert table_path(config) == tmp_path / ".pytest_cache" / "d" / "sparse-mla" / "flashmla-table.jsonl"
    request = SimpleNamespace(config=config, node=SimpleNamespace(nodeid="t::a", callspec=SimpleNamespace(id="a")))
    write_table_row(request, {"test": "t::a"})
    assert table_path(config).read_text() == '{"test": "t::a"}\n'


def test_the_runner_names_a_table_per_run(monkeypatch, tmp_path):
    monkeypatch.setenv(TABLE_ENV, str(tmp_path / "flashmla-table-0.7.4-warm.jsonl"))
    assert table_path(SimpleNamespace()) == tmp_path / "flashmla-table-0.7.4-warm.jsonl"


def test_a_table_path_the_run_cannot_write_is_a_usage_error_before_any_test(pytester, monkeypatch, tmp_path):
    """Not a failure of the GPU tier's last FlashMLA case, after the whole run: where the folder
    cannot be made (here: under a file), the run stops at its start, naming the path."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(TABLE_ENV, str(blocker / "table.jsonl"))
    pytester.makeconftest('pytest_plugins = ("pytest_sparse_mla",)')
    pytester.makepyfile(test_nothing="def test_nothing():\n    raise AssertionError('no test may run')\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist", "--rootdir", str(pytester.path))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{TABLE_ENV}={blocker / 'table.jsonl'}: FlashMLA's table cannot be written there*"])
