"""The replay journeys on a GPU runner: a failing GPU case, its dump, its replay under the bug and
its replay once fixed, for the three kinds of failure docs/replay.md names.

    python3 scripts/gpu_journeys.py [--out DIR] [--workers N] [--vllm SLICE]

Each journey runs some GPU tests with a re-created bug (``tests/bugs.py``) and
``--dump-failures``, then ``--replay`` of what was written with the bug (it must fail) and
without it (it must pass):

- ``plan``: ``ContextIsPosition`` (a kv_len rule off by one): single-step backend cases of the
  port (``*.case.json``, the main tier runs the port behind the seam);
- ``kernel-input``: ``QPeHeadsRolled`` (the kernel handed q_pe with its heads rolled): backend
  cases of the port, run again on the installed FlashInfer on replay;
- ``stateful``: ``StaleLengthsPastTheRowCount`` (an attention state keeping the lengths of a
  larger step): sequence files, replayed through one attention state.

With ``--vllm SLICE`` (a folder holding a vLLM release's ``vllm/``, vLLM 0.33.0's lines), three
journeys more through vLLM's own backend, each with a bug of ``scripts/vllm_planted_bugs.py``
planted in a copy of the release's SM90 module: ``vllm-kept-plan``, ``vllm-clamp`` and
``vllm-host-lengths``. Their tests run with ``--vllm`` naming the copy, the dump writes backend
cases (``*.case.json``: single steps and sequences), the replay under the bug names the copy and
the replay once fixed names SLICE.

Logs go to DIR (default ``out/gpu-journeys``); the table is printed last. Exit status 1 when a
journey did not go as it should (nothing written, a replay that passed under the bug or failed
without it).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.vllm_planted_bugs import BUGS, planted_copy  # noqa: E402


@dataclass(frozen=True)
class Journey:
    name: str
    bug: str
    tests: tuple[str, ...]  # pytest arguments selecting the GPU tests
    written: tuple[str, ...]  # globs of what the dump may write
    vllm: bool = False  # the bug is planted in a copy of a vLLM release's module, not an --impl


JOURNEYS = (
    Journey("plan", "ContextIsPosition",
            ("tests/gpu/test_attention_regimes.py", "-k", "test_kernel_matches and compacted and ctx2049"),
            ("*.case.json", "*.safetensors", "*.recipe.json")),
    Journey("kernel-input", "QPeHeadsRolled",
            ("tests/gpu/test_attention_regimes.py", "-k", "test_kernel_matches and compacted and (ctx1- or ctx2049)"),
            ("*.case.json", "*.safetensors", "*.recipe.json")),
    Journey("stateful", "StaleLengthsPastTheRowCount",
            # less the graph case at 128 heads: there the project's own path shows FlashInfer's standing
            # finding (docs/findings.md#graph-replay-with-stale-plan-state), fixed bug or not
            ("tests/gpu/test_edges.py", "tests/gpu/test_cuda_graphs.py", "-k",
             "test_previous_steps_slots_change_nothing or (test_capture_once_replan_and_replay and not h128)"),
            ("*.sequence.json",)),
)


#: The vLLM tests each planted bug fails: the sequences (a kept plan shows only there) and single steps.
VLLM_TESTS = ("tests/gpu/test_vllm_sm90.py", "-k",
              "test_sequence_on_flashinfer or (test_step_on_flashinfer and decode-mixed-lengths-kpool4)")
VLLM_JOURNEYS = tuple(Journey(f"vllm-{bug.name}", bug.name, VLLM_TESTS, ("*.case.json",), vllm=True) for bug in BUGS)


def pytest_run(args: list[str], log: Path) -> tuple[int, float]:
    started = time.perf_counter()
    with log.open("w") as f:
        f.write("$ pytest " + " ".join(args) + "\n")
        f.flush()
        rc = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                            check=False).returncode
    return rc, time.perf_counter() - started


def usage_error(log: Path) -> str:
    """The one line pytest's usage error printed in ``log`` (``ERROR: ...``), the log's path where none."""
    lines = [line.removeprefix("ERROR: ") for line in log.read_text(errors="replace").splitlines()
             if line.startswith("ERROR: ")]
    return lines[0] if lines else f"pytest's usage error (log: {log})"


def run_journey(journey: Journey, out: Path, workers: str, vllm: Path | None = None) -> dict:
    dump = out / journey.name / "dumps"
    dump.mkdir(parents=True, exist_ok=True)
    if journey.vllm:
        bugged = planted_copy(vllm, out / journey.name / "vllm-planted", next(b for b in BUGS if b.name == journey.bug))
        if bugged is None:
            return {"journey": journey.name, "bug": journey.bug, "found": "-", "written": 0, "with the bug": "-",
                    "fixed": "-", "seconds": 0, "status": f"NOT RUN: {vllm} does not hold the line the bug changes"}
        with_bug, fixed = [f"--vllm={bugged}"], [f"--vllm={vllm}"]
    else:
        with_bug, fixed = [f"--impl=tests.bugs:{journey.bug}"], []
    found_log = out / journey.name / "1-found.log"
    found_rc, found_s = pytest_run([*journey.tests, "-n", workers, *with_bug, f"--dump-failures={dump}", "-q",
                                    "--require-gpu-tier"], found_log)
    if found_rc == 4:  # a usage error: the GPU tier cannot run here, or the options are wrong
        return {"journey": journey.name, "bug": journey.bug, "found": found_rc, "written": 0, "with the bug": "-",
                "fixed": "-", "seconds": round(found_s), "status": f"NOT RUN: {usage_error(found_log)}"}
    files = sorted(p for pattern in journey.written for p in dump.glob(pattern))
    red_rc, red_s = pytest_run(["tests/test_replay.py", f"--replay={dump}", *with_bug, "-q", "-p", "no:xdist"],
                               out / journey.name / "2-replay-with-the-bug.log")
    green_rc, green_s = pytest_run(["tests/test_replay.py", f"--replay={dump}", *fixed, "-q", "-p", "no:xdist"],
                                   out / journey.name / "3-replay-fixed.log")
    ok = found_rc == 1 and bool(files) and red_rc == 1 and green_rc == 0
    return {"journey": journey.name, "bug": journey.bug, "found": found_rc, "written": len(files),
            "with the bug": red_rc, "fixed": green_rc, "seconds": round(found_s + red_s + green_s),
            "status": "ok" if ok else "NOT AS IT SHOULD BE"}


def table(rows: list[dict]) -> str:
    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(r[k]) for k in head) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "out" / "gpu-journeys"))
    parser.add_argument("--workers", default="auto", help="xdist workers of the finding runs")
    parser.add_argument("--vllm", default=None, help="a folder holding vLLM 0.33.0's vllm/: its journeys run too")
    parser.add_argument("--only-vllm", action="store_true", help="with --vllm, only vLLM's journeys")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    journeys = () if args.only_vllm else JOURNEYS
    if args.vllm:
        journeys += VLLM_JOURNEYS
    rows = []
    for journey in journeys:  # each journey's row as it ends: a run cut short still shows those done
        rows.append(run_journey(journey, out, args.workers, Path(args.vllm).resolve() if args.vllm else None))
        print(" ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    text = table(rows)
    (out / "table.md").write_text(text + "\n")
    print(text)
    print("exit codes: found 1 (the bug fails its tests), with the bug 1 (the replay fails), fixed 0 (it passes)")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
