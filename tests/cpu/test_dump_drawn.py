"""``--dump-failures`` of a Hypothesis test: what is written is the failing drawn example itself
(its spec and seed, as drawn), shrunk only among candidates that fail the same checks, with a
``why`` that says what its shrinking tried; replayed with the command it printed it fails as the
test did, and passes on the fixed implementation. A failing test with nothing to write is named
in the run's summary with the reason."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from pytest_sparse_mla.replay import NO_CASE_NOTED, OTHER_EXAMPLE, REPORTED_EXAMPLE
from recording.dump import WHY_OWN_BLOCK_TABLE
from recording.fixture import load_fixture
from recording.recipe import load_recipe
from recording.shrink import MAX_FIXTURE_BYTES

ROOT = Path(__file__).resolve().parents[2]
DRAWN_TEST = "test_drawn_production_inputs_plan_the_intended_slots"


def run_pytest(pytester, *args: str):
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist", "--rootdir", str(ROOT), *args)


def written_case(path: Path) -> dict:
    """The metadata a written fixture or recipe holds."""
    return load_recipe(path) if path.name.endswith(".recipe.json") else load_fixture(path).meta


def drawn_seed(drawn: str) -> int:
    """The ``seed`` argument of the example a written case names."""
    seeds = re.findall(r"\bseed=(\d+)", drawn)
    assert len(seeds) == 1, drawn
    return int(seeds[0])


@pytest.mark.parametrize(("bug", "shows"), [
    ("OptimisticBoundAsExact", lambda spec: spec["async_scheduling"] and spec["host_bound_slack"] > 0),
    ("ContextIsPosition", lambda spec: True),
    # a convert that shifts by log2(block_size) shows only on the step's own block table
    ("BlockSizeAsShift", lambda spec: spec["block_size"] & (spec["block_size"] - 1) != 0),
])
def test_a_failing_drawn_example_is_written_as_drawn_and_replays_as_it_failed(pytester, tmp_path, bug, shows):
    dump = tmp_path / "dump"
    impl = f"tests.bugs:{bug}"
    result = run_pytest(pytester, str(ROOT / "tests/cpu/test_input_space.py"), "-k", DRAWN_TEST, "--impl", impl,
                        f"--dump-failures={dump}")
    out = "\n".join(result.outlines)
    assert result.ret == 1 and "1 failed" in out, out[-3000:]
    files = [p for p in dump.iterdir() if not p.name.endswith(".repro.py")]
    assert len(files) == 1 and files[0].name.startswith(DRAWN_TEST), sorted(p.name for p in dump.iterdir())
    meta = written_case(files[0])
    # the drawn example itself: the spec it drew (async scheduling with its optimistic bound for
    # the async bug) and the seed its call was given
    assert meta["impl"] == impl and shows(meta["spec"]), meta["spec"]
    assert meta["drawn"].startswith((*(f"{how}{DRAWN_TEST}(" for how in REPORTED_EXAMPLE),
                                     f"{OTHER_EXAMPLE}: {DRAWN_TEST}(")), meta["drawn"]
    assert drawn_seed(meta["drawn"]) == meta["seed"], meta["drawn"]
    requests = [(int(a), int(b)) for a, b in re.findall(r"Request\(seq_len=(\d+), q_len=(\d+)\)", meta["drawn"])]
    assert requests == [(r["seq_len"], r["q_len"]) for r in meta["spec"]["requests"]], meta["drawn"]
    if meta.get("why") == WHY_OWN_BLOCK_TABLE:  # its fixture's host stages re-run over block size 1 pass
        assert files[0].name.endswith(".recipe.json") and "shrunk" not in meta, meta
    else:
        assert_shrunk_as_said(files[0], meta)
    printed = [line.removeprefix("replay: ") for line in result.outlines if line.startswith("replay: ")]
    assert printed == [f"pytest --replay={files[0]} --impl {impl}"], printed
    result = run_pytest(pytester, str(ROOT / "tests"), *shlex.split(printed[0])[1:])
    out = "\n".join(result.outlines)
    assert result.ret == 1 and "1 failed" in out and "plan != intent" in out, out[-3000:]
    result = run_pytest(pytester, str(ROOT / "tests"), f"--replay={files[0]}")
    assert result.ret == 0 and "1 passed" in "\n".join(result.outlines), "\n".join(result.outlines[-30:])


def assert_shrunk_as_said(path: Path, meta: dict) -> None:
    """The written case records its shrinking; a recipe's why says what was tried and what it
    ended at."""
    shrunk = meta["shrunk"]
    assert shrunk["check"] and shrunk["to"]["rows"] <= shrunk["from"]["rows"], shrunk
    if path.name.endswith(".recipe.json"):  # its why says what was tried and what it ended at
        assert shrunk["to"]["bytes"] > MAX_FIXTURE_BYTES, shrunk
        assert (f"shrunk to {shrunk['to']['rows']} rows x {shrunk['to']['heads']} heads among the candidates that "
                f"fail the same checks ({shrunk['candidates_tried']} tried), holds {shrunk['to']['bytes']} bytes") \
            in meta["why"], meta["why"]


NO_CASE = """
import pytest
from hypothesis import given, strategies as st

def test_fails_without_a_case():
    assert False, "no differential case here"

@given(st.integers(0, 3))
def test_drawn_without_a_case(x):
    assert x < 2
"""


def test_a_failing_test_with_nothing_to_write_is_named_with_the_reason(pytester, tmp_path):
    pytester.makeconftest('pytest_plugins = ("pytest_sparse_mla",)')
    pytester.makepyfile(test_no_case=NO_CASE)
    dump = tmp_path / "dump"
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist", "--rootdir", str(pytester.path),
                                          f"--dump-failures={dump}")
    out = "\n".join(result.outlines)
    assert result.ret == 1 and "2 failed" in out, out[-3000:]
    assert not dump.exists()
    assert f"--dump-failures={dump}: 0 failing cases written" in out, out[-3000:]
    assert f"  nothing written for test_fails_without_a_case: {NO_CASE_NOTED}" in out, out[-3000:]
    assert ("  nothing written for test_drawn_without_a_case: its failing example noted no differential case"
            in out), out[-3000:]
    assert f"nothing written under --dump-failures: {NO_CASE_NOTED}" in out, out[-3000:]
