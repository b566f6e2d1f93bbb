"""vLLM's SM90 sparse-MLA backend, driven as the engine drives it.

One :class:`VllmLayer` is one attention layer of one vLLM release: vLLM's
``FlashInferMLASparseSM90Impl`` and ``FlashInferMLASparseSM90Builder`` constructed from a
configuration the suite builds per case (:class:`LayerConfig`), sharing one top-k buffer. A
step is what the engine does each forward:

1. ``build(cam)``: vLLM's ``build()`` (its ``_kv_lens_host``, the dense-MHA cut, its
   ``_SM90State.plan``: a fresh plan, a kept plan or a replan, then in the bounded design the
   device clamp of every work item's kv_end);
2. the indexer's rows written into the shared top-k buffer;
3. ``forward(q_nope, q_pe, kv_cache, metadata)``: vLLM's ``forward_mqa`` (its convert kernel,
   its layout of kv_indices, FlashInfer's ``run``).

:meth:`VllmLayer.schedule` reads FlashInfer's schedule back after ``build`` (what the kernel
executes; ``backends.flashinfer.fa3_schedule``). Two designs ship: ``exact`` (0.30: exact host lengths,
a plan every step, the strided layout) and ``bounded`` (0.31 to 0.34: host upper bounds plus
32 tokens of slack, a plan kept while the bounds fit, the device clamp, packed indices). What
differs between releases comes from the facts of the release's version (``backends.vllm.facts``:
the design, the dtype an fp8 cache is planned with, whether ``forward_mqa`` reads the cache's
block stride, whether the builder reads adaptive verification, what a -1 inside a row's planned
length is packed as), never from its code, which is checked against them
(:meth:`VllmSM90Backend.feature_problems`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from mla_constants import FIRST_SLOT, KV_LORA_RANK, SLOT_ZERO

from ..flashinfer import fa3_schedule
from ..seam import (
    LayerConfig,
    StepInput,
    StepOutcome,
    block_stride_of,
    planned_then_run,
    slots_of_cache_rows,
    spans_selection,
    with_syncs_counted,
)
from .facts import CodeFeatures, facts_for, feature_problems
from .shims import load_sm90_module, stand_ins_in_use
from .source import VllmSource, design_of, flashinfer_pin, sm90_module_sha256

LAYER_NAME = "model.layers.0.self_attn.attn"
#: kv_indices entries FlashInfer's fa3 MLA kernel loads per KV tile (``CTA_TILE_KV`` of its
#: ``mla_hopper.cuh``).
FA3_KV_TILE = 64
#: vLLM's kv_cache_dtype string and the torch dtype of its cache tensor (fp8 is uint8 storage).
CACHE_DTYPES = {"bfloat16": ("auto", torch.bfloat16), "float8_e4m3fn": ("fp8", torch.uint8)}


@dataclass
class StepCommonMetadata:
    """The step's ``CommonAttentionMetadata`` as vLLM's builder reads it (device tensors where
    the engine keeps them on the device), plus the decode/prefill split the common builder
    derives (``num_decodes`` ...) and the token rows incl. CUDA-graph padding."""

    num_reqs: int
    num_actual_tokens: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1], device: the split the step runs
    query_start_loc_cpu: torch.Tensor  # the host's split (a placeholder under adaptive verification)
    seq_lens: torch.Tensor  # int32 [num_reqs], device
    seq_lens_cpu_upper_bound: torch.Tensor | None
    positions: torch.Tensor | None  # int64, device
    block_table_tensor: torch.Tensor  # int32 [num_reqs, table width], device
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    req_id_rows: int  # token rows incl. padding


def engine_block_table(block_table: torch.Tensor, device) -> torch.Tensor:
    """The step's block table as the engine's persistent, zero-initialised device buffer holds it:
    the ``num_reqs`` rows, then rows past them (here one spare row). The engine hands the backend
    a view of its first ``num_reqs`` rows, and the convert kernel reads it by pointer, so a padding
    row (request 0) of a step with no request reads the buffer's zero row. The whole buffer is
    handed over here, which the backend reads alike (it takes only the width and strides from its
    shape) and which Triton's interpreter can address (it maps a tensor's own elements only)."""
    rows, width = block_table.shape
    buffer = torch.zeros(rows + 1, width, dtype=torch.int32, device=device)
    buffer[:rows] = block_table.to(torch.int32).to(device)
    return buffer


def device_split(meta) -> torch.Tensor:
    """The query split the step runs on the device: the metadata's ``query_start_loc`` where it
    carries one that differs from the host's (adaptive verification), else ``query_start_loc_cpu``."""
    split = getattr(meta, "query_start_loc", None)
    return meta.query_start_loc_cpu if split is None else split


def common_metadata(meta, block_table: torch.Tensor, rows_with_padding: int, device) -> StepCommonMetadata:
    """The step's common metadata on ``device`` from the project's step metadata (the fields
    of ``harness.spec.StepMetadata``): the host's query split on the host, the device's on the
    device."""
    qsl = meta.query_start_loc_cpu.to(torch.int32)
    return StepCommonMetadata(
        num_reqs=meta.num_reqs,
        num_actual_tokens=meta.num_actual_tokens,
        query_start_loc=device_split(meta).to(torch.int32).to(device),
        query_start_loc_cpu=qsl,
        seq_lens=meta.seq_lens.to(torch.int32).to(device),
        seq_lens_cpu_upper_bound=meta.seq_lens_cpu_upper_bound,
        positions=None if meta.positions is None else meta.positions.to(device),
        block_table_tensor=engine_block_table(block_table, device),
        num_decodes=meta.num_decodes,
        num_decode_tokens=meta.num_decode_tokens,
        num_prefills=meta.num_prefills,
        req_id_rows=rows_with_padding,
    )


class VllmSM90Backend:
    """One vLLM release's SM90 backend, loaded from ``source`` (a ``backends.seam.Backend``)."""

    kernel = "fa3"
    returns_lse = False  # forward_mqa returns the output only

    def __init__(self, source: VllmSource):
        self.source = source
        self.module = load_sm90_module(source)
        self.version = source.version
        self.name = f"vllm-{source.version}"
        # What the release is comes from the facts of its version (backends.vllm.facts), not from
        # its code; the code is checked against them (code_features, feature_problems).
        self.judged = facts_for(source.version, design_of(source))
        facts = self.judged.facts
        self.design = facts.design
        self.plans_fp8_as_storage_dtype = facts.plans_fp8_as_storage_dtype
        self.reads_block_stride = facts.reads_block_stride
        # where it reads adaptive verification, the builder bounds every row by the longest
        # request, the host query split not being the device's
        self.reads_adaptive_verification = facts.reads_adaptive_verification
        self.minus_one_filler = facts.minus_one_filler
        self.flashinfer_pin = flashinfer_pin(source)  # what its METADATA requires; None without one

    def describe(self) -> str:
        fp8 = "uint8 (its storage dtype)" if self.plans_fp8_as_storage_dtype else "float8_e4m3fn"
        stride = "any block stride" if self.reads_block_stride else "contiguous blocks"
        pin = f"pins flashinfer-python {self.flashinfer_pin}" if self.flashinfer_pin else "pins no flashinfer-python"
        return (f"{self.source.describe()}: SM90 sparse backend, {self.design} design, plans an fp8 cache as {fp8}, "
                f"reads {stride}, packs a -1 inside a row's length as {self.minus_one_filler}, {pin}; "
                f"{self.judged.describe()}; "
                f"stand-ins: {', '.join(n for n in stand_ins_in_use() if n.startswith('vllm'))}")

    def packed_minus_one(self, device) -> str:
        """What the release's code packs a -1 of a converted row inside its planned length as, in
        kv_indices: ``"slot 0"`` or ``"the row's first slot"``. The bounded design packs rows with
        its own kernel (``_SM90State.pack_indices``), run here on one probe row ``[5, -1, -1, -1]``;
        the exact design copies its rows into the strided layout clamped at 0 in ``forward_mqa``."""
        pack = getattr(self.module._SM90State, "pack_indices", None)
        if pack is None:
            return SLOT_ZERO
        slots = torch.tensor([[5, -1, -1, -1]], dtype=torch.int32, device=device)
        holder = SimpleNamespace(kv_indptr=torch.tensor([0, 4], dtype=torch.int32, device=device),
                                 kv_indices=torch.full((4,), -7, dtype=torch.int32, device=device))
        pack(holder, slots)
        packed = holder.kv_indices.tolist()
        if packed[0] != 5 or len(set(packed[1:])) != 1:
            raise AssertionError(f"{self.name}'s pack of [5, -1, -1, -1] gave {packed}")
        return {0: SLOT_ZERO, 5: FIRST_SLOT}.get(packed[1], f"slot {packed[1]}")

    def code_features(self, device=None) -> CodeFeatures:
        """What the release's code shows of each of its facts (the filler probed on ``device``
        where one is given): what :func:`backends.vllm.facts.feature_problems` checks."""
        builder_init = inspect.getsource(self.module.FlashInferMLASparseSM90Builder.__init__)
        forward = inspect.getsource(self.module.FlashInferMLASparseSM90Impl.forward_mqa)
        backend_class = self.module.FlashInferMLASparseSM90Backend
        return CodeFeatures(
            design=design_of(self.source),
            fp8_plan_dtype="float8_e4m3fn" if "float8_e4m3fn" in builder_init else "uint8",
            hands_block_stride="BLOCK_STRIDE_ROWS" in forward,
            declares_block_alignment="customize_spec" in vars(backend_class),
            reads_adaptive_verification="enable_adaptive_verification" in builder_init,
            minus_one_filler=self.packed_minus_one(device) if device is not None else None,
            flashinfer_pin=self.flashinfer_pin,
            module_sha256=sm90_module_sha256(self.source))

    def feature_problems(self, device=None) -> list[str]:
        """Each feature the release's facts promise that its code lacks, naming the feature."""
        return feature_problems(self.version, self.judged.facts, self.code_features(device))

    def unsupported(self, config: LayerConfig) -> str | None:
        """A cache whose blocks lie apart on a release that reads contiguous blocks (0.30.0 and
        0.31.0 declare the LBHNC layout alone, ``supported_kv_cache_layouts``, so the engine never
        hands them one); what the installed FlashInfer refuses shows at plan."""
        if config.blocks_apart and not self.reads_block_stride:
            return (f"vLLM {self.version}'s SM90 backend reads contiguous blocks (its supported_kv_cache_layouts is "
                    f"LBHNC alone): the engine never hands it a cache whose blocks lie {config.kv_block_stride} rows "
                    f"apart")
        return None

    def open_layer(self, config: LayerConfig, device) -> VllmLayer:
        return VllmLayer(self, config, torch.device(device))


def loaded_past_length(schedule: fa3_schedule.Schedule, executed: list[int],
                       planned: list[int]) -> dict[int, tuple[int, int]]:
    """Per row, the entries ``[from, to)`` of its kv_indices past its executed length that
    FlashInfer's fa3 MLA kernel loads all the same. It reads a work item ``[kv_start, kv_end)`` in
    tiles of :data:`FA3_KV_TILE` entries from ``kv_start`` (``ceil(kv_end / tile) - kv_start //
    tile`` of them), bounds the loads by the row's planned length (its ``packed_kv_bound``) and
    masks only the scores past ``kv_end``: a row whose executed length ends inside a tile, short
    of its planned length, loads the entries up to the tile's end (or the planned length) with
    weight 0."""
    loaded: dict[int, tuple[int, int]] = {}
    tile = FA3_KV_TILE
    for row, start, end in zip(schedule.row.tolist(), schedule.kv_start.tolist(), schedule.kv_end.tolist(),
                               strict=True):
        tiles = -(-end // tile) - start // tile
        if tiles <= 0 or row >= len(planned):
            continue
        first, last = max(end, executed[row]), min(start + tiles * tile, planned[row])
        if first < last:
            before = loaded.get(row, (first, last))
            loaded[row] = (min(before[0], first), max(before[1], last))
    return loaded


def _vllm_config(config: LayerConfig, layer) -> SimpleNamespace:
    hf = SimpleNamespace(index_topk=config.topk, index_kpool=config.kpool, kv_lora_rank=KV_LORA_RANK,
                         qk_rope_head_dim=config.rope_dim)
    return SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context={LAYER_NAME: layer}),
        model_config=SimpleNamespace(hf_text_config=hf),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=config.max_tokens,
                                         async_scheduling=config.async_scheduling),
        speculative_config=SimpleNamespace(enable_adaptive_verification=config.adaptive_verification),
    )


class VllmLayer:
    """vLLM's impl and builder for one layer configuration; steps share its state."""

    def __init__(self, backend: VllmSM90Backend, config: LayerConfig, device: torch.device):
        m = backend.module
        self.backend, self.config, self.device = backend, config, device
        cache_dtype, self.cache_torch_dtype = CACHE_DTYPES[config.kv_dtype]
        self.topk_indices_buffer = torch.full((config.max_tokens, config.width), -1, dtype=torch.int32, device=device)
        head_size = KV_LORA_RANK + config.rope_dim
        self.impl = m.FlashInferMLASparseSM90Impl(
            config.num_heads, head_size, config.sm_scale, 1, None, None, cache_dtype, None, "decoder", None,
            topk_indices_buffer=self.topk_indices_buffer, indexer=None, q_lora_rank=None,
            kv_lora_rank=KV_LORA_RANK, qk_nope_head_dim=128, qk_rope_head_dim=config.rope_dim,
            qk_head_dim=128 + config.rope_dim, v_head_dim=128, kv_b_proj=None,
        )
        # The attention layer: its k_scale, and the Hopper routing of prefills to dense MHA that
        # the common builder's stand-in decided.
        self.attention_layer = SimpleNamespace(
            impl=self.impl, _k_scale_float=config.k_scale,
            _use_sparse_mha=lambda metadata: bool(metadata.prefill_use_dense_mha),
        )
        spec = SimpleNamespace(dtype=self.cache_torch_dtype, block_size=config.block_size,
                               tokens_per_state=config.kpool)
        self.builder = m.FlashInferMLASparseSM90Builder(spec, [LAYER_NAME], _vllm_config(config, self.attention_layer),
                                                        device)
        self.state = self.builder.state
        self.plans = 0  # FlashInfer plan() calls made by vLLM's state (a kept plan makes none)
        self.plan_syncs: list[int] = []  # device syncs of each of them (counted on CUDA)
        plan = with_syncs_counted(self.state.wrapper.plan, device, self.plan_syncs)

        def counted_plan(*args, **kwargs):
            self.plans += 1
            return plan(*args, **kwargs)

        self.state.wrapper.plan = counted_plan
        # What vLLM's _kv_lens_host returned in the last build(): (rows, host lengths, exact);
        # the exact design's lengths are always exact.
        self.host_lengths: tuple[int, torch.Tensor, bool] | None = None
        kv_lens_host = self.builder._kv_lens_host

        def noted_kv_lens_host(cam):
            result = kv_lens_host(cam)
            self.host_lengths = (result[0], result[1], True) if len(result) == 2 else tuple(result)
            return result

        self.builder._kv_lens_host = noted_kv_lens_host

    # --- one step -----------------------------------------------------------------------

    def build(self, cam: StepCommonMetadata):
        return self.builder.build(0, cam)

    def write_topk(self, topk_indices: torch.Tensor) -> None:
        """The indexer's rows into the shared top-k buffer (rows past them keep what they held)."""
        self.topk_indices_buffer[: topk_indices.shape[0]].copy_(topk_indices.to(self.device))

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, metadata) -> torch.Tensor:
        """vLLM's ``forward_mqa`` on ``kv_cache [num_blocks, block_size, 512 + R]`` (an fp8
        cache is handed over as vLLM holds it: uint8 storage)."""
        cache = kv_cache.view(self.cache_torch_dtype) if kv_cache.dtype != self.cache_torch_dtype else kv_cache
        out, _ = self.impl.forward_mqa((q_nope, q_pe), cache, metadata, self.attention_layer)
        return out

    def schedule(self) -> fa3_schedule.Schedule:
        return fa3_schedule.read_schedule(self.state.wrapper)

    @property
    def on_flashinfer(self) -> bool:
        """Whether the layer plans and runs on FlashInfer's own wrapper (not a stand-in)."""
        return type(self.state.wrapper).__module__.split(".")[0] == "flashinfer"

    def slots_loaded_past_length(self, outcome: StepOutcome) -> dict[int, list[int]]:
        """Per row, the slot ids that FlashInfer's fa3 kernel loads past the row's executed
        length (:func:`loaded_past_length`), read from kv_indices as the last ``forward``
        packed them."""
        n = outcome.planned_rows
        spans = loaded_past_length(self.schedule(), outcome.executed_lengths.tolist(),
                                   outcome.planned_lengths.tolist())
        indptr = self.state.wrapper._kv_indptr_buf[: n + 1].detach().to("cpu", torch.int64).tolist()
        indices = self.state.kv_indices.detach().to("cpu", torch.int64)
        return {row: indices[indptr[row] + a : indptr[row] + b].tolist() for row, (a, b) in spans.items()}

    def slots_of_indices(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """kv_indices as the last ``forward`` left them, as slot ids (host int64): a release that
        reads the block stride writes rows of the cache's row view (``flat_kv_row_view``), which
        are slot ids only where the blocks are contiguous."""
        indices = self.state.kv_indices.detach().to("cpu", torch.int64)
        if not self.backend.reads_block_stride:
            return indices
        return slots_of_cache_rows(indices, kv_cache.shape[1], block_stride_of(kv_cache))

    def planned_lengths(self, num_rows: int) -> torch.Tensor:
        """The host lengths of the plan in force (before any clamp)."""
        return self.state._lens_cpu[:num_rows].clone()

    def float_workspaces(self) -> list[torch.Tensor]:
        """The float workspace vLLM's state hands FlashInfer's wrapper (split partials are written there at run)."""
        return [self.state.workspace]

    def unread_rows(self, step: StepInput) -> list[torch.Tensor]:
        """The top-k buffer's rows past those the step's metadata counts (``num_actual_tokens``:
        a piecewise graph's padded rows and beyond; a FULL graph's metadata counts its padded rows)."""
        return [self.topk_indices_buffer[step.meta.num_actual_tokens:]]

    def index_buffers(self) -> list[torch.Tensor]:
        """vLLM's state's kv_indices, which its plan() hands FlashInfer and forward_mqa packs."""
        return [self.state.kv_indices]

    def unread_slots(self, step: StepInput) -> list[torch.Tensor]:
        """kv_indices from the end of the planned spans (``kv_indptr[planned rows]``) on: every
        design's forward writes its rows' spans only (0.30.0's strided copy ends there too)."""
        end = int(self.state.wrapper._kv_indptr_buf[step.planned_rows])
        return [self.state.kv_indices[end:]]

    def step(self, step: StepInput) -> StepOutcome:
        """build (plan, clamp), the schedule read back, then forward when the step has queries."""
        return planned_then_run(self, step)

    def plan_step(self, step: StepInput) -> StepOutcome:
        """build (plan, clamp) and the schedule read back; with queries, the indexer's rows in the
        top-k buffer."""
        rows_with_padding = step.topk_indices.shape[0]
        cam = common_metadata(step.meta, step.block_table, rows_with_padding, self.device)
        synced_before = len(self.plan_syncs)
        self.metadata = self.build(cam)
        _, host, exact = self.host_lengths
        n = step.planned_rows
        self.schedule_of_step = schedule = self.schedule()
        extents = fa3_schedule.row_extents(schedule, n)
        problems = [f"row {r} : {'; '.join(e.problems)}" for r, e in enumerate(extents) if e.problems]
        stray = fa3_schedule.stray_works(schedule, n)
        if stray:
            problems.append(f"work items name rows {stray[:8]} past the {n} planned rows")
        lengths = torch.tensor([e.length for e in extents], dtype=torch.int64)
        outcome = StepOutcome(
            backend=self.backend.name, planned_rows=n, host_lengths=host.to(torch.int64), host_exact=bool(exact),
            planned_lengths=self.planned_lengths(n).to(torch.int64), executed_lengths=lengths,
            schedule_problems=problems, plans=self.plans, reads_back=True,
            plan_syncs=self.plan_syncs[synced_before:],
        )
        if step.runs_kernel:
            self.write_topk(step.topk_indices)
        return outcome

    def launch(self, step: StepInput, outcome: StepOutcome) -> None:
        """vLLM's ``forward_mqa`` on the rows the MLA layer hands it (``MLAAttention.forward_impl``
        cuts q to the metadata's ``num_actual_tokens``: a piecewise graph's padded rows are cut, a
        FULL graph's counted; the decode prefix where the prefills go to dense MHA), then
        convert, pack and FlashInfer's run."""
        q_rows = step.meta.num_decode_tokens if step.prefills_to_mha else step.meta.num_actual_tokens
        self.out = self.forward(step.q_nope[:q_rows], step.q_pe[:q_rows], step.kv_cache, self.metadata)

    def forward_again(self, step: StepInput, outcome: StepOutcome) -> torch.Tensor:
        """``forward_mqa`` once more on the metadata of the last build (no plan made), on
        ``step``'s inputs: the output of the planned rows."""
        self.launch(step, outcome)
        return self.out[: outcome.planned_rows]

    def finish(self, step: StepInput, outcome: StepOutcome) -> StepOutcome:
        """The output and kv_indices as forward_mqa's convert and pack left them for the run, as slot ids."""
        n = outcome.planned_rows
        indptr = self.state.wrapper._kv_indptr_buf[: n + 1].detach().to("cpu", torch.int64)
        outcome.out = self.out[:n]
        outcome.executed_slots = spans_selection(indptr, outcome.executed_lengths,
                                                 self.slots_of_indices(step.kv_cache))
        outcome.executed_parts = fa3_schedule.column_parts(self.schedule_of_step, n,
                                                           outcome.executed_slots[0].shape[1])
        return outcome
