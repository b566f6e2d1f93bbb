"""The case runner: the one way a test (or a replay, or a script) runs a case through a backend.

:func:`run_case` and :func:`run_sequence` build each step's scenario from its spec and seed
(:func:`scenario_of_step`), open one layer of the backend, build the step's inputs, note the case
for ``--dump-failures`` before each step (:func:`harness.case_log.note_backend_case`, so a failing
case is written as the steps that ran), and run each step through :func:`judged_step`: the judge
(:func:`harness.judge.judge_step`) gives the step's verdict, which goes to the run's
:class:`Reporter` in one call, ``report``. The runner raises a failing verdict's exception; a
known finding met before the last step of a sequence is raised at the end, so that a later
step's failure of another kind is not hidden behind it.

A :class:`Reporter` is what the run answers to: the pytest plugin's ``judge`` fixture
(``pytest_sparse_mla.judge.StepJudge``: a configuration the backend does not serve skips the
test, each verdict's expected findings become strict xfails, the regime table, the upgrade
check's notes), or the base class, which reports nothing (a script, a test of the judge itself).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import sys
from collections.abc import Callable

import torch

from backends.registry import PORT_KERNELS, family_and_release
from backends.seam import StepOutcome

from .backend_step import layer_config, run_step
from .builder import (
    build_scenario,
    host_split_of,
    with_host_query_split,
    with_rejected_drafts,
    with_shared_mtp_indices,
)
from .case_log import note_backend_case
from .device_inputs import AttentionInputs, build_attention_inputs, nan_kv_buffer, with_blocks_apart
from .judge import Twin, Verdict, judge_step, kernel_reads_a_hole
from .layer_modes import CaptureUnsupported, layer_mode_of
from .spec import Scenario
from .topk_holes import TopkHoles, with_topk_holes


class Reporter:
    """What a run of cases answers to. This one reports nothing and runs every configuration:
    ``admit`` raises (or skips) where the run should not open a layer for ``config``; ``report``
    receives each step's verdict, once, before the runner raises its failure;
    ``query_shape_checked()`` says whether the installed FlashInfer refuses q rows other than the
    planned ones at run (a finding of vLLM's padded graph steps depends on it); ``cannot_run``
    is told why a layer's mode cannot run here (a forward no CUDA graph captures), before the
    runner raises :class:`harness.layer_modes.CaptureUnsupported`."""

    def admit(self, backend, config) -> None:
        return None

    def query_shape_checked(self) -> bool:
        return False

    def report(self, verdict: Verdict, scenario: Scenario, label: str, layer) -> None:
        return None

    def cannot_run(self, reason: str) -> None:
        return None


def judged_step(reporter: Reporter, backend, layer, scenario: Scenario, inputs: AttentionInputs | None, *,
                twin: Twin | None = None, compare: bool = True, label: str = "", context_of_step: str = "") -> Verdict:
    """One step of ``scenario`` through ``layer``, judged (:func:`harness.judge.judge_step`), its
    verdict reported to ``reporter`` and returned (its failure not raised)."""
    try:
        verdict = judge_step(backend, layer, scenario, inputs, compare=compare, twin=twin,
                             query_shape_checked=reporter.query_shape_checked, context_of_step=context_of_step)
    except CaptureUnsupported as exc:
        reporter.cannot_run(f"unsupported: {exc}")
        raise
    reporter.report(verdict, scenario, label, layer)
    return verdict


def port_twin(device) -> Twin:
    """The project's own path on FlashInfer's fa3 (``port-fa3``: an exact plan of the intended
    selection, the compacted layout) as a twin."""
    from backends.registry import open_backend

    port = open_backend("port-fa3")

    def twin(scenario: Scenario, inputs: AttentionInputs) -> torch.Tensor:
        layer = port.open_layer(layer_config(scenario.spec, max(scenario.topk_indices.shape[0], 1)), device)
        return run_step(layer, scenario, inputs).out

    return twin


def module_digest(backend) -> str | None:
    """sha256 of the text of the code under test that the backend loaded (``backend.module``'s
    file: a vLLM release's SM90 module or FLASHMLA_SPARSE); None for the project's own port."""
    path = getattr(getattr(backend, "module", None), "__file__", None)
    return file_digest(path) if path else None


@functools.lru_cache(maxsize=16)
def file_digest(path: str) -> str:
    """sha256 of a file's bytes (a loaded module's file does not change while the process runs)."""
    with open(path, "rb") as source:
        return hashlib.sha256(source.read()).hexdigest()


def flashinfer_in_use() -> str:
    """The FlashInfer MLA wrapper the process runs: ``flashinfer X.Y.Z``, or the stand-in class
    (``module:Class``) a CPU run installed as ``flashinfer.mla``; "none" where there is neither."""
    mla = sys.modules.get("flashinfer.mla")
    wrapper = getattr(mla, "BatchMLAPagedAttentionWrapper", None)
    if wrapper is None:
        return "none"
    module = getattr(wrapper, "__module__", "")
    if not module.startswith("flashinfer"):
        return f"{module}:{wrapper.__qualname__}"
    return f"flashinfer {getattr(sys.modules.get('flashinfer'), '__version__', '?')}"


def port_layer(backend) -> dict:
    """What reopens a port's layer as it ran (``backends.flashinfer.port.PortBackend``): its kv_indices layout
    and whether it keeps its plans where rows and lengths repeat; nothing for any other backend."""
    if family_and_release(backend.name)[0] not in PORT_KERNELS:
        return {}
    return {"layout": backend.layout, "reuse_plan": bool(backend.reuse_plan)}


def backend_identity(backend) -> dict:
    """What a written case records of the backend it failed on (for a port, its layer too:
    :func:`port_layer`)."""
    return {"name": backend.name, "kernel": getattr(backend, "kernel", None),
            "release": getattr(backend, "version", None), "module_digest": module_digest(backend),
            **port_layer(backend)}


def in_one_cache(inputs: AttentionInputs, cache: torch.Tensor) -> AttentionInputs:
    """The step's inputs with its KV cache written into the front of ``cache``, the one cache
    every step of a sequence shares (as the engine's does; the rest stays NaN)."""
    flat = cache.view(-1, cache.shape[-1])
    own = inputs.kv_cache.view(-1, cache.shape[-1])
    flat[: own.shape[0]] = own
    return AttentionInputs(inputs.q_nope, inputs.q_pe, cache)


def scenario_of_step(spec, seed: int, holes: TopkHoles | None = None, host_q_lens: list[int] | None = None, *,
                     rejected_drafts: int = 0, mtp_draft_step: int = 0) -> Scenario:
    """The scenario of one step: ``spec`` built with ``seed``, its single-token decodes' host
    bounds counting ``rejected_drafts`` rejected drafts (``harness.builder.with_rejected_drafts``),
    their top-k rows those MTP's draft step 0 kept for draft step ``mtp_draft_step`` where it is
    not 0 (``harness.builder.with_shared_mtp_indices``),
    the host holding the query split ``host_q_lens`` where given, the spec's own split the device's
    (``harness.builder.with_host_query_split``), its top-k rows written from the scores of
    ``holes`` where given (``harness.topk_holes``)."""
    scenario = build_scenario(spec, seed)
    if rejected_drafts:
        scenario = with_rejected_drafts(scenario, rejected_drafts)
    if mtp_draft_step:
        scenario = with_shared_mtp_indices(scenario, mtp_draft_step)
    if host_q_lens is not None:
        scenario = with_host_query_split(scenario, host_q_lens)
    return scenario if holes is None else with_topk_holes(scenario, holes)


def run_case(reporter: Reporter, backend, spec, device, *, seed: int = 0, twin: Twin | None = None,
             compare: bool = True, adaptive_verification: bool = False, holes: TopkHoles | None = None,
             host_q_lens: list[int] | None = None, rejected_drafts: int = 0, kv_block_stride: int | None = None,
             mtp_draft_step: int = 0, scenario: Scenario | None = None, label: str = "",
             what: str = "", inputs: AttentionInputs | None = None) -> StepOutcome:
    """One step of ``spec`` (built with ``seed``, its top-k written with ``holes`` where given, the
    host holding the query split ``host_q_lens`` where given; or ``scenario`` as given, built from
    them and changed by the test) through a fresh layer of ``backend``, judged
    (``rejected_drafts``, ``kv_block_stride`` and ``mtp_draft_step``: as :func:`run_sequence` takes them; ``label``:
    what the step's reports are named with; ``what``: leads its failure message; ``inputs``: the
    step's q and cache as :func:`harness.device_inputs.build_attention_inputs` built them for
    another backend's run of the same step, shared so that its float64 truth is computed once)."""
    step = (spec, seed, holes, host_q_lens) if scenario is None else scenario
    return run_sequence(reporter, backend, [step], device, twin=twin, compare=compare, kind="step",
                        adaptive_verification=adaptive_verification, rejected_drafts=rejected_drafts,
                        kv_block_stride=kv_block_stride, mtp_draft_step=mtp_draft_step, label=label,
                        what=what, step_inputs=inputs)[1][0]


def case_rebuilds(steps, after_step: Callable | None) -> bool:
    """Whether a written case rebuilds what its test ran: every step built from its spec and seed
    (none a scenario the test changed by hand) and no check of the test's own after a step
    (``after_step``), which a case does not record. Where it does not, no backend case is noted: a
    failure before launch is written as the laid-out step the checks before launch noted
    (:func:`before_launch`), a sequence as the one its test noted (``harness.case_log.note_sequence``)."""
    return after_step is None and not any(isinstance(step, Scenario) for step in steps)


def scenario_of(step, rejected_drafts: int, mtp_draft_step: int = 0) -> Scenario:
    """A step of :func:`run_sequence`: ``(spec, seed[, holes[, host_q_lens]])`` built, or a
    scenario as given."""
    if isinstance(step, Scenario):
        return step
    return scenario_of_step(*(tuple(step) + (None,) * (4 - len(step))), rejected_drafts=rejected_drafts,
                            mtp_draft_step=mtp_draft_step)


def run_sequence(reporter: Reporter, backend, steps, device, *, with_inputs: bool = True, twin: Twin | None = None,
                 compare: bool = True, kind: str = "sequence", adaptive_verification: bool = False,
                 rejected_drafts: int = 0, kv_block_stride: int | None = None, mtp_draft_step: int = 0,
                 label: str = "", after_step: Callable | None = None, what: str = "",
                 step_inputs: AttentionInputs | None = None):
    """``steps`` (``(spec, seed)``, ``(spec, seed, holes)`` or ``(spec, seed, holes, host_q_lens)``:
    :func:`scenario_of_step`'s arguments, in order; or a scenario a test changed, which a written
    case cannot rebuild) through one layer and, with ``with_inputs``, one KV cache they share; each
    step judged. A step with holes in its top-k, or a draft step of MTP's shared rows, runs its plan
    only on a backend whose kernel would read a hole (:func:`kernel_reads_a_hole`).
    ``rejected_drafts``: every step's single-token decodes had that many drafts rejected, which
    the host bound still counts (``harness.builder.with_rejected_drafts``); ``kv_block_stride``:
    the layer's cache has its blocks that many rows apart, NaN between them
    (``harness.device_inputs.with_blocks_apart``); ``mtp_draft_step``: every step is that draft step
    of MTP with shared top-k indices (``harness.builder.with_shared_mtp_indices``). A step whose
    plan the release refused as it is expected to (``StepOutcome.refusal``) ends the sequence.
    ``after_step(index, layer, scenario, inputs, outcome)``: called after each judged step that ran;
    ``what``: leads every failure message (the test's family); ``step_inputs``: a one-step
    sequence's inputs built already (:func:`run_case`). Returns ``(layer, outcomes)``."""
    if step_inputs is not None and (len(steps) != 1 or kind != "step"):
        raise ValueError("step_inputs: for a single step (run_case) only")
    scenarios = [scenario_of(step, rejected_drafts, mtp_draft_step) for step in steps]
    rebuilds = case_rebuilds(steps, after_step)
    specs = [s.spec for s in scenarios]
    max_tokens = max(max(s.topk_indices.shape[0] for s in scenarios), 1)
    config = dataclasses.replace(layer_config(specs[0], max_tokens, adaptive_verification=adaptive_verification),
                                 kv_block_stride=kv_block_stride)
    reporter.admit(backend, config)
    layer = backend.open_layer(config, device)
    cache = None
    if with_inputs and kind == "sequence":
        blocks = max(s.num_blocks for s in scenarios)
        cache = nan_kv_buffer((blocks, specs[0].block_size, specs[0].head_dim), specs[0].kv_dtype, device)
    case = {"kind": kind, "backend": backend_identity(backend), "max_tokens": max_tokens, "twin": twin is not None,
            "compare": compare, "with_inputs": with_inputs, "adaptive_verification": adaptive_verification,
            "rejected_drafts": rejected_drafts, "kv_block_stride": kv_block_stride, "mtp_draft_step": mtp_draft_step,
            "steps": [],
            "flashinfer": flashinfer_in_use(), "layer_mode": layer_mode_of(backend)}
    outcomes, found = [], None
    if not rebuilds:
        note_backend_case(None)  # an earlier case of the same test is not this one
    for i, scenario in enumerate(scenarios):
        holes = scenario.extra.get("topk_holes")
        case["steps"].append({"spec": scenario.spec, "seed": scenario.seed, "holes": holes,
                              "host_q_lens": host_split_of(scenario)})
        if rebuilds:
            note_backend_case(case)
        inputs = None
        past_selection = holes is not None or scenario.extra.get("mtp_draft_step") is not None
        if with_inputs and not (past_selection and kernel_reads_a_hole(backend)):
            inputs = step_inputs if step_inputs is not None else build_attention_inputs(scenario, device)
            inputs = in_one_cache(inputs, cache) if cache is not None else inputs
            inputs = with_blocks_apart(inputs, kv_block_stride) if kv_block_stride is not None else inputs
        named, of = (f"_step{i}", f"step {i} of the sequence's {len(scenarios)}") if kind == "sequence" else ("", "")
        of = ", ".join(part for part in (what, of) if part)
        verdict = judged_step(reporter, backend, layer, scenario, inputs, twin=twin, compare=compare,
                              label=label + named, context_of_step=of)
        outcome = verdict.outcome
        if verdict.failure is not None:
            if not (i + 1 < len(scenarios) and launched_finding(verdict)):
                raise verdict.failure
            found = found or verdict.failure
        outcomes.append(outcome)
        if outcome is not None and outcome.refusal is not None:
            break
        if after_step is not None and verdict.failure is None:
            after_step(i, layer, scenario, inputs, outcome)
    if found is not None:
        raise found
    return layer, outcomes


def launched_finding(verdict: Verdict) -> bool:
    """A step that ran its kernel and failed as one of the findings expected of it: the sequence
    goes on, so that a later step's failure of another kind is not hidden behind it (the finding
    is raised at the end, where nothing else failed)."""
    expected = tuple(f.exception for f in verdict.expected)
    return bool(expected) and isinstance(verdict.failure, expected) and verdict.outcome is not None \
        and verdict.outcome.out is not None
