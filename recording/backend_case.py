"""A failing case of a backend behind the seam (a vLLM release's SM90 backend, FlashMLA, the
port), kept as the steps that rebuild it: ``NAME.case.json``.

``harness.case_runner.run_sequence`` notes what it runs (``harness.case_log.note_backend_case``):
the backend (its name, kernel, release and the sha256 of the module text it loaded), the
layer's row capacity, whether a twin judged the output, and each step so far as its spec and
seed (and the score pattern of its top-k where it has holes). A failing test's case is written
with each step's scenario digest, and the FlashInfer the
step ran on (a release, or the stand-in class of a CPU run). A port's record names its layer
too (its kv_indices layout and whether it keeps its plans), and a step whose device query split
differs from the host's keeps the host's (``host_q_lens``). The layer mode the steps ran in
(``layer_mode``, ``harness.layer_modes``: plain, poisoned workspaces, graphed, against a fresh
layer) is recorded and reopened on replay, the comparison of that mode judged with every step; a
file without it is plain. A single step is a case of one
step; a sequence keeps every step up to the failing one, so a kept plan, a clamp of a kept plan
or a replan is carried into the failing step as the test carried it.

On replay (``pytest --replay=PATH --vllm=PATH``) the steps are rebuilt and run again through
one layer of the backend the run names, each judged as its test judged it
(``pytest_sparse_mla.judge.replay_backend_case``): it fails where a step still fails and passes
once the bug is gone. A release or a module other than the recorded one is one line of the
replay's report (:func:`identity_lines`). A file whose fields are wrong, or whose steps no
longer rebuild bit-exactly, is a :class:`~recording.fixture.FixtureError` naming the field.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from backends.registry import release_digest_problem
from harness.builder import MTP_DRAFT_STEPS
from harness.layer_modes import LAYER_MODES, PLAIN
from reference.indexer import HOLE_KINDS

from .checks import (
    LAYOUTS,
    MAX_BLOCK_SIZE,
    MAX_REQUESTS,
    MAX_ROWS,
    MAX_SEED,
    MAX_STEPS,
    MAX_TOPK,
    a_bool,
    a_dict,
    fields_problem,
    int_in,
    list_of,
    nullable,
    one_of,
    sha256_hex,
    shown,
    spec_problem,
    text,
)
from .fixture import FixtureError
from .recipe import load_checked, save_with_digest, scenario_digest

CASE_SUFFIX = ".case.json"
CASE_KEY = "sparse_mla_backend_case"
CASE_VERSION = 1
KINDS = ("step", "sequence")

BACKEND_FIELDS = {"name": text, "kernel": nullable(text), "release": nullable(text),
                  "module_digest": nullable(sha256_hex)}
#: A port's layer (``harness.case_runner.port_layer``); absent: the default layout, compacted, planned every step.
OPTIONAL_BACKEND_FIELDS = {"layout": one_of(*LAYOUTS), "reuse_plan": a_bool}
REQUIRED_FIELDS = {
    CASE_KEY: int_in(CASE_VERSION, CASE_VERSION), "kind": one_of(*KINDS), "backend": a_dict,
    "max_tokens": int_in(1, MAX_ROWS), "twin": a_bool, "compare": a_bool, "with_inputs": a_bool,
    "steps": lambda v: None, "name": text, "digest": sha256_hex,
}
OPTIONAL_FIELDS = {"vllm": text, "impl": text, "nodeid": text, "flashinfer": text, "why": text, "drawn": text,
                   "adaptive_verification": a_bool, "rejected_drafts": int_in(0, MAX_TOPK),
                   "mtp_draft_step": int_in(0, max(MTP_DRAFT_STEPS)),
                   "kv_block_stride": nullable(int_in(1, 64 * MAX_BLOCK_SIZE)), "layer_mode": one_of(*LAYER_MODES)}
STEP_FIELDS = {"spec": lambda v: None, "seed": int_in(0, MAX_SEED), "scenario_digest": sha256_hex}
#: The score pattern of a step's top-k where it has holes (``harness.topk_holes.TopkHoles``), and
#: the host's query split where the device's (the spec's own) differs from it
#: (``harness.builder.with_host_query_split``): each request's query rows on the host.
OPTIONAL_STEP_FIELDS = {"holes": a_dict,
                        "host_q_lens": list_of(int_in(0, MAX_ROWS), f"ints from 0 to {MAX_ROWS}", most=MAX_REQUESTS)}
HOLES_FIELDS = {"kind": one_of(*HOLE_KINDS), "count": int_in(1, MAX_TOPK)}


def is_backend_case(path) -> bool:
    return str(path).endswith(CASE_SUFFIX)


def step_record(spec, seed: int, holes, rejected_drafts: int = 0, host_q_lens=None, mtp_draft_step: int = 0) -> dict:
    """One step of a case file: its spec, seed, the score pattern of its top-k where it has holes
    (``harness.topk_holes.TopkHoles``), the host's query split where the device's differs, and the
    digest of the scenario they build."""
    from harness.case_runner import scenario_of_step

    scenario = scenario_of_step(spec, seed, holes, host_q_lens, rejected_drafts=rejected_drafts,
                                mtp_draft_step=mtp_draft_step)
    record = {"spec": dataclasses.asdict(spec), "seed": int(seed), "scenario_digest": scenario_digest(scenario)}
    if holes is not None:
        record["holes"] = {"kind": holes.kind, "count": int(holes.count)}
    if host_q_lens is not None:
        record["host_q_lens"] = [int(q) for q in host_q_lens]
    return record


def holes_of(step: dict):
    """The ``TopkHoles`` of a step of a case file, or None."""
    from harness.topk_holes import TopkHoles

    holes = step.get("holes")
    return None if holes is None else TopkHoles(holes["kind"], holes["count"])


def case_record(case: dict, **meta) -> dict:
    """The JSON of a noted backend case (``meta``: name, nodeid, vllm, why, ...)."""
    steps = [step_record(step["spec"], step["seed"], step.get("holes"), case["rejected_drafts"],
                         step.get("host_q_lens"), case.get("mtp_draft_step", 0)) for step in case["steps"]]
    return {CASE_KEY: CASE_VERSION, "kind": case["kind"], "backend": dict(case["backend"]),
            "max_tokens": int(case["max_tokens"]), "twin": bool(case["twin"]), "compare": bool(case["compare"]),
            "with_inputs": bool(case["with_inputs"]), "adaptive_verification": bool(case["adaptive_verification"]),
            "rejected_drafts": int(case["rejected_drafts"]), "kv_block_stride": case["kv_block_stride"],
            "mtp_draft_step": int(case.get("mtp_draft_step", 0)),
            "steps": steps, "flashinfer": case["flashinfer"], "layer_mode": case.get("layer_mode", PLAIN),
            **{k: v for k, v in meta.items() if v is not None}}


def write_backend_case(directory, name: str, case: dict, **meta) -> Path:
    """Write the noted case as ``directory/name.case.json``."""
    return save_with_digest(Path(directory) / f"{name}{CASE_SUFFIX}", case_record(case, name=name, **meta))


def case_problem(record: dict) -> str | None:
    """The first thing wrong with a backend case's fields (None: every field known and valid)."""
    problem = fields_problem(record, REQUIRED_FIELDS, OPTIONAL_FIELDS, "case")
    if problem:
        return problem
    problem = fields_problem(record["backend"], BACKEND_FIELDS, OPTIONAL_BACKEND_FIELDS, "case", "backend.")
    if problem:
        return problem
    backend = record["backend"]
    problem = release_digest_problem(backend["name"], backend["release"], backend["module_digest"])
    if problem:
        return f"case {problem}"
    steps = record["steps"]
    if not isinstance(steps, list) or not 1 <= len(steps) <= MAX_STEPS:
        return f"case field 'steps' is not a list of 1 to {MAX_STEPS} {{spec, seed, scenario_digest}} objects"
    if record["kind"] == "step" and len(steps) != 1:
        return f"case field 'steps' holds {len(steps)} steps, a case of kind 'step' one"
    for i, step in enumerate(steps):
        if not isinstance(step, dict):
            return f"case field 'steps[{i}]' is not a {{spec, seed, scenario_digest[, holes, host_q_lens]}} object"
        problem = fields_problem(step, STEP_FIELDS, OPTIONAL_STEP_FIELDS, "case", f"steps[{i}].")
        if problem:
            return problem
        if "holes" in step:
            problem = fields_problem(step["holes"], HOLES_FIELDS, {}, "case", f"steps[{i}].holes.")
            if problem:
                return problem
        problem = spec_problem(step["spec"], "case", f"steps[{i}].spec.")
        if problem:
            return problem
        if "host_q_lens" in step:
            problem = host_split_field_problem(step["spec"], step["host_q_lens"], f"steps[{i}].host_q_lens")
            if problem:
                return problem
    return None


def host_split_field_problem(spec: dict, host_q_lens: list[int], name: str) -> str | None:
    """Why a step's ``host_q_lens`` is no host split vLLM's runner makes beside the step's device
    split (its spec's own: ``harness.builder.host_split_problem``), or None."""
    from harness.builder import host_split_problem
    from harness.spec import spec_from_dict

    problem = host_split_problem(spec_from_dict(spec), host_q_lens)
    return None if problem is None else f"case field '{name}' is {shown(host_q_lens)}, not a host split: {problem}"


def load_backend_case(path) -> dict:
    """Read and check one case file, and check that each step's spec and seed still build the
    recorded scenario; any problem is a FixtureError naming the file and the field."""
    from harness.case_runner import scenario_of_step
    from harness.spec import spec_from_dict

    path = Path(path)
    record = load_checked(path, "case", CASE_KEY, CASE_VERSION, case_problem)
    for i, step in enumerate(record["steps"]):
        scenario = scenario_of_step(spec_from_dict(step["spec"]), step["seed"], holes_of(step),
                                    step.get("host_q_lens"), rejected_drafts=record.get("rejected_drafts", 0),
                                    mtp_draft_step=record.get("mtp_draft_step", 0))
        if scenario_digest(scenario) != step["scenario_digest"]:
            raise FixtureError(f"{path}: case field 'steps[{i}].scenario_digest' is not the digest of the scenario "
                               f"step {i}'s spec and seed build: the step's spec or seed was changed, or the scenario "
                               "builder changed since the case was written")
    return record


def steps_of(record: dict) -> list[tuple]:
    """``(spec, seed, holes, host_q_lens)`` of each step of a loaded case (``harness.case_runner.scenario_of_step``'s
    arguments)."""
    from harness.spec import spec_from_dict

    return [(spec_from_dict(step["spec"]), step["seed"], holes_of(step), step.get("host_q_lens"))
            for step in record["steps"]]


def identity_lines(record: dict, backend) -> list[str]:
    """What differs between the backend a case was written on and the one replaying it: the
    release, the module text (its sha256), the FlashInfer; one line each, none where they agree."""
    from harness.case_runner import backend_identity, flashinfer_in_use

    recorded, now = record["backend"], backend_identity(backend)
    lines = []
    if recorded.get("release") != now["release"]:
        lines.append(f"  release: written on {recorded['name']} {recorded.get('release')}, replayed on "
                     f"{now['name']} {now['release']}")
    if recorded.get("module_digest") != now["module_digest"]:
        lines.append(f"  module: written on a module of sha256 {str(recorded.get('module_digest'))[:16]}, replayed on "
                     f"{str(now['module_digest'])[:16]} (the code under test differs)")
    if record.get("flashinfer") and record["flashinfer"] != flashinfer_in_use():
        lines.append(f"  flashinfer: written on {record['flashinfer']}, replayed on {flashinfer_in_use()}")
    return lines
