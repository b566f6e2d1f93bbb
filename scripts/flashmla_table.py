"""The FA3-against-FlashMLA table of a GPU run, in markdown.

``tests/gpu/test_flashmla.py::test_flashmla_and_fa3_against_the_oracle`` writes one JSON line
per case (``$SPARSE_MLA_FLASHMLA_TABLE``, else ``.pytest_cache/d/sparse-mla/flashmla-table.jsonl``):
each kernel's output and LSE errors against the float64 oracle (max error, its ratio to the
working-precision reference's, rel L2, within budget or not) and the two kernels' largest
difference. This script takes the lines of one run (the last one in the file, or ``--run``),
the last line of each test, and prints a table per kernel variant and a summary of the worst
ratios::

    python -m scripts.flashmla_table [PATH] [--run RUN_ID] > table.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_PATH = Path(".pytest_cache/d/sparse-mla/flashmla-table.jsonl")
KERNELS = (("flashmla", "FlashMLA"), ("fa3", "FA3"))


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rows_of_run(rows: list[dict], run: str | None = None) -> list[dict]:
    """The rows of ``run`` (default: the run of the last row), the last of each test kept."""
    if not rows:
        return []
    run = run or rows[-1]["run"]
    latest: dict[str, dict] = {}
    for row in rows:
        if row["run"] == run:
            latest[row["test"]] = row
    return list(latest.values())


def error_cell(entry: dict, name: str) -> str:
    """``max err (ratio x lowp)``, bold where beyond the budget."""
    text = f"{entry[f'{name}_max_err']:.3g} ({entry[f'{name}_max_ratio']:.2f}x)"
    return text if entry[f"{name}_ok"] else f"**{text}**"


def verdict(row: dict) -> str:
    off = [label for key, label in KERNELS if not (row[key]["out_ok"] and row[key]["lse_ok"])]
    return "both within budget" if not off else f"{' and '.join(off)} beyond budget"


def variant_key(row: dict) -> tuple:
    return row["variant"], row["k_scale"]


def case_table(rows: list[dict]) -> list[str]:
    header = ["case", "heads", "rows", "regimes"]
    for _, label in KERNELS:
        header += [f"{label} out max err (x lowp)", f"{label} out rel L2", f"{label} lse max err (x lowp)"]
    header += ["max abs diff out", "verdict"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in sorted(rows, key=lambda r: r["case"]):
        cells = [row["case"], str(row["heads"]), str(row["rows"]), row["regimes"] or "-"]
        for key, _ in KERNELS:
            entry = row[key]
            cells += [error_cell(entry, "out"), f"{entry['out_rel_l2']:.3g}", error_cell(entry, "lse")]
        cells += [f"{row['out_max_diff']:.3g}", verdict(row)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def summary_table(rows: list[dict]) -> list[str]:
    header = ["variant", "k_scale", "cases"]
    for _, label in KERNELS:
        header += [f"{label} worst out ratio", f"{label} worst lse ratio", f"{label} beyond budget"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(variant_key(row), []).append(row)
    for (variant, k_scale), group in sorted(groups.items()):
        cells = [variant, f"{k_scale:g}", str(len(group))]
        for key, _ in KERNELS:
            cells += [f"{max(r[key]['out_max_ratio'] for r in group):.2f}x",
                      f"{max(r[key]['lse_max_ratio'] for r in group):.2f}x",
                      str(sum(1 for r in group if not (r[key]["out_ok"] and r[key]["lse_ok"])))]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render(rows: list[dict]) -> str:
    """The markdown of one run's rows: the summary, then a table per variant."""
    if not rows:
        return "No FlashMLA differential rows in this run.\n"
    out = [f"FA3 against FlashMLA: {len(rows)} cases (run {rows[0]['run']}). Errors against the float64 oracle "
           "over (a); ratios are to the working-precision reference's error; bold: beyond the error budget.", ""]
    out += summary_table(rows)
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(variant_key(row), []).append(row)
    for (variant, k_scale), group in sorted(groups.items()):
        out += ["", f"### {variant}, k_scale {k_scale:g}", ""] + case_table(group)
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.flashmla_table", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", nargs="?", type=Path, default=DEFAULT_PATH)
    parser.add_argument("--run", help="the run id to tabulate (default: the last run in the file)")
    args = parser.parse_args(argv)
    if not args.path.is_file():
        print(f"error: {args.path}: no such file (run the GPU tier's FlashMLA tests first)", file=sys.stderr)
        return 2
    sys.stdout.write(render(rows_of_run(read_rows(args.path), args.run)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
