"""Malformed recipes: every field is checked when a recipe is loaded, so a recipe whose fields
are wrong, even one whose digest was recomputed after the change, is a FixtureError naming the
field and the bad value, on its own and through ``--replay``; never a traceback from the
scenario builder (block size 0), an IndexError (a failing row past the batch) or a verdict on
the plan (a negative row)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recording.fixture import FixtureError
from recording.recipe import (
    OPTIONAL_FIELDS,
    OPTIONAL_SPEC_FIELDS,
    REQUIRED_FIELDS,
    SPEC_FIELDS,
    _file_digest,
    load_recipe,
    recipe_of_scenario,
    save_recipe,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def good_recipe() -> dict:
    """A valid recipe of a 3-row batch (rows 0..2 planned), as the dump writes it."""
    from harness.scenario import batch, build_scenario

    recipe = recipe_of_scenario(build_scenario(batch((9, 1), (3000, 1), (5, 1), kpool=4, topk=256), 3),
                                "compacted", name="case", impl="tests.bugs:CompactionPlansPrefix",
                                nodeid="tests/x.py::test_case", why="a test", failing_rows=[0, 2])
    assert recipe is not None
    return recipe


def written(tmp_path: Path, recipe: dict) -> Path:
    """``recipe`` saved with its digest recomputed, as a hand edit that also fixes the digest."""
    return save_recipe(tmp_path / "case.recipe.json", recipe)


def without(recipe: dict, key: str) -> dict:
    return {k: v for k, v in recipe.items() if k != key}


def with_spec(recipe: dict, **changes) -> dict:
    return dict(recipe, spec=dict(recipe["spec"], **changes))


BAD = {
    # case: (change, text the message must hold: the field and its bad value)
    "block-size-0": (lambda r: with_spec(r, block_size=0), "'spec.block_size' is int 0, expected an int >= 1"),
    "failing-row-past-the-batch": (lambda r: dict(r, failing_rows=[999]),
                                   "'failing_rows' is list [999], expected a non-empty list of distinct rows of the "
                                   "batch (0 to 2: its spec plans 3 rows)"),
    "failing-row-negative": (lambda r: dict(r, failing_rows=[-1]), "'failing_rows' is list [-1]"),
    "failing-rows-repeated": (lambda r: dict(r, failing_rows=[0, 0]), "'failing_rows' is list [0, 0]"),
    "failing-rows-empty": (lambda r: dict(r, failing_rows=[]), "'failing_rows' is list []"),
    "failing-row-as-string": (lambda r: dict(r, failing_rows=["0"]), "'failing_rows' is list [\"0\"]"),
    "seed-as-string": (lambda r: dict(r, seed="3"), "'seed' is str \"3\", expected an int >= 0"),
    "seed-as-bool": (lambda r: dict(r, seed=True), "'seed' is bool true, expected an int >= 0"),
    "seed-negative": (lambda r: dict(r, seed=-3), "'seed' is int -3, expected an int >= 0"),
    "layout-unknown": (lambda r: dict(r, layout="paged"),
                       "'layout' is str \"paged\", expected one of strided, packed, compacted"),
    "max-rows-zero": (lambda r: dict(r, max_rows=0), "'max_rows' is int 0, expected an int >= 1"),
    "max-rows-below-the-batch": (lambda r: dict(r, max_rows=2),
                                 "'max_rows' is 2, expected at least the 3 rows its spec plans"),
    "scenario-digest-short": (lambda r: dict(r, scenario_digest="abc"),
                              "'scenario_digest' is str \"abc\", expected 64 hexadecimal digits"),
    "name-as-number": (lambda r: dict(r, name=7), "'name' is int 7, expected a string"),
    "impl-without-factory": (lambda r: dict(r, impl="tests.bugs"), "'impl' is str \"tests.bugs\", expected "
                                                                   "MODULE:FACTORY"),
    "shrunk-as-list": (lambda r: dict(r, shrunk=[1]), "'shrunk' is list [1], expected an object"),
    "unknown-field": (lambda r: dict(r, colour="red"), "'colour' is not a recipe field"),
    "missing-seed": (lambda r: without(r, "seed"), "'seed' is missing"),
    "missing-spec": (lambda r: without(r, "spec"), "'spec' is missing"),
    "missing-layout": (lambda r: without(r, "layout"), "'layout' is missing"),
    "spec-as-list": (lambda r: dict(r, spec=[]), "'spec' is list [], expected an object"),
    "spec-missing-topk": (lambda r: dict(r, spec=without(r["spec"], "topk")), "'spec.topk' is missing"),
    "spec-unknown-field": (lambda r: with_spec(r, page_size=1), "'spec.page_size' is not a field of a batch spec"),
    "kv-dtype-unknown": (lambda r: with_spec(r, kv_dtype="int8"), "'spec.kv_dtype' is str \"int8\", expected one of"),
    "k-scale-zero": (lambda r: with_spec(r, k_scale=0.0), "'spec.k_scale' is float 0.0, expected a finite number > 0"),
    "rope-as-int": (lambda r: with_spec(r, rope=1), "'spec.rope' is int 1, expected true or false"),
    "request-negative": (lambda r: with_spec(r, requests=[{"seq_len": -1, "q_len": 1}]),
                         "'spec.requests' is list"),
    "full-graph-as-string": (lambda r: with_spec(r, full_graph="yes"),
                             "'spec.full_graph' is str \"yes\", expected true or false"),
    "full-graph-without-its-padded-requests": (lambda r: with_spec(r, full_graph=True, padded_rows=2),
                                               "'spec' is not a batch spec: full_graph: 5 tokens at query length 1 "
                                               "pad to 5 requests (0 tokens over), the batch has 3"),
    "requests-refused-together": (lambda r: with_spec(r, kpool=3), "'spec' is not a batch spec: topk=256 must be a "
                                                                   "positive multiple of kpool=3"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_recipe_field_is_a_fixture_error_naming_the_field_and_value(tmp_path, good_recipe, case):
    change, expected = BAD[case]
    path = written(tmp_path, change(dict(good_recipe)))
    with pytest.raises(FixtureError) as excinfo:
        load_recipe(path)
    message = str(excinfo.value)
    assert message.startswith(f"{path}: recipe field ") and expected in message, message


def test_the_good_recipe_loads_and_every_field_it_may_hold_is_checked(tmp_path, good_recipe):
    assert load_recipe(written(tmp_path, good_recipe))["failing_rows"] == [0, 2]
    fields = set(good_recipe) | {"digest"}
    assert fields <= set(REQUIRED_FIELDS) | set(OPTIONAL_FIELDS)
    assert set(good_recipe["spec"]) == set(SPEC_FIELDS) | set(OPTIONAL_SPEC_FIELDS)
    # a recipe written before an optional spec field loads as its default
    older = dict(good_recipe, spec=without(good_recipe["spec"], "full_graph"))
    assert load_recipe(written(tmp_path, older))["spec"].get("full_graph", False) is False


def test_a_changed_file_without_a_new_digest_is_still_caught_by_the_digest(tmp_path, good_recipe):
    path = written(tmp_path, good_recipe)
    recipe = json.loads(path.read_text())
    recipe["failing_rows"] = [1]
    path.write_text(json.dumps(recipe))
    with pytest.raises(FixtureError, match="does not match its content digest"):
        load_recipe(path)
    recipe["digest"] = _file_digest(recipe)
    path.write_text(json.dumps(recipe))
    assert load_recipe(path)["failing_rows"] == [1]


def test_a_bad_recipe_fails_its_replay_with_the_field_not_a_traceback(pytester, tmp_path, good_recipe):
    path = written(tmp_path, with_spec(good_recipe, block_size=0))
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--rootdir", str(ROOT), str(ROOT / "tests"),
                                          f"--replay={path}", "-p", "no:xdist")
    out = "\n".join(result.outlines)
    assert result.ret == 1 and "1 failed" in out, out[-2000:]
    assert "recipe field 'spec.block_size' is int 0, expected an int >= 1" in out, out[-2000:]
    assert "ZeroDivisionError" not in out and "Traceback" not in out, out[-2000:]
