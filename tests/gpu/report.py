"""A pytest plugin (``-p tests.gpu.report``) that sums up, on the controlling process, the kernel
error ratios and FlashInfer warnings the GPU tests attached to their reports: a terminal
section, and a JSON file when ``SPARSE_MLA_GPU_REPORT`` names one."""

from __future__ import annotations

import json
import os
from collections import defaultdict

from tests.gpu.notes import ERROR_KEY
from tests.plugin import WARNING_KEY

_ERRORS: list[dict] = []
_WARNINGS: dict[str, int] = defaultdict(int)


def pytest_runtest_logreport(report):
    # Errors are attached during the call; warnings at teardown (so only its report has them).
    for key, value in report.user_properties:
        if key == ERROR_KEY and report.when == "call":
            _ERRORS.append({"test": report.nodeid, **value})
        elif key == WARNING_KEY and report.when == "teardown":
            for message in value:
                _WARNINGS[message] += 1


def ratio_summary(errors: list[dict]) -> dict[str, dict[str, float]]:
    """Per kv dtype (and rope): worst and mean of each measured ratio."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for e in errors:
        groups[f"{e['kv_dtype']} R={e['rope']}"].append(e)
    out = {}
    for name, rows in sorted(groups.items()):
        summary = {"cases": len(rows)}
        for metric in ("out_max_ratio", "out_mean_ratio", "lse_max_ratio", "lse_mean_ratio", "out_rel_l2"):
            values = [r[metric] for r in rows if metric in r]
            if values:
                summary[f"{metric}_worst"] = max(values)
                summary[f"{metric}_mean"] = sum(values) / len(values)
        out[name] = summary
    return out


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput"):
        return
    summary = ratio_summary(_ERRORS)
    if summary:
        terminalreporter.section("kernel error / working-precision error (compare_to_budget ratios)")
        terminalreporter.write_line(f"{'kv':<22}{'cases':>6}{'out max':>10}{'(mean)':>9}{'out mean':>10}{'(mean)':>9}"
                                    f"{'lse max':>10}{'(mean)':>9}{'rel L2':>10}")
        for name, s in summary.items():
            terminalreporter.write_line(
                f"{name:<22}{s['cases']:>6}{s.get('out_max_ratio_worst', 0):>10.2f}{s.get('out_max_ratio_mean', 0):>9.2f}"
                f"{s.get('out_mean_ratio_worst', 0):>10.2f}{s.get('out_mean_ratio_mean', 0):>9.2f}"
                f"{s.get('lse_max_ratio_worst', 0):>10.2f}{s.get('lse_max_ratio_mean', 0):>9.2f}"
                f"{s.get('out_rel_l2_worst', 0):>10.2e}"
            )
    if _WARNINGS:
        terminalreporter.section("warnings raised by FlashInfer")
        for message, count in sorted(_WARNINGS.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"{count:>5} tests: {message[:300]}")
    path = os.environ.get("SPARSE_MLA_GPU_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({"ratios": summary, "errors": _ERRORS, "warnings": dict(_WARNINGS)}, f, indent=1, default=str)
