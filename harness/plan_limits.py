"""The largest plan a FlashInfer release accepts, and whether the rows of plans at that size are
right (docs/edges.md#plan-limits).

Every plan here is the production shape at its simplest: N query rows, each its own request
(page size 1), each reading ``width`` slots (2048: a full top-k row), H heads, bf16 q and KV,
rope 64, through the compatibility layer's ``MLAWrapper`` with reserved buffers sized for N.

- :func:`search_largest` grows N by doubling from 1 and then bisects between the last N that
  succeeded and the first that did not. It is pure: it calls an ``attempt(n)`` it is given.
- An attempt runs in a child process (``python3 -m harness.plan_limits``), so a crash (a CUDA
  error, an abort, a hang) stays there and the search goes on. plan() alone launches no kernel,
  so plan attempts share one child (:class:`PlanWorker`), replaced after any attempt that did
  not end cleanly; each rows attempt (plan, run, every row against its references) gets a
  fresh child.
- A refusal is an outcome (the exception's type and message); a plan that is accepted and then
  gives a wrong row without an error is a finding.

FlashInfer's fa3 MLA scheduler (``MLAPlan`` in ``scheduler.cuh``) sizes its per-work-item
arrays for :data:`FA3_WORK_CAPACITY` work items. A query row that is its own request and reads
at most the scheduler's KV chunk is one work item, so from a few hundred rows on a plan of N
rows has N work items (:func:`fa3_work_items` counts them). Releases whose plan() counts them
first refuse larger plans; a release that does not writes the arrays past their end.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable

from fast.flashinfer_compat import FA3_WORK_CAPACITY
from mla_constants import DEEPSEEK_V32_SM_SCALE, TOPK

#: Slots each row of a limit plan reads: one full top-k row.
PLAN_WIDTH = TOPK
#: The largest N whose kv_indptr (N * width) still fits int32.
INT32_ROWS_BOUND = (2**31 - 1) // PLAN_WIDTH
DEFAULT_HEADS = (16, 128)
PLAN_TIMEOUT_S = 240.0  # the first plan of a fresh JIT cache builds the kernel module
ROWS_TIMEOUT_S = 300.0
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- the scheduler's work items -------------------------------------------------------------------


def _scheduler_chunk(average: int) -> int:
    """The KV chunk length the fa3 MLA scheduler splits rows at, from the average KV length per
    cluster (its rounding steps: 32, 64, 128, 192, then multiples of 256)."""
    for limit, chunk in ((8, 32), (16, 64), (32, 128), (64, 192)):
        if average <= limit:
            return chunk
    return -(-average // 256) * 256


def fa3_work_items(q_lens, kv_lens, num_heads: int, num_sm: int) -> int:
    """Work items the fa3 MLA scheduler makes for a non-causal plan: every request's packed query
    (q_len x heads) in tiles of 64 rows per CTA (2 CTAs per cluster when the average packed
    query exceeds 64), every tile's KV in chunks of the scheduler's length (at least one item,
    an empty KV included). ``kv_lens`` counts every request of the plan (padded rows too)."""
    q_lens, kv_lens = list(q_lens), list(kv_lens)
    if not kv_lens:
        return 0
    cluster = 2 if sum(q_lens) * num_heads // len(kv_lens) > 64 else 1
    clusters = num_sm // cluster
    tile = 64 * cluster
    tiles = [-(-q * num_heads // tile) for q in q_lens]
    total = sum(t * kv for t, kv in zip(tiles, kv_lens))
    chunk = _scheduler_chunk(max(-(-total // clusters), 1))
    return sum(t * max(1, -(-kv // chunk)) for t, kv in zip(tiles, kv_lens))


def exceeds_work_capacity(rows: int) -> bool:
    """Whether a plan of ``rows`` query rows with at least one work item each (any row with a
    query, at any SM count) is beyond the scheduler's capacity."""
    return rows > FA3_WORK_CAPACITY


# --- outcomes and the search ---------------------------------------------------------------------


@dataclass
class Attempt:
    """One attempt: ``kind`` plan or rows, ``outcome`` accepted / refused / crashed / timeout
    (plan) or right / wrong / refused / run-error / crashed / timeout / not-run (rows)."""

    kind: str
    rows: int
    heads: int
    outcome: str
    detail: str = ""
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.outcome in ("accepted", "right")

    def line(self) -> str:
        text = f"{self.kind} N={self.rows} H={self.heads}: {self.outcome}"
        return text + (f" ({self.detail})" if self.detail else "")


@dataclass
class Search:
    """What :func:`search_largest` found: the largest N that succeeded (0: none), the first N
    above it that did not (None when the bound was reached), and every attempt in order."""

    largest_ok: int
    first_failing: Attempt | None
    bound: int
    attempts: list[Attempt]

    @property
    def reached_bound(self) -> bool:
        return self.first_failing is None

    def to_dict(self) -> dict:
        return {"largest_ok": self.largest_ok, "bound": self.bound, "reached_bound": self.reached_bound,
                "first_failing": asdict(self.first_failing) if self.first_failing else None,
                "attempts": [asdict(a) for a in self.attempts]}


def search_largest(attempt: Callable[[int], Attempt], *, bound: int, start: int = 1) -> Search:
    """Grow N from ``start`` by doubling (capped at ``bound``) while attempts succeed, then
    bisect between the last success (0 when ``start`` itself fails) and the first failure, to the
    exact N. Assumes success is monotone in N; every attempt is kept, so a report shows what was
    tried."""
    if not 1 <= start <= bound:
        raise ValueError(f"need 1 <= start <= bound, got start={start}, bound={bound}")
    attempts: list[Attempt] = []
    tried: dict[int, Attempt] = {}

    def succeeds(n: int) -> bool:
        result = attempt(n)
        attempts.append(result)
        tried[n] = result
        return result.ok

    good, bad, n = 0, None, start
    while True:
        if not succeeds(n):
            bad = n
            break
        good = n
        if n >= bound:
            break
        n = min(2 * n, bound)
    if bad is None:
        return Search(good, None, bound, attempts)
    while bad - good > 1:
        mid = (good + bad) // 2
        if succeeds(mid):
            good = mid
        else:
            bad = mid
    return Search(good, tried[bad], bound, attempts)


# --- the child process ---------------------------------------------------------------------------


def _exception_text(exc: BaseException, limit: int = 600) -> str:
    return f"{type(exc).__name__}: {str(exc)[:limit]}"


#: Exceptions a refusal may raise and leave the process healthy (host-side checks).
HEALTHY_REFUSALS = (ValueError, TypeError, NotImplementedError)


def _refusal(exc: BaseException) -> dict:
    """A refusal as a result: the exception's text, its class and base classes, and whether it
    leaves the process healthy (:data:`HEALTHY_REFUSALS`)."""
    types = [c.__name__ for c in type(exc).__mro__ if c not in (BaseException, object)]
    return {"outcome": "refused", "detail": _exception_text(exc), "exception_types": types,
            "healthy": isinstance(exc, HEALTHY_REFUSALS)}


def _limit_plan(n: int, heads: int, width: int, device, features=None):
    """A wrapper with reserved buffers for ``n`` rows and the host arrays of its plan (each row
    its own request reading ``width`` slots); returns ``(wrapper, plan_kwargs, kv_indices)``."""
    import torch

    from fast.flashinfer_compat import MLAWrapper
    from fast.sm90 import WORKSPACE_BYTES
    from mla_constants import KV_LORA_RANK, ROPE_DIM

    i32 = dict(dtype=torch.int32)
    kv_indices = torch.zeros(n * width, device=device, **i32)
    wrapper = MLAWrapper(
        torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device),
        qo_indptr=torch.zeros(n + 1, device=device, **i32), kv_indptr=torch.zeros(n + 1, device=device, **i32),
        kv_indices=kv_indices, kv_len_arr=torch.zeros(n, device=device, **i32), features=features,
    )
    plan = dict(
        qo_indptr=torch.arange(n + 1, **i32), kv_indptr=torch.arange(n + 1, **i32) * width, kv_indices=kv_indices,
        kv_len_arr=torch.full((n,), width, **i32), num_heads=heads, head_dim_ckv=KV_LORA_RANK, head_dim_kpe=ROPE_DIM,
        sm_scale=DEEPSEEK_V32_SM_SCALE, kv_dtype=torch.bfloat16,
    )
    return wrapper, plan, kv_indices


def plan_attempt(n: int, heads: int, width: int = PLAN_WIDTH, device: str = "cuda") -> dict:
    """In the child: plan ``n`` rows (nothing launched); accepted, or refused with the exception."""
    import torch

    start = time.perf_counter()
    result = {"kind": "plan", "rows": n, "heads": heads, "outcome": "accepted", "detail": ""}
    on_cuda = torch.device(device).type == "cuda"
    try:
        wrapper, plan, _ = _limit_plan(n, heads, width, device)
        wrapper.plan(**plan)
        if on_cuda:
            torch.cuda.synchronize()
        del wrapper, plan
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        result.update(_refusal(exc))
    if on_cuda:
        torch.cuda.empty_cache()
    result["seconds"] = time.perf_counter() - start
    return result


def rows_bytes(n: int, heads: int, width: int = PLAN_WIDTH) -> int:
    """Device bytes a rows attempt holds besides the references' chunk: q, out, lse, the slots
    (the kernel's int32 indices and the judge's copy) and the selection mask."""
    return n * (heads * (576 * 2 + 512 * 2 + 4) + width * (4 + 4 + 1))


POOL_SLOTS = 1 << 16  # KV slots the rows of a rows attempt draw from


def rows_attempt(n: int, heads: int, width: int = PLAN_WIDTH, device: str = "cuda", seed: int = 0,
                 emit=print) -> dict:
    """In the child: plan ``n`` rows, run them, and judge every row against the float64 truth
    and the yardstick (:func:`harness.row_check.judge_rows`). ``emit`` gets a JSON line per
    stage reached, so a parent knows where a child that died was."""
    import torch

    from harness.launch import nan_buffers
    from harness.row_check import judge_rows
    from harness.scenario import component_seed, query_rows, slot_values_on

    result = {"kind": "rows", "rows": n, "heads": heads, "outcome": "", "detail": "", "stage": "start"}
    start = time.perf_counter()

    def reached(stage: str) -> None:
        result["stage"] = stage
        emit("STAGE " + json.dumps({"stage": stage, "seconds": round(time.perf_counter() - start, 3)}))

    on_cuda = torch.device(device).type == "cuda"
    free = torch.cuda.mem_get_info()[0] if on_cuda else float("inf")
    needed = rows_bytes(n, heads, width) + (6 << 30)
    if needed > 0.9 * free:
        result.update(outcome="not-run", detail=f"needs about {needed / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
        return result
    reached("inputs")
    gen = torch.Generator(device=device).manual_seed(component_seed(seed, f"limit-slots-{n}") & 0x7FFFFFFF)
    wrapper, plan, kv_indices = _limit_plan(n, heads, width, device)
    kv_indices.copy_(torch.randint(0, POOL_SLOTS, (n * width,), generator=gen, device=device, dtype=torch.int32))
    q = query_rows(component_seed(seed, "limit-q"), torch.arange(n), heads, 576, device)
    pool = slot_values_on(component_seed(seed, "limit-kv"), torch.arange(POOL_SLOTS, device=device), 576,
                          torch.bfloat16)
    ckv, kpe = pool.view(-1, 1, 576)[..., :512], pool.view(-1, 1, 576)[..., 512:]  # the kernel's [N, 1, D] views
    out, lse = nan_buffers(n, heads, device)
    try:
        reached("plan")
        wrapper.plan(**plan)
    except Exception as exc:  # noqa: BLE001
        result.update(_refusal(exc))
        return result
    try:
        reached("run")
        wrapper.run(q[..., :512], q[..., 512:], ckv, kpe, out=out, lse=lse)
        if on_cuda:
            torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001
        result.update(outcome="run-error", detail=_exception_text(exc))
        return result
    reached("judge")
    slots = kv_indices.view(n, width)
    mask = torch.ones((n, width), dtype=torch.bool, device=device)
    report = judge_rows(out, lse, q[..., :512], q[..., 512:], pool[:, :512], pool[:, 512:], slots, mask,
                        sm_scale=DEEPSEEK_V32_SM_SCALE)
    summary = report.summary()
    nonfinite = int((~torch.isfinite(out.float()).flatten(1).all(dim=1) | ~torch.isfinite(lse).all(dim=1)).sum())
    result.update(summary=summary, nonfinite_rows=nonfinite, seconds=time.perf_counter() - start)
    if report.ok:
        result.update(outcome="right", detail=f"every row within budget (worst {summary['worst_ratio']:.2f}x)")
    else:
        result.update(outcome="wrong", detail=f"{summary['bad_rows']} of {n} rows beyond the budget, no error; "
                                              f"first {summary['first_bad']}; {nonfinite} rows not finite")
    reached("done")
    return result


def serve_plans(lines, emit=print) -> None:
    """In the child: one plan attempt per input line ``N H`` (width on the command line), one
    ``RESULT`` line each."""
    for line in lines:
        if not line.strip():
            continue
        n, heads, width = (int(x) for x in line.split())
        emit("RESULT " + json.dumps(plan_attempt(n, heads, width)))


def child_main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="one child of the plan-limit search (see harness.plan_limits)")
    parser.add_argument("--serve-plans", action="store_true", help="plan attempts read from stdin, 'N H W' per line")
    parser.add_argument("--rows", type=int, help="a rows attempt of this many rows")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--width", type=int, default=PLAN_WIDTH)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    emit = lambda text: print(text, flush=True)  # noqa: E731
    if args.serve_plans:
        serve_plans(sys.stdin, emit)
        return 0
    if args.rows is None:
        parser.error("give --serve-plans or --rows N")
    emit("RESULT " + json.dumps(rows_attempt(args.rows, args.heads, args.width, seed=args.seed, emit=emit)))
    return 0


# --- the parent side -----------------------------------------------------------------------------


def child_env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")]))


def child_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "harness.plan_limits", *args]


def _result_attempt(payload: dict) -> Attempt:
    return Attempt(kind=payload["kind"], rows=payload["rows"], heads=payload["heads"], outcome=payload["outcome"],
                   detail=payload.get("detail", ""), seconds=payload.get("seconds", 0.0),
                   extra={k: v for k, v in payload.items() if k not in ("kind", "rows", "heads", "outcome", "detail",
                                                                        "seconds")})


def _died(kind: str, n: int, heads: int, returncode, stderr: str, stage: str | None, seconds: float) -> Attempt:
    where = f" at stage {stage}" if stage else ""
    tail = " | ".join(line.strip() for line in stderr.strip().splitlines()[-4:])[-600:]
    return Attempt(kind, n, heads, "crashed", f"child exited with {returncode}{where}: {tail}", seconds,
                   {"returncode": returncode, "stage": stage})


class PlanWorker:
    """One child that makes plan attempts in turn; replaced after an attempt that crashed, timed
    out or raised anything but :data:`HEALTHY_REFUSALS` (host-side checks, which leave the process
    healthy), so no attempt runs in a process an earlier one may have damaged."""

    def __init__(self, width: int = PLAN_WIDTH, timeout: float = PLAN_TIMEOUT_S, command=None):
        self.width = width
        self.timeout = timeout
        self.command = command or child_command("--serve-plans")
        self.proc = None
        self.lines: queue.Queue | None = None
        self.stderr = None
        self.started = 0  # children started

    def _start(self) -> None:
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     text=True, cwd=REPO_ROOT, env=child_env(), bufsize=1)
        self.lines = queue.Queue()
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines), daemon=True).start()
        self.started += 1

    @staticmethod
    def _pump(stream, lines: queue.Queue) -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)  # end of output: the child exited

    def _stderr_text(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.stderr.close()
            self.proc = None

    def attempt(self, n: int, heads: int) -> Attempt:
        if self.proc is None:
            self._start()
        start = time.perf_counter()
        try:
            self.proc.stdin.write(f"{n} {heads} {self.width}\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # reported below as a crash
        deadline = start + self.timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                self.stop()
                return Attempt("plan", n, heads, "timeout", f"no answer within {self.timeout:.0f} s",
                               time.perf_counter() - start)
            if line is None:
                self.proc.wait()
                result = _died("plan", n, heads, self.proc.returncode, self._stderr_text(), "plan",
                               time.perf_counter() - start)
                self.stop()
                return result
            if line.startswith("RESULT "):
                result = _result_attempt(json.loads(line[len("RESULT "):]))
                if not result.ok and not result.extra.get("healthy"):
                    self.stop()
                return result

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def run_rows_attempt(n: int, heads: int, width: int = PLAN_WIDTH, seed: int = 0, timeout: float = ROWS_TIMEOUT_S,
                     command=None) -> Attempt:
    """A rows attempt in a fresh child: its RESULT, or how the child died (with the last stage
    it reached and its stderr tail), or a timeout."""
    cmd = command or child_command("--rows", str(n), "--heads", str(heads), "--width", str(width), "--seed", str(seed))
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT, env=child_env())
    except subprocess.TimeoutExpired as exc:
        return Attempt("rows", n, heads, "timeout", f"no result within {timeout:.0f} s", time.perf_counter() - start,
                       {"stage": _last_stage(exc.stdout or "")})
    seconds = time.perf_counter() - start
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if results and proc.returncode == 0:
        return _result_attempt(json.loads(results[-1][len("RESULT "):]))
    return _died("rows", n, heads, proc.returncode, proc.stderr, _last_stage(proc.stdout), seconds)


def _last_stage(stdout) -> str | None:
    if isinstance(stdout, bytes):
        stdout = stdout.decode(errors="replace")
    stages = [json.loads(line[len("STAGE "):])["stage"] for line in stdout.splitlines() if line.startswith("STAGE ")]
    return stages[-1] if stages else None


# --- the whole study -----------------------------------------------------------------------------


def checked_sizes(search: Search) -> list[int]:
    """The plan sizes whose rows are checked: just below and at the limit, and just above it
    where the search found a failure there (above the bound nothing is known, nothing is tried)."""
    limit = search.largest_ok
    sizes = [n for n in (limit - 1, limit) if n >= 1]
    if search.first_failing is not None:
        sizes.append(search.first_failing.rows)
    return sizes


def study_heads(heads: int, *, bound: int, plan_attempt_fn, rows_attempt_fn, rows_search: bool = False,
                rows_search_start: int = 1024, rows_workers: int = 1) -> dict:
    """For one head count: the plan search, then every row of the plans just below, at and just
    above the limit (:func:`checked_sizes`; one that plan() did not accept is recorded as the
    search saw it), ``rows_workers`` children at once. With ``rows_search``, where a checked plan
    was accepted and its rows were not all right, the largest N whose rows are (growing from
    ``rows_search_start``, up to the smallest such plan)."""
    plans = search_largest(lambda n: plan_attempt_fn(n, heads), bound=bound)
    failed = plans.first_failing
    sizes = checked_sizes(plans)
    to_run = [n for n in sizes if failed is None or n != failed.rows]
    with ThreadPoolExecutor(max_workers=max(1, rows_workers)) as pool:
        ran = dict(zip(to_run, pool.map(lambda n: rows_attempt_fn(n, heads), to_run)))
    checks = [ran[n] if n in ran else failed for n in sizes]
    entry = {"heads": heads, "plan_search": plans.to_dict(), "row_checks": [asdict(c) for c in checks]}
    wrong = [c for c in checks if c.kind == "rows" and not c.ok and c.outcome != "not-run"]
    if rows_search and wrong:
        top = min(c.rows for c in wrong)
        entry["rows_search"] = search_largest(lambda n: rows_attempt_fn(n, heads), bound=top,
                                              start=min(rows_search_start, top)).to_dict()
    return entry


def study(heads_list=DEFAULT_HEADS, *, bound: int = INT32_ROWS_BOUND, rows_search: bool = False,
          plan_timeout: float = PLAN_TIMEOUT_S, rows_timeout: float = ROWS_TIMEOUT_S, rows_workers: int = 1) -> dict:
    """The plan limits of the FlashInfer installed here, for each head count (children on this
    machine's GPU)."""
    info = environment_info()
    entries = []
    with PlanWorker(timeout=plan_timeout) as worker:
        for heads in heads_list:
            started = time.perf_counter()
            entry = study_heads(heads, bound=bound, plan_attempt_fn=worker.attempt,
                                rows_attempt_fn=lambda n, h: run_rows_attempt(n, h, timeout=rows_timeout),
                                rows_search=rows_search, rows_workers=rows_workers)
            entry["seconds"] = round(time.perf_counter() - started, 1)
            entries.append(entry)
        info["plan_children"] = worker.started
    return {"schema": 1, **info, "width": PLAN_WIDTH, "bound": bound, "work_capacity": FA3_WORK_CAPACITY,
            "results": entries}


def environment_info() -> dict:
    """FlashInfer version and the GPU, asked of a child (this process stays off CUDA)."""
    code = ("import json, torch\n"
            "from recording.environment import flashinfer_version\n"
            "p = torch.cuda.get_device_properties(0)\n"
            "print(json.dumps({'flashinfer': flashinfer_version(), 'torch': torch.__version__, "
            "'device': p.name, 'num_sm': p.multi_processor_count}))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, env=child_env(),
                          timeout=120)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {"flashinfer": None, "environment_error": proc.stderr[-400:]}


# --- the report ----------------------------------------------------------------------------------


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
            f"N={c['rows']} and then " + ("gave wrong rows without an error" if c["outcome"] == "wrong" else c["outcome"])
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
        "| H | largest accepted plan | first refused | rows at limit-1, limit, limit+1 | largest plan with every row right | what it shows |",
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


if __name__ == "__main__":
    sys.exit(child_main())
