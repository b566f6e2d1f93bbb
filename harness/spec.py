"""What a step is made of: the batch spec (requests, model and cache configuration), the
engine metadata the production builder reads, and the :class:`Scenario` a spec and a seed
build (:func:`harness.builder.build_scenario`), with the truth about every row.

Score magnitudes (docs/edges.md#magnitude): ``score_offsets`` adds a raw (before ``sm_scale``)
offset to every score of a query row through one shared coordinate of q and the KV cache
(:func:`score_offset_coordinate`), exactly; ``split_score_signs`` gives the newer half of each
request's tokens the opposite offset. :func:`with_empty_rows` empties chosen rows' selections.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from backends.seam import query_rows
from mla_constants import DEEPSEEK_V32_SM_SCALE, INVALID, KV_LORA_RANK, ROPE_DIM, TOPK
from reference.indexer import buffer_width
from reference.rules import convert_rule, request_ids_per_row

KV_DTYPES = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}
#: The stored value of the score-offset coordinate in every KV slot that holds data (exact in
#: bf16 and e4m3). Row r's q holds ``offset_r / (SCORE_OFFSET_KEY * k_scale)`` there, so the
#: coordinate adds exactly ``offset_r`` to each raw score ``q . (stored * k_scale)`` of the row.
SCORE_OFFSET_KEY = 1.0


class KernelVariantDims:
    """The dimensions and KV dtype a ``kv_dtype`` and ``rope`` field pair selects."""

    rope: bool
    kv_dtype: str

    @property
    def rope_dim(self) -> int:
        return ROPE_DIM if self.rope else 0

    @property
    def head_dim(self) -> int:
        return KV_LORA_RANK + self.rope_dim

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        return KV_DTYPES[self.kv_dtype]


@dataclass(frozen=True)
class Request:
    """One request of the step: ``seq_len`` tokens after the step, ``q_len`` of them queried now.
    ``q_len`` 0 is a request with no query row this step (a padded request: ``Request(0, 0)``)."""

    seq_len: int
    q_len: int = 1


@dataclass(frozen=True)
class BatchSpec(KernelVariantDims):
    requests: tuple[Request, ...]
    topk: int = TOPK
    kpool: int = 1
    width: int | None = None  # topk_indices_buffer width; default roundup(topk + kpool - 1, 128)
    block_size: int = 64
    rope: bool = True  # R = 64; False: NoPE (R = 0)
    kv_dtype: str = "bfloat16"  # or "float8_e4m3fn"
    k_scale: float = 1.0
    num_heads: int = 16
    sm_scale: float = DEEPSEEK_V32_SM_SCALE
    async_scheduling: bool = False
    host_bound_slack: int = 0  # tokens the host upper bound over-counts on spec-decode requests (async only)
    decode_threshold: int = 1  # requests with q_len <= this are decodes (1 + num speculative tokens)
    padded_rows: int = 0  # CUDA-graph padding rows past the last query token
    # The step runs in a FULL CUDA graph (a uniform decode batch): the engine metadata counts the
    # padded rows as tokens and the trailing Request(0, 0) as its padded requests (graph_padded).
    full_graph: bool = False
    table_slack: int = 2  # block-table columns past the longest allocation (stale entries)
    spare_blocks: int = 3  # physical blocks nobody owns
    min_block_id: int = 1  # first physical block id handed out (push slot ids past 2**23)
    # Raw score offset (q . k before sm_scale) of query row r: score_offsets[r % len]; () adds none
    # and leaves the inputs as without the option.
    score_offsets: tuple[float, ...] = ()
    split_score_signs: bool = False  # the newer half of each request's tokens gets the row's -offset
    # Which context sources the engine metadata carries (docs/input-space.md#context-sources):
    # without the host bound the builder reads the positions, without both the seq_lens.
    with_host_bound: bool = True  # seq_lens_cpu_upper_bound present
    with_positions: bool = True  # positions present

    def __post_init__(self) -> None:
        object.__setattr__(self, "requests", tuple(self.requests))
        object.__setattr__(self, "score_offsets", tuple(float(o) for o in self.score_offsets))
        for i, r in enumerate(self.requests):
            if r.q_len < 0 or r.seq_len < r.q_len:
                raise ValueError(f"request {i}: need 0 <= q_len <= seq_len, got {r}")
        # Requests with no query row may sit anywhere; the others come decodes first.
        kinds = [r.q_len <= self.decode_threshold for r in self.requests if r.q_len]
        if kinds != sorted(kinds, reverse=True):
            raise ValueError(f"decode requests (q_len <= {self.decode_threshold}) must come first: {self.requests}")
        if self.kpool < 1 or self.topk % self.kpool:
            raise ValueError(f"topk={self.topk} must be a positive multiple of kpool={self.kpool}")
        width = self.resolved_width
        if width % 128 or width < self.topk + self.kpool - 1:
            raise ValueError(f"width={width} must be a multiple of 128 and >= topk + kpool - 1")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {sorted(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.host_bound_slack and not self.async_scheduling:
            raise ValueError("host_bound_slack needs async_scheduling: without it the host bound is exact")
        if self.min_block_id < 1:
            raise ValueError("physical block 0 is reserved (slot 0 is what a -1 clamps to)")
        graph = full_graph_problem(self)
        if graph:
            raise ValueError(graph)
        if self.split_score_signs and not self.score_offsets:
            raise ValueError("split_score_signs needs score_offsets: it flips the sign of a row's offset")
        for offset in self.score_offsets:
            inexact = score_offset_problem(offset, self.k_scale)
            if inexact:
                raise ValueError(inexact)

    @property
    def resolved_width(self) -> int:
        return self.width if self.width is not None else buffer_width(self.topk, self.kpool)


    def replace(self, **changes) -> BatchSpec:
        return dataclasses.replace(self, **changes)


def uniform_query_len(spec: BatchSpec) -> int | None:
    """The query length every request with a query row shares, None where they differ or
    there is none."""
    lens = {r.q_len for r in spec.requests if r.q_len}
    return lens.pop() if len(lens) == 1 else None


def full_graph_problem(spec: BatchSpec) -> str | None:
    """Why ``spec`` is not a step vLLM's model runner runs in a FULL CUDA graph, where it says
    it is one. The sparse MLA backends support FULL graphs for uniform decode batches only
    (``AttentionCGSupport.UNIFORM_BATCH``); the dispatcher pads the tokens to a capture size
    that is a multiple of the uniform query length and the requests to that size over it
    (``CudagraphDispatcher._create_padded_batch_descriptor``): the padded requests trail with no
    query row and seq_len 0."""
    if not spec.full_graph:
        return None
    q = uniform_query_len(spec)
    if q is None or q > spec.decode_threshold:
        return "full_graph: a FULL CUDA graph runs uniform decode batches (one q_len <= decode_threshold)"
    live = [i for i, r in enumerate(spec.requests) if r.q_len]
    padded = spec.requests[live[-1] + 1:]
    if len(live) != live[-1] + 1 or any(r.seq_len for r in padded):
        return "full_graph: the padded requests trail the batch with no query row and seq_len 0"
    tokens = len(live) * q + spec.padded_rows
    if tokens % q or len(spec.requests) != tokens // q:
        return (f"full_graph: {tokens} tokens at query length {q} pad to {tokens // q} requests "
                f"({tokens % q} tokens over), the batch has {len(spec.requests)}")
    return None


def graph_padded(spec: BatchSpec, capture_size: int) -> BatchSpec:
    """``spec`` (a uniform decode batch) as vLLM's model runner runs it in the FULL CUDA graph of
    ``capture_size`` tokens: padded rows up to it, padded requests up to ``capture_size / q``. Its
    requests without a query row are left out (the runner's batch holds the scheduled ones)."""
    q = uniform_query_len(spec)
    if q is None:
        raise ValueError("graph_padded needs a uniform decode batch")
    live = tuple(r for r in spec.requests if r.q_len)
    rows = len(live) * q
    if capture_size < rows or capture_size % q:
        raise ValueError(f"capture size {capture_size} must be a multiple of {q} and at least the {rows} rows")
    padded = (Request(0, 0),) * (capture_size // q - len(live))
    return spec.replace(requests=live + padded, padded_rows=capture_size - rows, full_graph=True)


def spec_from_dict(spec: dict) -> BatchSpec:
    """The :class:`BatchSpec` of ``dataclasses.asdict(spec)`` (as JSON stores it)."""
    return BatchSpec(**dict(spec, requests=tuple(Request(**r) for r in spec["requests"])))


def batch(*pairs: tuple[int, int], **config) -> BatchSpec:
    """Shorthand: ``batch((seq_len, q_len), ..., topk=2048, kpool=4)``."""
    return BatchSpec(requests=tuple(Request(s, q) for s, q in pairs), **config)


@dataclass(frozen=True)
class StepMetadata:
    """The fields of the engine's common attention metadata that the builder reads."""

    num_reqs: int
    query_start_loc_cpu: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs] (a device tensor in the engine)
    seq_lens_cpu_upper_bound: torch.Tensor | None  # int32 [num_reqs]; optimistic under async spec decode
    positions: torch.Tensor | None  # int64 [num_rows + padded rows] (a device tensor in the engine)
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_actual_tokens: int  # the query rows; under a FULL CUDA graph the padded rows too
    # int32 [num_reqs + 1]: the device's query split where it differs from the host's (adaptive
    # verification: the host holds a placeholder split, the device the one the step runs); None
    # where the device holds the host's
    query_start_loc: torch.Tensor | None = None


def device_query_start_loc(meta) -> torch.Tensor:
    """The query split the step runs on the device: ``meta.query_start_loc`` where the metadata
    carries one, else the host's ``query_start_loc_cpu``."""
    device = getattr(meta, "query_start_loc", None)
    return meta.query_start_loc_cpu if device is None else device


@dataclass
class Scenario:
    """A step's host-side tensors and the truth about every row."""

    spec: BatchSpec
    seed: int
    meta: StepMetadata
    block_table: torch.Tensor  # int32 [num_reqs, table_width]
    allocations: list[torch.Tensor]  # physical block ids of each request, in logical order
    num_blocks: int
    topk_indices: torch.Tensor  # int32 [num_rows + padded_rows, width]
    row_ctx: torch.Tensor  # int64 [num_rows]
    row_identity: torch.Tensor  # bool [num_rows]
    row_regime: list[str]
    prefills_to_mha: bool
    extra: dict = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        """Query rows: the last query start (the token count of the metadata includes a FULL
        graph's padded rows)."""
        return query_rows(self.meta)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.spec.block_size

    @property
    def planned_rows(self) -> int:
        """Rows handed to the sparse kernel: the decode prefix when prefills go to MHA."""
        return self.meta.num_decode_tokens if self.prefills_to_mha else self.num_rows

    def request_ids(self) -> torch.Tensor:
        """The request of every row (padding rows: 0) under the split the step runs on the device."""
        return request_ids_per_row(device_query_start_loc(self.meta), self.topk_indices.shape[0])

    def intended_slots(self) -> torch.Tensor:
        """The convert rule applied to the indexer rows: ``[rows incl. padding, width]``."""
        return convert_rule(self.topk_indices, self.block_table, self.request_ids(), self.spec.block_size)

    def referenced_slots(self) -> torch.Tensor:
        """Slot ids of every token of every request, in request and token order."""
        bs = self.spec.block_size
        parts = [
            (blocks.to(torch.int64).unsqueeze(1) * bs + torch.arange(bs)).reshape(-1)[: r.seq_len]
            for blocks, r in zip(self.allocations, self.spec.requests, strict=True)
        ]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def readable_slots(self) -> torch.Tensor:
        """Sorted slot ids that some row's intended selection (a) reads: the only slots
        :func:`build_attention_inputs` fills when it poisons the rest."""
        slots = self.intended_slots()
        return torch.unique(slots[slots != INVALID].to(torch.int64))

    def describe(self) -> str:
        s = self.spec
        reqs = ", ".join(f"({r.seq_len},{r.q_len})" for r in s.requests[:6]) + (" ..." if len(s.requests) > 6 else "")
        offsets = ""
        if s.score_offsets:
            offsets = f" score_offsets={list(s.score_offsets)}" + (" split_signs" if s.split_score_signs else "")
        return (
            f"seed={self.seed} topk={s.topk} kpool={s.kpool} W={s.resolved_width} bs={s.block_size} "
            f"R={s.rope_dim} kv={s.kv_dtype} H={s.num_heads} async={s.async_scheduling} "
            f"requests(seq,q)=[{reqs}]{offsets}"
        )

    def row_score_offsets(self) -> torch.Tensor:
        """float64 raw score offset of every row (padding included: 0 there)."""
        rows = self.topk_indices.shape[0]
        offsets = torch.zeros(rows, dtype=torch.float64)
        if self.spec.score_offsets:
            cycle = torch.tensor(self.spec.score_offsets, dtype=torch.float64)
            offsets[: self.num_rows] = cycle[torch.arange(self.num_rows) % cycle.numel()]
        return offsets

    def slot_score_signs(self, slots: torch.Tensor) -> torch.Tensor:
        """float64 sign (+1 or -1) of the offset each of ``slots`` carries: -1 for the newer half
        of its request's tokens (token j of a request of seq_len L with ``j >= L - L // 2``)
        under ``split_score_signs``, +1 otherwise and for slots no token owns."""
        slots = slots.to(torch.int64).cpu()
        if not self.spec.split_score_signs or not self.spec.requests:
            return torch.ones(slots.shape, dtype=torch.float64)
        owned = self.referenced_slots()
        seq = torch.tensor([r.seq_len for r in self.spec.requests])
        token = torch.cat([torch.arange(r.seq_len) for r in self.spec.requests])
        newer = token >= torch.repeat_interleave(seq - seq // 2, seq)
        order = torch.argsort(owned)
        owned, newer = owned[order], newer[order]
        at = torch.searchsorted(owned, slots).clamp(max=owned.numel() - 1)
        hit = owned[at] == slots
        return torch.where(hit & newer[at], -1.0, 1.0).to(torch.float64)


def with_empty_rows(scenario: Scenario, rows) -> Scenario:
    """The scenario with the indexer rows ``rows`` all -1: those rows select no slot (their
    intended selection (a) is empty, and the poisoned cache fills only what the other rows
    read). Their context and regime stay as built; a plan must give them kv_len 0."""
    topk = scenario.topk_indices.clone()
    rows = list(rows)
    bad = [r for r in rows if not 0 <= r < scenario.num_rows]
    if bad:
        raise ValueError(f"rows {bad} are not query rows (0..{scenario.num_rows - 1})")
    topk[rows] = INVALID
    return dataclasses.replace(scenario, topk_indices=topk)


def score_offset_coordinate(spec: BatchSpec) -> int:
    """The one head coordinate (of q's ``512 + R`` and the cache's) that carries the score
    offsets: the last rope coordinate, so the values the output averages (ckv) keep their data,
    or for NoPE (R = 0) the last ckv coordinate."""
    return spec.head_dim - 1


def score_offset_query_value(offset: float, k_scale: float) -> float:
    """q's value in the offset coordinate for a raw score offset ``offset``."""
    return offset / (SCORE_OFFSET_KEY * k_scale)


def score_offset_problem(offset: float, k_scale: float) -> str | None:
    """Why a raw score offset cannot be realised exactly (q's value in the offset coordinate is
    not finite or not a bf16 value), or None."""
    value = score_offset_query_value(offset, k_scale)
    if not math.isfinite(value) or float(torch.tensor(value, dtype=torch.float64).to(torch.bfloat16)) != value:
        return (f"score offset {offset:g} needs q = {value!r} in the offset coordinate (k_scale {k_scale:g}), "
                "not a bf16 value: pick an offset with at most 8 significant bits")
    return None

