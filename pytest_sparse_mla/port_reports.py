"""What the port's GPU tests (its state API, ``harness.launch``) attach to their reports: the
measured error ratios (summed up at the end of the run) and, with ``--record-baseline`` /
``--compare-baseline``, each case's outputs and ratios or the plan the installed FlashInfer
refused, and in the upgrade check's timing pass its times."""

from __future__ import annotations

import functools

import torch

from harness.launch import DEVICE, Launch, Launched, nan_buffers
from harness.pipeline import Step
from pytest_sparse_mla.keys import ERROR_KEY
from pytest_sparse_mla.regimes import error_entry
from reference import Comparison


def record_errors(node, step: Step, comparisons: list[Comparison], label: str = "", backend: str = "port-fa3") -> None:
    """Attach the measured ratios to the test report (summed up by pytest_sparse_mla.gpus)."""
    entry = error_entry(backend, step.scenario.spec, comparisons, label, layout=step.layout)
    node.user_properties.append((ERROR_KEY, entry))


@functools.lru_cache(maxsize=1)
def case_timer():
    """The benchmark's timer (CUDA events over a held stream), calibrated once per process."""
    from harness.timing import Timer

    timer = Timer(torch.device(DEVICE))
    timer.calibrate()
    return timer


def note_baseline(request, launched: Launched, comparisons=None, *, out=None, lse=None) -> None:
    """For the upgrade check: a plan the installed FlashInfer refused, as the case's error;
    else, with --record-baseline / --compare-baseline, the case's outputs (``launched``'s, or
    ``out``/``lse``) and ratios; in the timing pass (--baseline-timing-out, one process per GPU)
    only its kernel and plan() times."""
    from pytest_sparse_mla.baselines import baseline_directory, timing_directory

    if launched.refusal is not None:
        request.getfixturevalue("baseline").note(error=launched.refusal)
        return
    out = launched.out if out is None else out
    lse = launched.lse if lse is None else lse
    if timing_directory(request.config) is not None:
        request.getfixturevalue("baseline").note(**time_case(launched.state, launched.launch, launched.step, out))
    elif baseline_directory(request.config) is not None:
        n = launched.rows
        ratios = {f"{c.name}_{k}": getattr(c, k) for c in comparisons for k in ("max_ratio", "mean_ratio")}
        request.getfixturevalue("baseline").note(ratios=ratios, outputs={"out": out[:n], "lse": lse[:n]})


def time_case(state, launch: Launch, step: Step, out) -> dict:
    """Repeated medians (us) of the kernel (CUDA events, same buffers) and of plan() (host time,
    device idle): ``recording.baseline.TIME_REPEATS`` medians of ``TIME_REPS`` calls each."""
    from recording.baseline import TIME_REPS, repeated_medians

    n = step.num_planned
    scratch_out, scratch_lse = nan_buffers(out.shape[0], out.shape[1])
    i = launch.inputs
    timer = case_timer()
    attend = lambda _: state.attend(i.q_nope, i.q_pe, i.ckv, i.kpe, scratch_out, scratch_lse)  # noqa: E731
    kernel = repeated_medians(lambda: timer.device_times(attend, TIME_REPS)[0]) if n else None
    plan = repeated_medians(lambda: timer.host_times(lambda _: state.plan(n, step.planned_lens), TIME_REPS, warmup=3))
    return {"kernel_us_repeats": kernel, "plan_us_repeats": plan}
