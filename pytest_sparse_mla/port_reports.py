"""What the port's GPU tests of its state API (``harness.port.launch``) attach to their reports, the
measured error ratios (summed up at the end of the run), and the times the upgrade check's timing
pass notes of a step whose layer shows its kernel and plan apart (``judge`` fixture)."""

from __future__ import annotations

import functools

import torch

from harness.pipeline import Step
from harness.port.launch import DEVICE
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


def timed_parts(kernel, plan, *, rows: int) -> dict:
    """Repeated medians (us) of ``kernel()`` (CUDA events, the same buffers; none where the step
    plans no row) and of ``plan()`` (host time, device idle): ``recording.baseline.TIME_REPEATS``
    medians of ``TIME_REPS`` calls each, as the upgrade check's timing pass notes them."""
    from recording.baseline import TIME_REPS, repeated_medians

    timer = case_timer()
    kernel_us = repeated_medians(lambda: timer.device_times(lambda _: kernel(), TIME_REPS)[0]) if rows else None
    plan_us = repeated_medians(lambda: timer.host_times(lambda _: plan(), TIME_REPS, warmup=3))
    return {"kernel_us_repeats": kernel_us, "plan_us_repeats": plan_us}
