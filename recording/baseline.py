"""Upgrade validation: record what every GPU-tier case did on the installed FlashInfer, and
compare another version against such a record (the record format, the comparison and the
report; the options and hooks are ``pytest_sparse_mla.baselines``).

``--record-baseline DIR`` writes, per case, a JSON record (outcome, error FlashInfer raised,
its warnings, error-budget ratios, kernel and plan() times) and a safetensors file of the
outputs. ``--compare-baseline DIR`` records the installed version the same way (into
``--baseline-out``, default ``baseline-compare/``) and writes ``report.md`` and
``report.json`` there: behaviour changes, numerical drift between the versions' outputs,
ratios before/after, time ratios. The run fails when a case regresses:

- a case that passed now fails, or a call that ran now raises (even where the suite expects
  the error, as for the strided layout on FlashInfer >= 0.7: the upgrade still breaks it);
- an error-budget ratio past the budget (the test itself fails then);
- kernel time more than ``KERNEL_TIME_LIMIT`` x the baseline (and more than
  ``KERNEL_TIME_FLOOR_US`` slower, so launch noise on tiny cases does not count);
- plan() host time more than ``PLAN_TIME_LIMIT`` x the baseline.

Times are judged only when both runs timed each case with the GPU to one test process
(``pytest -p no:xdist`` or ``-n 1`` per GPU): under ``-n auto`` on one GPU they are reported
with the number of processes that shared it, since contention inflates them (FlashInfer 0.7's
plan() waits for the device, so it also measures the other processes' kernels).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

SCHEMA = 1
KERNEL_TIME_LIMIT = 1.15
KERNEL_TIME_FLOOR_US = 2.0
PLAN_TIME_LIMIT = 2.0


@dataclass
class CaseRecord:
    case: str
    outcome: str = "passed"  # pytest outcome: passed / failed / xfailed / skipped / error
    flashinfer: str | None = None
    error: str | None = None  # what FlashInfer raised, if it did
    warnings: list[str] = field(default_factory=list)
    ratios: dict[str, float] = field(default_factory=dict)  # e.g. out_max, out_mean, lse_max, lse_mean
    kernel_us: float | None = None
    plan_us: float | None = None
    timing_workers: int = 1  # test processes sharing the GPU while this case was timed


def safe_name(case: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", case.split("::", 1)[-1])[:180]


def write_record(directory: Path, record: CaseRecord, outputs: dict[str, torch.Tensor] | None) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    name = safe_name(record.case)
    (directory / f"{name}.json").write_text(json.dumps(dict(asdict(record), schema=SCHEMA), indent=1, sort_keys=True))
    if outputs:
        save_file({k: v.detach().contiguous().cpu() for k, v in outputs.items()}, str(directory / f"{name}.safetensors"))


def read_records(directory: Path) -> dict[str, CaseRecord]:
    records = {}
    for path in sorted(Path(directory).glob("*.json")):
        data = json.loads(path.read_text())
        if data.pop("schema", None) != SCHEMA:
            raise ValueError(f"{path}: unknown baseline schema")
        records[data["case"]] = CaseRecord(**data)
    return records


def read_outputs(directory: Path, case: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = Path(directory) / f"{safe_name(case)}.safetensors"
    return load_file(str(path)) if path.exists() else {}


def drift(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """Max abs difference, relative L2 and the fraction of bitwise-equal elements (finite only;
    an empty output is equal)."""
    if a.numel() == 0:
        return {"max_abs": 0.0, "rel_l2": 0.0, "bitwise_equal": 1.0}
    a64, b64 = a.double(), b.double()
    finite = torch.isfinite(a64) & torch.isfinite(b64)
    diff = torch.where(finite, a64 - b64, torch.zeros_like(a64))
    ref = torch.where(finite, a64, torch.zeros_like(a64))
    norm = float(ref.norm())
    same_bits = (a.view(torch.int16) == b.view(torch.int16)) if a.dtype == torch.bfloat16 and b.dtype == a.dtype else (a == b)
    return {
        "max_abs": float(diff.abs().max()) if diff.numel() else 0.0,
        "rel_l2": float(diff.norm()) / norm if norm > 0 else float(diff.norm()),
        "bitwise_equal": float(same_bits.sum()) / max(same_bits.numel(), 1),
    }


@dataclass
class CaseComparison:
    case: str
    before: CaseRecord | None
    after: CaseRecord | None
    changes: list[str] = field(default_factory=list)
    regressions: list[str] = field(default_factory=list)
    drift: dict[str, dict[str, float]] = field(default_factory=dict)
    kernel_ratio: float | None = None
    plan_ratio: float | None = None


def _ok(record: CaseRecord | None) -> bool:
    return record is not None and record.outcome in ("passed", "xfailed")


def compare_case(case: str, before: CaseRecord | None, after: CaseRecord | None, before_out, after_out) -> CaseComparison:
    cmp = CaseComparison(case, before, after)
    if before is None:
        cmp.changes.append("new case")
    elif after is None:
        cmp.changes.append("case not run")
    else:
        if before.outcome != after.outcome:
            cmp.changes.append(f"outcome {before.outcome} -> {after.outcome}")
        if before.error and not after.error:
            cmp.changes.append(f"no longer raising (was: {before.error})")
        new_warnings = sorted(set(after.warnings) - set(before.warnings))
        if new_warnings:
            cmp.changes.append("new warnings: " + " | ".join(new_warnings))
        if after.error and not before.error:
            cmp.changes.append(f"newly raising: {after.error}")
            cmp.regressions.append(f"newly raising: {after.error}")
        elif _ok(before) and not _ok(after):
            cmp.regressions.append(f"was {before.outcome}, now {after.outcome}" + (f" ({after.error})" if after.error else ""))
        # Times taken while other test processes shared the GPU are reported, not judged: a
        # plan() that waits for the device (0.7.x) then measures the others' work too.
        judged = before.timing_workers <= 1 and after.timing_workers <= 1
        if before.kernel_us and after.kernel_us:
            cmp.kernel_ratio = after.kernel_us / before.kernel_us
            if judged and cmp.kernel_ratio > KERNEL_TIME_LIMIT and after.kernel_us - before.kernel_us > KERNEL_TIME_FLOOR_US:
                cmp.regressions.append(f"kernel time x{cmp.kernel_ratio:.2f} ({before.kernel_us:.1f} -> {after.kernel_us:.1f} us)")
        if before.plan_us and after.plan_us:
            cmp.plan_ratio = after.plan_us / before.plan_us
            if judged and cmp.plan_ratio > PLAN_TIME_LIMIT:
                cmp.regressions.append(f"plan() time x{cmp.plan_ratio:.2f} ({before.plan_us:.0f} -> {after.plan_us:.0f} us)")
    for key in sorted(set(before_out) & set(after_out)):
        if before_out[key].shape == after_out[key].shape:
            cmp.drift[key] = drift(before_out[key], after_out[key])
    return cmp


def compare_directories(before_dir: Path, after_dir: Path) -> list[CaseComparison]:
    before, after = read_records(before_dir), read_records(after_dir)
    return [
        compare_case(case, before.get(case), after.get(case), read_outputs(before_dir, case), read_outputs(after_dir, case))
        for case in sorted(set(before) | set(after))
    ]


def _fmt(x, spec=".2f", none="–") -> str:
    return none if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _workers(comparisons: list[CaseComparison]) -> str:
    before = max((c.before.timing_workers for c in comparisons if c.before), default=1)
    after = max((c.after.timing_workers for c in comparisons if c.after), default=1)
    return f"{before} and {after} processes per GPU"


def render_markdown(comparisons: list[CaseComparison], before_version: str, after_version: str) -> str:
    regressed = [c for c in comparisons if c.regressions]
    changed = [c for c in comparisons if c.changes]
    kernel = [c.kernel_ratio for c in comparisons if c.kernel_ratio]
    plan = [c.plan_ratio for c in comparisons if c.plan_ratio]
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else None  # noqa: E731
    lines = [
        f"# FlashInfer upgrade check: {before_version} -> {after_version}",
        "",
        f"{len(comparisons)} cases; {len(regressed)} regressed; {len(changed)} changed behaviour; "
        f"median kernel-time ratio {_fmt(med(kernel))}; median plan()-time ratio {_fmt(med(plan))}.",
        "",
        f"Regression rules: outcome passed/xfailed -> failed/raised; kernel time > x{KERNEL_TIME_LIMIT} and "
        f"> {KERNEL_TIME_FLOOR_US} us slower; plan() time > x{PLAN_TIME_LIMIT}; an error ratio past the budget "
        "fails the case itself. Times are judged only when neither run shared the GPU between test processes "
        f"(here: {_workers(comparisons)}).",
        "",
        "## Regressions",
        "",
    ]
    lines += [f"- `{c.case}`: " + "; ".join(c.regressions) for c in regressed] or ["none"]
    lines += ["", "## Behaviour changes", ""]
    lines += [f"- `{c.case}`: " + "; ".join(c.changes) for c in changed] or ["none"]
    lines += ["", "## Per case", "",
              "| case | before | after | out max ratio before/after | out drift max abs | rel L2 | bitwise equal | kernel us before/after | plan us before/after |",
              "|---|---|---|---|---|---|---|---|---|"]
    for c in comparisons:
        b, a = c.before, c.after
        d = c.drift.get("out", {})
        lines.append(
            f"| `{c.case}` | {b.outcome if b else '–'} | {a.outcome if a else '–'} | "
            f"{_fmt(b.ratios.get('out_max') if b else None)}/{_fmt(a.ratios.get('out_max') if a else None)} | "
            f"{_fmt(d.get('max_abs'), '.3g')} | {_fmt(d.get('rel_l2'), '.3g')} | {_fmt(d.get('bitwise_equal'), '.1%')} | "
            f"{_fmt(b.kernel_us if b else None, '.1f')}/{_fmt(a.kernel_us if a else None, '.1f')} | "
            f"{_fmt(b.plan_us if b else None, '.0f')}/{_fmt(a.plan_us if a else None, '.0f')} |"
        )
    return "\n".join(lines) + "\n"


def write_report(comparisons: list[CaseComparison], out_dir: Path, before_version: str, after_version: str) -> bool:
    """Write report.md and report.json; True when nothing regressed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.md").write_text(render_markdown(comparisons, before_version, after_version))
    payload = {
        "before": before_version,
        "after": after_version,
        "thresholds": {"kernel_time": KERNEL_TIME_LIMIT, "kernel_time_floor_us": KERNEL_TIME_FLOOR_US,
                       "plan_time": PLAN_TIME_LIMIT},
        "cases": [
            {"case": c.case, "before": asdict(c.before) if c.before else None, "after": asdict(c.after) if c.after else None,
             "changes": c.changes, "regressions": c.regressions, "drift": c.drift, "kernel_ratio": c.kernel_ratio,
             "plan_ratio": c.plan_ratio}
            for c in comparisons
        ],
    }
    (out_dir / "report.json").write_text(json.dumps(payload, indent=1, sort_keys=True))
    return not any(c.regressions for c in comparisons)
