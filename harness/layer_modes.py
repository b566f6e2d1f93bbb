"""A backend's layer run in a mode that sets each step beside another run of the same step
(docs/input-space.md#plan-history-poisoned-workspaces-graph-against-eager):

- ``plain``: the layer as the backend opens it;
- ``poisoned``: every byte of the layer's float workspaces :data:`backends.seam.POISON_BYTE`,
  the rows of its input buffers the step must not read :data:`backends.seam.UNREAD_ROW_TOKEN`,
  and its kv_indices past the planned spans the index of the step's first token
  (:func:`backends.seam.first_token_index`), after its plan, before its kernel
  (:class:`PoisonedLayer`), set beside a clean layer of the same configuration that runs the
  same steps: output and LSE bit for bit the clean run's;
- ``graphed``: each step's forward run eagerly, then captured in a CUDA graph and replayed on the
  same inputs, once right after the capture and once more after every block the caching
  allocator holds free was taken and poisoned (:class:`GraphedLayer`, :func:`occupy_freed_memory`):
  output and LSE of both replays bit for bit the eager run's;
- ``against-fresh``: each step also run through a fresh layer of the same configuration, which
  carries no history (:class:`AgainstFreshLayer`): bit for bit where both run on the same planned
  lengths, within :data:`PLAN_HISTORY_ULPS` bf16 ULPs where they differ.

A mode's layer keeps what its comparison found of the step it ran last
(``comparison_problems()``); the judge adds those to the step's problems
(``harness.judge.judge_step``), so a step whose two runs differ fails as a step. A written case
records its mode (``layer_mode``, ``recording/backend_case.py``) and its replay opens the backend
in the same mode (:func:`in_layer_mode`), so the comparison that failed is judged again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from backends.seam import StepOutcome, float_workspaces, plant_in_unread_rows, poison, split_step_missing

from .bits import bitwise_equal, ulp_distance_bf16

PLAIN = "plain"

#: bf16 ULPs the output of the same step may differ by between plan histories whose planned
#: lengths differ (their KV split points differ). Measured 0 on the CPU stand-ins (they attend a
#: row in one softmax, unsplit) and 0 in 511 kept-plan cases of vLLM 0.33.0 on FlashInfer
#: 0.7.2.post1's fa3 kernel (scripts/plan_history_ulps.py, docs/input-space.md#plan-history),
#: and 0 in 511 of vLLM 0.34.0 on 0.7.4's; the bound is that 0 plus a margin of one ULP until
#: the fa2 kernels and the older releases' fa3 are measured. A failure reports the ULPs it saw.
PLAN_HISTORY_ULPS = 1


class CaptureUnsupported(Exception):
    """The layer's forward cannot be captured in a CUDA graph here; the message says why."""


class WrappedBackend:
    """``backend`` with each layer it opens wrapped by ``wrap(layer)``; everything else its own."""

    def __init__(self, backend, wrap):
        self._backend, self._wrap = backend, wrap

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def open_layer(self, config, device):
        return self._wrap(self._backend.open_layer(config, device))


class WrappedLayer:
    """A layer that hands every member it does not define on to ``layer``."""

    def __init__(self, layer):
        self.layer = layer

    def __getattr__(self, name):
        return getattr(self.layer, name)


# --- what two runs of one step may differ by ---------------------------------------------------------


def kept(outcome: StepOutcome) -> StepOutcome:
    """A copy of what ``outcome`` reports that the layer's next step cannot overwrite (its output,
    LSE and planned lengths)."""
    def copy(x):
        return None if x is None else x.clone()

    return StepOutcome(outcome.backend, outcome.planned_rows, out=copy(outcome.out), lse=copy(outcome.lse),
                       planned_lengths=copy(outcome.planned_lengths), plans=outcome.plans)


def bitwise_problems(outcome: StepOutcome, other: StepOutcome, this: str, that: str) -> list[str]:
    """Where ``outcome``'s output or LSE (``this`` run's) is not ``other``'s (``that`` run's) bit
    for bit: how many elements differ and by how much."""
    problems = []
    if outcome.out is not None and other.out is not None and not bitwise_equal(outcome.out, other.out):
        problems.append(f"{this}'s output is not {that}'s bit for bit ({output_gap(outcome.out, other.out)})")
    if outcome.lse is not None and other.lse is not None and not bitwise_equal(outcome.lse, other.lse):
        gap = float((outcome.lse.float() - other.lse.float()).abs().nan_to_num(float("inf")).max()) \
            if outcome.lse.shape == other.lse.shape else float("inf")
        problems.append(f"{this}'s LSE is not {that}'s bit for bit (max |diff| {gap:.3g})")
    return problems


def output_gap(out: torch.Tensor, other: torch.Tensor) -> str:
    """How two outputs of one step differ: the elements apart, the most bf16 ULPs, the non-finite ones."""
    if out.shape != other.shape:
        return f"shapes {tuple(out.shape)} and {tuple(other.shape)}"
    ulps = ulp_distance_bf16(out.cpu(), other.cpu()) if out.dtype == torch.bfloat16 == other.dtype \
        else (out.float() != other.float()).int().cpu()
    nonfinite = int((~torch.isfinite(out.float())).sum())
    return f"{int((ulps > 0).sum())} elements differ, max {int(ulps.max())} bf16 ULPs, non-finite: {nonfinite}"


def max_ulps(out: torch.Tensor, other: torch.Tensor) -> int:
    if not out.numel():
        return 0
    return int(ulp_distance_bf16(out.cpu(), other.cpu()).max())


def lengths(outcome: StepOutcome) -> list[int] | None:
    return None if outcome.planned_lengths is None else outcome.planned_lengths.tolist()


def same_plan(outcome: StepOutcome, fresh: StepOutcome) -> bool:
    """Both runs on the same planned lengths (one plan, one split)."""
    return outcome.planned_lengths is not None and fresh.planned_lengths is not None and \
        torch.equal(outcome.planned_lengths, fresh.planned_lengths)


def history_problems(outcome: StepOutcome, fresh: StepOutcome, bound: int = PLAN_HISTORY_ULPS) -> list[str]:
    """A step after its history against the same step through a fresh layer: bit for bit where
    their planned lengths are the same, within ``bound`` bf16 ULPs where they differ."""
    if outcome.out is None or fresh.out is None:
        return []
    ulps = max_ulps(outcome.out, fresh.out)
    if same_plan(outcome, fresh) and not bitwise_equal(outcome.out, fresh.out):
        return [f"the same planned lengths as fresh, output not bit for bit fresh's (max {ulps} bf16 ULPs apart)"]
    if ulps > bound:
        return [f"output {ulps} bf16 ULPs from fresh's, beyond the plan-history bound of {bound} "
                f"(planned {lengths(outcome)} vs fresh {lengths(fresh)})"]
    return []


# --- the modes ---------------------------------------------------------------------------------------


class ModeLayer(WrappedLayer):
    """A mode's layer: ``reopen()`` opens another layer of the same backend and configuration;
    :meth:`comparison_problems` is what the comparison of the step run last found."""

    def __init__(self, layer, reopen: Callable[[], object]):
        super().__init__(layer)
        self.reopen = reopen
        self.problems: list[str] = []

    def comparison_problems(self) -> list[str]:
        return list(self.problems)


class PoisonedLayer(ModeLayer):
    """Every byte of the layer's float workspaces poisoned, token 0 planted in the rows of its
    input buffers the step must not read (``backends.seam.Layer.unread_rows``) and the step's first token in its
    kv_indices past the planned spans (``Layer.unread_slots``), after its plan,
    before its kernel (before the whole step where the layer has no plan/launch split); a clean
    layer of the same configuration runs the same steps beside it, and each poisoned step must be
    the clean one bit for bit."""

    def __init__(self, layer, reopen):
        super().__init__(layer, reopen)
        self.clean = reopen()

    def step(self, step):
        clean = kept(self.clean.step(step))
        outcome = self.poisoned_step(step)
        self.problems = bitwise_problems(outcome, clean, "the poisoned run", "the clean run")
        return outcome

    def poisoned_step(self, step):
        if split_step_missing(self.layer):
            poison(float_workspaces(self.layer))
            plant_in_unread_rows(self.layer, step)
            return self.layer.step(step)
        outcome = self.layer.plan_step(step)
        if not step.runs_kernel or outcome.refusal is not None:
            return outcome
        poison(float_workspaces(self.layer))
        plant_in_unread_rows(self.layer, step)
        self.layer.launch(step, outcome)
        return self.layer.finish(step, outcome)


def capture_problem(layer) -> str | None:
    """Why ``layer``'s forward cannot be captured and replayed here, or None. Graphs that cannot
    capture every forward (a simulated machine's) say which they cannot (their class's
    ``capture_problem(layer)``)."""
    reason = getattr(layer, "capture_unsupported", None)
    if reason:
        return reason
    missing = split_step_missing(layer)
    if missing:
        return f"{type(layer).__name__} has no plan/launch split (lacks {', '.join(missing)}: backends.seam.Layer)"
    declared = getattr(torch.cuda.CUDAGraph, "capture_problem", None)
    if callable(declared):
        return declared(layer)
    if not torch.cuda.is_available():
        return "CUDA graphs need a CUDA device"
    return None


#: Requests up to this many bytes are served from the caching allocator's small pool (segments of
#: 2 MiB), larger ones from its large pool (c10's ``kSmallSize``).
SMALL_POOL_REQUEST_BYTES = 1 << 20
#: Rounds of :func:`occupy_freed_memory`: a block taken by a request smaller than itself is split,
#: and the rest it leaves free is taken in the next round.
OCCUPY_ROUNDS = 4


def requests_taking_free_blocks(segments: list[dict], device_index: int, stream: int) -> list[int]:
    """Request sizes in bytes, largest first, that take every free (``inactive``) block of the
    caching allocator's default pool on ``device_index`` handed out to ``stream`` (the allocator
    hands a block only to requests of the stream it was freed on), from the segments of
    ``torch.cuda.memory_snapshot()``. A block of a small segment is asked for in pieces of at most
    :data:`SMALL_POOL_REQUEST_BYTES` (a whole free small segment, 2 MiB, asked for at once would be
    served from the large pool), a block of a large segment whole."""
    sizes = []
    for segment in segments:
        if (segment["device"] != device_index or tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0)
                or segment.get("stream", stream) != stream):
            continue
        for block in segment["blocks"]:
            if block["state"] != "inactive":
                continue
            if segment.get("segment_type") == "small":
                whole, rest = divmod(block["size"], SMALL_POOL_REQUEST_BYTES)
                sizes += [SMALL_POOL_REQUEST_BYTES] * whole + ([rest] if rest else [])
            else:
                sizes.append(block["size"])
    return sorted(sizes, reverse=True)


def occupy_freed_memory(device: torch.device) -> list[torch.Tensor]:
    """Tensors that take every block the caching allocator of ``device`` holds free in its
    default pool for the current stream (:func:`requests_taking_free_blocks`, again on what a
    round left free, at most :data:`OCCUPY_ROUNDS` rounds), each filled with
    :data:`backends.seam.POISON_BYTE` (none off CUDA, where no allocator hands freed memory out
    again). A graph that reads or writes memory its layer stopped holding after the capture (a
    plan's temporary, a buffer reallocated by a later plan) then meets the poison, as it meets
    whatever the next allocation writes in an engine. Hold the tensors across the replay;
    dropping them hands the blocks back."""
    if device.type != "cuda":
        return []
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(index).cuda_stream
    held = []
    for _ in range(OCCUPY_ROUNDS):
        sizes = requests_taking_free_blocks(torch.cuda.memory_snapshot(), index, stream)
        if not sizes:
            break
        taken = [torch.empty(size, dtype=torch.uint8, device=device) for size in sizes]
        poison(taken)
        held += taken
    return held


class GraphedLayer(ModeLayer):
    """Each step planned on the host, its forward run eagerly (the warm-up, kept), then captured in
    a CUDA graph and replayed on the same inputs twice: right after the capture, and again after
    :func:`occupy_freed_memory` poisoned every block the allocator holds free (what an engine's
    later allocations do to memory a graph should not read). The eager output is poisoned before
    each replay, so a replay that writes nothing shows; both replays must be the eager run's bit
    for bit, and the outcome is the second's. A layer that cannot be captured here raises
    :class:`CaptureUnsupported`."""

    def step(self, step):
        reason = capture_problem(self.layer)
        if reason:
            raise CaptureUnsupported(reason)
        self.problems = []
        outcome = self.layer.plan_step(step)
        if not step.runs_kernel or outcome.refusal is not None:
            return outcome
        self.layer.launch(step, outcome)
        warm = self.layer.finish(step, outcome)
        eager = kept(warm)
        poison([warm.out] + ([warm.lse] if warm.lse is not None else []))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.layer.launch(step, outcome)
        replayed = self._replay(graph, step, outcome)
        self.problems = bitwise_problems(replayed, eager, "the graph replay", "the eager run")
        poison([replayed.out] + ([replayed.lse] if replayed.lse is not None else []))
        held = occupy_freed_memory(replayed.out.device)
        churned = self._replay(graph, step, outcome)
        self.problems += bitwise_problems(churned, eager, "the graph replay after allocation churn", "the eager run")
        del held
        return churned

    def _replay(self, graph, step, outcome) -> StepOutcome:
        graph.replay()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return self.layer.finish(step, outcome)


class AgainstFreshLayer(ModeLayer):
    """Each step also run through a fresh layer of the same configuration (no history: no kept
    plan, no buffers of earlier steps); the step after its history must be the fresh run's
    (:func:`history_problems`)."""

    def step(self, step):
        fresh = kept(self.reopen().step(step))
        outcome = self.layer.step(step)
        self.problems = history_problems(outcome, fresh)
        return outcome


#: Each layer mode's wrapper (None: the layer as opened).
MODES: dict[str, type[ModeLayer] | None] = {PLAIN: None, "poisoned": PoisonedLayer, "graphed": GraphedLayer,
                                            "against-fresh": AgainstFreshLayer}
LAYER_MODES = tuple(MODES)


class ModeBackend(WrappedBackend):
    """``backend`` whose layers run in ``mode`` (one of :data:`LAYER_MODES` but plain)."""

    def __init__(self, backend, mode: str):
        super().__init__(backend, MODES[mode])
        self.layer_mode = mode

    def describe(self) -> str:
        return f"{self._backend.describe()}, its layers {mode_described(self.layer_mode)}"

    def open_layer(self, config, device):
        return self._wrap(self._backend.open_layer(config, device), lambda: self._backend.open_layer(config, device))


def mode_described(mode: str) -> str:
    return {"poisoned": "with poisoned workspaces beside a clean layer", "graphed": "graphed against eager",
            "against-fresh": "against a fresh layer"}.get(mode, "plain")


def in_layer_mode(backend, mode: str):
    """``backend`` with its layers in ``mode`` (itself for plain)."""
    if mode not in MODES:
        raise ValueError(f"unknown layer mode {mode!r} (one of {', '.join(LAYER_MODES)})")
    return backend if mode == PLAIN else ModeBackend(backend, mode)


def layer_mode_of(backend) -> str:
    """The mode ``backend``'s layers run in (:func:`in_layer_mode`; plain where none was set)."""
    mode = getattr(backend, "layer_mode", PLAIN)
    return mode if mode in MODES else PLAIN


def mode_problems(layer) -> list[str]:
    """What ``layer``'s mode found comparing the step it ran last with its other run (none for a
    layer in no mode; asked of the layer's class, as a wrapper hands other members on)."""
    comparison = getattr(type(layer), "comparison_problems", None)
    return comparison(layer) if callable(comparison) else []
