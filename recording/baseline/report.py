"""The upgrade check's report: ``report.md`` (the summary, then regressions, behaviour
changes, drift, fixtures, what did not run, and a table per case) and ``report.json``."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from .comparison import CaseComparison, RunFacts
from .summary import SummaryLine, display_name, fmt, passed, summary
from .timing import (
    KERNEL_SPREAD_LIMIT,
    KERNEL_TIME_FLOOR_US,
    KERNEL_TIME_LIMIT,
    PLAN_SPREAD_LIMIT,
    PLAN_TIME_LIMIT,
    TIME_REPEATS,
    TIME_REPS,
    thresholds,
)


def render_markdown(comparisons: list[CaseComparison], run: RunFacts, head: list[SummaryLine], before_version: str,
                    after_version: str) -> str:
    lines = [f"# Upgrade check: {before_version} -> {after_version}", "", "```"]
    lines += [line.render() for line in head]
    lines += ["```", "",
              f"FAIL fails the check, note is a change that does not. Rules, over every test the runs ran (those "
              f"that record no output included): passed/xfailed -> failed, error or xpassed, passed -> xfailed (a "
              f"known finding now), or newly raising; an integer result (executed length, packed index) not equal "
              f"entry for entry; a baseline test that ran and did not run now (unless the run's own -k/-m/paths left "
              f"it out); kernel time > "
              f"x{KERNEL_TIME_LIMIT} and > {KERNEL_TIME_FLOOR_US} us slower; plan() time > x{PLAN_TIME_LIMIT}. "
              f"Times come from a pass with one process per GPU, {TIME_REPEATS} medians of {TIME_REPS} calls; a "
              f"time whose medians "
              f"spread more than {KERNEL_SPREAD_LIMIT:.0%} (kernel) or {PLAN_SPREAD_LIMIT:.0%} (plan()) is not judged. "
              f"Fixtures re-run on the new release are compared with the old release's record of them, or, where the "
              f"baseline has none, with the output the fixture file holds for the old release; a new refusal fails.",
              "", "## Regressions", ""]
    lines += [f"- `{c.case}`: " + "; ".join(c.regressions) for c in comparisons if c.regressions] or ["none"]
    lines += ["", "## Behaviour changes", ""]
    lines += [f"- `{c.case}`: " + "; ".join(c.changes) for c in comparisons if c.changes] or ["none"]
    drifted = [c for c in comparisons if c.drift and not c.bitwise_equal and not c.is_fixture]
    lines += ["", "## Outputs no longer bitwise equal", ""]
    lines += [f"- `{c.case}`: " + "; ".join(
        f"{k} max abs {d['max_abs']:.3g}, rel L2 {d['rel_l2']:.3g}, {d['bitwise_equal']:.1%} bitwise equal, "
        f"{d['rows_differing']}/{d['rows']} rows differ (worst: "
        + ", ".join(f"row {r} {m:.3g}" for r, m in d["worst_rows"]) + ")"
        for k, d in c.drift.items() if d["bitwise_equal"] < 1.0) for c in drifted] or ["none"]
    lines += ["", "## Fixtures", ""]
    lines += fixture_lines([c for c in comparisons if c.is_fixture], run, before_version)
    skipped = [c for c in comparisons if c.status in ("not run", "deselected", "new")]  # not: skipped in both
    lines += ["", "## Not run, left out, new", ""]
    lines += [f"- `{c.case}`: {c.status}" + (f" ({c.why})" if c.why else "") for c in skipped] or ["none"]
    lines += ["", "## Per case", "",
              "| case | before | after | out max ratio before/after | out bitwise equal | rows differing | "
              "kernel us before/after | plan us before/after | time not judged |",
              "|---|---|---|---|---|---|---|---|---|"]
    for c in (c for c in comparisons if c.measured and not c.is_fixture):
        b, a = c.before, c.after
        d = c.drift.get("out", {})
        unjudged = "; ".join(t.why for t in (c.kernel_time, c.plan_time) if not t.judged and t.why)
        lines.append(
            f"| `{c.case}` | {b.outcome if b else '–'} | {a.outcome if a else c.status} | "
            f"{fmt(b.ratios.get('out_max_ratio') if b else None)}/"
            f"{fmt(a.ratios.get('out_max_ratio') if a else None)} | "
            f"{fmt(d.get('bitwise_equal'), '.1%')} | {d.get('rows_differing', '–')} | "
            f"{fmt(b.kernel_us if b else None, '.1f')}/{fmt(a.kernel_us if a else None, '.1f')} | "
            f"{fmt(b.plan_us if b else None, '.0f')}/{fmt(a.plan_us if a else None, '.0f')} | {unjudged} |"
        )
    return "\n".join(lines) + "\n"


def drift_text(d: dict) -> str:
    if d["bitwise_equal"] == 1.0:
        return "bitwise equal"
    worst = ", ".join(f"row {r} {m:.3g}" for r, m in d["worst_rows"])
    return (f"max abs {d['max_abs']:.3g}, rel L2 {d['rel_l2']:.3g}, {d['bitwise_equal']:.1%} bitwise equal, "
            f"{d['rows_differing']}/{d['rows']} rows differ (worst: {worst})")


def fixture_lines(fixtures: list[CaseComparison], run: RunFacts, before_version: str) -> list[str]:
    """One item per fixture: what it was compared with and how its outputs moved; then the
    fixtures not re-run now."""
    lines = []
    for c in fixtures:
        record = c.after or c.before
        if c.after is None:
            what = f"{c.status}: {c.why}"
        elif not c.outputs_compared:
            what = "; ".join([f"re-run, not compared: {c.why}", *c.regressions])
        else:
            against = c.against or f"the baseline's record ({before_version})"
            parts = [f"against {against}"]
            if c.after.error or (c.before and c.before.error):
                parts.append(f"refused before: {c.before.error or 'no'}; now: {c.after.error or 'no'}")
            parts += [f"{k} {drift_text(d)}" for k, d in c.drift.items()]
            parts += c.regressions
            what = "; ".join(parts)
        lines.append(f"- `{display_name(c)}` ({record.fixture}): {what}")
    lines += [f"- `{case}`: not re-run ({why}); judged on its recorded outputs only"
              for case, why in sorted(run.not_rerun.items())]
    return lines or ["none replayed"]


def write_report(comparisons: list[CaseComparison], out_dir: Path, before_version: str, after_version: str,
                 run: RunFacts | None = None) -> bool:
    """Write report.md and report.json; True when the check passes."""
    run = run or RunFacts()
    head = summary(comparisons, run, before_version, after_version)
    ok = passed(head)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.md").write_text(render_markdown(comparisons, run, head, before_version, after_version))
    payload = {
        "before": before_version,
        "after": after_version,
        "passed": ok,
        "summary": [line.render() for line in head],
        "summary_status": {line.name: line.status for line in head},
        "thresholds": thresholds(),
        "timing": run.timing or "timing pass ran",
        "fixtures_not_rerun": run.not_rerun,
        "cases": [
            {"case": c.case, "status": c.status, "why": c.why, "fixture": c.is_fixture, "against": c.against or None,
             "measured": c.measured, "integers": c.integers,
             "before": asdict(c.before) if c.before else None, "after": asdict(c.after) if c.after else None,
             "changes": c.changes, "regressions": c.regressions, "drift": c.drift,
             "kernel_time": dict(asdict(c.kernel_time), ratio=c.kernel_time.ratio),
             "plan_time": dict(asdict(c.plan_time), ratio=c.plan_time.ratio)}
            for c in comparisons
        ],
    }
    (out_dir / "report.json").write_text(json.dumps(payload, indent=1, sort_keys=True))
    return ok
