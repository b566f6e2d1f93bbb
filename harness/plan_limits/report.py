"""The plan-limit study's report: a table per release (largest accepted plan, first refusal,
the rows of the plans around the limit, what it shows) as markdown and JSON."""

from __future__ import annotations

import json
import os


def _cell(attempt: dict | None) -> str:
    if attempt is None:
        return "-"
    text = attempt["outcome"]
    if attempt.get("detail"):
        text += f": {attempt['detail']}"
    return text.replace("|", "/").replace("\n", " ")


#: Outcomes of a rows attempt that make it a finding: plan() accepted the plan, then this.
BAD_ROWS_OUTCOMES = ("wrong", "run-error", "crashed", "timeout")


def entry_finding(entry: dict) -> str:
    """One sentence: what the checked plans of one head count show."""
    checks = [c for c in entry["row_checks"] if c["kind"] == "rows"]
    bad = [c for c in checks if c["outcome"] in BAD_ROWS_OUTCOMES]
    skipped = [c for c in checks if c["outcome"] == "not-run"]
    plans = entry["plan_search"]
    if bad:
        text = "FINDING: plan() accepted " + ", ".join(
            f"N={c['rows']} and then "
            + ("gave wrong rows without an error" if c["outcome"] == "wrong" else c["outcome"])
            for c in bad)
        searched = entry.get("rows_search")
        if searched:
            text += f"; every row right up to N={searched['largest_ok']}"
    elif plans["reached_bound"]:
        text = "no refusal up to the bound; the rows checked are right"
    else:
        text = f"refused above N={plans['largest_ok']}; the rows at the limit are right"
    if skipped:
        text += "; not run (memory): " + ", ".join(f"N={c['rows']}" for c in skipped)
    return text


def report_markdown(report: dict) -> str:
    """A table per release: largest accepted plan, first refusal, the rows of the plans around
    the limit, the largest all-right plan where searched, and what it shows."""
    lines = [
        f"## FlashInfer {report.get('flashinfer')} on {report.get('device')} ({report.get('num_sm')} SMs)",
        "",
        f"Each row its own request (page size 1), {report['width']} slots per row, bf16, rope 64; search bound "
        f"{report['bound']} rows; the scheduler's work capacity is {report['work_capacity']}.",
        "",
        "| H | largest accepted plan | first refused | rows at limit-1, limit, limit+1 | "
        "largest plan with every row right | what it shows |",
        "|---:|---:|---|---|---|---|",
    ]
    for entry in report["results"]:
        plans = entry["plan_search"]
        largest = f"{plans['largest_ok']}" + (" (the bound)" if plans["reached_bound"] else "")
        checks = "; ".join(f"N={c['rows']}: {_cell(c)}" for c in entry["row_checks"])
        rows_search = entry.get("rows_search")
        right = str(rows_search["largest_ok"]) if rows_search else "-"
        lines.append(f"| {entry['heads']} | {largest} | {_cell(plans['first_failing'])} | {checks} | {right} | "
                     f"{entry_finding(entry)} |")
    lines += ["", "Attempts (in order):", ""]
    for entry in report["results"]:
        attempts = entry["plan_search"]["attempts"]
        lines.append(f"- H {entry['heads']}: " + ", ".join(f"{a['rows']} {a['outcome']}" for a in attempts)
                     + f" ({len(attempts)} plan attempts, {entry.get('seconds', '?')} s)")
    return "\n".join(lines) + "\n"


def write_report(report: dict, out_dir: str) -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"plan-limits-{report.get('flashinfer') or 'unknown'}")
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(report_markdown(report))
    return stem + ".json", stem + ".md"
