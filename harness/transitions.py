"""The transitions between consecutive steps of one layer that production makes, and which of
them a pair of steps is (docs/input-space.md#transitions).

A step's buffers, plan and graph are carried into the next, so what breaks is often not a step
but a change between two: drafts rejected under async scheduling and then none drafted, drafts
trimmed for some requests only, a request that has no query row this step (under each source of
its context), fewer or shorter rows written over buffers that still hold the last step's slots,
CUDA-graph padding up to a larger batch seen before (piecewise, or a FULL graph whose metadata
counts the padding). :func:`step_transitions` names the
transitions from one batch spec to the next; the stateful tests record them, the run's coverage
line counts them, and a test checks that the draw reaches every one of :data:`TRANSITIONS`.
"""

from __future__ import annotations

from .spec import BatchSpec

#: Each transition with what it is.
TRANSITIONS: dict[str, str] = {
    "first-step": "the first step on fresh buffers",
    "more-rows": "more query rows than the last step",
    "fewer-rows-over-stale-slots": "fewer query rows than the last step, over buffers holding its slots",
    "same-rows-other-lengths": "as many rows as the last step, other lengths",
    "rejected-drafts-then-no-drafts": "async scheduling after rejected drafts (an optimistic host bound), "
                                      "then a step with no draft rows",
    "drafts-differ-per-request": "decode requests with different draft counts in one step, down to none",
    "idle-request-host-bound": "a request with no query row, context from the host bound",
    "idle-request-positions": "a request with no query row, context from the positions",
    "idle-request-seq-lens": "a request with no query row, context from seq_lens (no bound, no positions)",
    "graph-padding-after-larger": "CUDA-graph padding up to the rows of a larger batch seen before",
    "full-graph-after-larger": "a uniform decode batch in the FULL CUDA graph of a larger batch seen before "
                               "(the metadata counts the padded rows and requests)",
    "prefill-chunks-become-decodes": "requests that ran a prefill chunk last step decode in this one",
}


def context_source(spec: BatchSpec) -> str:
    """Where the builder reads each row's context from in this spec."""
    if spec.with_host_bound:
        return "host-bound"
    return "positions" if spec.with_positions else "seq-lens"


def rows_of(spec: BatchSpec) -> int:
    return sum(r.q_len for r in spec.requests)


def decode_q_lens(spec: BatchSpec) -> list[int]:
    return [r.q_len for r in spec.requests if 0 < r.q_len <= spec.decode_threshold]


def step_transitions(previous: BatchSpec | None, current: BatchSpec, *, largest_rows: int = 0,
                     prefills_before: int = 0) -> set[str]:
    """The transitions from ``previous`` (None: the first step) to ``current``. ``largest_rows``:
    the most rows of any step before (the graph a padded step replays); ``prefills_before``: the
    prefill requests of the last step still present, in order, as decodes now."""
    names: set[str] = set()
    rows = rows_of(current)
    if previous is None:
        names.add("first-step")
    else:
        before = rows_of(previous)
        if rows > before:
            names.add("more-rows")
        elif rows < before:
            names.add("fewer-rows-over-stale-slots")
        elif [r.seq_len for r in current.requests] != [r.seq_len for r in previous.requests]:
            names.add("same-rows-other-lengths")
    decodes = decode_q_lens(current)
    if current.async_scheduling and current.host_bound_slack and decodes and max(decodes) == 1:
        names.add("rejected-drafts-then-no-drafts")
    if len(set(decodes)) > 1:
        names.add("drafts-differ-per-request")
    # a FULL graph's requests without a query row are its padding, not idle requests
    if not current.full_graph and any(r.q_len == 0 for r in current.requests):
        names.add(f"idle-request-{context_source(current)}")
    if current.full_graph and current.padded_rows and largest_rows > rows:
        names.add("full-graph-after-larger")
    elif current.padded_rows and largest_rows and rows + current.padded_rows == largest_rows > rows:
        names.add("graph-padding-after-larger")
    if prefills_before:
        names.add("prefill-chunks-become-decodes")
    return names
