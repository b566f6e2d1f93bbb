"""Sequences: a failure that needs several steps to show, kept as the steps that rebuild it.

A multi-step test notes its sequence (``harness.case_log.note_sequence``, then each step). When
it fails under ``--dump-failures``, :func:`write_failing_sequence` runs the sequence again
through the implementation under test with the state carried as the test carried it
(``harness.port.sequence``), drops every step whose absence keeps it failing (the step where the
failure shows always stays), and writes ``NAME.sequence.json``: the kind of carried state, the
layout, the row capacity, and each step's spec, seed and scenario digest, with the
implementation and the test. On replay (``pytest --replay=PATH``) the sequence is rebuilt and run
again the same way: it fails where the steps still fail and passes once the bug is fixed. A
sequence whose steps no longer rebuild bit-exactly, or whose fields are wrong, is a
:class:`~recording.fixture.FixtureError` naming the field.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from .checks import (
    LAYOUTS,
    MAX_ROWS,
    MAX_SEED,
    MAX_STEPS,
    a_bool,
    a_dict,
    field_problem,
    fields_problem,
    impl_spec,
    int_in,
    one_of,
    sha256_hex,
    spec_problem,
    text,
)
from .fixture import FixtureError
from .recipe import load_checked, save_with_digest, scenario_digest

SEQUENCE_SUFFIX = ".sequence.json"
SEQUENCE_KEY = "sparse_mla_sequence"
SEQUENCE_VERSION = 1
#: Seconds the shrink over steps may spend re-running the sequence.
SHRINK_SECONDS = 60.0
KINDS = ("reused-buffers", "attention-state")

REQUIRED_FIELDS = {
    SEQUENCE_KEY: int_in(SEQUENCE_VERSION, SEQUENCE_VERSION), "kind": one_of(*KINDS), "layout": one_of(*LAYOUTS),
    "max_rows": int_in(1, MAX_ROWS), "graph": a_bool, "reuse_plan": a_bool, "steps": lambda v: None, "name": text,
    "failing_step": int_in(0, MAX_STEPS - 1), "why": text, "digest": sha256_hex,
}
OPTIONAL_FIELDS = {"impl": impl_spec, "vllm": text, "nodeid": text, "shrunk": a_dict}
STEP_FIELDS = {"spec": lambda v: None, "seed": int_in(0, MAX_SEED), "scenario_digest": sha256_hex}


def is_sequence(path) -> bool:
    return str(path).endswith(SEQUENCE_SUFFIX)


def sequence_of_note(note: dict):
    """The :class:`harness.port.sequence.Sequence` a case log noted."""
    from harness.port.sequence import Sequence

    return Sequence(kind=note["kind"], layout=note["layout"], steps=tuple(note["steps"]),
                    max_rows=int(note["max_rows"]), graph=bool(note.get("graph", False)),
                    reuse_plan=bool(note.get("reuse_plan", False)))


def sequence_recipe(sequence, **meta) -> dict:
    """The JSON of a sequence (``meta``: name, why, failing_step, impl, nodeid, ...)."""
    steps = [{"spec": dataclasses.asdict(s.spec), "seed": int(s.seed), "scenario_digest": scenario_digest(s)}
             for s in sequence.scenarios()]
    return {SEQUENCE_KEY: SEQUENCE_VERSION, "kind": sequence.kind, "layout": sequence.layout,
            "max_rows": int(sequence.max_rows), "graph": sequence.graph, "reuse_plan": sequence.reuse_plan,
            "steps": steps, **meta}


def save_sequence(path, recipe: dict) -> Path:
    return save_with_digest(path, recipe)


def sequence_problem(recipe: dict) -> str | None:
    """The first thing wrong with a sequence's fields (None: every field known and valid)."""
    problem = fields_problem(recipe, REQUIRED_FIELDS, OPTIONAL_FIELDS, "sequence")
    if problem:
        return problem
    steps = recipe["steps"]
    if not isinstance(steps, list) or not 1 <= len(steps) <= MAX_STEPS:
        return (f"sequence field 'steps' is not a list of 1 to {MAX_STEPS} {{spec, seed, scenario_digest}} objects"
                + (f" (it holds {len(steps)})" if isinstance(steps, list) and steps else ""))
    for i, step in enumerate(steps):
        if not isinstance(step, dict) or set(step) != set(STEP_FIELDS):
            return f"sequence field 'steps[{i}]' is not a {{spec, seed, scenario_digest}} object"
        for name, check in STEP_FIELDS.items():
            problem = field_problem(f"steps[{i}].{name}", step[name], check, "sequence")
            if problem:
                return problem
        problem = spec_problem(step["spec"], "sequence", f"steps[{i}].spec.")
        if problem:
            return problem
    rows = max(sum(r["q_len"] for r in step["spec"]["requests"]) + step["spec"]["padded_rows"] for step in steps)
    if recipe["max_rows"] < rows:
        return (f"sequence field 'max_rows' is {recipe['max_rows']}, expected at least the {rows} rows of its largest "
                "step")
    if recipe["failing_step"] >= len(steps):
        return (f"sequence field 'failing_step' is {recipe['failing_step']}, expected a step of the sequence "
                f"(0 to {len(steps) - 1})")
    return None


def load_sequence(path):
    """Read, check and rebuild one sequence file: ``(harness.port.sequence.Sequence, recipe)``. Any
    problem is a FixtureError naming the file and the field."""
    from harness.port.sequence import Sequence
    from harness.scenario import build_scenario, spec_from_dict

    path = Path(path)
    recipe = load_checked(path, "sequence", SEQUENCE_KEY, SEQUENCE_VERSION, sequence_problem)
    steps = []
    for i, step in enumerate(recipe["steps"]):
        spec = spec_from_dict(step["spec"])
        if scenario_digest(build_scenario(spec, step["seed"])) != step["scenario_digest"]:
            raise FixtureError(f"{path}: sequence field 'steps[{i}].scenario_digest' is not the digest of the scenario "
                               f"step {i}'s spec and seed build: the step's spec or seed was changed, or the scenario "
                               "builder changed since the sequence was written")
        steps.append((spec, step["seed"]))
    sequence = Sequence(kind=recipe["kind"], layout=recipe["layout"], steps=tuple(steps),
                        max_rows=recipe["max_rows"], graph=recipe["graph"], reuse_plan=recipe["reuse_plan"])
    return sequence, recipe


def why_of(failing_step: int, steps: int, after: int, dropped: int, runs: int, complete: bool) -> str:
    """What the written sequence is, in words that are true of it."""
    tried = "every earlier step was tried" if complete else f"the shrink stopped after {runs} runs"
    return (f"the failure shows at step {failing_step} of {steps} steps run through state carried from step to "
            f"step; the {after} steps the test ran after it were left out, and {dropped} earlier steps were dropped "
            f"because it still failed without each ({tried}); each step's rows are kept whole")


def write_failing_sequence(directory, name: str, note: dict, implementation, device, features=None,
                           **meta) -> Path | None:
    """Shrink the noted sequence over its steps on ``implementation`` (the object under test;
    ``meta``'s ``impl`` is its spec) and write it; None where it does not fail when run again (a
    failure the sequence alone does not carry)."""
    impl = implementation
    from harness.port.sequence import first_failure, run_recorded_sequence, shrink_sequence

    sequence = sequence_of_note(note)
    deadline = time.perf_counter() + SHRINK_SECONDS
    failing = first_failure(run_recorded_sequence(impl, sequence, device, features))
    if failing is None:
        return None

    def fails(candidate) -> bool:
        return time.perf_counter() < deadline and \
            first_failure(run_recorded_sequence(impl, candidate, device, features)) is not None

    # The steps after the first failing one add nothing: it already shows there.
    cut = dataclasses.replace(sequence, steps=sequence.steps[: failing.index + 1])
    small, runs = shrink_sequence(cut, fails)
    final = first_failure(run_recorded_sequence(impl, small, device, features))
    if final is None:  # the shrink ran out of time mid-way: keep the cut sequence
        small, final = cut, failing
    complete = time.perf_counter() < deadline
    recipe = sequence_recipe(
        small, name=name, failing_step=final.index,
        why=why_of(final.index, len(small.steps), len(sequence.steps) - len(cut.steps),
                   len(cut.steps) - len(small.steps), runs, complete),
        shrunk={"steps_before": len(sequence.steps), "steps_after": len(small.steps), "runs": runs,
                "problems": final.problems[:4]},
        **meta,
    )
    return save_sequence(Path(directory) / f"{name}{SEQUENCE_SUFFIX}", recipe)
