"""Plan hygiene (docs/input-space.md#plan-hygiene-device-synchronisations-per-plan): what each
FlashInfer ``plan()`` of a step costs the host in device synchronisations, and what it reads of
kv_indices before the step writes them.

A plan runs on the host every step (vLLM plans in its metadata builder, once per draft and
verify build); a device-to-host read inside it waits for every kernel queued before it. Each
plan's synchronisations are counted (``backends.seam.device_syncs_counted``: torch's sync debug
mode) through one layer over decode steps of 1, 16 and 128 rows after a warm-up step, each step
judged: a plan must make as many synchronisations for 128 rows as for one (a plan that reads back
per row, or per work item, would wait once for each). The counts are the check's result, for the
run's report.

:func:`check_stale_ids_at_plan`: a correct step after one whose slot ids ran past the cache must
run (FlashInfer 0.7.4 records the planned page range from kv_indices at plan(), which vLLM calls
before ``forward_mqa`` packs the step's ids: docs/findings.md#planned-page-range-from-the-previous-step).
"""

from __future__ import annotations

from backends.seam import block_stride_of, index_buffers, plan_syncs_counted

from .case_runner import run_sequence
from .findings import FINDINGS_DOC
from .plan_history import decode_step

#: The row counts whose plans are compared, after a warm-up step of :data:`WARM_UP_ROWS`.
SYNC_ROWS = (1, 16, 128)
WARM_UP_ROWS = 4
SYNC_SEED = 17


def decode_contexts(rows: int) -> list[int]:
    """Decode contexts of ``rows`` rows, spread over 40 to 1539 tokens."""
    return [40 + (53 * i) % 1500 for i in range(rows)]


def sync_count_problems(counts: dict[int, list[int]]) -> list[str]:
    """What is wrong with ``counts`` (per row count, the synchronisations of each plan its step
    made): a step that made no plan or several, plans whose counts differ between row counts."""
    problems = [f"the step of {rows} rows made {len(syncs)} plans, not one" for rows, syncs in counts.items()
                if len(syncs) != 1]
    if not problems and len({syncs[0] for syncs in counts.values()}) > 1:
        per_rows = ", ".join(f"{rows} rows: {syncs[0]}" for rows, syncs in counts.items())
        problems.append(f"device synchronisations per plan() grow with the step ({per_rows})")
    return problems


def check_syncs_per_plan(judge, backend, device) -> dict[int, list[int]]:
    """The warm-up step, then one step of each of :data:`SYNC_ROWS` through one layer, each
    judged; per row count, the synchronisations of each plan its step made. Raises
    ``AssertionError`` naming :func:`sync_count_problems`."""
    steps = [decode_step(decode_contexts(rows), SYNC_SEED + i) for i, rows in enumerate((WARM_UP_ROWS, *SYNC_ROWS))]
    with plan_syncs_counted():
        _, outcomes = run_sequence(judge, backend, steps, device, what="device synchronisations per plan()")
    counts = {rows: list(outcome.plan_syncs) for rows, outcome in zip(SYNC_ROWS, outcomes[1:], strict=True)}
    problems = sync_count_problems(counts)
    if problems:
        raise AssertionError(f"{backend.name}: " + "; ".join(problems))
    return counts


#: What FlashInfer's run() raises where the KV cache does not cover the page range it recorded
#: at plan() (0.7.4's ``_check_planned_geometry``).
COVERAGE_REFUSAL = "KV cache does not cover the planned CSR page indices"
STALE_IDS_FINDING = ("run() judges the cache's coverage by the slot ids kv_indices held at plan(): "
                     + FINDINGS_DOC + "#planned-page-range-from-the-previous-step")
#: The two steps of :func:`check_stale_ids_at_plan`: decode contexts and seeds.
STALE_IDS_STEPS = (((40, 150, 330), 21), ((41, 151, 331, 700), 22))


class CoverageJudgedOnStaleIds(AssertionError):
    """A correct step refused at run for slot ids that an earlier step left in kv_indices, which
    the plan read before the step wrote its own."""


def slot_rows(kv_cache) -> int:
    """The rows of ``kv_cache``'s row view: the first slot id past the cache."""
    return int(kv_cache.shape[0]) * block_stride_of(kv_cache)


def check_stale_ids_at_plan(judge, backend, device) -> None:
    """A step, then every entry of the layer's kv_indices (``backends.seam.index_buffers``) set to
    the first slot id past the cache (what a step whose ids ran past its cache leaves there), then
    a correct step through the same layer, each judged: the second must run and pass. A backend
    that plans a step before it writes that step's ids, on a FlashInfer that records the planned
    page range from kv_indices at plan() and checks it at run (``coverage_from_plan_slots``),
    refuses it: :class:`CoverageJudgedOnStaleIds`. Where nothing checks the range, the kernel
    could load those ids past a row's executed length (the tail the bounded design plans and the
    clamp cuts), outside the cache: run it on the GPU only where the range is checked."""

    def leave_ids_past_the_cache(index, layer, scenario, inputs, outcome):
        if index == 0:
            buffers = index_buffers(layer)
            if not buffers:
                raise AssertionError(f"{backend.name}: its layer shows no kv_indices buffers (Layer.index_buffers)")
            for buffer in buffers:
                buffer.fill_(slot_rows(inputs.kv_cache))

    steps = [decode_step(contexts, seed) for contexts, seed in STALE_IDS_STEPS]
    try:
        run_sequence(judge, backend, steps, device, after_step=leave_ids_past_the_cache,
                     what="a correct step after one whose slot ids ran past the cache")
    except ValueError as exc:
        if COVERAGE_REFUSAL not in str(exc):
            raise
        raise CoverageJudgedOnStaleIds(
            f"{backend.describe()}: the second step's run() refused it ({exc}) although its own slot ids lie in the "
            f"cache: its plan() read the ids the first step left in kv_indices, all past the cache, before its "
            f"forward wrote its own") from None
