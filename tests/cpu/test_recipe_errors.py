"""Malformed recipes: every field is checked when a recipe is loaded, so a recipe whose fields
are wrong, even one whose digest was recomputed after the change, is a FixtureError naming the
field and the bad value, on its own and through ``--replay``; never a traceback from the
scenario builder (block size 0), an IndexError (a failing row past the batch) or a verdict on
the plan (a negative row)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recording.checks import OPTIONAL_SPEC_FIELDS, SPEC_FIELDS
from recording.fixture import FixtureError
from recording.recipe import (
    OPTIONAL_FIELDS,
    REQUIRED_FIELDS,
    _file_digest,
    load_recipe,
    recipe_of_scenario,
    save_recipe,
)

ROOT = Path(__file__).resolve().parents[2]
MAX_SEED = "9223372036854775807"


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
    "block-size-0": (lambda r: with_spec(r, block_size=0),
                     "'spec.block_size' is int 0, expected an int from 1 to 4096"),
    "failing-row-past-the-batch": (lambda r: dict(r, failing_rows=[999]),
                                   "'failing_rows' is list [999], expected a non-empty list of distinct rows of the "
                                   "batch (0 to 2: its spec plans 3 rows)"),
    "failing-row-negative": (lambda r: dict(r, failing_rows=[-1]), "'failing_rows' is list [-1]"),
    "failing-rows-repeated": (lambda r: dict(r, failing_rows=[0, 0]), "'failing_rows' is list [0, 0]"),
    "failing-rows-empty": (lambda r: dict(r, failing_rows=[]), "'failing_rows' is list []"),
    "failing-row-as-string": (lambda r: dict(r, failing_rows=["0"]), "'failing_rows' is list [\"0\"]"),
    "seed-as-string": (lambda r: dict(r, seed="3"), "'seed' is str \"3\", expected an int from 0 to " + MAX_SEED),
    "seed-as-bool": (lambda r: dict(r, seed=True), "'seed' is bool true, expected an int from 0 to " + MAX_SEED),
    "seed-negative": (lambda r: dict(r, seed=-3), "'seed' is int -3, expected an int from 0 to " + MAX_SEED),
    "seed-past-63-bits": (lambda r: dict(r, seed=2**63), "'seed' is int 9223372036854775808, expected an int from 0 "
                                                         "to " + MAX_SEED),
    "layout-unknown": (lambda r: dict(r, layout="paged"),
                       "'layout' is str \"paged\", expected one of strided, packed, compacted"),
    "max-rows-zero": (lambda r: dict(r, max_rows=0), "'max_rows' is int 0, expected an int from 1 to 65536"),
    "max-rows-past-its-bound": (lambda r: dict(r, max_rows=10**6), "'max_rows' is int 1000000, expected an int from "
                                                                   "1 to 65536"),
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
    "k-scale-zero": (lambda r: with_spec(r, k_scale=0.0), "'spec.k_scale' is float 0.0, expected a finite number in "
                                                        "(0, 1024]"),
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
    assert "recipe field 'spec.block_size' is int 0, expected an int from 1 to 4096" in out, out[-2000:]
    assert "ZeroDivisionError" not in out and "Traceback" not in out, out[-2000:]


# --- each field of a spec within its bound, one line, nothing built -----------------------------


@pytest.fixture
def nothing_built(monkeypatch):
    """Fails the test where the scenario builder is called: a bad recipe stops before it."""
    import harness.builder
    import harness.scenario

    def refuse(*args, **kwargs):
        raise AssertionError("the scenario builder ran on a recipe that should have been refused")

    monkeypatch.setattr(harness.scenario, "build_scenario", refuse)
    monkeypatch.setattr(harness.builder, "build_scenario", refuse)


ONE = {"seq_len": 1, "q_len": 1}
#: Each field of a recipe's spec past its bound (and each size a spec may ask for), and its line.
SPEC_BOUNDS = {
    "topk-1e9": (dict(topk=10**9), "'spec.topk' is int 1000000000, expected an int from 1 to 2048"),
    "kpool": (dict(kpool=10**6), "'spec.kpool' is int 1000000, expected an int from 1 to 2048"),
    "width": (dict(width=10**9), "'spec.width' is int 1000000000, expected null or an int from 1 to 4096"),
    "block_size": (dict(block_size=10**6), "'spec.block_size' is int 1000000, expected an int from 1 to 4096"),
    "rope": (dict(rope="yes"), "'spec.rope' is str \"yes\", expected true or false"),
    "kv_dtype": (dict(kv_dtype="int4"), "'spec.kv_dtype' is str \"int4\", expected one of bfloat16, float8_e4m3fn"),
    "k_scale": (dict(k_scale=-1.0), "'spec.k_scale' is float -1.0, expected a finite number in (0, 1024]"),
    "num_heads": (dict(num_heads=10**4), "'spec.num_heads' is int 10000, expected an int from 1 to 256"),
    "sm_scale-nan": (dict(sm_scale=float("nan")), "'spec.sm_scale' is float NaN, expected a finite number in (0, 16]"),
    "sm_scale-1e300": (dict(sm_scale=1e300), "'spec.sm_scale' is float 1e+300, expected a finite number in (0, 16]"),
    "async_scheduling": (dict(async_scheduling=1), "'spec.async_scheduling' is int 1, expected true or false"),
    "host_bound_slack": (dict(host_bound_slack=10**9), "'spec.host_bound_slack' is int 1000000000, expected an int "
                                                       "from 0 to 1048576"),
    "decode_threshold": (dict(decode_threshold=0), "'spec.decode_threshold' is int 0, expected an int from 1 to "
                                                   "65536"),
    "padded_rows": (dict(padded_rows=10**9), "'spec.padded_rows' is int 1000000000, expected an int from 0 to 65536"),
    "table_slack": (dict(table_slack=10**9), "'spec.table_slack' is int 1000000000, expected an int from 0 to "
                                             "1048576"),
    "spare_blocks": (dict(spare_blocks=10**9), "'spec.spare_blocks' is int 1000000000, expected an int from 0 to "
                                               "33554432"),
    "min_block_id": (dict(min_block_id=0), "'spec.min_block_id' is int 0, expected an int from 1 to 33554432"),
    "score_offsets": (dict(score_offsets=[1e9]), "'spec.score_offsets' is list [1000000000.0], expected a list of at "
                                                 "most 65536 finite numbers from -1048576 to 1048576"),
    "split_score_signs": (dict(split_score_signs="no"), "'spec.split_score_signs' is str \"no\", expected true or "
                                                        "false"),
    "with_host_bound": (dict(with_host_bound=None), "'spec.with_host_bound' is NoneType null, expected true or false"),
    "with_positions": (dict(with_positions=0), "'spec.with_positions' is int 0, expected true or false"),
    "full_graph": (dict(full_graph="yes"), "'spec.full_graph' is str \"yes\", expected true or false"),
    "a-request-past-its-bound": (dict(requests=[{"seq_len": 10**9, "q_len": 1}]),
                                 "'spec.requests' is list [{\"q_len\": 1, \"seq_len\": 1000000000}], expected a list "
                                 "of at most 65536 {seq_len, q_len} objects of ints from 0 to 1048576, got an entry "
                                 "dict {\"q_len\": 1, \"seq_len\": 1000000000}"),
    "requests-past-their-count": (dict(requests=[ONE] * 65537),
                                  "'spec.requests' is list [{\"q_len\": 1, \"seq_len\": 1}, {\"q_len\": 1, "
                                  "\"seq_len\": 1}, {\"q, expected a list of at most 65536 {seq_len, q_len} objects "
                                  "of ints from 0 to 1048576 (it holds 65537)"),
    "rows": (dict(padded_rows=65536), "'spec' plans 65539 query rows (its requests' q_len and padded_rows), expected "
                                      "at most 65536"),
    "tokens": (dict(requests=[{"seq_len": 1 << 20, "q_len": 1}] * 9),
               "'spec.requests' holds 9437184 tokens, expected at most 8388608"),
    "cache-slots": (dict(min_block_id=1 << 22), "'spec' needs a cache of 268438784 slots ((min_block_id + blocks + "
                                                "spare_blocks) x block_size), expected at most 33554432"),
    "block-table": (dict(requests=[ONE] * 64, table_slack=1 << 20),
                    "'spec' needs a block table of 67108928 entries (requests x (blocks + table_slack)), expected at "
                    "most 33554432"),
    "indexer-entries": (dict(padded_rows=65533, topk=2048, kpool=2048, width=4096),
                        "'spec' needs 268435456 indexer entries (rows x width 4096), expected at most 134217728"),
}


@pytest.mark.parametrize("case", sorted(SPEC_BOUNDS))
def test_each_spec_field_past_its_bound_is_one_line_and_nothing_is_built(tmp_path, good_recipe, nothing_built, case):
    changes, line = SPEC_BOUNDS[case]
    path = written(tmp_path, with_spec(good_recipe, **changes))
    with pytest.raises(FixtureError) as excinfo:
        load_recipe(path)
    assert str(excinfo.value) == f"{path}: recipe field {line}"


@pytest.mark.parametrize(("changes", "line"), [
    (dict(rows=10**9), "recipe field 'rows' is int 1000000000, expected an int from 0 to 65536"),
    (dict(too_large_to_build=-1), "recipe field 'too_large_to_build' is int -1, expected an int >= 0"),
    (dict(crashed_at=3), "recipe field 'crashed_at' is int 3, expected a string"),
    (dict(crash=3), "recipe field 'crash' is int 3, expected a string"),
    (dict(vllm=3), "recipe field 'vllm' is int 3, expected a string"),
    (dict(drawn=3), "recipe field 'drawn' is int 3, expected a string"),
    (dict(nodeid=3), "recipe field 'nodeid' is int 3, expected a string"),
    (dict(why=3), "recipe field 'why' is int 3, expected a string"),
    (dict(scale_case=3), "recipe field 'scale_case' is int 3, expected a string"),
    (dict(sparse_mla_recipe=2), "not a recipe of version 1 (no 'sparse_mla_recipe': 1)"),
])
def test_each_other_recipe_field_is_one_line(tmp_path, good_recipe, nothing_built, changes, line):
    path = written(tmp_path, dict(good_recipe, **changes))
    with pytest.raises(FixtureError) as excinfo:
        load_recipe(path)
    assert str(excinfo.value) == f"{path}: {line}"


def test_a_recipe_whose_seed_was_edited_says_what_changed(tmp_path, good_recipe, device):
    from fast.impl import FastImpl
    from recording.recipe import rebuild_fixture

    path = written(tmp_path, dict(good_recipe, seed=4))
    recipe = load_recipe(path)
    with pytest.raises(FixtureError) as excinfo:
        rebuild_fixture(path, recipe, FastImpl(), device)
    assert str(excinfo.value) == (
        f"{path}: recipe field 'scenario_digest' is not the digest of the scenario its spec and seed build: the spec "
        "or the seed was changed, or the scenario builder changed since the recipe was written")


def test_a_recipe_with_topk_1e9_fails_its_replay_at_load_with_the_bound(pytester, tmp_path, good_recipe):
    path = written(tmp_path, with_spec(good_recipe, topk=10**9))
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--rootdir", str(ROOT), str(ROOT / "tests"),
                                          f"--replay={path}", "-p", "no:xdist")
    line = f"{path}: recipe field 'spec.topk' is int 1000000000, expected an int from 1 to 2048"
    out = "\n".join(result.outlines)
    assert result.ret == 1 and "1 failed" in out, out[-2000:]
    failed = [x for x in result.outlines if x.startswith("FAILED ")]
    assert len(failed) == 1 and failed[0].endswith(f"test_replay.py::test_replay_fixture[{path}] - Failed: {line}"), \
        out[-2000:]
    assert out.count(line) == 2 and "fixture replay diagnostics" not in out, out[-2000:]


@pytest.mark.parametrize("key", ["seed", "layout"])
def test_a_field_given_twice_is_refused_naming_it(tmp_path, good_recipe, key):
    """A file that shows one value for a field and holds another (JSON keeps the last of two):
    refused, even where the value the digest was made of comes last."""
    path = written(tmp_path, good_recipe)
    text = path.read_text()
    shown = {"seed": 999, "layout": "strided"}[key]
    path.write_text(text.replace("{", "{" + json.dumps(key) + ": " + json.dumps(shown) + ", ", 1))
    with pytest.raises(FixtureError, match=f"recipe field '{key}' is given twice"):
        load_recipe(path)
