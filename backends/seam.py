"""The backend seam: what the suite hands any production backend for one step, and the one
record every backend hands back.

A backend is a whole production path for one attention layer: host rules (per-row kv_len,
dense-MHA routing), the convert kernel, the state and its plan, and the attention kernel. The
suite knows backends only through this module:

- :class:`LayerConfig`: one layer's configuration (heads, rope, cache dtype, scales, top-k,
  kpool, buffer width, block size, the largest step, the scheduling mode);
- :class:`StepInput`: one engine step (its metadata, block table, the indexer's rows, the
  queries and the KV cache); the queries left out stops a step after its plan;
- :class:`StepOutcome`: what the step did, as far as the backend can show it: the output (and
  the natural-log LSE where the kernel returns one), the rows planned, each row's executed KV
  length and slots where they can be read back, the host lengths and the plans made;
- :class:`Backend` / :class:`Layer`: ``backend.open_layer(config, device)`` then
  ``layer.step(step_input)`` for each step of a sequence (the layer keeps what production keeps
  between steps: buffers, a kept plan);
- a cache whose blocks lie apart (``LayerConfig.kv_block_stride``): :func:`blocks_apart` lays
  one out, :func:`block_stride_of` reads its stride, :func:`slots_of_cache_rows` turns the rows a
  kernel reads back into slot ids.

:func:`backends.registry.open_backend` names them: ``port-fa3`` and ``port-fa2`` (the project's own path, the
seed's logic, vLLM 0.30.0's, on FlashInfer's fa3 or fa2 kernel), ``vllm`` (a vLLM release's own
SM90 backend) and ``flashmla`` (FlashMLA's sparse kernels as vLLM's FLASHMLA_SPARSE backend
calls them); the last two read a release named by ``--vllm``. A user's own backend is any object
with the members of :class:`Backend`, opened as ``module:factory``. Implementations are imported only
when a backend is opened, so this module imports no vendor.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class LayerConfig:
    num_heads: int
    rope_dim: int  # 64 or 0 (NoPE)
    kv_dtype: str  # "bfloat16" or "float8_e4m3fn"
    k_scale: float
    sm_scale: float
    topk: int
    kpool: int
    width: int  # the top-k buffer's width
    block_size: int
    max_tokens: int  # max_num_batched_tokens: rows the state's buffers hold
    async_scheduling: bool = False
    adaptive_verification: bool = False
    # Rows between the starts of consecutive blocks of the layer's cache (docs/input-space.md#blocks-apart):
    # None for block_size (contiguous blocks); more where the engine's cache for the layer is a view
    # of a larger buffer with other layers' pages between its blocks.
    kv_block_stride: int | None = None

    @property
    def blocks_apart(self) -> bool:
        return self.kv_block_stride not in (None, self.block_size)


def query_rows(meta) -> int:
    """The query rows of a step's metadata: its last query start (``num_actual_tokens`` counts
    a FULL CUDA graph's padded rows as well)."""
    return int(meta.query_start_loc_cpu[meta.num_reqs]) if meta.num_reqs else 0


@dataclass
class StepInput:
    """One engine step. ``meta`` has the fields of ``harness.spec.StepMetadata``; host tensors
    except the queries and the cache, which are on the layer's device."""

    meta: object
    block_table: torch.Tensor  # int32 [num_reqs, table width]
    topk_indices: torch.Tensor  # int32 [rows incl. CUDA-graph padding, width]: request-local, -1 invalid
    prefills_to_mha: bool = False  # the engine's routing of this step's prefill rows to dense MHA
    q_nope: torch.Tensor | None = None  # [rows incl. padding, H, 512] bf16
    q_pe: torch.Tensor | None = None  # [rows incl. padding, H, R] bf16
    kv_cache: torch.Tensor | None = None  # [num_blocks, block_size, 512 + R] bf16 or float8_e4m3fn

    @property
    def planned_rows(self) -> int:
        """Rows the sparse kernel serves: the decode prefix when prefills go to dense MHA, else
        the query rows (a FULL CUDA graph's padded rows are tokens of the metadata, not queries)."""
        return self.meta.num_decode_tokens if self.prefills_to_mha else query_rows(self.meta)

    @property
    def runs_kernel(self) -> bool:
        return self.q_nope is not None


@dataclass
class LaidOut:
    """What a layer's host stages hand the kernel for a step, rehearsed before the kernel runs
    (convert, kv_indptr and the kv_indices layout of the plan in force): the planned row ``r``
    reads ``kv_indices[kv_indptr[r] : kv_indptr[r] + planned length]``."""

    layout: str  # strided | packed | compacted
    max_rows: int  # rows the layer's buffers hold
    width: int  # the top-k buffer's width
    slots: torch.Tensor  # int32 [rows incl. padding, width]: the converted top-k rows (-1 invalid)
    counts: torch.Tensor  # [rows incl. padding]: their valid counts, as convert gives them
    kv_indptr: torch.Tensor  # host int32 [max_rows + 1]
    kv_indices: torch.Tensor  # int32 [capacity]


@dataclass
class StepOutcome:
    """What one step did. Tensors are host tensors except ``out``/``lse`` (the layer's device).
    ``executed_lengths`` / ``executed_slots``: what the kernel reads per planned row, read back
    from where the kernel reads it (None where the backend cannot show it); ``schedule_problems``:
    what the read-back found malformed (work items past a row, stray rows, buffers that hold other
    than what was laid out, rows written past the planned ones); ``refusal``: the plan refused as
    the release is expected to; ``laid_out``: what the host stages laid out, before launch."""

    backend: str
    planned_rows: int
    out: torch.Tensor | None = None  # [planned rows, H, 512]
    lse: torch.Tensor | None = None  # [planned rows, H], natural log
    executed_lengths: torch.Tensor | None = None  # int64 [planned rows]
    executed_slots: tuple[torch.Tensor, torch.Tensor] | None = None  # (slots, mask) [planned rows, n]
    # int64 [planned rows, n]: which of the kernel's works (split parts, numbered in KV order from 0
    # per row) reads each column of executed_slots; None where the backend cannot show it
    executed_parts: torch.Tensor | None = None
    host_lengths: torch.Tensor | None = None  # int64, the host rule's lengths of every row
    host_exact: bool = True  # False: the host lengths are upper bounds
    planned_lengths: torch.Tensor | None = None  # int64 [planned rows], the plan in force
    schedule_problems: list[str] = field(default_factory=list)
    # why the kernel refused the step at its plan, as the installed release is expected to: the
    # step ends there (nothing launched)
    refusal: str | None = None
    # what the layer's host stages laid out for the kernel, known before it launches (None where
    # the layer cannot show it): the step's planned selection (b) and its invariants are judged on
    # it before the kernel runs
    laid_out: LaidOut | None = None
    plans: int = 0  # plans made so far by the layer
    # device-to-host synchronisations of each FlashInfer plan() the step made, in order
    # (:func:`device_syncs_counted`; empty where none was counted: no plan made, not on CUDA, or
    # the step ran outside :func:`plan_syncs_counted`)
    plan_syncs: list[int] = field(default_factory=list)
    reads_back: bool = False  # executed lengths come from the kernel's own schedule, not from the plan
    # False: the layer has no dense-MHA path for its prefills (FlashMLA's fp8 NoPE cache), so the
    # engine hands the sparse kernel every row, whatever the step's routing
    dense_prefill: bool = True

    def describe_row(self, row: int, valid: int | None = None) -> str:
        parts = [f"row {row}"]
        if self.host_lengths is not None and row < self.host_lengths.numel():
            parts.append(f"host {'exact' if self.host_exact else 'bound'} {int(self.host_lengths[row])}")
        if self.planned_lengths is not None and row < self.planned_lengths.numel():
            parts.append(f"planned {int(self.planned_lengths[row])}")
        if self.executed_lengths is not None and row < self.executed_lengths.numel():
            parts.append(f"executed {int(self.executed_lengths[row])}")
        if valid is not None:
            parts.append(f"valid {valid}")
        return ", ".join(parts)


def spans_selection(indptr: torch.Tensor, lengths: torch.Tensor, indices: torch.Tensor):
    """``(slots, mask)`` ``[rows, max length]`` of each row's span
    ``indices[indptr[r] : indptr[r] + lengths[r]]`` (host int64 tensors; -1 outside a span)."""
    width = int(lengths.max()) if lengths.numel() else 0
    cols = torch.arange(width)
    mask = cols.unsqueeze(0) < lengths.unsqueeze(1)
    pos = (indptr[: lengths.numel()].unsqueeze(1) + cols.unsqueeze(0)).clamp(min=0, max=max(indices.numel() - 1, 0))
    slots = indices[pos] if indices.numel() else torch.zeros_like(pos)
    return torch.where(mask, slots, torch.full_like(slots, -1)), mask


#: What :func:`slots_of_cache_rows` gives a row between two blocks (no slot of the cache lies there).
ROW_BETWEEN_BLOCKS = -2
#: Every byte between the blocks of a cache laid out by :func:`blocks_apart`: NaN read as bf16,
#: e4m3 and FlashMLA's 656-byte layout (its e4m3 values, float32 tile scales and bf16 rope alike).
BETWEEN_BLOCKS_BYTE = 0xFF


def block_stride_of(cache: torch.Tensor) -> int:
    """Rows between the starts of consecutive blocks of ``cache [num_blocks, block_size, D]``
    (``block_size`` for a contiguous cache)."""
    if cache.stride(0) % cache.shape[-1] or cache.stride(1) != cache.shape[-1] or cache.stride(2) != 1:
        raise ValueError(f"a cache of whole rows is [num_blocks, block_size, D] with rows of D contiguous elements and "
                         f"blocks a whole number of rows apart; got shape {tuple(cache.shape)}, strides "
                         f"{cache.stride()}")
    return cache.stride(0) // cache.shape[-1]


def blocks_apart(cache: torch.Tensor, block_stride: int) -> torch.Tensor:
    """``cache [num_blocks, block_size, D]`` with its blocks ``block_stride`` rows apart: the view
    ``[:, :block_size]`` of a new ``[num_blocks, block_stride, D]`` buffer that holds the cache's
    blocks, every byte between them :data:`BETWEEN_BLOCKS_BYTE` (what vLLM 0.32+ hands a layer whose
    cache shares its pages with other layers'; a read between blocks shows as NaN)."""
    num_blocks, block_size, dim = cache.shape
    if block_stride < block_size:
        raise ValueError(f"block stride {block_stride} rows is below the block size {block_size}")
    buffer = torch.empty((num_blocks, block_stride, dim), dtype=cache.dtype, device=cache.device)
    buffer.view(torch.uint8).fill_(BETWEEN_BLOCKS_BYTE)
    view = buffer[:, :block_size]
    view.copy_(cache)
    return view


def slots_of_cache_rows(rows: torch.Tensor, block_size: int, block_stride: int) -> torch.Tensor:
    """The slot ids (``block * block_size + offset``) of rows of a cache whose blocks lie
    ``block_stride`` rows apart (row ``block * block_stride + offset``); a row between two blocks
    gives :data:`ROW_BETWEEN_BLOCKS`, a negative row stays as it is."""
    rows = rows.to(torch.int64)
    block, offset = rows.div(block_stride, rounding_mode="floor"), rows.remainder(block_stride)
    slots = torch.where(offset < block_size, block * block_size + offset, torch.full_like(rows, ROW_BETWEEN_BLOCKS))
    return torch.where(rows < 0, rows, slots)


#: What torch warns at each device synchronisation under ``torch.cuda.set_sync_debug_mode("warn")``.
SYNC_WARNING = "called a synchronizing CUDA operation"


@contextlib.contextmanager
def device_syncs_counted(device) -> Iterator[list[int]]:
    """Counts the CUDA synchronisations made inside the block (torch's sync debug mode: each
    ``.item()``, each device-to-host copy, each blocking host-to-device copy) into the list it
    yields, one entry appended when the block ends (other warnings raised in the block are
    raised again after it: :func:`syncs_counted_others_passed_on`); on a device other than CUDA
    nothing is appended."""
    counted: list[int] = []
    if torch.device(device).type != "cuda":
        yield counted
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counted
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    counted.append(syncs_counted_others_passed_on(caught))


def syncs_counted_others_passed_on(caught: list[warnings.WarningMessage]) -> int:
    """How many of the warnings ``caught`` are torch's sync warnings; every other one is raised
    again, for whoever records warnings outside the count (pytest, the GPU tier's report)."""
    syncs = 0
    for w in caught:
        if SYNC_WARNING in str(w.message):
            syncs += 1
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return syncs


#: Whether the layers count the synchronisations of their plans now (:func:`plan_syncs_counted`).
_COUNTING_PLAN_SYNCS = contextvars.ContextVar("counting_plan_syncs", default=False)


@contextlib.contextmanager
def plan_syncs_counted() -> Iterator[None]:
    """Within the block, every layer's FlashInfer ``plan()`` wrapped by :func:`with_syncs_counted`
    counts its synchronisations; outside it the plan runs bare (no sync debug mode, no warning
    capture): the plans the rest of the suite makes, and the upgrade check times, cost nothing more."""
    token = _COUNTING_PLAN_SYNCS.set(True)
    try:
        yield
    finally:
        _COUNTING_PLAN_SYNCS.reset(token)


def with_syncs_counted(plan: Callable, device, into: list[int]) -> Callable:
    """``plan`` that appends the synchronisations of each of its calls made within
    :func:`plan_syncs_counted` to ``into``; other calls are ``plan``'s own."""

    def counted(*args, **kwargs):
        if not _COUNTING_PLAN_SYNCS.get():
            return plan(*args, **kwargs)
        with device_syncs_counted(device) as syncs:
            result = plan(*args, **kwargs)
        into.extend(syncs)
        return result

    return counted


@runtime_checkable
class Layer(Protocol):
    """``step`` is the one member a layer must have. A layer may also have these optional members
    (docs/input-space.md#plan-history, #poisoned-workspaces, #graph-against-eager):

    - ``float_workspaces() -> list[torch.Tensor]``: the buffers the kernel may read partials or
      metadata from that the step does not write first (FlashInfer's float workspace, FlashMLA's
      scheduler buffers): a test fills every byte with :data:`POISON_BYTE` before a step's kernel
      and no output may change;
    - ``unread_rows(step) -> list[torch.Tensor]``: the rows of the layer's persistent input buffers
      that ``step`` must not read (vLLM's top-k buffer past the rows the step's metadata counts:
      a piecewise graph's padded rows, what a larger step left): a test fills them with
      :data:`UNREAD_ROW_TOKEN` after the step's inputs are staged and no output may change;
    - ``unread_slots(step) -> list[torch.Tensor]``: the entries of the layer's kv_indices buffers
      past the end of the step's planned spans (``kv_indptr[planned rows]`` on): no row of the
      step reads there and its forward writes nothing there; a test plants
      :func:`first_token_index` in them after the plan and no output may change (a kernel that
      reads past the planned indices, as when ``sum(kv_len)`` runs beyond the indices written,
      would attend it);
    - ``index_buffers() -> list[torch.Tensor]``: the layer's kv_indices buffers whole, as its plan
      and its kernel read them (FlashInfer's reserved buffer), which persist between steps: a
      test fills them with what an earlier step could have left there;
    - ``plan_step(step) -> StepOutcome``, ``launch(step, outcome)``, ``finish(step, outcome) ->
      StepOutcome``: ``step`` in three parts. ``plan_step`` runs the host part (build, plan) and
      stages the step's inputs in the layer's own device buffers; ``launch`` runs the device part
      only (the forward: convert, layout, kernel), which a CUDA graph can capture and replay, its
      output left in the layer's buffers; ``finish`` reads the output and what the kernel executed
      back into the outcome. ``finish(s, launch(s, plan_step(s)))`` is ``step(s)``, except where
      ``plan_step`` gives an outcome with a ``refusal`` (the release refused the plan, as it is
      expected to): the step ends there. The judge runs a layer whose class has this split in its
      three parts (:func:`runs_in_parts`): what ``plan_step``'s outcome shows (its ``laid_out``, a
      plan accepted where a refusal was expected) is judged before anything launches;
    - ``rerun(step, outcome) -> (out, lse)``: the layer promises bitwise repeatability within one
      plan: the step's device part run once more on the plan in force (no ``plan_step`` between)
      into fresh NaN-filled buffers gives the planned rows' output and LSE bit for bit as the
      first run did; the judge asks it, where the layer's class has it, after ``finish`` and fails
      a step that differs;
    - ``timing_parts(step, outcome) -> (kernel, plan)``: two callables of no argument, the kernel
      alone on the staged inputs (device) and the plan alone (host), each callable again (the
      upgrade check's timing pass times them);
    - ``capture_unsupported: str``: why the layer's forward cannot be captured in a CUDA graph,
      where it cannot.
    """

    def step(self, step: StepInput) -> StepOutcome: ...


#: Every byte of a poisoned workspace: NaN read as float32 or bf16, -1 read as an integer.
POISON_BYTE = 0xFF


def float_workspaces(layer) -> list[torch.Tensor]:
    """The layer's ``float_workspaces()``, or none where the layer has no such member."""
    member = getattr(layer, "float_workspaces", None)
    return list(member()) if callable(member) else []


def poison(buffers: list[torch.Tensor]) -> None:
    """Every byte of ``buffers`` set to :data:`POISON_BYTE`."""
    for buffer in buffers:
        buffer.view(torch.uint8).fill_(POISON_BYTE)


#: What a poisoned step plants in the rows a layer's step must not read (``Layer.unread_rows``):
#: token 0, which every request holds, so that a row read by mistake attends a real token (a -1
#: would read as an invalid entry and change nothing).
UNREAD_ROW_TOKEN = 0


def first_token_index(step: StepInput) -> int:
    """The kv_indices entry that names the first token of the step's first request: a row of
    the step's cache that request wrote (slot ids, or rows of the cache's row view where its
    blocks lie apart). What a poisoned step plants past the planned spans
    (``Layer.unread_slots``): a fresh buffer holds 0 there, and a kernel that reads the entry
    attends a written row in the poisoned run and another (or none) in the clean one."""
    return int(step.block_table[0, 0]) * block_stride_of(step.kv_cache)


def unread_rows(layer, step) -> list[torch.Tensor]:
    """The layer's ``unread_rows(step)``, or none where the layer has no such member."""
    member = getattr(layer, "unread_rows", None)
    return list(member(step)) if callable(member) else []


def unread_slots(layer, step) -> list[torch.Tensor]:
    """The layer's ``unread_slots(step)``, or none where the layer has no such member."""
    member = getattr(layer, "unread_slots", None)
    return list(member(step)) if callable(member) else []


def index_buffers(layer) -> list[torch.Tensor]:
    """The layer's ``index_buffers()``, or none where the layer has no such member."""
    member = getattr(layer, "index_buffers", None)
    return list(member()) if callable(member) else []


def plant_in_unread_rows(layer, step) -> None:
    """Every entry of the rows ``step`` must not read set to :data:`UNREAD_ROW_TOKEN`, and every
    kv_indices entry past its planned spans to :func:`first_token_index`."""
    for rows in unread_rows(layer, step):
        rows.fill_(UNREAD_ROW_TOKEN)
    for entries in unread_slots(layer, step):
        entries.fill_(first_token_index(step))


def planned_then_run(layer, step: StepInput) -> StepOutcome:
    """One step of a layer that has the plan/launch/finish split: the plan (and the outcome of
    a step planned only, or whose plan was refused), then, where the step has queries, the kernel
    and its read-back."""
    outcome = layer.plan_step(step)
    if not step.runs_kernel or outcome.refusal is not None:
        return outcome
    layer.launch(step, outcome)
    return layer.finish(step, outcome)


def runs_in_parts(layer) -> bool:
    """Whether ``layer``'s class has the plan/launch/finish split itself, so that its ``step`` is
    :func:`planned_then_run` of them and a step can be driven in its parts; a wrapper that hands
    them on to another layer (``__getattr__``) is run by its own ``step``."""
    return all(callable(getattr(type(layer), name, None)) for name in ("plan_step", "launch", "finish"))


def split_step_missing(layer) -> list[str]:
    """The members of the plan/launch/finish split (:class:`Layer`) that ``layer`` lacks."""
    return [name for name in ("plan_step", "launch", "finish") if not callable(getattr(layer, name, None))]


#: What a backend may declare of itself, as a class attribute (absent: False), for the judge to
#: read instead of its name:
#:
#: - ``executes_valid_counts``: its kernel executes each row's count of valid entries (handed
#:   ``topk_length``), not the length rule's count, so holes in a row's top-k are not attended
#:   (FlashMLA through vLLM's FLASHMLA_SPARSE);
#: - ``hands_holes_to_the_kernel``: its layout leaves a -1 inside a planned span, which the kernel
#:   would read as slot -1, so a step whose top-k has holes is planned and judged, never launched
#:   (the project's port).
CAPABILITIES = ("executes_valid_counts", "hands_holes_to_the_kernel")


def declares(backend, capability: str) -> bool:
    """Whether ``backend`` declares ``capability`` (one of :data:`CAPABILITIES`)."""
    if capability not in CAPABILITIES:
        raise ValueError(f"unknown capability {capability!r}; known: {', '.join(CAPABILITIES)}")
    return bool(getattr(backend, capability, False))


@runtime_checkable
class Backend(Protocol):
    name: str  # "port-fa3", "vllm-0.33.0", "flashmla-0.33.0", ...
    kernel: str  # "fa3", "fa2", "flashmla"
    returns_lse: bool

    def describe(self) -> str: ...

    def unsupported(self, config: LayerConfig) -> str | None: ...

    def open_layer(self, config: LayerConfig, device) -> Layer: ...
