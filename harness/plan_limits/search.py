"""The plans of the limit search and the search itself: N query rows, each its own request (page
size 1) reading ``PLAN_WIDTH`` slots; :func:`search_largest` grows N by doubling from 1 and then
bisects between the last N that succeeded and the first that did not; :func:`search_near` finds
the same N in two attempts where it is the N expected. Pure: both call an ``attempt(n)`` they
are given and keep every :class:`Attempt`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from mla_constants import TOPK

#: Slots each row of a limit plan reads: one full top-k row.
PLAN_WIDTH = TOPK
#: The largest N whose kv_indptr (N * width) still fits int32.
INT32_ROWS_BOUND = (2**31 - 1) // PLAN_WIDTH


@dataclass
class Attempt:
    """One attempt: ``kind`` plan or rows, ``outcome`` accepted / refused / crashed / timeout
    (plan) or right / wrong / refused / run-error / crashed / timeout / not-run (rows)."""

    kind: str
    rows: int
    heads: int
    outcome: str
    detail: str = ""
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.outcome in ("accepted", "right")

    def line(self) -> str:
        text = f"{self.kind} N={self.rows} H={self.heads}: {self.outcome}"
        return text + (f" ({self.detail})" if self.detail else "")


@dataclass
class Search:
    """What :func:`search_largest` found: the largest N that succeeded (0: none), the first N
    above it that did not (None when the bound was reached), and every attempt in order."""

    largest_ok: int
    first_failing: Attempt | None
    bound: int
    attempts: list[Attempt]

    @property
    def reached_bound(self) -> bool:
        return self.first_failing is None

    def to_dict(self) -> dict:
        return {"largest_ok": self.largest_ok, "bound": self.bound, "reached_bound": self.reached_bound,
                "first_failing": asdict(self.first_failing) if self.first_failing else None,
                "attempts": [asdict(a) for a in self.attempts]}


class _Probes:
    """The attempts of one search, in order, each N at most once."""

    def __init__(self, attempt: Callable[[int], Attempt]):
        self.attempt = attempt
        self.attempts: list[Attempt] = []
        self.tried: dict[int, Attempt] = {}

    def succeeds(self, n: int) -> bool:
        result = self.attempt(n)
        self.attempts.append(result)
        self.tried[n] = result
        return result.ok

    def bisect(self, good: int, bad: int, bound: int) -> Search:
        """Between a success ``good`` (0: none) and a failure ``bad``, to the exact N."""
        while bad - good > 1:
            mid = (good + bad) // 2
            if self.succeeds(mid):
                good = mid
            else:
                bad = mid
        return Search(good, self.tried[bad], bound, self.attempts)


def search_largest(attempt: Callable[[int], Attempt], *, bound: int, start: int = 1) -> Search:
    """Grow N from ``start`` by doubling (capped at ``bound``) while attempts succeed, then
    bisect between the last success (0 when ``start`` itself fails) and the first failure, to the
    exact N. Assumes success is monotone in N; every attempt is kept, so a report shows what was
    tried."""
    if not 1 <= start <= bound:
        raise ValueError(f"need 1 <= start <= bound, got start={start}, bound={bound}")
    probes = _Probes(attempt)
    good, n = 0, start
    while probes.succeeds(n):
        good = n
        if n >= bound:
            return Search(good, None, bound, probes.attempts)
        n = min(2 * n, bound)
    return probes.bisect(good, n, bound)


def search_near(attempt: Callable[[int], Attempt], *, bound: int, expected: int) -> Search:
    """What :func:`search_largest` finds, starting where the limit is expected: ``expected``,
    then ``expected + 1`` (where the limit is ``expected``, two attempts find it exactly), then
    ``bound``; a bisection between the last success and the first failure where those do not
    settle it, and :func:`search_largest` below ``expected`` where ``expected`` itself fails."""
    if not 1 <= expected <= bound:
        raise ValueError(f"need 1 <= expected <= bound, got expected={expected}, bound={bound}")
    probes = _Probes(attempt)
    if not probes.succeeds(expected):
        if expected == 1:
            return Search(0, probes.tried[1], bound, probes.attempts)
        below = search_largest(attempt, bound=expected - 1)
        first = below.first_failing or probes.tried[expected]
        return Search(below.largest_ok, first, bound, probes.attempts + below.attempts)
    good = expected
    for n in sorted({min(expected + 1, bound), bound}):
        if n == good:
            continue
        if not probes.succeeds(n):
            return probes.bisect(good, n, bound)
        good = n
    return Search(good, None, bound, probes.attempts)


def checked_sizes(search: Search) -> list[int]:
    """The plan sizes whose rows are checked: just below and at the limit, and just above it
    where the search found a failure there (above the bound nothing is known, nothing is tried)."""
    limit = search.largest_ok
    sizes = [n for n in (limit - 1, limit) if n >= 1]
    if search.first_failing is not None:
        sizes.append(search.first_failing.rows)
    return sizes
