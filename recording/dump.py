"""Writing a failing case under ``--dump-failures``: only when a test has failed, the noted case
is shrunk on the implementation under test (:mod:`recording.shrink`) and written as a small
fixture with its standalone reproducer (:mod:`recording.repro`), or as a recipe
(:mod:`recording.recipe`) where even the shrunk fixture is larger than
:data:`recording.shrink.MAX_FIXTURE_BYTES`. A batch too large to build whole whose plan is
wrong on some rows is written as the fixture of those rows (:func:`fixture_of_failing_rows`);
one whose plan is right on every row failed in its kernel run, which only the whole batch
shows: a recipe. A step whose plan is wrong only on its own block table (its fixture's host
stages re-run over the stored slots as one block of size 1) is a recipe too. Each recipe says
why it is one (``why``). Nothing here runs for a passing test.
"""

from __future__ import annotations

import time
from pathlib import Path

from .case_log import fixture_of_rows, plan_failing_rows
from .fixture import Fixture, save_fixture
from .recipe import RECIPE_SUFFIX, recipe_of_scenario, recipe_of_step, save_recipe
from .repro import write_repro
from .shrink import MAX_FIXTURE_BYTES, fixture_bytes, shrink_fixture
from .step_size import MAX_FAILING_ROWS, build_bytes, smallest_rows

WHY_TOO_LARGE = ("a batch too large to build whole whose plan is right on every row: the failure is in its "
                 "kernel run, which only the whole batch shows")
WHY_PASSES_ITS_REPLAY = ("the noted case passes its replay through the implementation under test (the test failed "
                         "on a check the replay does not make): a file of it would not reproduce the failure")
WHY_OWN_BLOCK_TABLE = ("the step's plan is wrong as the implementation made it on the step's own block table, and "
                       "right when its fixture's host stages re-run over the stored slots as one block of size 1: "
                       "the recipe rebuilds the step, block table and all")


class NothingToWrite(Exception):
    """A failing test whose case is not written; the message says why."""


def why_shrunk_too_large(shrunk: dict | None, size: int) -> str:
    """Why a failing case is a recipe: what its shrinking tried and the size it ended at."""
    if not isinstance(shrunk, dict):
        where = "the failing case (not shrunk)"
    else:
        to = shrunk["to"]
        where = (f"the failing case, shrunk to {to['rows']} rows x {to['heads']} heads among the candidates that fail "
                 f"the same checks ({shrunk['candidates_tried']} tried),")
    return (f"{where} holds {size} bytes of tensors, over the {MAX_FIXTURE_BYTES}-byte fixture limit: its rows "
            "(failing_rows) are rebuilt from the spec and seed on replay")
WHY_FAILING_ROWS = ("a batch too large to build whole: the fixture of the rows whose plan is wrong, built from the "
                    "scenario (q drawn per row)")


def fixture_of_failing_rows(step, **meta) -> Fixture | None:
    """The fixture of the rows of ``step`` whose plan is wrong (at most :data:`MAX_FAILING_ROWS`),
    or None where the plan is right on every row (or the rows cannot be built apart)."""
    rows = plan_failing_rows(step)
    if not rows:
        return None
    built_from = dict(rows=step.num_planned, heads=step.scenario.spec.num_heads, bytes=build_bytes(step))
    return fixture_of_rows(step, smallest_rows(step, rows, MAX_FAILING_ROWS), why=WHY_FAILING_ROWS,
                           built_from=built_from, **meta)


def write_step_recipe(directory, file_name: str, step, **meta) -> Path | None:
    """The recipe of a noted step, written without building its fixture (None where its spec
    and seed do not rebuild it)."""
    recipe = recipe_of_step(step, **meta)
    return None if recipe is None else save_recipe(Path(directory) / f"{file_name}{RECIPE_SUFFIX}", recipe)


#: The metadata of a failing case's fixture that its recipe carries.
RECIPE_META = ("name", "nodeid", "impl", "vllm", "shrunk", "scale_case", "drawn")


def write_failure(directory, name: str, fixture: Fixture, impl=None, step=None, shrink: bool = True,
                  device="cpu") -> Path:
    """Shrink ``fixture`` (the failing case, as built from the noted ``step`` where there is
    one) and write it into ``directory`` as ``name.safetensors`` with ``name.repro.py``, or as
    ``name.recipe.json``; returns the path written. The shrink runs ``impl`` on ``device``
    (the run's). A case that fails nothing when judged is not written: :class:`NothingToWrite`."""
    directory = Path(directory)
    started = time.perf_counter()
    small = shrink_fixture(fixture, impl, device) if shrink else fixture
    if small is None:
        recipe = recipe_of_own_block_table(fixture, step)
        if recipe is None:
            raise NothingToWrite(WHY_PASSES_ITS_REPLAY)
        return save_recipe(directory / f"{name}{RECIPE_SUFFIX}", recipe)
    if isinstance(small.meta.get("shrunk"), dict):
        small.meta["shrunk"]["seconds"] = round(time.perf_counter() - started, 3)
    size = fixture_bytes(small)
    if size > MAX_FIXTURE_BYTES and step is not None:
        keep = {k: small.meta[k] for k in RECIPE_META if k in small.meta}
        if isinstance(small.meta.get("rows"), list):
            keep["failing_rows"] = small.meta["rows"]
        recipe = recipe_of_step(step, why=why_shrunk_too_large(small.meta.get("shrunk"), size), **keep)
        if recipe is not None:
            return save_recipe(directory / f"{name}{RECIPE_SUFFIX}", recipe)
    path = save_fixture(directory / f"{name}.safetensors", small)
    write_repro(small, path)
    return path


def recipe_of_own_block_table(fixture: Fixture, step) -> dict | None:
    """The recipe of a noted ``step`` whose plan, as the implementation made it on the step's own
    block table, is wrong while its fixture's host stages, re-run over the stored slots as one
    block of size 1, plan it right: only the spec and seed rebuild what failed. None where
    there is no step, the plan as made is right too, or the step is not rebuilt by its spec."""
    from .replay import replay

    if step is None or "plan != intent" not in replay(fixture).failures():
        return None
    meta = {k: fixture.meta[k] for k in RECIPE_META if k in fixture.meta}
    return recipe_of_step(step, why=WHY_OWN_BLOCK_TABLE, **meta)


def write_crash(directory, file_name: str, crash: dict, **meta) -> Path | None:
    """A recipe of a step whose stages killed their process (``crash`` as noted by
    :func:`recording.case_log.note_crash`); None where its spec and seed do not rebuild it."""
    recipe = recipe_of_scenario(
        crash["scenario"], crash["layout"], crashed_at=crash["stage"], crash=crash["detail"], **meta
    )
    return None if recipe is None else save_recipe(Path(directory) / f"{file_name}{RECIPE_SUFFIX}", recipe)
