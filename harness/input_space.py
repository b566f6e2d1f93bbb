"""The production input space as data (docs/input-space.md): every dimension of what reaches the
production path, the value classes the engine can give it, which combinations exist, a
classifier from a drawn case to its classes, and the realisation of a class assignment as a
concrete case.

- :data:`SPACE`: dimension -> value classes (one :class:`Dimension` each, with its doc anchor);
- :func:`classify`: a batch spec, a layout and the case's top-k holes -> the class of each
  dimension (:func:`classify_case` for an :class:`InputCase`);
- :func:`feasible`: whether a (partial) assignment of classes can occur at all;
- :data:`SITUATIONS`: combinations of classes of several dimensions that a covering design
  reaches whole (what a bug that needs all of them at once takes to show);
- :func:`covering_assignments`: assignments that reach every class (strength 1) or every
  feasible pair of classes (strength 2), and every situation;
- :func:`realize`: an assignment -> an :class:`InputCase`, its free values (contexts, sizes,
  counts) picked by a :class:`Chooser` (Hypothesis draws, or a seeded generator);
- :func:`pair_universe` and :func:`coverage_of`: what a set of classified cases reached and
  missed (the coverage report, ``--input-coverage``).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from mla_constants import (
    BF16_NOPE,
    BF16_ROPE64,
    DEEPSEEK_V32_SM_SCALE,
    FP8_NOPE,
    FP8_ROPE64,
    GLM_NOPE_SM_SCALE,
    KERNEL_VARIANTS,
    TOPK,
    variant_name,
)

from .spec import BatchSpec, Request, graph_padded, uniform_query_len
from .topk_holes import HOLE_KINDS, TopkHoles

SLOT_IDS_PAST = 1 << 23


@dataclass(frozen=True)
class Dimension:
    name: str
    classes: tuple[str, ...]
    anchor: str  # section of docs/input-space.md

    def __post_init__(self) -> None:
        if len(set(self.classes)) != len(self.classes):
            raise ValueError(f"dimension {self.name}: repeated classes {self.classes}")


SPACE: tuple[Dimension, ...] = (
    Dimension("block_size", ("64", "pow2-multiple-of-64", "non-pow2-multiple-of-64"), "block-sizes"),
    Dimension("kpool", ("1", "4"), "kpool-and-topk"),
    Dimension("topk", ("2048", "below-2048"), "kpool-and-topk"),
    Dimension("batch", ("empty", "decodes", "prefills", "mixed"), "batch-composition"),
    Dimension("spec_rows", ("none", "spec-decode"), "batch-composition"),
    Dimension("no_query_requests", ("none", "trailing", "middle"), "batch-composition"),
    Dimension("padded_rows", ("none", "piecewise", "full-graph"), "batch-composition"),
    Dimension("prefill_route", ("no-prefill", "sparse", "dense-mha"), "batch-composition"),
    Dimension("scheduling", ("sync", "async"), "context-sources"),
    Dimension("context_source", ("bound-and-positions", "bound-only", "positions-only", "neither"),
              "context-sources"),
    Dimension("drafts", ("none-pending", "partly-rejected", "all-rejected"), "context-sources"),
    Dimension("layout", ("strided", "packed", "compacted"), "layouts"),
    Dimension("variant", (BF16_ROPE64, FP8_ROPE64, BF16_NOPE, FP8_NOPE), "kernel-variants-and-heads"),
    Dimension("heads", ("16", "32", "64", "128"), "kernel-variants-and-heads"),
    Dimension("slot_ids", ("below-2^23", "past-2^23"), "block-sizes"),
    Dimension("topk_holes", ("none", "holes"), "holes-in-the-top-k"),
)
DIMENSIONS = {d.name: d for d in SPACE}
#: What a class assignment is: dimension name -> class.
Assignment = dict


# --- classification --------------------------------------------------------------------------


def _block_size_class(bs: int) -> str:
    if bs == 64:
        return "64"
    if bs % 64 == 0:
        return "pow2-multiple-of-64" if bs & (bs - 1) == 0 else "non-pow2-multiple-of-64"
    return f"outside:{bs}"


def _batch_class(spec: BatchSpec) -> str:
    live = [r for r in spec.requests if r.q_len]
    decodes = sum(r.q_len <= spec.decode_threshold for r in live)
    if not live:
        return "empty"
    if decodes == len(live):
        return "decodes"
    return "prefills" if decodes == 0 else "mixed"


def _no_query_class(spec: BatchSpec) -> str:
    q = [r.q_len for r in spec.requests]
    if 0 not in q:
        return "none"
    last_live = max((i for i, n in enumerate(q) if n), default=0)
    return "middle" if 0 in q[:last_live] else "trailing"


def _padded_rows_class(spec: BatchSpec) -> str:
    """CUDA-graph padding: none, rows past the tokens the metadata counts (a piecewise graph), or
    a FULL graph's metadata that counts them (uniform decode batches)."""
    if spec.full_graph:
        return "full-graph"
    return "piecewise" if spec.padded_rows else "none"


def _spec_rows_class(spec: BatchSpec) -> str:
    spec_decode = any(1 < r.q_len <= spec.decode_threshold for r in spec.requests)
    return "spec-decode" if spec_decode else "none"


def _prefill_route_class(spec: BatchSpec) -> str:
    first = next((i for i, r in enumerate(spec.requests) if r.q_len > spec.decode_threshold), None)
    if first is None:
        return "no-prefill"
    return "dense-mha" if max(r.seq_len for r in spec.requests[first:]) <= spec.topk else "sparse"


CONTEXT_SOURCES = {  # (host bound present, positions present) -> class
    (True, True): "bound-and-positions",
    (True, False): "bound-only",
    (False, True): "positions-only",
    (False, False): "neither",
}


def _context_source_class(spec: BatchSpec) -> str:
    """Which of the optional context sources the step's metadata holds (seq_lens it always
    holds): what each builder chooses from, whatever rule it chooses by."""
    return CONTEXT_SOURCES[(spec.with_host_bound, spec.with_positions)]


def holds_host_bound(context_source: str) -> bool:
    return context_source in ("bound-and-positions", "bound-only")


def holds_positions(context_source: str) -> bool:
    return context_source in ("bound-and-positions", "positions-only")


def _drafts_class(spec: BatchSpec) -> str:
    """How many drafts of the last step were rejected, as the optimistic host bound shows them
    (async scheduling with speculative decoding)."""
    drafts = max((r.q_len - 1 for r in spec.requests if 1 < r.q_len <= spec.decode_threshold), default=0)
    slack = spec.host_bound_slack if spec.async_scheduling and spec.with_host_bound else 0
    if not drafts or not slack:
        return "none-pending"
    return "all-rejected" if slack >= drafts else "partly-rejected"


def _variant_class(spec: BatchSpec) -> str:
    return variant_name(spec.kv_dtype, spec.rope)


def _slot_class(spec: BatchSpec) -> str:
    return "past-2^23" if spec.min_block_id * spec.block_size >= SLOT_IDS_PAST else "below-2^23"


def classify(spec: BatchSpec, layout: str, holes: TopkHoles | None = None) -> Assignment:
    """The class of every dimension of :data:`SPACE` a case (spec + layout + the score pattern
    its top-k rows are written from, if any) falls in; a value outside the production space
    comes back as ``outside:<value>``."""
    topk = "2048" if spec.topk == TOPK else ("below-2048" if spec.topk < TOPK else f"outside:{spec.topk}")
    return {
        "block_size": _block_size_class(spec.block_size),
        "kpool": str(spec.kpool) if spec.kpool in (1, 4) else f"outside:{spec.kpool}",
        "topk": topk,
        "batch": _batch_class(spec),
        "spec_rows": _spec_rows_class(spec),
        "no_query_requests": _no_query_class(spec),
        "padded_rows": _padded_rows_class(spec),
        "prefill_route": _prefill_route_class(spec),
        "scheduling": "async" if spec.async_scheduling else "sync",
        "context_source": _context_source_class(spec),
        "drafts": _drafts_class(spec),
        "layout": layout,
        "variant": _variant_class(spec),
        "heads": str(spec.num_heads)
        if str(spec.num_heads) in DIMENSIONS["heads"].classes
        else f"outside:{spec.num_heads}",
        "slot_ids": _slot_class(spec),
        "topk_holes": "none" if holes is None else "holes",
    }


def classify_case(case: InputCase) -> Assignment:
    """:func:`classify` of an :class:`InputCase` (its spec, layout and top-k holes)."""
    return classify(case.spec, case.layout, case.holes)


# --- which combinations exist ----------------------------------------------------------------


def _conflict(a: Assignment) -> bool:
    """Whether a (partial) assignment is impossible, from the dimensions it fixes."""

    def has(**kv):
        return all(a.get(k) in (v if isinstance(v, tuple) else (v,)) for k, v in kv.items())

    rules = (
        # spec rows are decode requests: they need decodes in the batch
        has(spec_rows="spec-decode", batch=("empty", "prefills")),
        # prefill routing exists exactly when the batch has prefills
        has(prefill_route="no-prefill", batch=("prefills", "mixed")),
        has(prefill_route=("sparse", "dense-mha"), batch=("empty", "decodes")),
        # a request without query rows in the middle sits before a request with rows
        has(no_query_requests="middle", batch="empty"),
        # rejected drafts: async scheduling, speculative rows, a host bound to be optimistic
        has(drafts=("partly-rejected", "all-rejected"), scheduling="sync"),
        has(drafts=("partly-rejected", "all-rejected"), context_source=("positions-only", "neither")),
        has(drafts=("partly-rejected", "all-rejected"), spec_rows="none"),
        has(drafts=("partly-rejected", "all-rejected"), batch=("empty", "prefills")),
        # a FULL graph runs uniform decode batches, its padded requests trailing
        has(padded_rows="full-graph", batch=("empty", "prefills", "mixed")),
        has(padded_rows="full-graph", no_query_requests=("none", "middle")),
        # holes need a row of the indexer's top-k that the sparse kernel serves
        has(topk_holes="holes", batch="empty"),
        has(topk_holes="holes", batch="prefills", prefill_route="dense-mha"),
    )
    return any(rules)


#: The dimensions :func:`_conflict` relates; every class of the others combines with anything.
CONSTRAINED = ("batch", "spec_rows", "no_query_requests", "padded_rows", "prefill_route", "scheduling",
               "context_source", "drafts", "topk_holes")


def feasible(a: Assignment) -> bool:
    """Whether some full assignment extends ``a`` without a conflict."""
    return _feasible(frozenset((k, v) for k, v in a.items() if k in CONSTRAINED))


@functools.cache
def _feasible(items: frozenset) -> bool:
    return _complete(dict(items)) is not None


def _complete(a: Assignment) -> Assignment | None:
    if _conflict(a):
        return None
    free = [DIMENSIONS[n] for n in CONSTRAINED if n not in a]
    if not free:
        return a
    d = free[0]
    for c in d.classes:
        done = _complete({**a, d.name: c})
        if done is not None:
            return done
    return None


@dataclass(frozen=True)
class Situation:
    """Classes of several dimensions that production combines in one step and that a bug can
    need all at once (docs/input-space.md#situations): a covering design reaches them whole."""

    name: str
    classes: tuple[tuple[str, str], ...]  # (dimension, class)

    def reached_by(self, a: Assignment) -> bool:
        return all(a.get(k) == v for k, v in self.classes)


SITUATIONS: tuple[Situation, ...] = (
    # decodes with draft rows, then prefills routed to dense MHA: only the decode tokens are planned
    Situation("drafts-beside-dense-mha",
              (("batch", "mixed"), ("spec_rows", "spec-decode"), ("prefill_route", "dense-mha"))),
    # async scheduling, a host bound that over-counts rejected drafts, and no positions to read
    Situation("async-bound-without-positions",
              (("scheduling", "async"), ("context_source", "bound-only"), ("drafts", "all-rejected"))),
)


@functools.lru_cache(maxsize=1)
def pair_universe() -> frozenset:
    """Every feasible pair ``((dim, class), (dim, class))`` (dims in :data:`SPACE` order)."""
    pairs = set()
    for d1, d2 in itertools.combinations(SPACE, 2):
        for c1 in d1.classes:
            for c2 in d2.classes:
                if feasible({d1.name: c1, d2.name: c2}):
                    pairs.add(((d1.name, c1), (d2.name, c2)))
    return frozenset(pairs)


def pairs_of(a: Assignment) -> set:
    items = [(d.name, a[d.name]) for d in SPACE if d.name in a]
    return set(itertools.combinations(items, 2))


@functools.lru_cache(maxsize=2)
def covering_assignments(strength: int) -> tuple[tuple[tuple[str, str], ...], ...]:
    """Full feasible assignments (as sorted item tuples) that together reach every value class
    (strength 1) or every feasible pair (strength 2), and every situation of :data:`SITUATIONS`:
    a greedy covering design, a row for each situation it did not reach appended."""
    if strength not in (1, 2):
        raise ValueError(f"strength must be 1 or 2, got {strength}")
    rows: list[Assignment] = []
    if strength == 1:
        wanted = {(d.name, c) for d in SPACE for c in d.classes}
        while wanted:
            row = _greedy_row(lambda a, w=wanted: len(set(a.items()) & w), seed_items=[min(wanted)])
            wanted -= set(row.items())
            rows.append(row)
    else:
        wanted = set(pair_universe())
        while wanted:
            first = min(wanted)
            row = _greedy_row(lambda a, w=wanted: len(pairs_of(a) & w), seed_items=list(first))
            wanted -= pairs_of(row)
            rows.append(row)
    rows += situation_rows(rows)
    return tuple(tuple(sorted(r.items())) for r in rows)


def situation_rows(rows: list[Assignment]) -> list[Assignment]:
    """One full assignment per situation of :data:`SITUATIONS` that ``rows`` do not reach: the
    situation's classes, the other dimensions completed with their first feasible class."""
    missing = [s for s in SITUATIONS if not any(s.reached_by(r) for r in rows)]
    return [_greedy_row(lambda a: 0, seed_items=list(s.classes)) for s in missing]


def _greedy_row(gain: Callable[[Assignment], int], seed_items) -> Assignment:
    a = dict(seed_items)
    for d in SPACE:
        if d.name in a:
            continue
        best, best_gain = None, -1
        for c in d.classes:
            trial = {**a, d.name: c}
            if not feasible(trial):
                continue
            g = gain(trial)
            if g > best_gain:
                best, best_gain = c, g
        a[d.name] = best
    return a


@dataclass
class Coverage:
    classes_reached: dict  # dim -> sorted classes reached
    classes_missed: dict  # dim -> sorted classes missed
    outside: dict  # dim -> values outside the production space that were drawn
    pairs_reached: int
    pairs_total: int
    pairs_missed: list
    situations_reached: list  # names of SITUATIONS reached
    situations_missed: list

    @property
    def every_class(self) -> bool:
        return not any(self.classes_missed.values())


def coverage_of(assignments) -> Coverage:
    """Which classes and feasible pairs a set of classified cases reached."""
    assignments = [dict(a) for a in assignments]
    reached = {d.name: sorted({a[d.name] for a in assignments if a.get(d.name) in d.classes}) for d in SPACE}
    missed = {d.name: [c for c in d.classes if c not in reached[d.name]] for d in SPACE}
    outside = {
        d.name: sorted({a[d.name] for a in assignments if d.name in a and a[d.name] not in d.classes}) for d in SPACE
    }
    seen_pairs = set()
    for a in assignments:
        seen_pairs |= pairs_of({k: v for k, v in a.items() if k in DIMENSIONS and v in DIMENSIONS[k].classes})
    universe = pair_universe()
    missing = sorted(universe - seen_pairs)
    situations = [s.name for s in SITUATIONS if any(s.reached_by(a) for a in assignments)]
    return Coverage(
        reached, missed, {k: v for k, v in outside.items() if v}, len(universe & seen_pairs), len(universe), missing,
        situations, [s.name for s in SITUATIONS if s.name not in situations],
    )


# --- realisation: an assignment -> a concrete case --------------------------------------------


class Chooser(Protocol):
    def pick(self, values): ...

    def integer(self, lo: int, hi: int) -> int: ...


class SeededChooser:
    """Free values from a seeded NumPy generator (the bounded GPU draw, covering examples)."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def pick(self, values):
        values = list(values)
        return values[int(self.rng.integers(len(values)))]

    def integer(self, lo: int, hi: int) -> int:
        return int(self.rng.integers(lo, hi + 1))


@dataclass(frozen=True)
class InputCase:
    spec: BatchSpec
    layout: str
    assignment: tuple[tuple[str, str], ...]
    holes: TopkHoles | None = None  # the scores the step's top-k rows are written from

    @property
    def id(self) -> str:
        a = dict(self.assignment)
        return "-".join(a[d.name] for d in SPACE)


BLOCK_SIZES = {"64": (64,), "pow2-multiple-of-64": (128, 256), "non-pow2-multiple-of-64": (192, 320, 576)}
VARIANT_KNOBS = {variant_name(kv_dtype, rope): (kv_dtype, rope, k_scale) for kv_dtype, rope, k_scale in KERNEL_VARIANTS}
MAX_PREFILL_ROWS = 24  # query rows of one drawn prefill chunk (keeps a case small on CPU)


def _context(ch: Chooser, topk: int, kpool: int) -> int:
    near = [1, kpool + 1, topk - kpool - 1, topk - 1, topk, topk + 1, topk + kpool - 1, topk + kpool, 2 * topk + 1]
    kind = ch.pick(("near", "near", "any", "long"))
    if kind == "near":
        return max(1, ch.pick(near))
    if kind == "any":
        return ch.integer(1, 3 * topk)
    return ch.integer(3 * topk, 100_003)


def _requests(a: Assignment, ch: Chooser, topk: int, kpool: int, threshold: int) -> list[Request]:
    batch_class = a["batch"]
    n_dec = ch.integer(1, 4) if batch_class in ("decodes", "mixed") else 0
    n_pre = ch.integer(1, 2) if batch_class in ("prefills", "mixed") else 0
    decodes = []
    for i in range(n_dec):
        uniform = a["padded_rows"] == "full-graph"
        q = threshold if (a["spec_rows"] == "spec-decode" and (i == 0 or uniform or ch.pick((True, False)))) else 1
        decodes.append(Request(max(_context(ch, topk, kpool), q), q))
    prefills = []
    for i in range(n_pre):
        q = ch.integer(threshold + 1, threshold + MAX_PREFILL_ROWS)
        if a["prefill_route"] == "dense-mha":
            seq = ch.integer(q, max(q, topk))
        elif i == 0:
            seq = ch.integer(max(q, topk + 1), 3 * topk)
        else:
            seq = max(q, _context(ch, topk, kpool))
        prefills.append(Request(seq, q))
    requests = decodes + prefills
    if a["no_query_requests"] == "trailing" or (a["no_query_requests"] == "middle" and not requests):
        requests += [Request(0, 0)] * ch.integer(1, 2)
    elif a["no_query_requests"] == "middle":
        at = ch.integer(0, len(requests) - 1)
        requests.insert(at, Request(ch.pick((0, ch.integer(1, topk))), 0))
    return requests


def with_a_long_row(requests: list[Request], ch: Chooser, topk: int, threshold: int) -> list[Request]:
    """``requests`` with a query row past ``topk`` (its top-k rows are the indexer's, not the
    identity fill, and one has more candidates than topk): as they are where a request with
    query rows has one, else with the first decode's context drawn past it."""
    if any(r.q_len and r.seq_len > topk for r in requests):
        return requests
    first = next(i for i, r in enumerate(requests) if 0 < r.q_len <= threshold)
    longer = Request(ch.integer(topk + 1, 3 * topk), requests[first].q_len)
    return requests[:first] + [longer] + requests[first + 1 :]


def realize(assignment, ch: Chooser) -> InputCase:
    """A concrete case in the classes of ``assignment`` (a full feasible assignment), its free
    values picked by ``ch``. A case of top-k holes has a planned row past topk, whose top-k
    leaves holes whatever the score pattern drawn (``reference.indexer.row_with_holes``)."""
    a = dict(assignment)
    if not feasible(a) or set(a) != set(DIMENSIONS):
        raise ValueError(f"not a full feasible assignment: {a}")
    topk = TOPK if a["topk"] == "2048" else ch.pick((128, 256))
    kpool = int(a["kpool"])
    block_size = ch.pick(BLOCK_SIZES[a["block_size"]])
    drafts = 1 if a["spec_rows"] == "none" else ch.integer(2 if a["drafts"] == "partly-rejected" else 1, 3)
    threshold = drafts + 1 if a["spec_rows"] == "spec-decode" else 1
    requests = _requests(a, ch, topk, kpool, threshold)
    holes = None
    if a["topk_holes"] == "holes":
        requests = with_a_long_row(requests, ch, topk, threshold)
        holes = TopkHoles(ch.pick(HOLE_KINDS), ch.integer(1, 3))
    async_ = a["scheduling"] == "async"
    slack = {
        "none-pending": 0,
        "partly-rejected": ch.integer(1, drafts - 1) if drafts > 1 else 0,
        "all-rejected": drafts,
    }[a["drafts"]]
    kv_dtype, rope, k_scale = VARIANT_KNOBS[a["variant"]]
    spec = BatchSpec(
        requests=tuple(requests),
        topk=topk,
        kpool=kpool,
        block_size=block_size,
        rope=rope,
        kv_dtype=kv_dtype,
        k_scale=k_scale,
        num_heads=int(a["heads"]),
        sm_scale=DEEPSEEK_V32_SM_SCALE if rope else GLM_NOPE_SM_SCALE,
        async_scheduling=async_,
        host_bound_slack=slack if async_ else 0,
        decode_threshold=threshold,
        padded_rows=ch.integer(1, 7) if a["padded_rows"] == "piecewise" else 0,
        min_block_id=SLOT_IDS_PAST // block_size + 1 if a["slot_ids"] == "past-2^23" else 1,
        with_host_bound=holds_host_bound(a["context_source"]),
        with_positions=holds_positions(a["context_source"]),
    )
    if a["padded_rows"] == "full-graph":
        rows = sum(r.q_len for r in spec.requests)
        spec = graph_padded(spec, rows + uniform_query_len(spec) * ch.integer(1, 3))
    return InputCase(spec, a["layout"], tuple(sorted(a.items())), holes)


def covering_cases(strength: int, seed: int = 0) -> list[InputCase]:
    """:func:`covering_assignments` realised with seeded free values."""
    return [realize(a, SeededChooser(seed * 7919 + i)) for i, a in enumerate(covering_assignments(strength))]


def draw_assignment(pick: Callable[[tuple[str, ...]], str]) -> Assignment:
    """A full feasible assignment, each dimension's class picked by ``pick`` among the classes
    that keep the assignment feasible (so every class and combination can be drawn)."""
    a: Assignment = {}
    for d in SPACE:
        a[d.name] = pick(tuple(c for c in d.classes if feasible({**a, d.name: c})))
    return a
