"""One step of the production path, driven through the implementation under test, plus the
checks every tier shares: invariants before launch and the two selections (a) and (b).

:func:`prepare_step` runs what happens on the host and device before the kernel (convert,
kv_len, planned rows, kv_indptr, kv_indices) for one scenario and layout; the GPU tier adds
plan + run on top of the same :class:`Step`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fast.layouts import indices_capacity
from reference import Violation, check_plan_invariants, intended_selection, planned_selection
from reference.invariants import same_multisets
from reference.rules import valid_first

from .case_log import note_step
from .scenario import BatchSpec, Scenario, build_scenario, spec_from_dict

#: The stages of :func:`prepare_step`, in order.
STAGES = ("request_ids", "convert", "kv_len", "kv_indptr", "layout", "invariants")
REPO_ROOT = str(Path(__file__).resolve().parents[1])
STEP_CHILD_TIMEOUT_S = 120.0


@dataclass
class Step:
    scenario: Scenario
    layout: str
    max_rows: int
    slots: torch.Tensor  # convert output [rows incl. padding, W] (device)
    counts: torch.Tensor  # convert's valid counts [rows incl. padding] (device)
    lens: torch.Tensor  # host int32, every query row
    planned_lens: torch.Tensor  # host int32, planned rows only
    kv_indptr: torch.Tensor  # host int32 [max_rows + 1]
    kv_indices: torch.Tensor  # device int32 [capacity]
    violations: list[Violation] = field(default_factory=list)

    @property
    def num_planned(self) -> int:
        return self.planned_lens.numel()

    def regimes(self, rows=None) -> list[str]:
        regimes = self.scenario.row_regime[: self.num_planned]
        return regimes if rows is None else [regimes[r] for r in rows]

    def context(self) -> str:
        return f"layout={self.layout} {self.scenario.describe()}"


def meta_on_device(meta, device):
    """The step metadata with the tensors the engine keeps on the device (seq_lens,
    positions) on ``device``; the host ones stay on the host."""
    positions = None if meta.positions is None else meta.positions.to(device)
    return dataclasses.replace(meta, seq_lens=meta.seq_lens.to(device), positions=positions)


def prepare_step(impl, scenario: Scenario, layout: str, device="cpu", max_rows: int | None = None,
                 reached=lambda stage: None) -> Step:
    """Convert, compute lens, lay out kv_indices, and check the invariants (no kernel), with
    the device tensors of the step on ``device``; ``reached(stage)`` is called as each stage
    of the implementation under test starts (:data:`STAGES`)."""
    spec, meta = scenario.spec, meta_on_device(scenario.meta, device)
    rows = scenario.topk_indices.shape[0]
    max_rows = max(rows, 1) if max_rows is None else max_rows
    width = spec.resolved_width
    reached("request_ids")
    req = impl.request_ids(meta.query_start_loc_cpu.to(device), rows)
    reached("convert")
    slots, counts = impl.convert(
        scenario.topk_indices.to(device), scenario.block_table.to(device), req, spec.block_size, with_counts=True
    )
    reached("kv_len")
    lens = impl.kv_lens(meta, topk=spec.topk, kpool=spec.kpool, async_scheduling=spec.async_scheduling)
    planned = impl.planned_lens(meta, lens, topk=spec.topk).to(torch.int32)
    reached("kv_indptr")
    indptr = impl.kv_indptr(layout, planned, max_rows, width)
    lens_all = torch.zeros(rows, dtype=torch.int32)
    lens_all[: planned.numel()] = planned[:rows]
    kv_indices = torch.full((indices_capacity(max_rows, width),), -1, dtype=torch.int32, device=device)
    reached("layout")
    impl.write_kv_indices(layout, slots, lens_all.to(device), indptr[: rows + 1].to(device), kv_indices)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)  # a kernel fault shows at the stage that launched it
    reached("invariants")
    violations = plan_violations(scenario, layout, slots, planned, max_rows)
    step = Step(scenario, layout, max_rows, slots, counts, lens, planned, indptr, kv_indices, violations)
    note_step(step)  # the case a failing test dumps under --dump-failures
    return step


def plan_violations(scenario: Scenario, layout: str, slots: torch.Tensor, planned: torch.Tensor,
                    max_rows: int) -> list[Violation]:
    """The invariants before launch (docs/invariants.md#before-launch) of a plan of ``planned``
    lengths over the converted rows ``slots`` under ``layout``."""
    # The rows as the layout reads them: compacted reads the valid entries, front first.
    rows_read = valid_first(slots) if layout == "compacted" else slots
    return check_plan_invariants(
        converted=rows_read,
        lens=planned,
        q_rows=scenario.planned_rows,
        num_slots=scenario.num_slots,
        max_tokens=max_rows,
        width=scenario.spec.resolved_width,
        regimes=scenario.row_regime,
    )


def intended(step: Step) -> tuple[torch.Tensor, torch.Tensor]:
    """(a): the valid entries of the reference-converted indexer rows of the planned rows."""
    return intended_selection(step.scenario.intended_slots(), step.scenario.planned_rows)


def as_planned(step: Step) -> tuple[torch.Tensor, torch.Tensor]:
    """(b): ``(slots, mask)`` the plan makes the kernel read."""
    slots, lens = planned_selection(step.kv_indptr, step.kv_indices, step.planned_lens, step.num_planned)
    mask = torch.arange(slots.shape[1]).unsqueeze(0) < lens.unsqueeze(1)
    return slots, mask


def selection_mismatches(step: Step) -> list[int]:
    """Rows whose planned selection (b) is not the intended multiset (a): a plan/layout bug."""
    a_slots, a_mask = intended(step)
    b_slots, b_mask = as_planned(step)
    n = min(a_slots.shape[0], b_slots.shape[0])
    rows = (~same_multisets(a_slots[:n].cpu(), a_mask[:n].cpu(), b_slots[:n], b_mask[:n])).nonzero().flatten().tolist()
    if a_slots.shape[0] != b_slots.shape[0]:
        rows.append(n)
    return rows


def describe_rows(step: Step, rows: list[int], limit: int = 6) -> str:
    """Human-readable lines for failing rows: regime, ctx, planned len, valid count."""
    sc = step.scenario
    lines = []
    counts = step.counts.cpu()
    for r in rows[:limit]:
        if r >= sc.num_rows:
            lines.append(f"  row {r}: beyond the {sc.num_rows} query rows")
            continue
        plen = int(step.planned_lens[r]) if r < step.num_planned else None
        lines.append(
            f"  row {r}: regime {sc.row_regime[r]} ctx {int(sc.row_ctx[r])} planned len {plen} valid {int(counts[r])}"
        )
    if len(rows) > limit:
        lines.append(f"  ... and {len(rows) - limit} more rows")
    return "\n".join(lines)


def run_step_in_child(impl_spec: str, spec: BatchSpec, seed: int, layout: str, device="cpu",
                      timeout: float = STEP_CHILD_TIMEOUT_S) -> dict:
    """:func:`prepare_step` of the scenario in a child process, where code under test that
    kills its process (a segfault in a convert kernel, say) cannot take the session down:
    ``{"outcome": "ok" | "crashed" | "timeout" | "error", "stage", "detail"}``, the stage being
    the last one the child reached."""
    cmd = [
        sys.executable,
        "-m",
        "harness.pipeline",
        "--impl",
        impl_spec,
        "--spec",
        json.dumps(dataclasses.asdict(spec)),
        "--seed",
        str(seed),
        "--layout",
        layout,
        "--device",
        str(device),
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")]))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT, env=env)
        stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr, code = "", None
    stages = [line[6:] for line in stdout.splitlines() if line.startswith("STAGE ")]
    stage = stages[-1] if stages else None
    if code == 0 and "RESULT ok" in stdout:
        return {"outcome": "ok", "stage": stage, "detail": ""}
    tail = " | ".join(line.strip() for line in stderr.strip().splitlines()[-3:])[-400:]
    if code is None:
        return {"outcome": "timeout", "stage": stage, "detail": f"no result within {timeout:.0f} s at stage {stage}"}
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        return {
            "outcome": "crashed",
            "stage": stage,
            "detail": f"the implementation under test killed its process ({name}) at stage {stage}"
            + (f": {tail}" if tail else ""),
        }
    return {
        "outcome": "error",
        "stage": stage,
        "detail": f"the child exited with {code} at stage {stage}" + (f": {tail}" if tail else ""),
    }


def child_main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="one step's host stages in their own process (see run_step_in_child)")
    parser.add_argument("--impl", required=True)
    parser.add_argument("--spec", required=True, help="the BatchSpec as JSON")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--layout", required=True)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    from fast.impl import load_impl

    impl = load_impl(args.impl)
    scenario = build_scenario(spec_from_dict(json.loads(args.spec)), args.seed)
    prepare_step(impl, scenario, args.layout, args.device, reached=lambda stage: print(f"STAGE {stage}", flush=True))
    print("RESULT ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(child_main())
