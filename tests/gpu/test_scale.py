"""The scale edge (docs/edges.md#scale): plans of 1, 2, 3, 1024, 8192, 16384 and 32768 rows at
H 16 and 128 through the production path, every row judged against its own error budget, so
one wrong row fails its case and the message names it (row, request, regime, context, planned
length, worst head, error against budget).

Cases of 8192 rows and more are marked ``gpu_large`` (the main job runs them; ``-m "not
gpu_large"`` leaves them out). Plans beyond the fa3 scheduler's work capacity (16384 work
items: the 32768-row cases) run in a child process, since a release that accepts them may
fault the device; they are the strict-xfail finding WorkCapacityExceeded on every release, raised
when the plan is refused or when it is accepted and then crashes or gives a wrong row. A child
that crashes or times out before the plan (in the stages of the implementation under test) is
no such finding: the test fails naming the case and the stage, and under ``--dump-failures``
leaves a recipe of the case (docs/replay.md).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness.findings import WORK_CAPACITY_FINDING, WorkCapacityExceeded
from harness.pipeline import prepare_step
from harness.port.launch import DEVICE
from harness.port.scale import (
    SCALE_LAYOUT,
    SCALE_SEED,
    check_scale_case,
    narrow_scale_cases,
    run_case_in_child,
    scale_cases,
)
from harness.scenario import build_scenario, component_seed, slot_values, slot_values_on
from pytest_sparse_mla.impl import IMPL_SPEC
from recording.case_log import note_crash

pytestmark = [pytest.mark.gpu, pytest.mark.edge("scale")]


def params():
    out = []
    for case in scale_cases() + narrow_scale_cases():
        marks = [pytest.mark.gpu_large] if case.large else []
        if case.over_capacity:
            marks.append(pytest.mark.xfail(reason=WORK_CAPACITY_FINDING, raises=WorkCapacityExceeded, strict=True))
        out.append(pytest.param(case, id=case.id, marks=marks))
    return out


def record_regimes(regime_log, counts: dict) -> None:
    regime_log.record([regime for regime, n in sorted(counts.items()) for _ in range(n)])


def failure_text(case, result: dict, version: str) -> str:
    lines = [
        f"{case.id}: {result['outcome']} at stage {result.get('stage')}; flashinfer {version}",
        result.get("detail", ""),
    ]
    lines += [f"  {p}" for p in result.get("problems", [])]
    if result.get("wrote_past_planned_rows"):
        lines.append("  the kernel wrote rows past the planned rows")
    return "\n".join(line for line in lines if line)


#: The stages a scale case reaches once its plan is built: a crash from here on is the kernel's.
KERNEL_STAGES = ("plan", "run", "judge", "done")


def died_apart(result: dict) -> bool:
    """The child process of a case crashed or timed out."""
    return result["outcome"] in ("crashed", "timeout")


def raise_work_capacity_finding(case, result: dict, version: str) -> None:
    """What a plan beyond the work capacity showed, as the finding: refused with a ValueError, or
    accepted and then crashed, failed at run, timed out or gave wrong rows. Anything else
    (right rows, another refusal, a child that died before the plan) is left to the assertions
    that follow."""
    outcome = result["outcome"]
    if died_apart(result) and result.get("stage") not in KERNEL_STAGES:
        return
    if outcome == "refused" and result.get("refusal_is_value_error"):
        raise WorkCapacityExceeded(f"refused at plan: {failure_text(case, result, version)}")
    if outcome in ("wrong", "crashed", "run-error", "timeout"):
        raise WorkCapacityExceeded(f"accepted at plan, then {outcome}: {failure_text(case, result, version)}")


@pytest.mark.parametrize("case", params())
def test_every_row_within_its_budget_at_scale(impl, features, request, regime_log, record_property, case,
                                              failure_dump):
    """plan + run of the whole batch; every planned row against the float64 truth and the
    yardstick of its own selection (b), (b) == (a) checked on the device first."""
    failure_dump.note(scale_case=case.id)
    if case.over_capacity:
        result = run_case_in_child(case, request.config.stash[IMPL_SPEC])
        if died_apart(result):  # the case a failure dumps: a recipe, replayed apart
            note_crash(build_scenario(case.spec, SCALE_SEED), SCALE_LAYOUT, result.get("stage"), result["detail"])
        elif result["outcome"] == "invalid" and failure_dump.directory:
            # A wrong plan, seen before any launch: the host stages run again here, without the
            # kernel, so that the dump writes the fixture of the failing rows.
            prepare_step(impl, build_scenario(case.spec, SCALE_SEED), SCALE_LAYOUT, device=DEVICE)
    else:
        result = check_scale_case(impl, case, DEVICE)
    record_regimes(regime_log, result.get("regimes", {}))
    if result["outcome"] in ("right", "wrong"):
        regime_log.kernel_ran()
    regime_log.blame(result.get("bad_row_regimes", []))
    record_property("scale", {k: v for k, v in result.items() if k not in ("detail", "problems")})
    print(f"{case.id}: {result['outcome']}; {result.get('summary')}; stage times {result.get('seconds')}")
    if case.over_capacity:
        raise_work_capacity_finding(case, result, features.version)
    assert result["outcome"] == "right", failure_text(case, result, features.version)


def test_device_values_equal_the_host_scenario_values():
    """The KV values generated on the GPU are bitwise those of the host builder (the same
    integer hash), so a scale case's cache is the scenario builder's cache."""
    slots = np.array([0, 1, 63, 64, 1 << 23, (1 << 23) + 12345, 3_000_000], dtype=np.uint64)
    seed = component_seed(5, "kv")
    host = torch.from_numpy(slot_values(seed, slots, 576))
    device = slot_values_on(seed, torch.from_numpy(slots.astype(np.int64)).to(DEVICE), 576).cpu()
    assert torch.equal(host.view(torch.int32), device.view(torch.int32))
