"""Recipes: a failing case that is too large for a fixture file, kept as what rebuilds it.

A recipe (``NAME.recipe.json``, a few KB) holds the scenario spec and seed, the layout and row
capacity, the implementation it failed under, the test, and the checks it failed; with a
content digest of the file and one of the scenario it rebuilds (indexer rows, block table,
query positions), so a recipe that no longer rebuilds its case bit-exactly is a
:class:`~recording.fixture.FixtureError`, never a verdict. On replay the scenario is rebuilt
from the spec and seed by the one scenario builder, its stages run through the implementation
under test (:func:`harness.pipeline.prepare_step`), and the result is judged as a fixture of
that step (on a GPU, re-run there too).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch

from .checks import (
    LAYOUTS,
    MAX_ROWS,
    MAX_SEED,
    a_dict,
    any_value,
    fields_problem,
    impl_spec,
    int_at_least,
    int_in,
    is_int,
    one_of,
    planned_rows_of,
    sha256_hex,
    shown,
    spec_problem,
    text,
)
from .fixture import FixtureError, tensor_digest

RECIPE_SUFFIX = ".recipe.json"
RECIPE_KEY = "sparse_mla_recipe"
RECIPE_VERSION = 1


def is_recipe(path) -> bool:
    return str(path).endswith(RECIPE_SUFFIX)


def scenario_digest(scenario) -> str:
    """SHA-256 over what the scenario builder made: indexer rows, block table, query starts, positions."""
    meta = scenario.meta
    parts = [scenario.topk_indices, scenario.block_table, meta.query_start_loc_cpu, meta.seq_lens]
    h = hashlib.sha256()
    for t in parts:
        h.update(tensor_digest(torch.as_tensor(t).cpu()).encode())
    return h.hexdigest()


def _file_digest(recipe: dict) -> str:
    rest = {k: v for k, v in recipe.items() if k != "digest"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def recipe_of_step(step, **meta) -> dict | None:
    """The recipe of a noted step, or None where its spec and seed do not rebuild its scenario
    (a test that changed the scenario it was given)."""
    return recipe_of_scenario(step.scenario, step.layout, step.max_rows, rows=int(step.num_planned), **meta)


def recipe_of_scenario(sc, layout: str, max_rows: int | None = None, **meta) -> dict | None:
    """The recipe of a scenario's step under ``layout`` (None where its spec and seed do not
    rebuild it)."""
    from harness.scenario import build_scenario, spec_from_dict

    spec = dataclasses.asdict(sc.spec)
    try:
        rebuilt = build_scenario(spec_from_dict(spec), sc.seed)
    except (TypeError, ValueError, KeyError):
        return None
    digest = scenario_digest(sc)
    if scenario_digest(rebuilt) != digest:
        return None
    max_rows = max(int(sc.topk_indices.shape[0]), 1) if max_rows is None else int(max_rows)
    return {RECIPE_KEY: RECIPE_VERSION, "spec": spec, "seed": int(sc.seed), "layout": layout, "max_rows": max_rows,
            "scenario_digest": digest, **meta}


def save_with_digest(path, data: dict) -> Path:
    """Write a JSON case file (a recipe, a sequence) with the content digest of the rest."""
    path = Path(path)
    data = dict(data)
    data["digest"] = _file_digest(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, sort_keys=True, indent=1) + "\n")
    return path


class KeyGivenTwice(ValueError):
    """A JSON object of a case file names one key twice (the message: the key)."""


def keys_given_once(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object's pairs as a dict; a key given twice is :class:`KeyGivenTwice`."""
    seen: dict = {}
    for name, value in pairs:
        if name in seen:
            raise KeyGivenTwice(name)
        seen[name] = value
    return seen


def load_checked(path, kind: str, key: str, version: int, problem_of) -> dict:
    """Read one JSON case file of ``kind`` (``key``: ``version`` marks it), check its fields with
    ``problem_of`` and its content digest; any problem is a FixtureError naming the file and
    the field."""
    path = Path(path)
    if not path.is_file():
        raise FixtureError(f"{path}: no such file")
    try:
        data = json.loads(path.read_text(), object_pairs_hook=keys_given_once)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FixtureError(f"{path}: not a JSON {kind}: {exc}") from exc
    except KeyGivenTwice as exc:
        raise FixtureError(f"{path}: {kind} field '{exc}' is given twice: the file shows one value and a reader "
                           "would take another; keep one") from exc
    if not isinstance(data, dict) or data.get(key) != version:
        raise FixtureError(f"{path}: not a {kind} of version {version} (no '{key}': {version})")
    problem = problem_of(data)
    if problem:
        raise FixtureError(f"{path}: {problem}")
    if data.get("digest") != _file_digest(data):
        raise FixtureError(
            f"{path}: the {kind} does not match its content digest: the file was changed after it was written"
        )
    return data


def save_recipe(path, recipe: dict) -> Path:
    return save_with_digest(path, recipe)


def load_recipe(path) -> dict:
    """Read and check one recipe; any problem is a FixtureError naming the file and the field."""
    return load_checked(path, "recipe", RECIPE_KEY, RECIPE_VERSION, recipe_problem)


# --- what a recipe may hold ----------------------------------------------------------------------

#: Each field every recipe has, with its check (``spec``'s fields: :data:`SPEC_FIELDS`).
REQUIRED_FIELDS = {
    RECIPE_KEY: int_in(RECIPE_VERSION, RECIPE_VERSION), "spec": a_dict, "seed": int_in(0, MAX_SEED),
    "layout": one_of(*LAYOUTS), "max_rows": int_in(1, MAX_ROWS), "scenario_digest": sha256_hex, "name": text,
    "digest": sha256_hex,
}
#: Each field a recipe may have, with its check (``failing_rows``: :func:`failing_rows_problem`).
OPTIONAL_FIELDS = {
    "impl": impl_spec, "vllm": text, "nodeid": text, "why": text, "scale_case": text, "rows": int_in(0, MAX_ROWS),
    "failing_rows": any_value, "shrunk": a_dict, "too_large_to_build": int_at_least(0),
    "crashed_at": text, "crash": text, "drawn": text,
}


def failing_rows_problem(rows, planned: int) -> str | None:
    """``failing_rows`` lists rows of the batch its spec builds: distinct ints from 0 to the
    ``planned`` rows less one."""
    ok = isinstance(rows, list) and all(is_int(r) and 0 <= r < planned for r in rows) and len(set(rows)) == len(rows)
    if ok and rows:
        return None
    return (f"recipe field 'failing_rows' is {shown(rows)}, expected a non-empty list of distinct rows of the batch "
            f"(0 to {planned - 1}: its spec plans {planned} rows)")


def recipe_problem(recipe: dict) -> str | None:
    """The first thing wrong with a recipe's fields (None: every field is known and valid)."""
    problem = fields_problem(recipe, REQUIRED_FIELDS, OPTIONAL_FIELDS) or spec_problem(recipe["spec"])
    if problem:
        return problem
    planned = planned_rows_of(recipe["spec"])
    if recipe["max_rows"] < planned:
        return (f"recipe field 'max_rows' is {recipe['max_rows']}, expected at least the {planned} rows its spec "
                "plans")
    return failing_rows_problem(recipe["failing_rows"], planned) if "failing_rows" in recipe else None


def rebuild_fixture(path, recipe: dict, impl, device="cpu", whole: bool = True):
    """The fixture of the recipe's case with its stages run through ``impl`` now; a recipe
    whose spec and seed no longer rebuild its scenario bit-exactly is a FixtureError.

    The stages run on the whole batch; the fixture holds the rows the recipe names
    (``failing_rows``), or, for a batch too large to build whole, the rows whose plan is wrong
    now, else one row per regime (those that read the fewest slots) unless ``whole`` (where
    a kernel re-runs it: a failure that only the whole batch shows)."""
    from harness.pipeline import prepare_step
    from harness.scenario import build_attention_inputs, build_scenario, spec_from_dict

    from . import step_size
    from .case_log import fixture_from_step, fixture_of_rows, plan_failing_rows
    from .fixture import subset_fixture
    from .step_size import MAX_FAILING_ROWS, build_bytes, smallest_rows

    try:
        scenario = build_scenario(spec_from_dict(recipe["spec"]), recipe["seed"])
    except (TypeError, ValueError, KeyError) as exc:
        raise FixtureError(f"{path}: recipe field 'spec' does not build a scenario: {exc}") from exc
    if scenario_digest(scenario) != recipe["scenario_digest"]:
        raise FixtureError(
            f"{path}: recipe field 'scenario_digest' is not the digest of the scenario its spec and seed build: the "
            "spec or the seed was changed, or the scenario builder changed since the recipe was written"
        )
    step = prepare_step(impl, scenario, recipe["layout"], device, max_rows=recipe["max_rows"])
    meta = {k: recipe[k] for k in ("name", "impl", "vllm", "nodeid", "why", "scale_case", "drawn")
            if isinstance(recipe.get(k), str)}
    rows = recipe.get("failing_rows")
    if not isinstance(rows, list) and not whole and build_bytes(step) > step_size.MAX_BUILD_BYTES:
        rows = smallest_rows(step, plan_failing_rows(step) or rows_per_regime(step), MAX_FAILING_ROWS)
    fx = None
    if isinstance(rows, list) and (recipe.get("scale_case") or build_bytes(step) > step_size.MAX_BUILD_BYTES):
        fx = fixture_of_rows(step, rows, source="recipe", **meta)  # q drawn per row, as the scale cases do
    if fx is None:
        fx = fixture_from_step(step, build_attention_inputs(scenario), source="recipe", **meta)
        if isinstance(rows, list):  # the rows with the inputs their test built
            fx = subset_fixture(fx, rows)
    fx.path = Path(path)
    return fx


def rows_per_regime(step) -> list[int]:
    """The planned rows of each regime that reads the fewest KV slots: one row per regime."""
    from .step_size import smallest_rows

    regimes = step.regimes()
    return sorted(smallest_rows(step, [r for r, g in enumerate(regimes) if g == regime], 1)[0]
                  for regime in set(regimes))
