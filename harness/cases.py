"""The case catalogue both tiers draw from: the contexts that reach every regime, and the batch
situations (docs/regimes.md#batch-situations), as :class:`harness.BatchSpec` values (built by the one scenario
builder, ``harness.build_scenario``)."""

from __future__ import annotations

from dataclasses import dataclass

from mla_constants import DEEPSEEK_V32_SM_SCALE, GLM_NOPE_SM_SCALE, KERNEL_VARIANTS, TOPK, variant_name
from reference import classify_row

from .builder import plan_rows
from .input_space import covering_cases
from .scenario import BatchSpec, batch
from .spec import KernelVariantDims

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
    """A named batch situation; ``focus`` lists the regimes it exists to exercise."""

    name: str
    spec: BatchSpec
    focus: tuple[str, ...] = ()

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
    return [(Case(f"input-space-{c.id}", c.spec), c.layout) for c in covering_cases(strength, seed)]


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
