"""What the GPU tests attach to their reports: the measured error ratios (summed up at the end
of the run) and, with ``--record-baseline`` / ``--compare-baseline``, each case's outputs,
ratios and times."""

from __future__ import annotations

import functools

import torch

from harness.launch import DEVICE, Launch, nan_buffers
from harness.pipeline import Step
from pytest_sparse_mla.keys import ERROR_KEY
from reference import Comparison


def record_errors(node, step: Step, comparisons: list[Comparison], label: str = "") -> None:
    """Attach the measured ratios to the test report (summed up by pytest_sparse_mla.gpus)."""
    spec = step.scenario.spec
    entry = {
        "kv_dtype": spec.kv_dtype,
        "rope": spec.rope_dim,
        "heads": spec.num_heads,
        "layout": step.layout,
        "label": label,
        **{f"{c.name}_{k}": getattr(c, k) for c in comparisons for k in ("max_ratio", "mean_ratio", "rel_l2", "max_err")},
    }
    node.user_properties.append((ERROR_KEY, entry))


@functools.lru_cache(maxsize=1)
def case_timer():
    """The benchmark's timer (CUDA events over a held stream), calibrated once per process."""
    from harness.timing import Timer

    timer = Timer(torch.device(DEVICE))
    timer.calibrate()
    return timer


def note_baseline(request, state, launch: Launch, step: Step, out, lse, comparisons) -> None:
    """With --record-baseline / --compare-baseline: the case's outputs, ratios and times."""
    from pytest_sparse_mla.baselines import baseline_directory

    if baseline_directory(request.config) is None:
        return
    n = step.num_planned
    ratios = {f"{c.name}_{k}": getattr(c, k) for c in comparisons for k in ("max_ratio", "mean_ratio")}
    from harness.timing import summarize

    scratch_out, scratch_lse = nan_buffers(out.shape[0], out.shape[1])
    i = launch.inputs
    timer = case_timer()
    kernel_us = None
    if n:
        times, _ = timer.device_times(lambda _: state.attend(i.q_nope, i.q_pe, i.ckv, i.kpe, scratch_out, scratch_lse), 15)
        kernel_us = summarize(times)["median_s"] * 1e6
    plan_us = summarize(timer.host_times(lambda _: state.plan(n, step.planned_lens), 15, warmup=3))["median_s"] * 1e6
    request.getfixturevalue("baseline").note(
        ratios=ratios, kernel_us=kernel_us, plan_us=plan_us, outputs={"out": out[:n], "lse": lse[:n]}
    )
