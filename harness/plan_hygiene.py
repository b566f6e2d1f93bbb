"""Plan hygiene (docs/input-space.md#plan-hygiene): what each FlashInfer ``plan()`` of a step
costs the host in device synchronisations.

A plan runs on the host every step (vLLM plans in its metadata builder, once per draft and
verify build); a device-to-host read inside it waits for every kernel queued before it. Each
plan's synchronisations are counted (``backends.seam.device_syncs_counted``: torch's sync debug
mode) through one layer over decode steps of 1, 16 and 128 rows after a warm-up step, each step
judged: a plan must make as many synchronisations for 128 rows as for one (a plan that reads back
per row, or per work item, would wait once for each). The counts are the check's result, for the
run's report.
"""

from __future__ import annotations

from .case_runner import run_sequence
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
    _, outcomes = run_sequence(judge, backend, steps, device, what="device synchronisations per plan()")
    counts = {rows: list(outcome.plan_syncs) for rows, outcome in zip(SYNC_ROWS, outcomes[1:], strict=True)}
    problems = sync_count_problems(counts)
    if problems:
        raise AssertionError(f"{backend.name}: " + "; ".join(problems))
    return counts
