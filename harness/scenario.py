"""The one scenario builder every tier uses: a batch spec + a seed -> a step's tensors.

A :class:`BatchSpec` lists requests (decode first) and the model/cache configuration. From it
and a seed, :func:`build_scenario` derives everything on the host: the block table (permuted
physical blocks, physical block 0 never allocated, a table wider than any allocation with
stale entries past each allocation), the indexer rows, the metadata the production builder
reads, and each row's context and regime. :func:`build_attention_inputs` then materialises q
and the KV cache on a device. Every random draw comes from NumPy generators or, for the KV
cache, a counter-based integer hash (:func:`slot_values`), keyed by ``(seed, component)``, so
the same spec and seed give the same tensors on any machine.

Score magnitudes (docs/edges.md#magnitude): ``score_offsets`` adds a raw (before ``sm_scale``)
offset to every score of a query row through one shared coordinate of q and the KV cache
(:func:`score_offset_coordinate`), exactly; ``split_score_signs`` gives the newer half of each
request's tokens the opposite offset. :func:`with_empty_rows` empties chosen rows' selections.

Production batch sizes (docs/edges.md#scale): :func:`build_attention_inputs_on` generates the
same KV cache on the device, and q per row from a key (:func:`query_rows`), so a row keeps its
q in any batch; :func:`intended_slots_on` and :func:`readable_slots_on` apply the convert rule
there. The indexer rows are written by :func:`indexer_rows_fast`, bitwise the per-row model.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from mla_constants import DEEPSEEK_V32_SM_SCALE, INVALID, KV_LORA_RANK, ROPE_DIM, TOPK
from reference.indexer import buffer_width, decode_rows_use_identity, prefill_rows_use_identity
from reference.rules import classify_rows, convert_rule, request_ids_per_row, route_prefills_to_mha, row_context

KV_DTYPES = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}
#: The stored value of the score-offset coordinate in every KV slot that holds data (exact in
#: bf16 and e4m3). Row r's q holds ``offset_r / (SCORE_OFFSET_KEY * k_scale)`` there, so the
#: coordinate adds exactly ``offset_r`` to each raw score ``q . (stored * k_scale)`` of the row.
SCORE_OFFSET_KEY = 1.0


@dataclass(frozen=True)
class Request:
    """One request of the step: ``seq_len`` tokens after the step, ``q_len`` of them queried now."""

    seq_len: int
    q_len: int = 1


@dataclass(frozen=True)
class BatchSpec:
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
    table_slack: int = 2  # block-table columns past the longest allocation (stale entries)
    spare_blocks: int = 3  # physical blocks nobody owns
    min_block_id: int = 1  # first physical block id handed out (push slot ids past 2**23)
    # Raw score offset (q . k before sm_scale) of query row r: score_offsets[r % len]; () adds none
    # and leaves the inputs as without the option.
    score_offsets: tuple[float, ...] = ()
    split_score_signs: bool = False  # the newer half of each request's tokens gets the row's -offset

    def __post_init__(self) -> None:
        object.__setattr__(self, "requests", tuple(self.requests))
        object.__setattr__(self, "score_offsets", tuple(float(o) for o in self.score_offsets))
        for i, r in enumerate(self.requests):
            if r.q_len < 1 or r.seq_len < r.q_len:
                raise ValueError(f"request {i}: need 1 <= q_len <= seq_len, got {r}")
        kinds = [r.q_len <= self.decode_threshold for r in self.requests]
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
        if self.split_score_signs and not self.score_offsets:
            raise ValueError("split_score_signs needs score_offsets: it flips the sign of a row's offset")
        for offset in self.score_offsets:
            inexact = score_offset_problem(offset, self.k_scale)
            if inexact:
                raise ValueError(inexact)

    @property
    def resolved_width(self) -> int:
        return self.width if self.width is not None else buffer_width(self.topk, self.kpool)

    @property
    def rope_dim(self) -> int:
        return ROPE_DIM if self.rope else 0

    @property
    def head_dim(self) -> int:
        return KV_LORA_RANK + self.rope_dim

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        return KV_DTYPES[self.kv_dtype]

    def replace(self, **changes) -> "BatchSpec":
        return dataclasses.replace(self, **changes)


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
    num_actual_tokens: int


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
        return self.meta.num_actual_tokens

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.spec.block_size

    @property
    def planned_rows(self) -> int:
        """Rows handed to the sparse kernel: the decode prefix when prefills go to MHA."""
        return self.meta.num_decode_tokens if self.prefills_to_mha else self.num_rows

    def request_ids(self) -> torch.Tensor:
        return request_ids_per_row(self.meta.query_start_loc_cpu, self.topk_indices.shape[0])

    def intended_slots(self) -> torch.Tensor:
        """The convert rule applied to the indexer rows: ``[rows incl. padding, width]``."""
        return convert_rule(self.topk_indices, self.block_table, self.request_ids(), self.spec.block_size)

    def referenced_slots(self) -> torch.Tensor:
        """Slot ids of every token of every request, in request and token order."""
        bs = self.spec.block_size
        parts = [
            (blocks.to(torch.int64).unsqueeze(1) * bs + torch.arange(bs)).reshape(-1)[: r.seq_len]
            for blocks, r in zip(self.allocations, self.spec.requests)
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


def component_seed(seed: int, component: str) -> int:
    """A stable 63-bit seed for one random component of a scenario."""
    digest = hashlib.sha256(f"{seed}:{component}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _allocate_blocks(spec: BatchSpec, rng: np.random.Generator) -> tuple[list[np.ndarray], int]:
    needed = [math.ceil(r.seq_len / spec.block_size) for r in spec.requests]
    total = sum(needed)
    num_blocks = spec.min_block_id + total + spec.spare_blocks
    pool = spec.min_block_id + rng.permutation(total + spec.spare_blocks)
    bounds = np.cumsum([0] + needed)
    return [pool[bounds[i] : bounds[i + 1]] for i in range(len(needed))], num_blocks


def _block_table(allocs: list[np.ndarray], table_width: int, num_blocks: int, rng) -> np.ndarray:
    """Allocated blocks first, then stale ids (anything but block 0) up to the table width."""
    table = rng.integers(1, num_blocks, size=(len(allocs), table_width), dtype=np.int64)
    for i, blocks in enumerate(allocs):
        table[i, : blocks.size] = blocks
    return table.astype(np.int32)


def build_scenario(spec: BatchSpec, seed: int) -> Scenario:
    """Host-side tensors of one step (no q, no KV cache: see :func:`build_attention_inputs`)."""
    reqs = spec.requests
    seq_lens = torch.tensor([r.seq_len for r in reqs], dtype=torch.int32)
    q_lens = torch.tensor([r.q_len for r in reqs], dtype=torch.int32)
    qsl = torch.zeros(len(reqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q_lens, 0)
    num_rows = int(qsl[-1])
    is_decode = [r.q_len <= spec.decode_threshold for r in reqs]
    num_decodes = sum(is_decode)
    num_decode_tokens = int(qsl[num_decodes])

    ctx = row_context(seq_lens, qsl)
    row_is_decode = torch.arange(num_rows) < num_decode_tokens
    prefill_seq_lens = seq_lens[num_decodes:]
    decode_identity = decode_rows_use_identity(int(seq_lens.max()) if reqs else 0, spec.topk)
    prefill_identity = prefill_rows_use_identity(int(prefill_seq_lens.max()) if num_decodes < len(reqs) else 0, spec.topk)
    identity = torch.where(row_is_decode, torch.tensor(decode_identity), torch.tensor(prefill_identity))

    rng = np.random.default_rng(component_seed(seed, "blocks"))
    allocs, num_blocks = _allocate_blocks(spec, rng)
    table_width = max((a.size for a in allocs), default=0) + spec.table_slack
    table = _block_table(allocs, max(table_width, 1), num_blocks, rng)

    topk_indices = indexer_rows_fast(
        ctx, identity, spec.topk, spec.kpool, spec.resolved_width, component_seed(seed, "indexer"), spec.padded_rows
    )
    upper = seq_lens.clone()
    spec_decode = torch.tensor([d and r.q_len > 1 for d, r in zip(is_decode, reqs)], dtype=torch.bool)
    upper[spec_decode] += spec.host_bound_slack
    positions = torch.zeros(num_rows + spec.padded_rows, dtype=torch.int64)
    positions[:num_rows] = ctx - 1
    meta = StepMetadata(
        num_reqs=len(reqs),
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens,
        seq_lens_cpu_upper_bound=upper,
        positions=positions,
        num_decodes=num_decodes,
        num_decode_tokens=num_decode_tokens,
        num_prefills=len(reqs) - num_decodes,
        num_actual_tokens=num_rows,
    )
    return Scenario(
        spec=spec,
        seed=seed,
        meta=meta,
        block_table=torch.from_numpy(table),
        allocations=[torch.from_numpy(a.astype(np.int64)) for a in allocs],
        num_blocks=num_blocks,
        topk_indices=topk_indices,
        row_ctx=ctx,
        row_identity=identity,
        row_regime=classify_rows(ctx, identity, spec.topk, spec.kpool),
        prefills_to_mha=route_prefills_to_mha(prefill_seq_lens, spec.topk),
    )


@dataclass
class AttentionInputs:
    q_nope: torch.Tensor  # [rows incl. padding, H, 512] bf16
    q_pe: torch.Tensor  # [rows incl. padding, H, R] bf16
    kv_cache: torch.Tensor  # [num_blocks, block_size, 512 + R] bf16 or float8_e4m3fn

    @property
    def ckv(self) -> torch.Tensor:
        """``[num_slots, 1, 512]`` view of the cache."""
        return self.kv_cache.view(-1, 1, self.kv_cache.shape[-1])[..., :KV_LORA_RANK]

    @property
    def kpe(self) -> torch.Tensor:
        """``[num_slots, 1, R]`` view of the cache."""
        return self.kv_cache.view(-1, 1, self.kv_cache.shape[-1])[..., KV_LORA_RANK:]


_NAN_BITS = {"bfloat16": (torch.int16, 0x7FC0), "float8_e4m3fn": (torch.uint8, 0x7F)}
_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)
_LANES = 4  # 16-bit table indices per 64-bit hash: a value costs a quarter hash and a lookup
_MAX_HEAD_DIM = KV_LORA_RANK + ROPE_DIM


def _normal(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(size=shape, dtype=np.float32))


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, in place on a uint64 array (wrapping arithmetic)."""
    x ^= x >> _U64(30)
    x *= _U64(0xBF58476D1CE4E5B9)
    x ^= x >> _U64(27)
    x *= _U64(0x94D049BB133111EB)
    x ^= x >> _U64(31)
    return x


@functools.lru_cache(maxsize=1)
def _normal_table() -> np.ndarray:
    """2**16 standard normals (float32) that 16-bit hash lanes index."""
    return np.random.default_rng(component_seed(0, "normal-table")).standard_normal(1 << 16, dtype=np.float32)


def slot_values(seed: int, slots: np.ndarray, head_dim: int) -> np.ndarray:
    """Standard-normal float32 values ``[len(slots), head_dim]`` of the given KV slots. Value j
    of slot s is a function of ``(seed, s, j)`` alone: 16-bit lane ``j % 4`` of element
    ``s * 144 + j // 4`` of the splitmix64 stream seeded by ``seed`` indexes a fixed table of
    normals. So a slot holds the same values whichever other slots are generated (and, for
    its first 512 values, whether the cache has rope or not), and integer arithmetic makes
    them the same on any machine."""
    chunks = -(-head_dim // _LANES)
    counters = np.asarray(slots, dtype=_U64)[:, None] * _U64(_MAX_HEAD_DIM // _LANES) + np.arange(1, chunks + 1, dtype=_U64)
    with np.errstate(over="ignore"):
        counters *= _GOLDEN
        counters += _U64(seed)
        bits = _splitmix64(counters)
    lanes = bits.astype("<u8", copy=False).view("<u2")  # lane 0 = the low 16 bits, whatever the byte order
    return _normal_table()[lanes[:, :head_dim]]


def nan_kv_buffer(shape: tuple[int, ...], kv_dtype: str, device) -> torch.Tensor:
    """A KV buffer of ``kv_dtype`` on ``device`` with every element NaN: a slot no builder
    wrote shows in any output that reads it."""
    bits, pattern = _NAN_BITS[kv_dtype]
    buffer = torch.empty(shape, dtype=KV_DTYPES[kv_dtype], device=device)
    buffer.view(bits).fill_(pattern)
    return buffer


def _kv_cache_buffer(scenario: Scenario, device, poison: bool) -> torch.Tensor:
    """The scenario's KV cache buffer on ``device``: every slot NaN with ``poison`` (the builder
    then writes the slots some row reads), uninitialised without (the builder writes every slot)."""
    spec = scenario.spec
    shape = (scenario.num_blocks, spec.block_size, spec.head_dim)
    if poison:
        return nan_kv_buffer(shape, spec.kv_dtype, device)
    return torch.empty(shape, dtype=spec.torch_kv_dtype, device=device)


def build_attention_inputs(
    scenario: Scenario, device: torch.device | str = "cpu", *, poison: bool = True, q_seed_component: str = "q"
) -> AttentionInputs:
    """q and the KV cache on ``device``. With ``poison`` only the slots some row's intended
    selection reads get data (:meth:`Scenario.readable_slots`) and every other slot, slot 0
    included, holds NaN, so a read outside the selection shows in the output; without it every
    slot gets data. A slot's values depend only on the seed and the slot (:func:`slot_values`)."""
    spec = scenario.spec
    rows = scenario.topk_indices.shape[0]
    q = _normal(component_seed(scenario.seed, q_seed_component), (rows, spec.num_heads, spec.head_dim))
    q = q.to(torch.bfloat16).to(device)
    cache = _kv_cache_buffer(scenario, device, poison)
    flat = cache.view(-1, spec.head_dim)
    kv_seed = component_seed(scenario.seed, "kv")
    if poison:
        slots = scenario.readable_slots()
        values = torch.from_numpy(slot_values(kv_seed, slots.numpy(), spec.head_dim)).to(spec.torch_kv_dtype)
        flat[slots.to(device)] = values.to(device)
    else:
        slots = torch.arange(scenario.num_slots)
        values = slot_values(kv_seed, slots.numpy(), spec.head_dim)
        flat.copy_(torch.from_numpy(values).to(spec.torch_kv_dtype))
    if spec.score_offsets:
        _carry_score_offsets(scenario, q, flat, slots)
    return AttentionInputs(q_nope=q[..., :KV_LORA_RANK], q_pe=q[..., KV_LORA_RANK:], kv_cache=cache)


def _carry_score_offsets(scenario: Scenario, q: torch.Tensor, flat: torch.Tensor, filled: torch.Tensor) -> None:
    """Write the offset coordinate: ``SCORE_OFFSET_KEY`` times the slot's sign into every filled
    slot, each row's offset over ``SCORE_OFFSET_KEY * k_scale`` into its q (every head)."""
    spec = scenario.spec
    coord = score_offset_coordinate(spec)
    query = scenario.row_score_offsets() / (SCORE_OFFSET_KEY * spec.k_scale)
    q[:, :, coord] = query.to(torch.bfloat16).to(q.device).unsqueeze(1)
    keys = (scenario.slot_score_signs(filled) * SCORE_OFFSET_KEY).to(torch.float32).to(spec.torch_kv_dtype)
    flat[filled.to(flat.device), coord] = keys.to(flat.device)


# --- production batch sizes (docs/edges.md#scale) ---------------------------------------------
#
# The same step at 10^4-10^5 rows: indexer rows written without a Python array per row, the
# reference convert and the KV values computed on the device, and q drawn per row from the
# counter-based hash, so that a row's q depends on its key alone (not on the batch around it).


def indexer_rows_fast(
    ctx: torch.Tensor, identity: torch.Tensor, topk: int, kpool: int, width: int, seed: int, num_padded_rows: int = 0
) -> torch.Tensor:
    """Bitwise what :func:`reference.indexer.indexer_rows` returns: the rows that draw (kpool 1
    with ctx > topk, pooled with at least topk / kpool complete pools) call the generator in row
    order exactly as the per-row model does; prefixes and pooled tails are written for all rows
    at once."""
    kpool = max(int(kpool), 1)
    if kpool > 1 and topk % kpool:
        raise ValueError(f"topk={topk} must be a multiple of kpool={kpool}")
    if kpool > 1 and width < topk + kpool - 1:
        raise ValueError(f"width={width} < topk + kpool - 1 = {topk + kpool - 1}")
    c = ctx.to(torch.int64).numpy()
    ident = identity.to(torch.bool).numpy()
    n = c.size
    too_wide = ident & (c > width)
    if too_wide.any():
        raise ValueError(f"identity fill needs ctx <= width, got ctx={int(c[too_wide][0])}, width={width}")
    out = np.full((n + num_padded_rows, width), INVALID, dtype=np.int32)
    if kpool == 1:
        draws = ~ident & (c > topk)
        prefix = np.where(draws, 0, c)
        complete = tail = None
    else:
        complete, tail = np.divmod(c, kpool)
        draws = ~ident & (complete >= topk // kpool)
        prefix = np.where(ident, c, np.where(draws, 0, complete * kpool))
        tail = np.where(ident, 0, tail)
    _write_prefixes(out, prefix)
    if kpool > 1:
        _write_pool_tails(out, complete * kpool, tail, topk)
    rng = np.random.default_rng(seed)
    selectable = topk // kpool
    spread = np.arange(kpool)
    for r in np.flatnonzero(draws):
        if kpool == 1:
            out[r, :topk] = rng.choice(int(c[r]), size=topk, replace=False)
        else:
            pools = rng.choice(int(complete[r]), size=selectable, replace=False)
            out[r, :topk] = (pools[:, None] * kpool + spread).reshape(-1)
    return torch.from_numpy(out)


_FILL_ROWS = 4096  # rows per vectorised write (bounds the temporaries)


def _write_prefixes(out: np.ndarray, lengths: np.ndarray) -> None:
    """Row r of ``out`` gets ``0..lengths[r]-1`` in its leading columns."""
    cols = np.arange(out.shape[1], dtype=np.int32)
    for start in range(0, lengths.size, _FILL_ROWS):
        part = lengths[start : start + _FILL_ROWS, None]
        rows = out[start : start + part.shape[0]]
        np.copyto(rows, cols[None, :], where=cols[None, :] < part)


def _write_pool_tails(out: np.ndarray, first: np.ndarray, counts: np.ndarray, topk: int) -> None:
    """Row r of ``out`` gets ``first[r] .. first[r] + counts[r] - 1`` from column topk on (the
    trailing incomplete pool)."""
    if not counts.any():
        return
    span = int(counts.max())
    offsets = np.arange(span)
    for start in range(0, counts.size, _FILL_ROWS):
        n = counts[start : start + _FILL_ROWS].size
        values = (first[start : start + n, None] + offsets[None, :]).astype(np.int32)
        block = out[start : start + n, topk : topk + span]
        np.copyto(block, values, where=offsets[None, :] < counts[start : start + n, None])


_HASH_ELEMENTS = 1 << 23  # 64-bit hash values per chunk on the device (64 MiB)


def _as_int64(value: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _logical_shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x >> bits`` on the 64 bits of an int64 tensor as unsigned (zeros shifted in)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64_torch(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser of :func:`_splitmix64` on an int64 tensor holding uint64 bits
    (wrapping arithmetic), in place, on any device."""
    x ^= _logical_shift_right(x, 30)
    x *= _as_int64(0xBF58476D1CE4E5B9)
    x ^= _logical_shift_right(x, 27)
    x *= _as_int64(0x94D049BB133111EB)
    x ^= _logical_shift_right(x, 31)
    return x


def fill_hashed_normals(out: torch.Tensor, seed: int, keys: torch.Tensor, stride: int) -> torch.Tensor:
    """Write standard normals into ``out [len(keys), width]`` (any float dtype, any device, rounded
    to it): value j of row i is the normal-table entry that 16-bit lane ``j % 4`` of
    ``splitmix64(seed + GOLDEN * (keys[i] * stride + j // 4 + 1))`` indexes. With
    ``stride = 144`` this is :func:`slot_values`, bit for bit; a row's values depend on its key
    alone. Chunked so the 64-bit intermediates stay small."""
    rows, width = out.shape
    chunks = -(-width // _LANES)
    if chunks > stride:
        raise ValueError(f"width {width} needs {chunks} hash values per key, more than the stride {stride}")
    device = out.device
    table = torch.from_numpy(_normal_table()).to(device)
    steps = torch.arange(1, chunks + 1, dtype=torch.int64, device=device)
    keys = keys.to(device=device, dtype=torch.int64)
    per = max(1, _HASH_ELEMENTS // chunks)
    for start in range(0, rows, per):
        part = keys[start : start + per]
        bits = (part[:, None] * stride + steps[None, :]).mul_(_as_int64(int(_GOLDEN))).add_(_as_int64(seed % (1 << 64)))
        bits = splitmix64_torch(bits)
        values = torch.empty((part.numel(), chunks, _LANES), dtype=torch.float32, device=device)
        for lane in range(_LANES):
            values[:, :, lane] = table[_logical_shift_right(bits, 16 * lane) & 0xFFFF]
        out[start : start + part.numel()] = values.view(part.numel(), chunks * _LANES)[:, :width].to(out.dtype)
    return out


def slot_values_on(seed: int, slots: torch.Tensor, head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`slot_values` computed on ``slots``' device, as ``dtype``: bitwise the same values."""
    out = torch.empty((slots.numel(), head_dim), dtype=dtype, device=slots.device)
    return fill_hashed_normals(out, seed, slots.reshape(-1), _MAX_HEAD_DIM // _LANES)


def query_rows(seed: int, keys: torch.Tensor, num_heads: int, head_dim: int, device) -> torch.Tensor:
    """bf16 q ``[len(keys), H, head_dim]`` on ``device``: row i is a function of ``(seed, keys[i],
    H, head_dim)`` alone (:func:`fill_hashed_normals`), whatever rows are drawn with it."""
    width = num_heads * head_dim
    out = torch.empty((keys.numel(), width), dtype=torch.bfloat16, device=device)
    fill_hashed_normals(out, seed, keys.reshape(-1), -(-width // _LANES))
    return out.view(keys.numel(), num_heads, head_dim)


def intended_slots_on(scenario: Scenario, device) -> torch.Tensor:
    """:meth:`Scenario.intended_slots` (the reference convert rule) computed on ``device``."""
    return convert_rule(
        scenario.topk_indices.to(device), scenario.block_table.to(device), scenario.request_ids().to(device),
        scenario.spec.block_size,
    )


def readable_slots_on(scenario: Scenario, device) -> torch.Tensor:
    """:meth:`Scenario.readable_slots` computed on ``device`` (sorted int64 slot ids there)."""
    slots = intended_slots_on(scenario, device)
    return torch.unique(slots[slots != INVALID].to(torch.int64))


def build_attention_inputs_on(
    scenario: Scenario, device, *, poison: bool = True, row_keys: torch.Tensor | None = None,
    q_seed_component: str = "q-rows",
) -> AttentionInputs:
    """q and the KV cache generated on ``device`` (for batches of 10^4-10^5 rows). The cache is
    bitwise that of :func:`build_attention_inputs` (same slots filled, same values); q row i is
    drawn from its key ``row_keys[i]`` (default: the row index) by :func:`query_rows`, so a row
    given the same key in another batch gets the same q."""
    spec = scenario.spec
    rows = scenario.topk_indices.shape[0]
    keys = torch.arange(rows, dtype=torch.int64) if row_keys is None else row_keys.to(torch.int64)
    if keys.numel() != rows:
        raise ValueError(f"row_keys has {keys.numel()} keys for {rows} rows")
    q = query_rows(component_seed(scenario.seed, q_seed_component), keys, spec.num_heads, spec.head_dim, device)
    cache = _kv_cache_buffer(scenario, device, poison)
    flat = cache.view(-1, spec.head_dim)
    kv_seed = component_seed(scenario.seed, "kv")
    if poison:
        slots = readable_slots_on(scenario, device)
    else:
        slots = torch.arange(scenario.num_slots, dtype=torch.int64, device=device)
    for start in range(0, slots.numel(), _HASH_ELEMENTS // 64):
        part = slots[start : start + _HASH_ELEMENTS // 64]
        flat[part] = slot_values_on(kv_seed, part, spec.head_dim).to(spec.torch_kv_dtype)
    if spec.score_offsets:
        _carry_score_offsets(scenario, q, flat, slots.cpu())
    return AttentionInputs(q_nope=q[..., :KV_LORA_RANK], q_pe=q[..., KV_LORA_RANK:], kv_cache=cache)
