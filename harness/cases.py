"""The case catalogue both tiers draw from: the contexts that reach every regime, and the batch
situations (docs/regimes.md#batch-situations), as :class:`harness.BatchSpec` values (built by the one scenario
builder, ``harness.build_scenario``)."""

from __future__ import annotations

from dataclasses import dataclass

from mla_constants import DEEPSEEK_V32_SM_SCALE, GLM_NOPE_SM_SCALE, KERNEL_VARIANTS, TOPK, variant_name
from reference import classify_row

from .builder import build_scenario, even_host_split, plan_rows
from .input_space import covering_cases
from .scenario import BatchSpec, batch
from .spec import KernelVariantDims, Scenario
from .topk_holes import TopkHoles, with_topk_holes

LONG_CTX = 100_003  # >= 100k, r = 3 for kpool 4
KPOOLS = (1, 4)
#: Regimes a kpool can reach: identity fill (A) needs a short batch; kpool 1 is H otherwise.
REGIMES_BY_KPOOL = {1: ("A", "H"), 4: ("A", "B", "C", "D", "E", "F", "G")}


def regime_contexts(topk: int, kpool: int) -> list[int]:
    """ctx at 1, kpool-1, kpool, kpool+1, topk-kpool-1, topk-1, topk, topk+1, topk+kpool-1,
    topk+kpool, 2*topk+r and >= 100k (duplicates and ctx < 1 dropped, order kept)."""
    r = 1 if kpool > 1 else 0
    raw = [1, kpool - 1, kpool, kpool + 1, topk - kpool - 1, topk - 1, topk, topk + 1,
           topk + kpool - 1, topk + kpool, 2 * topk + r, LONG_CTX]
    return list(dict.fromkeys(c for c in raw if c >= 1))


@dataclass(frozen=True)
class Case:
    """A named batch situation; ``focus`` lists the regimes it exists to exercise; ``holes``: the
    scores its top-k rows are written from (docs/input-space.md#holes-in-the-top-k), None for the
    indexer's rows without holes."""

    name: str
    spec: BatchSpec
    focus: tuple[str, ...] = ()
    holes: TopkHoles | None = None

    @property
    def id(self) -> str:
        return self.name


def context_case(ctx: int, kpool: int, topk: int = TOPK, **config) -> Case:
    """One decode row at ``ctx``, in a batch whose other request is long so the row takes the
    indexer's pooled/top-k path (not the identity short fill)."""
    spec = batch((ctx, 1), (LONG_CTX, 1), topk=topk, kpool=kpool, **config)
    regime = classify_row(ctx, topk, kpool, identity=False)
    return Case(f"ctx{ctx}-kpool{kpool}", spec, (regime,))


def identity_case(kpool: int, topk: int = TOPK, **config) -> Case:
    """All rows short: decode rows take the identity fill (regime A)."""
    spec = batch((1, 1), (kpool + 1, 1), (topk - 1, 1), (topk, 1), topk=topk, kpool=kpool, **config)
    return Case(f"identity-kpool{kpool}", spec, ("A",))


def situation_cases(kpool: int, topk: int = TOPK, **config) -> list[Case]:
    """The batch situations (docs/regimes.md#batch-situations) for one kpool."""
    k = f"kpool{kpool}"
    spec_decode = dict(decode_threshold=8)
    return [
        Case(
            f"decode-mixed-lengths-{k}",
            batch(
                (5, 1), (topk - 3, 1), (topk + 2, 1), (3 * topk + 1, 1), (LONG_CTX, 1), topk=topk, kpool=kpool, **config
            ),
        ),
        Case(
            f"spec-decode-straddling-topk-{k}",
            batch((topk + 3, 8), (topk - 2, 8), (LONG_CTX, 8), topk=topk, kpool=kpool, **spec_decode, **config),
        ),
        Case(
            f"decode+prefill-to-mha-{k}",
            batch((LONG_CTX, 1), (topk + 5, 1), (300, 40), (topk, 24), topk=topk, kpool=kpool, **config),
        ),
        Case(
            f"decode+prefill-sparse-{k}",
            batch((9, 1), (topk + 1, 1), (topk + 40, 48), (700, 16), topk=topk, kpool=kpool, **config),
        ),
        Case(
            f"chunked-prefill-with-context-{k}",
            batch((3 * topk + 7, 64), (topk + 30, 40), topk=topk, kpool=kpool, **config),
        ),
        Case(
            f"async-spec-decode-{k}",
            batch(
                (topk + 3, 4),
                (topk - 1, 4),
                (LONG_CTX, 4),
                topk=topk,
                kpool=kpool,
                decode_threshold=4,
                async_scheduling=True,
                host_bound_slack=3,
                **config,
            ),
        ),
        Case(f"empty-batch-{k}", batch(topk=topk, kpool=kpool, **config)),
    ]


def all_regime_cases(topk: int = TOPK, **config) -> list[Case]:
    """Every context of :func:`regime_contexts` for kpool 1 and 4, plus the identity fill."""
    cases = []
    for kpool in KPOOLS:
        cases.append(identity_case(kpool, topk, **config))
        cases += [context_case(ctx, kpool, topk, **config) for ctx in regime_contexts(topk, kpool)]
    return cases


# --- kernel configurations for the GPU tier (a covering design, not a cross product) --------

LONG_CTX_128K = 131_072
MIN_BLOCK_ID_PAST_2_23 = (1 << 23) // 64 + 1  # with block_size 64 every slot id is >= 2**23
HEADS = (16, 32, 64, 128)


@dataclass(frozen=True)
class KernelConfig(KernelVariantDims):
    """What selects a kernel variant (kv dtype x rope: each one JIT-builds separately) plus
    the per-launch knobs that do not (heads, sm_scale, k_scale)."""

    kv_dtype: str
    rope: bool
    num_heads: int
    k_scale: float = 1.0

    @property
    def sm_scale(self) -> float:
        return DEEPSEEK_V32_SM_SCALE if self.rope else GLM_NOPE_SM_SCALE

    @property
    def variant(self) -> str:
        return variant_name(self.kv_dtype, self.rope)


    @property
    def id(self) -> str:
        scale = f"-k{self.k_scale:g}" if self.k_scale != 1.0 else ""
        return f"{self.variant}-h{self.num_heads}{scale}"

    def apply(self, spec: BatchSpec) -> BatchSpec:
        return spec.replace(
            kv_dtype=self.kv_dtype,
            rope=self.rope,
            num_heads=self.num_heads,
            k_scale=self.k_scale,
            sm_scale=self.sm_scale,
        )


#: The three kernel variants the regime cases cycle: bf16 and fp8 KV with rope 64, bf16 NoPE.
VARIANTS = KERNEL_VARIANTS[:3]


def covering_config(index: int) -> KernelConfig:
    """The ``index``-th of 12 configurations cycling variants (period 3) and heads (period 4)
    together: any 12 consecutive indices hold every variant x heads pair once, and any 3
    consecutive indices hold the 3 variants. Use :func:`case_layout_index` to spread them over
    cases x layouts."""
    kv_dtype, rope, k_scale = VARIANTS[index % len(VARIANTS)]
    return KernelConfig(kv_dtype, rope, HEADS[index % len(HEADS)], k_scale)


def case_layout_index(case_index: int, layout_index: int) -> int:
    """``5 * case + layout``: for each layout, consecutive cases walk every variant (2 case mod 3)
    and every head count (case mod 4), so all layout x variant x heads triples are met within
    12 cases, and the layouts of one case get different variants."""
    return 5 * case_index + layout_index


def large_batch_cases() -> list[Case]:
    """About 66 and 132 rows, contexts up to 128k, slot ids >= 2**23."""
    short = [c for c in regime_contexts(TOPK, 4) if c < LONG_CTX]
    decodes = [(short[i % len(short)], 1) for i in range(58)] + [(LONG_CTX_128K, 1), (65_537, 1)]
    rows66 = batch(*decodes, (4_099, 6), topk=TOPK, kpool=4)
    seqs = [4, 9, 2047, 2048, 2049, 2050, 2051, 3000, 4096, 9000, 20_001]
    rows132 = batch(
        *[(seqs[i % len(seqs)] + i, 4) for i in range(33)],
        topk=TOPK,
        kpool=1,
        decode_threshold=4,
        min_block_id=MIN_BLOCK_ID_PAST_2_23,
    )
    return [
        Case("batch66-kpool4-ctx128k", rows66, ("A", "B", "C", "D", "E", "F", "G")),
        Case("batch132-kpool1-spec4-slots-past-2p23", rows132, ("H",)),
    ]


def graph_replay_sequence(kpool: int, topk: int = TOPK, **config) -> list[Case]:
    """Batches replayed through one CUDA graph captured at the first (largest) one: fewer rows,
    other lengths and slots, larger again, then empty."""
    k = f"kpool{kpool}"
    return [
        Case(
            f"graph-max-{k}",
            batch(
                (LONG_CTX, 1),
                (topk + 3, 1),
                (40, 1),
                (topk + 9, 8),
                (900, 12),
                (5, 2),
                topk=topk,
                kpool=kpool,
                **config,
            ),
        ),
        Case(f"graph-smaller-{k}", batch((topk - 1, 1), (topk + kpool, 1), (7, 1), topk=topk, kpool=kpool, **config)),
        Case(f"graph-mid-{k}", batch((3 * topk + 1, 1), (topk, 1), (topk + 2, 10), topk=topk, kpool=kpool, **config)),
        Case(f"graph-empty-{k}", batch(topk=topk, kpool=kpool, **config)),
    ]


def has_regime_c(case: Case) -> bool:
    """Whether a planned row of the case is in regime C, which the strided and packed layouts
    plan wrong (docs/findings.md#regime-c-planned-as-a-prefix)."""
    return "C" in plan_rows(case.spec).planned_regimes


# --- the production input space (docs/input-space.md) ----------------------------------------


def input_space_cases(strength: int = 1, seed: int = 0) -> list[tuple[Case, str]]:
    """The covering design of the production input space as named cases, each with the layout
    it is drawn for: strength 1 reaches every value class of every dimension, strength 2 every
    feasible pair (``harness.input_space.covering_assignments``)."""
    return [(Case(f"input-space-{c.id}", c.spec, holes=c.holes), c.layout) for c in covering_cases(strength, seed)]


def case_scenario(case, seed: int) -> Scenario:
    """The scenario of a case (a :class:`Case` or an ``InputCase``) built with ``seed``, its top-k
    rows written with the case's holes where it has them."""
    scenario = build_scenario(case.spec, seed)
    return scenario if case.holes is None else with_topk_holes(scenario, case.holes)


def sequence_specs(kpool: int) -> list[BatchSpec]:
    """One layer, steps in order: decode rows around topk advancing one token a step (the
    bounded design keeps its plan), a jump past the slack (a replan), spec-decode rows that
    straddle topk, fewer rows (a replan of fewer rows over buffers that hold the larger step's
    slots), the first batch again, an empty step."""
    base = [TOPK - 3, 17, TOPK + 5, 3 * TOPK + 1]
    steps = [batch(*[(s + t, 1) for s in base], kpool=kpool) for t in range(4)]
    steps.append(batch(*[(s + 40, 1) for s in base], kpool=kpool))
    steps.append(batch((TOPK + 3, 4), (TOPK - 2, 4), kpool=kpool, decode_threshold=4))
    steps.append(batch((TOPK + 1, 1), kpool=kpool))
    steps.append(batch(*[(s, 1) for s in base], kpool=kpool))
    steps.append(batch(kpool=kpool))
    return steps


def sequence_steps(kpool: int, config: KernelConfig) -> list[tuple[BatchSpec, int]]:
    """:func:`sequence_specs` in ``config``, each step with its seed (its index)."""
    return [(config.apply(spec), seed) for seed, spec in enumerate(sequence_specs(kpool))]


# --- every residue, every stride (docs/input-space.md#every-residue-every-stride) -------------

#: A multiple of the block size 64 near the ~57k-token prompts of vllm-project/vllm#55927 (a wrong
#: token whenever the prompt length was 3 mod 4): 896 x 64 = 57344.
FAR_BLOCK_MULTIPLE = 896


def residues_around(point: int, kpool: int) -> list[int]:
    """Contexts ``point - n .. point + n - 1`` (``n = max(kpool, 2)``): every residue modulo kpool
    just below ``point`` and from it on (contexts below 1 dropped)."""
    n = max(kpool, 2)
    return [c for c in range(point - n, point + n) if c >= 1]


def residue_case(topk: int, kpool: int, block_size: int, multiples, config: KernelConfig) -> Case:
    """Decode rows at every residue modulo kpool around topk and around each of ``multiples`` x the
    block size, beside a long request (so short rows take the indexer's pooled path, not the
    identity fill); and a prefill chunk over the same residues around topk and around the largest
    multiple (a prefill past topk: every row planned sparse)."""
    points = sorted({topk, *(m * block_size for m in multiples)})
    contexts = list(dict.fromkeys(c for p in points for c in residues_around(p, kpool)))
    n = max(kpool, 2)
    prefills = [(p + n - 1, 2 * n) for p in (topk, points[-1])]
    spec = batch(*[(c, 1) for c in contexts], (LONG_CTX, 1), *prefills, topk=topk, kpool=kpool,
                 block_size=block_size)
    return Case(f"residues-topk{topk}-kpool{kpool}-bs{block_size}", config.apply(spec))


def residue_cases() -> list[Case]:
    """Every residue modulo kpool around topk and around multiples of the block size: every
    multiple up to topk + block size at a top-k of 256, a few at the production top-k (the first,
    those around topk, a far one), and kpool 1 at a block size that is no power of two."""
    return [
        residue_case(256, 4, 64, [*range(1, 256 // 64 + 2), FAR_BLOCK_MULTIPLE],
                     KernelConfig("bfloat16", False, 32)),
        residue_case(TOPK, 4, 64, [1, TOPK // 64 - 1, TOPK // 64, TOPK // 64 + 1, FAR_BLOCK_MULTIPLE],
                     KernelConfig("float8_e4m3fn", True, 64)),
        residue_case(TOPK, 1, 576, [1, 3, 4, 100], KernelConfig("bfloat16", True, 16)),
    ]


def kv_parts_cases() -> list[Case]:
    """Steps whose cache rows the kernel reads as the two strided views vLLM hands it (ckv: the
    first 512 elements of each 576-element row, kpe: the last 64), with rope (a NoPE row is ckv
    whole, contiguous), bf16 and fp8 at k_scale 1, kpool 4 and 1."""
    requests = ((5, 1), (TOPK - 1, 1), (TOPK + 2, 1), (LONG_CTX, 1), (TOPK + 40, 8))
    configs = ((KernelConfig("bfloat16", True, 16), 4), (KernelConfig("float8_e4m3fn", True, 32), 4),
               (KernelConfig("bfloat16", True, 128), 1))
    return [Case(f"kv-parts-kpool{kpool}-{c.id}", c.apply(batch(*requests, kpool=kpool))) for c, kpool in configs]


#: Element offsets (slot x row width) an int32 (2**31) and a uint32 (2**32) offset cannot hold.
OFFSET_BOUNDARIES = (1 << 31, 1 << 32)
#: The row widths slot ids are multiplied by: 576 elements (512 + rope 64, bf16 or FlashInfer's
#: fp8), 656 bytes (FlashMLA's fp8 row: 512 e4m3 values, 4 float32 tile scales, 64 bf16 rope).
ROW_576, ROW_656 = 576, 656


def straddling_slot(boundary: int, row_width: int) -> int:
    """The slot whose row holds element ``boundary`` (slot x ``row_width`` <= boundary < the next)."""
    return boundary // row_width


def slot_offset_case(boundary: int, row_width: int, config: KernelConfig, block_size: int = 64) -> Case:
    """(``boundary``: a power of two.) Three decode requests whose blocks are exactly the ids around the block holding
    :func:`straddling_slot` (no spare block), each context a whole number of blocks and at most
    topk, so each row reads every token of its request: every slot of those blocks is read, the
    rows just below ``boundary`` elements from the cache's start, the row across it and those past
    it."""
    seq_lens = (TOPK, TOPK // 2, 10 * block_size)
    blocks = sum(s // block_size for s in seq_lens)
    first = straddling_slot(boundary, row_width) // block_size - blocks // 2
    spec = batch(*[(s, 1) for s in seq_lens], block_size=block_size, min_block_id=first, spare_blocks=0)
    return Case(f"offset-2p{boundary.bit_length() - 1}-row{row_width}", config.apply(spec))


def blocks_apart_cases() -> list[tuple[Case, int]]:
    """``(case, block stride in rows)``: decode rows around topk and a sparse prefill in a cache
    whose blocks lie apart (docs/input-space.md#blocks-apart): 64-row blocks 192 rows apart (fp8
    at 64 heads: FlashMLA's decode kernel reads such a cache as its pages, strided, and its
    prefill rows are gathered from it), 128-row blocks 192 rows apart (one and a half blocks: no
    multiple of the block size)."""
    requests = ((5, 1), (TOPK - 1, 1), (TOPK + 2, 1), (3 * TOPK + 1, 1), (TOPK + 40, 8))
    return [
        (Case("blocks-apart-bs64-kpool4", KernelConfig("float8_e4m3fn", True, 64).apply(
            batch(*requests, kpool=4, block_size=64))), 192),
        (Case("blocks-apart-bs128-kpool1", KernelConfig("bfloat16", True, 64).apply(
            batch(*requests, kpool=1, block_size=128))), 192),
    ]


def rejected_drafts_cases() -> list[tuple[Case, int]]:
    """``(case, rejected drafts)``: async steps with speculative decoding on (decode threshold 4)
    whose single-token decodes had that many drafts rejected the step before
    (``harness.builder.with_rejected_drafts``): every request decoding one token around topk
    (the drafter proposed none), and single-token decodes beside spec-decode requests whose own
    bound over-counts too."""
    async_spec = dict(decode_threshold=4, async_scheduling=True)
    return [
        (Case("rejected-drafts-then-one-token-kpool4", KernelConfig("bfloat16", True, 16).apply(
            batch((5, 1), (TOPK - 2, 1), (TOPK - 1, 1), (TOPK, 1), (TOPK + 1, 1), (3 * TOPK + 1, 1), kpool=4,
                  **async_spec))), 3),
        (Case("rejected-drafts-beside-drafts-kpool1", KernelConfig("bfloat16", False, 32).apply(
            batch((TOPK + 3, 4), (LONG_CTX, 4), (TOPK - 1, 1), (TOPK + 2, 1), (40, 1), kpool=1,
                  host_bound_slack=2, **async_spec))), 3),
    ]


def longest_request_cases(kpool: int = 4) -> list[Case]:
    """Spec-decode steps (decode threshold 4, bf16 with rope) for a builder under adaptive
    verification, which bounds every row by the longest request's host bound because the
    device's query split may differ from the host's: the longest request first, in the middle
    and last, the others short enough that a bound from any other request falls short of its
    rows' valid counts (docs/input-space.md#situations)."""
    short, middle, longest = (40, 4), (TOPK // 2, 4), (TOPK + 9, 4)
    orders = {"first": (longest, short, middle), "middle": (short, longest, middle), "last": (short, middle, longest)}
    config = KernelConfig("bfloat16", True, 16)
    return [Case(f"adaptive-longest-{where}-kpool{kpool}", config.apply(batch(*reqs, kpool=kpool, decode_threshold=4)))
            for where, reqs in orders.items()]


def device_split_cases() -> list[tuple[Case, list[int]]]:
    """``(case, the host's query split)``: spec-decode steps (decode threshold 4) under adaptive
    verification whose device split (the spec's own) differs from the host's placeholder split
    (:func:`harness.builder.even_host_split`: the draft budget dealt evenly over the verification
    requests), so rows the host counts to a short request run for a long one on the device: the
    longest request past topk gaining rows from a short one before it (kpool 4, bf16 with rope),
    and a request at topk / 2 gaining a row from a short one after it, beside a longer decode and a
    sparse prefill whose rows stay where they are (kpool 1, bf16 NoPE)."""
    threshold = dict(decode_threshold=4)
    gains = KernelConfig("bfloat16", True, 16).apply(
        batch((40, 1), (TOPK + 9, 4), (TOPK // 2, 3), kpool=4, **threshold))
    beside_prefill = KernelConfig("bfloat16", False, 32).apply(
        batch((TOPK // 2, 4), (30, 1), (TOPK + 50, 2), (TOPK + 300, 16), kpool=1, **threshold))
    return [(Case("device-split-longest-gains-rows-kpool4", gains), even_host_split(gains, 3)),
            (Case("device-split-beside-prefill-kpool1", beside_prefill), even_host_split(beside_prefill, 3))]
