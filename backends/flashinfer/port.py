"""The project's own production path as a backend, and the API of the studies of its state.

``port-fa3`` / ``port-fa2``: the seed's logic (vLLM 0.30.0's SM90 backend as ``fast/`` ports
it: exact host lengths, the dense-MHA routing, the convert kernel, a plan every step) on
FlashInfer's ``BatchMLAPagedAttentionWrapper`` with ``backend="fa3"`` (what production runs on
SM90) or ``"fa2"``, under one of the three kv_indices layouts (``compacted`` by default: the layout
that lays out any selection; ``strided`` and ``packed`` plan regime C rows as a prefix,
docs/findings.md#regime-c-planned-as-a-prefix). A :class:`PortLayer` plans each step's exact
lengths, rehearses its host stages' convert and layout before launch (:func:`lay_out`, the
``laid_out`` of the plan-only outcome), runs convert, layout and kernel on its attention state, and
reads back what the kernel was handed: each planned row's kv_len, the kv_indices its span holds,
and what the state's buffers hold against the rehearsal (:func:`state_problems`). The port
promises bitwise repeatability within one plan (``rerun``).

The rest of this module is the port's own API for the studies of its state (harness's port
studies, the modules docs/code-map.md lists as such: graphs, kept plans, scale, plan limits,
reruns of the port's fixtures): its attention state and wrapper, their configuration, the refusal
text that was measured. Every other module of harness/ and recording/ reaches backends through
``backends.seam`` and ``backends.registry`` alone.
"""

from __future__ import annotations

import dataclasses

import torch

from fast.impl import FastImpl, default_impl
from fast.layouts import check_layout
from fast.layouts import indices_capacity as indices_capacity
from mla_constants import KV_LORA_RANK

from ..seam import (
    LaidOut,
    LayerConfig,
    StepInput,
    StepOutcome,
    planned_then_run,
    spans_selection,
    with_syncs_counted,
)
from . import compat, fa3_schedule
from . import sm90_state as sm90
from .compat import MLA_KERNELS, PAGE_COUNT_REFUSAL, MLAWrapper
from .compat import parse_version as parse_version
from .compat import signature_features as signature_features
from .installed import installed_flashinfer_version
from .sm90_state import AttentionConfig as AttentionConfig

#: The text of the refusal a FlashInfer that checks page counts gives a strided plan of short rows.
PLAN_REFUSAL = PAGE_COUNT_REFUSAL
KERNELS = MLA_KERNELS
#: Why the port takes no cache whose blocks lie apart: it ports vLLM 0.30.0's SM90 backend, which
#: declares the LBHNC layout alone (``supported_kv_cache_layouts``) and aligns no block stride (no
#: ``customize_spec``), so the engine never hands that code a strided cache view.
READS_CONTIGUOUS_BLOCKS = ("the port of vLLM 0.30.0's SM90 backend reads contiguous blocks (0.30.0 declares the "
                           "LBHNC layout alone): the engine never hands it a cache whose blocks lie apart")


#: What a plan accepted where the page-count refusal was expected says (the step fails before launch).
REFUSAL_EXPECTED = ("plan() accepted a strided plan with rows shorter than W, where the probe found that this "
                    "FlashInfer checks page counts (Features.plan_checks_page_counts)")


def plan_refused(features, layout: str, planned: torch.Tensor, width: int) -> bool:
    """A FlashInfer whose plan() checks page counts (probed: ``features.plan_checks_page_counts``)
    refuses a strided plan whose planned rows are not all ``width`` long, with :data:`PLAN_REFUSAL`."""
    return layout == "strided" and bool(features.plan_checks_page_counts) and bool((planned != width).any())


def kernel_parts(state, num_rows: int, width: int) -> torch.Tensor | None:
    """``[num_rows, width]``: which of its works reads each KV position of a planned row
    (:func:`backends.flashinfer.fa3_schedule.column_parts`), read from the schedule the state's last plan
    left (FlashInfer's fa3 and fa2 MLA kernels share the scheduler and its plan info); None where
    the wrapper keeps no readable schedule (a stand-in)."""
    wrapper = getattr(state, "wrapper", None)
    if getattr(wrapper, "kernel", None) not in ("fa3", "fa2"):
        return None
    try:
        schedule = fa3_schedule.read_schedule(getattr(wrapper, "_wrapper", wrapper))
    except (fa3_schedule.ScheduleUnreadable, AttributeError, TypeError, ValueError):
        return None
    return fa3_schedule.column_parts(schedule, num_rows, width)


def open_wrapper(device, *, kernel: str = "fa3", **buffers) -> MLAWrapper:
    """A wrapper with its own workspace and the reserved metadata ``buffers`` (qo_indptr,
    kv_indptr, kv_indices, kv_len_arr): the one the port's state makes (read from ``backends.flashinfer.sm90_state``
    when called, so a stand-in put there is the one made)."""
    workspace = torch.empty(sm90.WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return sm90.MLAWrapper(workspace, kernel=kernel, **buffers)


def make_attention_state(impl, config: AttentionConfig, device="cuda", **kwargs):
    """The port's SM90 attention state (:class:`backends.flashinfer.sm90_state.SM90AttentionState`) on the
    host stages of ``impl``; an ``impl`` with a ``make_attention_state(config, device, **kwargs)``
    of its own makes the state itself (a planted bug in the state, a user's own state)."""
    own = getattr(impl, "make_attention_state", None)
    if callable(own):
        return own(config, device, **kwargs)
    return sm90.make_attention_state(impl, config, device, **kwargs)


def attention_config(config: LayerConfig, *, kernel: str = "fa3", layout: str = "compacted") -> AttentionConfig:
    """The port's state configuration for a layer."""
    return AttentionConfig(
        num_heads=config.num_heads, max_rows=max(config.max_tokens, 1), width=config.width, layout=layout,
        block_size=config.block_size, sm_scale=config.sm_scale, rope_dim=config.rope_dim,
        kv_dtype=getattr(torch, config.kv_dtype), k_scale=config.k_scale, kernel=kernel,
    )


class PortBackend:
    """The project's port on FlashInfer's ``kernel`` (``fa3`` or ``fa2``), its host stages (kv_len,
    planned rows, request ids, convert, the layout) those of ``impl``: the implementation under
    test (``--impl``), the project's own (``fast/``) where None."""

    returns_lse = True
    # the compacted layout leaves a top-k hole as -1 inside its row's span (backends.seam.CAPABILITIES)
    hands_holes_to_the_kernel = True

    def __init__(self, kernel: str = "fa3", impl=None, layout: str = "compacted", *, reuse_plan: bool = False):
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        check_layout(layout)
        self.kernel = kernel
        self.name = f"port-{kernel}"
        self.impl = impl if impl is not None else default_impl()
        self.layout = layout
        self.reuse_plan = reuse_plan  # the state keeps its last plan where rows and lengths repeat

    def describe(self) -> str:
        version = installed_flashinfer_version() or "not importable"
        kept = ", plans kept where rows and lengths repeat" if self.reuse_plan else ""
        return (f"the project's port of the seed (vLLM 0.30.0's logic), {host_stages(self.impl)}, {self.layout} "
                f"layout{kept}, FlashInfer {version} backend={self.kernel}")

    def with_layer(self, layout: str, reuse_plan: bool) -> PortBackend:
        """The same port (kernel, host stages) under ``layout``, keeping its plans or not: itself
        where it is that already."""
        if layout == self.layout and reuse_plan == self.reuse_plan:
            return self
        return PortBackend(self.kernel, self.impl, layout, reuse_plan=reuse_plan)

    def unsupported(self, config: LayerConfig) -> str | None:
        """A cache whose blocks lie apart (what FlashInfer refuses is probed at plan:
        ``backends.flashinfer.compat.unsupported_reason``)."""
        return READS_CONTIGUOUS_BLOCKS if config.blocks_apart else None

    def open_layer(self, config: LayerConfig, device) -> PortLayer:
        return PortLayer(self, config, torch.device(device))


def host_stages(impl) -> str:
    """Whose host stages the port runs: the project's own, or the implementation under test's class."""
    kind = type(impl)
    return "its own host stages" if kind is FastImpl else f"host stages of {kind.__module__}.{kind.__qualname__}"


def lay_out(impl, layout: str, step: StepInput, planned: torch.Tensor, *, block_size: int, max_rows: int,
            width: int, device) -> LaidOut:
    """The host stages' convert, kv_indptr and kv_indices layout of ``step`` for the ``planned``
    lengths, in buffers of their own: what the layer's device part is to hand the kernel, known
    before it runs."""
    rows = step.topk_indices.shape[0]
    req = impl.request_ids(step.meta.query_start_loc_cpu.to(device), rows)
    return lay_out_rows(impl, layout, step.topk_indices.to(device), step.block_table.to(device), req, planned,
                        block_size=block_size, max_rows=max_rows, width=width, device=device)


def lay_out_rows(impl, layout: str, topk_indices: torch.Tensor, block_table: torch.Tensor, req: torch.Tensor,
                 planned: torch.Tensor, *, block_size: int, max_rows: int, width: int, device) -> LaidOut:
    """:func:`lay_out` for top-k rows whose request ids are given (``req``, one per row)."""
    rows = topk_indices.shape[0]
    slots, counts = impl.convert(topk_indices, block_table, req, block_size, with_counts=True)
    indptr = impl.kv_indptr(layout, planned, max_rows, width)
    lens = torch.zeros(rows, dtype=torch.int32)
    lens[: planned.numel()] = planned[:rows]
    kv_indices = torch.full((indices_capacity(max_rows, width),), -1, dtype=torch.int32, device=device)
    impl.write_kv_indices(layout, slots, lens.to(device), indptr[: rows + 1].to(device), kv_indices)
    return LaidOut(layout, max_rows, width, slots, counts, indptr, kv_indices)


def state_problems(state, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, planned: torch.Tensor) -> list[str]:
    """What the state hands the kernel against what was laid out (``kv_indptr``, ``kv_indices``)
    for the ``planned`` lengths: kv_indptr, kv_len on the host and the device, no stale length
    past the planned rows, kv_indices."""
    n = planned.numel()
    problems = []
    indptr = state.planned_kv_indptr
    if not torch.equal(indptr[: n + 1], kv_indptr[: n + 1]):
        problems.append(f"kv_indptr differs: state {indptr[: n + 1].tolist()[:8]} vs laid out "
                        f"{kv_indptr[: n + 1].tolist()[:8]}")
    if not torch.equal(state.planned_kv_len[:n], planned.to(torch.int32)):
        problems.append("kv_len differs from the planned lens")
    if bool((state.planned_kv_len[n:] != 0).any()):
        problems.append(f"stale kv_len past row {n}: {state.planned_kv_len[n:].nonzero().flatten()[:8].tolist()}")
    if bool((state.kv_len[n:] != 0).any()):
        problems.append("stale device kv_len past the planned rows")
    end = int(kv_indptr[n])
    mine, theirs = state.kv_indices[:end].cpu(), kv_indices[:end].cpu()
    if not torch.equal(mine, theirs):
        at = int((mine != theirs).nonzero()[0])
        problems.append(f"kv_indices differ first at entry {at}: state {int(mine[at])} vs laid out {int(theirs[at])}")
    return problems


def rows_written_past(out: torch.Tensor, rows: int) -> list[str]:
    """Rows of ``out`` past the first ``rows`` that the kernel wrote (they were filled with NaN)."""
    if bool(torch.isnan(out[rows:].float()).all()):
        return []
    return [f"the kernel wrote rows past the {rows} planned rows"]


class PortLayer:
    """One SM90 attention state; each step plans the port's exact lengths, rehearses its layout,
    then convert, layout and run."""

    def __init__(self, backend: PortBackend, config: LayerConfig, device: torch.device):
        self.backend, self.config, self.device = backend, config, device
        self.impl = backend.impl
        self.layout = backend.layout
        state_config = attention_config(config, kernel=backend.kernel, layout=backend.layout)
        if backend.reuse_plan:
            state_config = dataclasses.replace(state_config, reuse_plan=True)
        self.state = make_attention_state(self.impl, state_config, device)
        self.plan_syncs: list[int] = []  # device syncs of each FlashInfer plan() (counted on CUDA)
        self.state.wrapper.plan = with_syncs_counted(self.state.wrapper.plan, device, self.plan_syncs)
        rows = max(config.max_tokens, 1)
        self.topk = torch.full((rows, config.width), -1, dtype=torch.int32, device=device)

    def float_workspaces(self) -> list[torch.Tensor]:
        """FlashInfer's float workspace of the layer's wrapper (split partials are written there at run)."""
        return [self.state.workspace]

    def unread_slots(self, step: StepInput) -> list[torch.Tensor]:
        """kv_indices from the end of the planned spans (``kv_indptr[planned rows]``) on: the
        packed and compacted layouts write nothing there (the strided one's convert writes every
        row of the buffer, so what is planted there is overwritten before the kernel)."""
        return [self.state.kv_indices[int(self.state.planned_kv_indptr[step.planned_rows]):]]

    def step(self, step: StepInput) -> StepOutcome:
        return planned_then_run(self, step)

    def plan_step(self, step: StepInput) -> StepOutcome:
        """The host lengths, the rehearsed layout (``laid_out``) and the plan, or the plan's
        refusal where the installed FlashInfer is expected to refuse it (:func:`plan_refused`; a
        plan accepted there is a schedule problem); with queries and a plan, the step's inputs
        staged in the layer's buffers (the top-k rows, block table, request ids, padded queries,
        NaN output)."""
        cfg, impl, state = self.config, self.impl, self.state
        meta = step.meta
        host = impl.kv_lens(meta, topk=cfg.topk, kpool=cfg.kpool, async_scheduling=cfg.async_scheduling)
        planned = impl.planned_lens(meta, host, topk=cfg.topk).to(torch.int32)
        n = int(planned.numel())
        laid = lay_out(impl, self.layout, step, planned, block_size=cfg.block_size, max_rows=state.config.max_rows,
                       width=cfg.width, device=self.device)
        outcome = StepOutcome(
            backend=self.backend.name, planned_rows=n, host_lengths=host.to(torch.int64), host_exact=True,
            planned_lengths=planned.to(torch.int64), laid_out=laid,
        )
        expected = self.refusal_expected(planned)
        synced_before = len(self.plan_syncs)
        try:
            state.plan(n, planned)
        except ValueError as exc:
            if not expected or PLAN_REFUSAL not in str(exc):
                raise
            outcome.refusal = f"ValueError at plan: {exc}"[:300]
        else:
            if expected:
                outcome.schedule_problems.append(REFUSAL_EXPECTED)
        outcome.plans = state.plans
        outcome.plan_syncs = self.plan_syncs[synced_before:]
        if step.runs_kernel and outcome.refusal is None:
            self._stage(step)
        return outcome

    def refusal_expected(self, planned: torch.Tensor) -> bool:
        """Whether the installed FlashInfer is to refuse this plan (its probe asked only for a
        strided plan with a row shorter than W)."""
        width = self.config.width
        if self.layout != "strided" or not bool((planned != width).any()):
            return False
        return plan_refused(compat.detect_features(self.device), self.layout, planned, width)

    def _stage(self, step: StepInput) -> None:
        rows = step.topk_indices.shape[0]
        self.topk.fill_(-1)
        self.topk[:rows] = step.topk_indices.to(self.device)
        padded = self.topk.shape[0]
        table = _block_table_buffer(step.block_table, self.device)
        req = self.impl.request_ids(step.meta.query_start_loc_cpu.to(self.device), padded)
        heads = self.config.num_heads
        self.out = torch.full((padded, heads, KV_LORA_RANK), float("nan"), dtype=torch.bfloat16, device=self.device)
        self.lse = torch.full((padded, heads), float("nan"), dtype=torch.float32, device=self.device)
        q_nope, q_pe = _padded(step.q_nope, padded), _padded(step.q_pe, padded)
        flat = step.kv_cache.view(-1, 1, step.kv_cache.shape[-1])
        self.staged = (self.topk, table, req, q_nope, q_pe, flat[..., :KV_LORA_RANK], flat[..., KV_LORA_RANK:])

    def launch(self, step: StepInput, outcome: StepOutcome) -> None:
        """Convert, layout and the kernel on the staged inputs, into the layer's output buffers."""
        self.state.step(*self.staged, self.out, self.lse)

    def finish(self, step: StepInput, outcome: StepOutcome) -> StepOutcome:
        """The output, LSE and the kernel's lengths, slots and works of the planned rows, what the
        state handed the kernel against the rehearsed layout (:func:`state_problems`) and rows
        written past the planned ones (:func:`rows_written_past`)."""
        state, n = self.state, outcome.planned_rows
        self._synchronize()
        lengths = state.kv_len[:n].to("cpu", torch.int64)
        outcome.out, outcome.lse = self.out[:n], self.lse[:n]
        outcome.executed_lengths = lengths
        outcome.executed_slots = spans_selection(state.kv_indptr[: n + 1].to("cpu", torch.int64), lengths,
                                                state.kv_indices.to("cpu", torch.int64))
        outcome.executed_parts = kernel_parts(state, n, outcome.executed_slots[0].shape[1])
        laid = outcome.laid_out
        outcome.schedule_problems += (state_problems(state, laid.kv_indptr, laid.kv_indices, outcome.planned_lengths)
                                      + rows_written_past(self.out, n))
        return outcome

    def _nan_outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh NaN-filled buffers shaped as the layer's output and LSE."""
        return torch.full_like(self.out, float("nan")), torch.full_like(self.lse, float("nan"))

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def rerun(self, step: StepInput, outcome: StepOutcome) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's device part once more on the plan in force, into fresh NaN-filled buffers:
        the planned rows' ``(out, lse)``."""
        out, lse = self._nan_outputs()
        self.state.step(*self.staged, out, lse)
        self._synchronize()
        n = outcome.planned_rows
        return out[:n], lse[:n]

    def attend_again(self, outcome: StepOutcome) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel alone once more on the staged inputs and on what the state's buffers hold
        now (no plan, no convert, no layout), into fresh NaN-filled buffers: the planned rows'
        ``(out, lse)``."""
        out, lse = self._nan_outputs()
        _, _, _, q_nope, q_pe, ckv, kpe = self.staged
        self.state.attend(q_nope, q_pe, ckv, kpe, out, lse)
        self._synchronize()
        n = outcome.planned_rows
        return out[:n], lse[:n]

    def timing_parts(self, step: StepInput, outcome: StepOutcome):
        """The kernel alone on the staged inputs, into scratch buffers (device), and the plan alone (host)."""
        state = self.state
        out, lse = self._nan_outputs()
        _, _, _, q_nope, q_pe, ckv, kpe = self.staged
        planned = outcome.planned_lengths.to(torch.int32)
        return (lambda: state.attend(q_nope, q_pe, ckv, kpe, out, lse),
                lambda: state.plan(outcome.planned_rows, planned))


def _block_table_buffer(block_table: torch.Tensor, device) -> torch.Tensor:
    """The block table with at least one row (padded rows read request 0's row)."""
    rows, width = block_table.shape
    out = torch.zeros((max(rows, 1), max(width, 1)), dtype=torch.int32, device=device)
    out[:rows, :width] = block_table.to(device)
    return out


def _padded(q: torch.Tensor, rows: int) -> torch.Tensor:
    if q.shape[0] >= rows:
        return q
    pad = torch.zeros((rows - q.shape[0],) + tuple(q.shape[1:]), dtype=q.dtype, device=q.device)
    return torch.cat([q, pad])
