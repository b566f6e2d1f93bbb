"""Timers and the two measured ceilings.

Device work is timed with CUDA events, one pair per repetition, after a warm-up. Before the
timed repetitions the stream is held by a sleep kernel long enough for the host to enqueue
all of them, so that host-side launch overhead (FlashInfer's Python checks in ``run``) does
not leak into the device times; the events then measure back-to-back device execution. The
caller rotates its inputs by the repetition index. Without CUDA the same calls fall back to
``time.perf_counter`` (the CPU smoke run).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

MAX_BACKLOG_S = 0.25


def summarize(samples: list[float]) -> dict[str, float | int]:
    """Median, 10th and 90th percentile and minimum (seconds) of the samples."""
    xs = sorted(samples)
    if not xs:
        raise ValueError("no samples")
    pick = lambda q: xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]  # noqa: E731
    return {"median_s": statistics.median(xs), "p10_s": pick(0.1), "p90_s": pick(0.9), "min_s": xs[0], "reps": len(xs)}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timer:
    """Times ``fn(i)`` for i = 0..reps-1 on one device."""

    device: torch.device
    sleep_cycles_per_s: float | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def calibrate(self, rounds: int = 3) -> None:
        """Measure the rate of ``torch.cuda._sleep`` (cycles per second) for the backlog; the
        highest of a few rounds (clocks ramp up under load: a higher rate errs on the long side)."""
        if not self.cuda or not hasattr(torch.cuda, "_sleep"):
            return
        cycles = 20_000_000
        rates = []
        for _ in range(rounds):
            synchronize(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            synchronize(self.device)
            elapsed = start.elapsed_time(end) / 1e3
            if elapsed > 0:
                rates.append(cycles / elapsed)
        self.sleep_cycles_per_s = max(rates) if rates else None

    def backlog(self, seconds: float) -> bool:
        """Hold the stream busy for about ``seconds`` (capped); False when not possible."""
        if not self.sleep_cycles_per_s or seconds <= 0:
            return False
        torch.cuda._sleep(int(min(seconds, MAX_BACKLOG_S) * self.sleep_cycles_per_s))
        return True

    def device_times(self, fn, reps: int, *, warmup: int = 3) -> tuple[list[float], dict]:
        """Per-repetition device times (s) of ``fn(i)``, and how they were taken."""
        host = []
        for i in range(warmup):
            t0 = time.perf_counter()
            fn(i)
            host.append(time.perf_counter() - t0)
        synchronize(self.device)
        if not self.cuda:
            return self.wall_times(fn, reps, warmup=0), {"timer": "perf_counter"}
        enqueue_s = min(host) if host else 0.0
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        backlogged = self.backlog(2.0 * enqueue_s * reps + 5e-3)
        for i, (start, end) in enumerate(events):
            start.record()
            fn(i)
            end.record()
        synchronize(self.device)
        times = [start.elapsed_time(end) / 1e3 for start, end in events]
        return times, {"timer": "cuda-events", "backlog": backlogged, "host_enqueue_s": enqueue_s}

    def host_times(self, fn, reps: int, *, warmup: int = 1) -> list[float]:
        """Host time until each ``fn(i)`` returns, the device idle when it is called (work it
        leaves queued is not counted; a synchronize inside it is)."""
        return self._perf_counter_times(fn, reps, warmup, wait_for_device=False)

    def wall_times(self, fn, reps: int, *, warmup: int = 1) -> list[float]:
        """Wall time of each ``fn(i)`` until the device has finished its work."""
        return self._perf_counter_times(fn, reps, warmup, wait_for_device=True)

    def _perf_counter_times(self, fn, reps: int, warmup: int, wait_for_device: bool) -> list[float]:
        for i in range(warmup):
            fn(i)
        out = []
        for i in range(reps):
            synchronize(self.device)
            t0 = time.perf_counter()
            fn(i)
            if wait_for_device:
                synchronize(self.device)
            out.append(time.perf_counter() - t0)
        synchronize(self.device)
        return out

    def throughput(self, fn, reps: int) -> float:
        """Wall seconds per call of ``reps`` back-to-back calls (one synchronize at the end)."""
        synchronize(self.device)
        t0 = time.perf_counter()
        for i in range(reps):
            fn(i)
        synchronize(self.device)
        return (time.perf_counter() - t0) / reps


def estimate_seconds(fn, device: torch.device, calls: int = 2) -> float:
    """Rough wall time of one call (after one untimed call), device synchronized."""
    fn(0)
    synchronize(device)
    t0 = time.perf_counter()
    for i in range(calls):
        fn(i)
    synchronize(device)
    return (time.perf_counter() - t0) / calls


# --- ceilings ------------------------------------------------------------------------------


def copy_ceiling(timer: Timer, nbytes: int, reps: int) -> dict:
    """Device-to-device copy rate, counting bytes read plus bytes written."""
    dev = timer.device
    src = torch.randn(nbytes // 4, device=dev)
    dst = torch.empty_like(src)
    times, how = timer.device_times(lambda i: dst.copy_(src), reps)
    s = summarize(times)
    moved = 2 * src.numel() * src.element_size()
    return {"bytes_moved": moved, "bytes_per_s": moved / s["median_s"], **s, **how}


def matmul_ceiling(timer: Timer, n: int, reps: int, dtype: torch.dtype) -> dict:
    """Matrix product rate on random ``n x n`` operands (2 n^3 FLOPs per product)."""
    dev = timer.device
    g = torch.Generator(device=dev).manual_seed(7)
    a = torch.randn(n, n, device=dev, generator=g).to(dtype)
    b = torch.randn(n, n, device=dev, generator=g).to(dtype)
    c = torch.empty(n, n, device=dev, dtype=dtype)
    times, how = timer.device_times(lambda i: torch.matmul(a, b, out=c), reps)
    s = summarize(times)
    flops = 2 * n**3
    return {
        "n": n,
        "dtype": str(dtype).replace("torch.", ""),
        "flops": flops,
        "flops_per_s": flops / s["median_s"],
        **s,
        **how,
    }
