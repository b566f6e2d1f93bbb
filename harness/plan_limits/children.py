"""The parent side of the plan-limit search: the children that make attempts
(:mod:`harness.port.plan_limits_child`), how each ended (its result, or how it died, with the last
stage it reached), and time limits. plan() alone launches no kernel, so plan attempts share one
child (:class:`PlanWorker`), replaced after any attempt that did not end cleanly; each rows
attempt gets a fresh child (:func:`run_rows_attempt`), or one started ahead that waits for its
size (:class:`WarmRowsChildren`)."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time

from ..memory_retry import out_of_gpu_memory, retried_when_out_of_gpu_memory, retries_note
from .search import PLAN_WIDTH, Attempt

PLAN_TIMEOUT_S = 240.0  # the first plan of a fresh JIT cache builds the kernel module
ROWS_TIMEOUT_S = 300.0
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child_env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")]))


def child_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "harness.port.plan_limits_child", *args]


def _result_attempt(payload: dict) -> Attempt:
    return Attempt(kind=payload["kind"], rows=payload["rows"], heads=payload["heads"], outcome=payload["outcome"],
                   detail=payload.get("detail", ""), seconds=payload.get("seconds", 0.0),
                   extra={k: v for k, v in payload.items() if k not in ("kind", "rows", "heads", "outcome", "detail",
                                                                        "seconds")})


def _died(kind: str, n: int, heads: int, returncode, stderr: str, stage: str | None, seconds: float) -> Attempt:
    where = f" at stage {stage}" if stage else ""
    tail = " | ".join(line.strip() for line in stderr.strip().splitlines()[-4:])[-600:]
    return Attempt(kind, n, heads, "crashed", f"child exited with {returncode}{where}: {tail}", seconds,
                   {"returncode": returncode, "stage": stage, "out_of_gpu_memory": out_of_gpu_memory(stderr)})


def _with_memory_retries(run) -> Attempt:
    """A rows attempt (``run()``: one fresh child each time), made again where it ran out of GPU
    memory (:mod:`harness.memory_retry`); the retries are named in its detail."""
    attempt, made_again = retried_when_out_of_gpu_memory(run, lambda a: bool(a.extra.get("out_of_gpu_memory")))
    if made_again:
        attempt.extra["memory_retries"] = made_again
        attempt.detail += retries_note(made_again)
    return attempt


class PlanWorker:
    """One child that makes plan attempts in turn; replaced after an attempt that crashed, timed
    out or raised anything but :data:`harness.port.plan_limits_child.HEALTHY_REFUSALS` (host-side
    checks, which leave the process healthy), so no attempt runs in a process an earlier one may
    have damaged."""

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

    def once() -> Attempt:
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT, env=child_env())
        except subprocess.TimeoutExpired as exc:
            return _rows_timeout(n, heads, timeout, start, exc.stdout)
        return _rows_outcome(n, heads, proc.returncode, proc.stdout, proc.stderr, start)

    return _with_memory_retries(once)


class WarmRowsChildren:
    """Rows children started before their sizes are known: each imports torch and FlashInfer
    and starts CUDA while the plan search runs, then makes one rows attempt, its size read from
    stdin (``--rows-from-stdin``), and exits. Each attempt still gets a process no earlier
    attempt ran in; one asked for when none is left waiting is started then."""

    def __init__(self, count: int, command=None):
        self.command = command or child_command("--rows-from-stdin")
        self.lock = threading.Lock()
        self.waiting = [self._start() for _ in range(count)]

    def _start(self) -> subprocess.Popen:
        return subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=REPO_ROOT, env=child_env())

    def attempt(self, n: int, heads: int, width: int = PLAN_WIDTH, seed: int = 0,
                timeout: float = ROWS_TIMEOUT_S) -> Attempt:
        """:func:`run_rows_attempt` in a waiting child (made again in fresh ones where it ran out
        of GPU memory); ``timeout`` counts from each start."""

        def once() -> Attempt:
            with self.lock:
                proc = self.waiting.pop(0) if self.waiting else self._start()
            start = time.perf_counter()
            try:
                stdout, stderr = proc.communicate(f"{n} {heads} {width} {seed}\n", timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, _ = proc.communicate()
                return _rows_timeout(n, heads, timeout, start, stdout)
            return _rows_outcome(n, heads, proc.returncode, stdout, stderr, start)

        return _with_memory_retries(once)

    def close(self) -> None:
        with self.lock:
            waiting, self.waiting = self.waiting, []
        for proc in waiting:
            proc.kill()
            proc.communicate()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _rows_timeout(n: int, heads: int, timeout: float, start: float, stdout) -> Attempt:
    return Attempt("rows", n, heads, "timeout", f"no result within {timeout:.0f} s", time.perf_counter() - start,
                   {"stage": _last_stage(stdout or "")})


def _rows_outcome(n: int, heads: int, returncode, stdout: str, stderr: str, start: float) -> Attempt:
    """A finished rows child: its RESULT, or how it died."""
    results = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if results and returncode == 0:
        return _result_attempt(json.loads(results[-1][len("RESULT "):]))
    return _died("rows", n, heads, returncode, stderr, _last_stage(stdout), time.perf_counter() - start)


def _last_stage(stdout) -> str | None:
    if isinstance(stdout, bytes):
        stdout = stdout.decode(errors="replace")
    stages = [json.loads(line[len("STAGE "):])["stage"] for line in stdout.splitlines() if line.startswith("STAGE ")]
    return stages[-1] if stages else None
