"""compute-sanitizer memcheck and initcheck on one small case of each kernel variant
(docs/edges.md#sanitizer).

    python3 -m scripts.sanitize [--tools memcheck initcheck] [--variants bf16-rope64 ...]
                                [--out DIR] [--timeout-s S] [--parallel N]

Finds compute-sanitizer (on PATH, under /usr/local/cuda*/bin, or in the nvidia-cuda-sanitizer-api
wheel) and runs, for every tool and variant, ``compute-sanitizer --tool T --log-file F python3
-m scripts.sanitize --driver VARIANT``: the driver takes 3 decode rows (kpool 4: regimes G, C
and D) at H 16 through the production path (convert, compacted layout, plan, run), on NaN-filled
outputs, and prints the rows whose output is not finite. PyTorch's caching allocator is off in
the driver (``PYTORCH_NO_CUDA_MEMORY_CACHING=1``), so every tensor is an allocation of its own
and a read past one is an error memcheck sees. The sanitizer's log is parsed: its error
summary, each error kind with the kernel it was in and how often, API errors apart.

Writes sanitize.json and sanitize.md into --out (default out/sanitize) and prints the table.
Exit status 0 when every run ended with 0 errors, 1 when a run reported errors or did not
finish, 2 when compute-sanitizer is not found.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from backends.flashinfer.port import make_attention_state
from mla_constants import GPU_TIER_DEFAULT_DEVICE, GPU_TIER_DEVICE_ENV

REPO = Path(__file__).resolve().parent.parent
TOOLS = ("memcheck", "initcheck")
DRIVER_HEADS = 16
DRIVER_KPOOL = 4
DRIVER_SEED = 31
RUN_TIMEOUT_S = 900.0


def kernel_configs() -> dict:
    """The three kernel variants (harness.cases.VARIANTS) at the driver's head count, by name."""
    from harness.cases import VARIANTS, KernelConfig

    configs = [KernelConfig(kv_dtype, rope, DRIVER_HEADS, k_scale) for kv_dtype, rope, k_scale in VARIANTS]
    return {c.variant: c for c in configs}


# --- finding the sanitizer ------------------------------------------------------------------------


def sanitizer_candidates() -> list[str]:
    """Where compute-sanitizer is looked for, in order (globs expanded)."""
    places = []
    on_path = shutil.which("compute-sanitizer")
    if on_path:
        places.append(on_path)
    places += sorted(glob.glob("/usr/local/cuda*/bin/compute-sanitizer"), reverse=True)
    places += sorted(glob.glob("/usr/local/cuda*/compute-sanitizer/compute-sanitizer"), reverse=True)
    for root in sys.path:
        places += glob.glob(
            os.path.join(root, "nvidia", "cuda_sanitizer_api", "compute-sanitizer", "compute-sanitizer")
        )
    return places


LOOKED_IN = ("PATH", "/usr/local/cuda*/bin", "/usr/local/cuda*/compute-sanitizer",
             "site-packages/nvidia/cuda_sanitizer_api (the nvidia-cuda-sanitizer-api wheel)")


def find_sanitizer() -> str | None:
    for place in sanitizer_candidates():
        if os.path.isfile(place) and os.access(place, os.X_OK):
            return place
    return None


def not_found_reason() -> str:
    return "compute-sanitizer not found (looked on " + ", ".join(LOOKED_IN) + ")"


# --- parsing its log -----------------------------------------------------------------------------

PREFIX = "========="
SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?")
API_ERROR = re.compile(r"Program hit (\w+) \(error \d+\) due to \"(.*?)\" on CUDA API call to (\w+)")
SIZE = re.compile(r" of size \d+ bytes?$")


def kernel_of(location: str) -> str:
    """The kernel named by an ``at ...`` line: ``at kernel(args)+0x90 in file.cu:6`` (newer
    sanitizers) or ``at 0x00000090 in /path/file.cu:6:kernel(args)`` (older ones)."""
    text = location.strip()[3:].strip()
    text = re.sub(r"^0x[0-9a-fA-F]+ in ", "", text)
    older = re.match(r"^.*?\.\w+:\d+:(.+)$", text)
    if older:
        return older.group(1)
    text = re.sub(r" in \S+$", "", text)
    return re.sub(r"\+0x[0-9a-fA-F]+$", "", text)


def parse_log(text: str) -> dict:
    """A sanitizer log as ``{"summary": N or None, "errors": {kind | kernel: count},
    "api_errors": {error at call: count}, "headlines": [first 20 error lines]}``. Error blocks
    start with an unindented line after the ``=========`` prefix; their first ``at`` line names
    the kernel."""
    summary = None
    errors: Counter[str] = Counter()
    api: Counter[str] = Counter()
    headlines: list[str] = []
    block: str | None = None
    kernel: str | None = None

    def close() -> None:
        if block is not None:
            errors[f"{block} | {kernel or 'kernel not named'}"] += 1

    for raw in text.splitlines():
        if not raw.startswith(PREFIX):
            continue
        line = raw[len(PREFIX):]
        body = line.strip()
        found = SUMMARY.search(body)
        if found:
            close()
            block = None
            summary = int(found.group(1))
            continue
        if not body or body.startswith("COMPUTE-SANITIZER"):
            continue
        if not line.startswith("  "):  # a headline
            close()
            block, kernel = None, None
            hit = API_ERROR.search(body)
            if hit:
                api[f"{hit.group(1)} ({hit.group(2)}) at {hit.group(3)}"] += 1
            elif body.startswith(("Invalid ", "Uninitialized ", "Malloc", "Free", "Leaked", "Race", "Barrier",
                                  "Misaligned", "Out-of-range", "Cuda", "Error", "Unknown", "Hardware", "Stack")):
                block = SIZE.sub("", body)
            else:
                continue
            if len(headlines) < 20:
                headlines.append(body)
        elif block is not None and kernel is None and body.startswith("at "):
            kernel = kernel_of(body)
    close()
    return {"summary": summary, "errors": dict(errors), "api_errors": dict(api), "headlines": headlines}


# --- the driver (run under the sanitizer) -----------------------------------------------------------


def driver_spec():
    """Three decode rows beside a long request: regimes G, C and D (kpool 4)."""
    from harness.cases import LONG_CTX
    from harness.scenario import batch
    from mla_constants import TOPK

    return batch((LONG_CTX, 1), (5, 1), (TOPK, 1), kpool=DRIVER_KPOOL)


def driver(variant: str, device=None) -> dict:
    """One small case of ``variant`` through the production path on ``device`` (default the GPU
    tier's), NaN-filled outputs; the rows whose output is not finite."""
    import torch

    import harness.port.launch as launch
    from fast.impl import default_impl
    from harness.pipeline import prepare_step
    from harness.scenario import build_attention_inputs, build_scenario

    device = device or launch.DEVICE
    config = kernel_configs()[variant]
    impl = default_impl()
    scenario = build_scenario(config.apply(driver_spec()), DRIVER_SEED)
    step = prepare_step(impl, scenario, "compacted", device=device)
    inputs = build_attention_inputs(scenario, device)
    state = make_attention_state(impl, launch.attention_config(scenario, "compacted", step.max_rows), device)
    steps = launch.launch_inputs(impl, scenario, inputs, step.max_rows)
    out, lse = launch.nan_buffers(step.max_rows, config.num_heads, device)
    state.plan(step.num_planned, step.planned_lens)
    state.step(*steps.step_args(out, lse))
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    n = step.num_planned
    bad = (~torch.isfinite(out[:n].float()).flatten(1).all(dim=1) | ~torch.isfinite(lse[:n]).all(dim=1))
    return {"variant": variant, "rows": n, "regimes": scenario.row_regime[:n], "flashinfer": state.features.version,
            "nonfinite_rows": bad.nonzero().flatten().tolist()}


# --- running it ----------------------------------------------------------------------------------


def driver_env() -> dict:
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault(GPU_TIER_DEVICE_ENV, GPU_TIER_DEFAULT_DEVICE)
    return env


def run_one(sanitizer: str, tool: str, variant: str, timeout: float = RUN_TIMEOUT_S) -> dict:
    """One tool on one variant: the parsed log, the driver's result, the exit status and wall."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "sanitizer.log")
        cmd = [sanitizer, "--tool", tool, "--log-file", log, "--print-limit", "100",
               sys.executable, "-m", "scripts.sanitize", "--driver", variant]
        started = time.perf_counter()
        result = {"tool": tool, "variant": variant}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=driver_env())
            result.update(returncode=proc.returncode, stderr_tail=proc.stderr[-800:])
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            result["driver"] = json.loads(lines[-1][7:]) if lines else None
        except subprocess.TimeoutExpired:
            result.update(returncode=None, driver=None, stderr_tail=f"no end within {timeout:.0f} s")
        result["seconds"] = round(time.perf_counter() - started, 1)
        text = open(log).read() if os.path.exists(log) else ""
        result.update(parse_log(text))
    return result


def run_problems(result: dict) -> list[str]:
    """What is wrong with one run: errors reported, no error summary (it did not finish), the
    driver not finishing, or rows that are not finite."""
    where = f"{result['tool']} {result['variant']}"
    problems = []
    if result["summary"] is None:
        problems.append(f"{where}: no error summary (the run did not finish: {result.get('stderr_tail', '')[-300:]})")
    elif result["summary"]:
        kinds = "; ".join(f"{k} x{n}" for k, n in list(result["errors"].items())[:6])
        api = "; ".join(f"{k} x{n}" for k, n in result["api_errors"].items())
        problems.append(f"{where}: {result['summary']} errors: {kinds}" + (f"; API errors: {api}" if api else ""))
    driver_result = result.get("driver")
    if driver_result is None:
        problems.append(f"{where}: the driver did not finish (exit {result.get('returncode')})")
    elif driver_result["nonfinite_rows"]:
        problems.append(f"{where}: rows {driver_result['nonfinite_rows']} not finite")
    return problems


def run_all(
    sanitizer: str, tools=TOOLS, variants=None, parallel: int = 3, timeout: float = RUN_TIMEOUT_S
) -> list[dict]:
    variants = list(variants or kernel_configs())
    pairs = [(tool, variant) for tool in tools for variant in variants]
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        return list(pool.map(lambda pair: run_one(sanitizer, *pair, timeout=timeout), pairs))


def report_markdown(sanitizer: str, results: list[dict]) -> str:
    version = next((r["driver"]["flashinfer"] for r in results if r.get("driver")), None)
    lines = [
        f"## compute-sanitizer ({sanitizer}), FlashInfer {version}",
        "",
        f"3 decode rows (regimes G, C, D), kpool {DRIVER_KPOOL}, H {DRIVER_HEADS}, compacted layout, "
        "caching allocator off.",
        "",
        "| tool | variant | errors | kinds (kernel) | API errors | rows not finite | s |",
        "|---|---|---:|---|---|---|---:|",
    ]
    for r in results:
        kinds = "; ".join(f"{k} x{n}" for k, n in r["errors"].items()) or "-"
        api = "; ".join(f"{k} x{n}" for k, n in r["api_errors"].items()) or "-"
        rows = r["driver"]["nonfinite_rows"] if r.get("driver") else "driver did not finish"
        summary = "no summary" if r["summary"] is None else r["summary"]
        lines.append(f"| {r['tool']} | {r['variant']} | {summary} | {kinds.replace('|', '/')} | {api} | {rows} | "
                     f"{r['seconds']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--driver", help="run one variant's case (what the sanitizer launches)")
    parser.add_argument("--tools", nargs="+", default=list(TOOLS), choices=TOOLS)
    parser.add_argument("--variants", nargs="+", help="default: every kernel variant")
    parser.add_argument("--out", type=Path, default=Path("out/sanitize"))
    parser.add_argument("--timeout-s", type=float, default=RUN_TIMEOUT_S)
    parser.add_argument("--parallel", type=int, default=3)
    args = parser.parse_args(argv)
    if args.driver:
        print("RESULT " + json.dumps(driver(args.driver)), flush=True)
        return 0
    sanitizer = find_sanitizer()
    if sanitizer is None:
        print(not_found_reason())
        return 2
    results = run_all(sanitizer, args.tools, args.variants, args.parallel, args.timeout_s)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sanitize.json").write_text(json.dumps({"sanitizer": sanitizer, "runs": results}, indent=1))
    text = report_markdown(sanitizer, results)
    (args.out / "sanitize.md").write_text(text)
    print(text)
    problems = [p for r in results for p in run_problems(r)]
    print("\n".join(problems) if problems else "no errors")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
