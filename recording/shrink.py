"""Shrinking a failing case before it is written, on the implementation under test.

From the fixture of a failing batch, :func:`shrink_fixture` tries smaller candidates: one
failing row (the rows that read the fewest KV slots first), one failing row per failing check,
all failing rows; then at most :data:`MIN_HEADS` heads (the worst ones kept: heads are
independent), and only the KV slots the remaining rows read. Each candidate is judged again:
its host stages re-run through the implementation under test (:mod:`recording.restage`) and
its recorded outputs against the reference (:func:`recording.replay.replay`); a candidate is
kept only while it fails the same checks (:func:`failure_signature`); a fixture that fails
nothing is not shrunk, and not written (:class:`recording.dump.NothingToWrite`). The fixture records what
it fails, what it was shrunk from and to (rows, heads, bytes) and how many candidates were
tried, under ``shrunk``; ``rows`` and ``heads`` map its rows and heads to the original batch's
(its spec and seed still rebuild that batch).

A fixture still over :data:`MAX_FIXTURE_BYTES` after shrinking is written as a recipe instead
(:mod:`recording.recipe`).
"""

from __future__ import annotations

import torch

from .fixture import Fixture, fixture_tensors, subset_fixture
from .replay import ReplayReport, replay
from .restage import restage_fixture

#: A shrunk fixture larger than this is written as a recipe.
MAX_FIXTURE_BYTES = 2_000_000
#: Heads kept at least (the fewest the GPU tier runs the kernel with).
MIN_HEADS = 16
#: Single-row candidates tried at most.
MAX_SINGLE_ROWS = 8


def fixture_bytes(fx: Fixture) -> int:
    """Bytes of the tensors the fixture's file holds (the file adds its header, a few KB)."""
    return sum(t.numel() * t.element_size() for t in fixture_tensors(fx).values())


def judge(fx: Fixture, impl, device="cpu") -> ReplayReport:
    """The replay verdict of ``fx`` with its host stages re-run through ``impl`` (when given)
    on ``device``, the run's device; the references there too (a failing batch of the GPU tier
    is large)."""
    return replay(fx, rerun=restage_fixture(fx, impl, device=device) if impl is not None else None, device=device)


def plan_report_rows(report: ReplayReport) -> tuple[list, list[int]]:
    """(violations, mismatching rows) of the plan the verdict is on: the re-staged one where there is one."""
    rerun = report.rerun
    if rerun is not None and rerun.plan is not None and not rerun.refused:
        return report.rerun_violations, report.rerun_plan_mismatch_rows
    return report.violations, report.plan_mismatch_rows


def failure_signature(report: ReplayReport) -> frozenset[str]:
    """What fails, without row numbers: the checks (invariant rules, plan != intent, the kernel
    per version and output, bad inputs, a raising stage)."""
    kinds = set()
    violations, mismatches = plan_report_rows(report)
    kinds.update(f"invariant {v.rule}" for v in violations)
    if mismatches:
        kinds.add("plan != intent")
    for version, comparisons in report.kernel.items():
        kinds.update(f"kernel {c.name.split()[0]} [{version}]" for c in comparisons if not c.ok)
    if report.bad_inputs:
        kinds.add("bad inputs")
    if report.rerun is not None and report.rerun.refused:
        kinds.add("raised: " + report.rerun.refused.split(":")[0])
    if report.fixture.meta.get("expect_finding") and report.plan_ok:
        kinds.add("finding gone")
    return frozenset(kinds)


def failing_rows_by_check(report: ReplayReport) -> dict[str, list[int]]:
    """Each failing check's rows (kernel checks: their worst rows)."""
    rows: dict[str, list[int]] = {}
    violations, mismatches = plan_report_rows(report)
    for v in violations:
        if v.row is not None:
            rows.setdefault(f"invariant {v.rule}", []).append(v.row)
    if mismatches:
        rows["plan != intent"] = list(mismatches)
    for version, comparisons in report.kernel.items():
        for c in comparisons:
            if not c.ok:
                rows[f"kernel {c.name.split()[0]} [{version}]"] = [r for r, _, _ in c.worst]
    if report.bad_inputs:
        rows["bad inputs"] = list(report.bad_inputs)
    return {k: sorted(set(v)) for k, v in rows.items() if v}


def row_footprints(fx: Fixture) -> torch.Tensor:
    """Per row: the KV slots it reads (planned span plus intended entries)."""
    return fx["kv_len"].to(torch.int64) + (fx["intended"] != -1).sum(dim=1)


def worst_heads(report: ReplayReport, heads: int) -> list[int]:
    """The heads of the kernel checks' worst elements, first."""
    seen: list[int] = []
    for comparisons in report.kernel.values():
        for c in comparisons:
            for _, h, _ in c.worst:
                if h < heads and h not in seen:
                    seen.append(h)
    return seen


def row_candidates(fx: Fixture, by_check: dict[str, list[int]]) -> list[list[int]]:
    """Smaller row sets to try, smallest first: single failing rows (fewest slots read first),
    one row per failing check, every failing row."""
    size = row_footprints(fx)
    failing = sorted({r for rows in by_check.values() for r in rows if r < fx.num_rows})
    singles = sorted(failing, key=lambda r: (int(size[r]), r))[:MAX_SINGLE_ROWS]
    cover = sorted({min((r for r in rows if r < fx.num_rows), key=lambda r: (int(size[r]), r))
                    for rows in by_check.values() if any(r < fx.num_rows for r in rows)})
    candidates = [[r] for r in singles]
    for rows in (cover, failing):
        if rows and rows not in candidates and len(rows) < fx.num_rows:
            candidates.append(rows)
    return candidates


def shrink_fixture(fx: Fixture, impl=None, device="cpu") -> Fixture | None:
    """The smallest candidate of ``fx`` that fails the same checks (``fx`` itself when no
    smaller one does), with ``shrunk`` recorded in its metadata; None where ``fx`` itself,
    judged, fails nothing. A captured fixture comes back as it is (its rows are not judged
    apart). The implementation runs on ``device`` (the run's)."""
    # A fixture of some rows of a batch too large to build says what it was built from.
    built_from = fx.meta.pop("built_from", None)
    if fx.tensors.get("capture/qo_indptr") is not None:
        return fx  # a captured plan is the program's: its rows are not independent here
    report = judge(fx, impl, device)
    signature = failure_signature(report)
    if not signature:
        return None
    before = built_from or dict(rows=fx.num_rows, heads=int(fx.meta["num_heads"]), bytes=fixture_bytes(fx))
    tried = 0
    best, best_report = fx, report
    for rows in row_candidates(fx, failing_rows_by_check(report)):
        tried += 1
        candidate = subset_fixture(fx, rows)
        candidate_report = judge(candidate, impl, device)
        if failure_signature(candidate_report) == signature:
            best, best_report = candidate, candidate_report
            break
    heads = int(best.meta["num_heads"])
    if heads > MIN_HEADS:
        keep = worst_heads(best_report, heads)[:MIN_HEADS]
        keep += [h for h in range(heads) if h not in keep][: MIN_HEADS - len(keep)]
        tried += 1
        candidate = subset_fixture(best, list(range(best.num_rows)), sorted(keep))
        if failure_signature(judge(candidate, impl, device)) == signature:
            best = candidate
    after = dict(rows=best.num_rows, heads=int(best.meta["num_heads"]), bytes=fixture_bytes(best))
    best.meta["shrunk"] = {"check": sorted(signature), "from": before, "to": after, "candidates_tried": tried}
    best.meta.pop("digest", None)
    return best
