"""Writing a failing case under ``--dump-failures``: only when a test has failed, the noted case
is shrunk on the implementation under test (:mod:`recording.shrink`) and written as a small
fixture with its standalone reproducer (:mod:`recording.repro`), or as a recipe
(:mod:`recording.recipe`) where even the shrunk fixture is larger than
:data:`recording.shrink.MAX_FIXTURE_BYTES` (a failure that shows only at scale). Nothing here
runs for a passing test.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from mla_constants import KV_LORA_RANK

from .fixture import Fixture, save_fixture
from .recipe import RECIPE_SUFFIX, recipe_of_scenario, recipe_of_step, save_recipe
from .repro import write_repro
from .shrink import MAX_FIXTURE_BYTES, fixture_bytes, shrink_fixture

#: A noted step whose fixture would take more host memory than this is written as a recipe
#: without being built (a failing batch of tens of thousands of rows, say).
MAX_BUILD_BYTES = 1 << 30


def build_bytes(step) -> int:
    """About the host bytes the fixture of a noted step takes before shrinking: q and out of
    every planned row, and the KV slots their plans read."""
    spec = step.scenario.spec
    width = KV_LORA_RANK + spec.rope_dim
    slots = int(step.planned_lens.to(torch.int64).sum()) if step.num_planned else 0
    return step.num_planned * spec.num_heads * width * 2 * 2 + slots * width * 2


def write_step_recipe(directory, file_name: str, step, **meta) -> Path | None:
    """The recipe of a noted step, written without building its fixture (None where its spec
    and seed do not rebuild it)."""
    recipe = recipe_of_step(step, **meta)
    return None if recipe is None else save_recipe(Path(directory) / f"{file_name}{RECIPE_SUFFIX}", recipe)


def write_failure(directory, name: str, fixture: Fixture, impl=None, step=None, shrink: bool = True,
                  device="cpu") -> Path:
    """Shrink ``fixture`` (the failing case, as built from the noted ``step`` where there is
    one) and write it into ``directory`` as ``name.safetensors`` with ``name.repro.py``, or as
    ``name.recipe.json``; returns the path written. The shrink runs ``impl`` on ``device``
    (the run's)."""
    directory = Path(directory)
    started = time.perf_counter()
    small = shrink_fixture(fixture, impl, device) if shrink else fixture
    if isinstance(small.meta.get("shrunk"), dict):
        small.meta["shrunk"]["seconds"] = round(time.perf_counter() - started, 3)
    if fixture_bytes(small) > MAX_FIXTURE_BYTES and step is not None:
        keep = {k: small.meta[k] for k in ("name", "nodeid", "impl", "shrunk") if k in small.meta}
        recipe = recipe_of_step(step, **keep)
        if recipe is not None:
            return save_recipe(directory / f"{name}{RECIPE_SUFFIX}", recipe)
    path = save_fixture(directory / f"{name}.safetensors", small)
    write_repro(small, path)
    return path


def write_crash(directory, file_name: str, crash: dict, **meta) -> Path | None:
    """A recipe of a step whose stages killed their process (``crash`` as noted by
    :func:`recording.case_log.note_crash`); None where its spec and seed do not rebuild it."""
    recipe = recipe_of_scenario(
        crash["scenario"], crash["layout"], crashed_at=crash["stage"], crash=crash["detail"], **meta
    )
    return None if recipe is None else save_recipe(Path(directory) / f"{file_name}{RECIPE_SUFFIX}", recipe)
