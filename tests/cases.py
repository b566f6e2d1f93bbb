"""The case catalogue both tiers draw from: the contexts that reach every regime, and the batch
situations of SPEC §4, as :class:`reference.BatchSpec` values (built by the one scenario
builder, ``reference.build_scenario``)."""

from __future__ import annotations

from dataclasses import dataclass

from reference import BatchSpec, batch, classify_row

TOPK = 2048
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
    """The batch-level situations of SPEC §4 for one kpool."""
    k = f"kpool{kpool}"
    spec_decode = dict(decode_threshold=8)
    return [
        Case(f"decode-mixed-lengths-{k}", batch((5, 1), (topk - 3, 1), (topk + 2, 1), (3 * topk + 1, 1), (LONG_CTX, 1),
                                                 topk=topk, kpool=kpool, **config)),
        Case(f"spec-decode-straddling-topk-{k}", batch((topk + 3, 8), (topk - 2, 8), (LONG_CTX, 8), topk=topk, kpool=kpool,
                                                      **spec_decode, **config)),
        Case(f"decode+prefill-to-mha-{k}", batch((LONG_CTX, 1), (topk + 5, 1), (300, 40), (topk, 24), topk=topk,
                                                 kpool=kpool, **config)),
        Case(f"decode+prefill-sparse-{k}", batch((9, 1), (topk + 1, 1), (topk + 40, 48), (700, 16), topk=topk,
                                                 kpool=kpool, **config)),
        Case(f"chunked-prefill-with-context-{k}", batch((3 * topk + 7, 64), (topk + 30, 40), topk=topk, kpool=kpool,
                                                        **config)),
        Case(f"async-spec-decode-{k}", batch((topk + 3, 4), (topk - 1, 4), (LONG_CTX, 4), topk=topk, kpool=kpool,
                                             decode_threshold=4, async_scheduling=True, host_bound_slack=3, **config)),
        Case(f"empty-batch-{k}", batch(topk=topk, kpool=kpool, **config)),
    ]


def all_regime_cases(topk: int = TOPK, **config) -> list[Case]:
    """Every context of :func:`regime_contexts` for kpool 1 and 4, plus the identity fill."""
    cases = []
    for kpool in KPOOLS:
        cases.append(identity_case(kpool, topk, **config))
        cases += [context_case(ctx, kpool, topk, **config) for ctx in regime_contexts(topk, kpool)]
    return cases
