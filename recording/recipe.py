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

from .fixture import FixtureError, tensor_digest

RECIPE_SUFFIX = ".recipe.json"
RECIPE_KEY = "sparse_mla_recipe"
RECIPE_VERSION = 1
LAYOUTS = ("strided", "packed", "compacted")
HEX64 = frozenset("0123456789abcdef")


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


def load_checked(path, kind: str, key: str, version: int, problem_of) -> dict:
    """Read one JSON case file of ``kind`` (``key``: ``version`` marks it), check its fields with
    ``problem_of`` and its content digest; any problem is a FixtureError naming the file and
    the field."""
    path = Path(path)
    if not path.is_file():
        raise FixtureError(f"{path}: no such file")
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FixtureError(f"{path}: not a JSON {kind}: {exc}") from exc
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


def _shown(value) -> str:
    return f"{type(value).__name__} {json.dumps(value)[:60]}"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (_is_int(value) or isinstance(value, float)) and value == value and abs(value) != float("inf")


def int_at_least(low: int):
    def check(value) -> str | None:
        return None if _is_int(value) and value >= low else f"expected an int >= {low}"
    return check


def positive_number(value) -> str | None:
    return None if _is_number(value) and value > 0 else "expected a finite number > 0"


def a_bool(value) -> str | None:
    return None if isinstance(value, bool) else "expected true or false"


def text(value) -> str | None:
    return None if isinstance(value, str) else "expected a string"


def one_of(*allowed):
    def check(value) -> str | None:
        return None if value in allowed and isinstance(value, str) else f"expected one of {', '.join(allowed)}"
    return check


def sha256_hex(value) -> str | None:
    ok = isinstance(value, str) and len(value) == 64 and set(value) <= HEX64
    return None if ok else "expected 64 hexadecimal digits (a SHA-256)"


def impl_spec(value) -> str | None:
    ok = isinstance(value, str) and value.count(":") == 1 and all(value.split(":"))
    return None if ok else "expected MODULE:FACTORY"


def a_dict(value) -> str | None:
    return None if isinstance(value, dict) else "expected an object"


def requests(value) -> str | None:
    if not isinstance(value, list):
        return "expected a list of {seq_len, q_len} objects"
    for r in value:
        if not (isinstance(r, dict) and set(r) == {"seq_len", "q_len"} and all(_is_int(v) and v >= 0
                                                                               for v in r.values())):
            return f"expected a list of {{seq_len, q_len}} objects of ints >= 0, got an entry {_shown(r)}"
    return None


def width(value) -> str | None:
    return None if value is None or (_is_int(value) and value >= 1) else "expected null or an int >= 1"


def score_offsets(value) -> str | None:
    ok = isinstance(value, list) and all(_is_number(v) for v in value)
    return None if ok else "expected a list of finite numbers"


#: Each field of a recipe's ``spec`` (a :class:`harness.spec.BatchSpec` as JSON) with its check.
SPEC_FIELDS = {
    "requests": requests, "topk": int_at_least(1), "kpool": int_at_least(1), "width": width,
    "block_size": int_at_least(1), "rope": a_bool, "kv_dtype": one_of("bfloat16", "float8_e4m3fn"),
    "k_scale": positive_number, "num_heads": int_at_least(1), "sm_scale": positive_number,
    "async_scheduling": a_bool, "host_bound_slack": int_at_least(0), "decode_threshold": int_at_least(1),
    "padded_rows": int_at_least(0), "table_slack": int_at_least(0), "spare_blocks": int_at_least(0),
    "min_block_id": int_at_least(1), "score_offsets": score_offsets, "split_score_signs": a_bool,
    "with_host_bound": a_bool, "with_positions": a_bool,
}
#: Fields of a recipe's ``spec`` that recipes written before them lack (absent: the default).
OPTIONAL_SPEC_FIELDS = {"full_graph": a_bool}
#: Each field every recipe has, with its check (``spec``'s fields: :data:`SPEC_FIELDS`).
REQUIRED_FIELDS = {
    RECIPE_KEY: int_at_least(RECIPE_VERSION), "spec": a_dict, "seed": int_at_least(0), "layout": one_of(*LAYOUTS),
    "max_rows": int_at_least(1), "scenario_digest": sha256_hex, "name": text, "digest": sha256_hex,
}
#: Each field a recipe may have, with its check (``failing_rows``: :func:`failing_rows_problem`).
OPTIONAL_FIELDS = {
    "impl": impl_spec, "vllm": text, "nodeid": text, "why": text, "scale_case": text, "rows": int_at_least(0),
    "failing_rows": lambda value: None, "shrunk": a_dict, "too_large_to_build": int_at_least(0),
    "crashed_at": text, "crash": text, "drawn": text,
}


def field_problem(name: str, value, check, kind: str = "recipe") -> str | None:
    """``recipe field 'NAME' is TYPE VALUE, expected ...`` where ``check`` refuses ``value``."""
    wrong = check(value)
    return None if wrong is None else f"{kind} field '{name}' is {_shown(value)}, {wrong}"


def fields_problem(data: dict, required: dict, optional: dict, kind: str = "recipe", prefix: str = "",
                   unknown: str | None = None) -> str | None:
    """The first field of ``data`` missing, unknown, or refused by its check (``required`` and
    ``optional``: field -> check), named ``prefix + name`` (an unknown one "is not ``unknown``",
    by default a ``kind`` field)."""
    for name in required:
        if name not in data:
            return f"{kind} field '{prefix}{name}' is missing"
    for name in data:
        if name not in required and name not in optional:
            return f"{kind} field '{prefix}{name}' is not {unknown or f'a {kind} field'}"
    for name, check in {**required, **optional}.items():
        problem = field_problem(prefix + name, data[name], check, kind) if name in data else None
        if problem:
            return problem
    return None


def spec_problem(spec: dict) -> str | None:
    """What is wrong with a recipe's ``spec``: a missing, unknown or ill-typed field, or values
    the batch spec refuses together (its own message)."""
    problem = fields_problem(spec, SPEC_FIELDS, OPTIONAL_SPEC_FIELDS, prefix="spec.", unknown="a field of a batch spec")
    if problem:
        return problem
    from harness.spec import spec_from_dict

    try:
        spec_from_dict(spec)
    except (TypeError, ValueError) as exc:
        return f"recipe field 'spec' is not a batch spec: {exc}"
    return None


def planned_rows_of(spec: dict) -> int:
    """The rows the batch of a (valid) recipe spec plans, without building it."""
    from harness.builder import plan_rows
    from harness.spec import spec_from_dict

    return plan_rows(spec_from_dict(spec)).planned_rows


def failing_rows_problem(rows, planned: int) -> str | None:
    """``failing_rows`` lists rows of the batch its spec builds: distinct ints from 0 to the
    ``planned`` rows less one."""
    ok = isinstance(rows, list) and all(_is_int(r) and 0 <= r < planned for r in rows) and len(set(rows)) == len(rows)
    if ok and rows:
        return None
    return (f"recipe field 'failing_rows' is {_shown(rows)}, expected a non-empty list of distinct rows of the batch "
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
            f"{path}: the spec and seed no longer rebuild the recorded scenario (scenario digest differs)"
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
