"""Where the reference oracle spends its time at one shape: wall time, the host time to enqueue
a call, the process's CPU time, peak extra memory and the top device kernels (torch.profiler).

    python3 -m bench.reference_profile --rows 256 --heads 128 --mode float32
    python3 -m bench.reference_profile --rows 4 --heads 4 --topk 64     # any device, tiny
    python3 -m bench.reference_profile --rows 66 --heads 16 --topk 2176 --mode float64 --cpu-chunk-mib 1024

Inputs are the benchmark's (decode rows, each selecting topk slots of its own, bf16-rope64, the
cache and q as the kernel holds them). The wall time is the median over repetitions of a call
followed by a synchronisation; "host" is the time until the call returns, which on a GPU is the
host's share (the call synchronises once, for its input checks, before any work is queued).
On a CPU the CPU time (all threads) is what a call costs a test worker that shares the cores
with others; ``--cpu-chunk-mib`` sets the oracle's cap on a chunk there (``CPU_CHUNK_BYTES``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fast.impl import default_impl
from harness.timing import synchronize
from reference import oracle_fast
from reference.oracle import COMPUTE_MODES, DEFAULT_MEMORY_BUDGET_BYTES, sparse_mla_reference

from .reference_section import decode_reference_problem, peak_extra_bytes


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m bench.reference_profile", description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--mode", choices=COMPUTE_MODES, default="float32")
    p.add_argument("--budget-gib", type=float, default=DEFAULT_MEMORY_BUDGET_BYTES / (1 << 30),
                   help="memory_budget_bytes of the call, in GiB")
    p.add_argument("--cpu-chunk-mib", type=int, default=oracle_fast.CPU_CHUNK_BYTES >> 20,
                   help="the oracle's cap on one chunk on a CPU, in MiB")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--kernels", type=int, default=12, help="how many device kernels to list (0: no profile)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator(device=device).manual_seed(1234)
    scenario, x, slots, lens = decode_reference_problem(default_impl(), a.rows, a.heads, a.topk,
                                                        ("bfloat16", True, 1.0), device, generator)
    slots, lens = slots.to(device), lens.to(device)
    budget = int(a.budget_gib * (1 << 30))
    oracle_fast.CPU_CHUNK_BYTES = a.cpu_chunk_mib << 20

    def call():
        return sparse_mla_reference(x.q_nope, x.q_pe, x.ckv, x.kpe, slots, lens=lens, sm_scale=scenario.spec.sm_scale,
                                    mode=a.mode, memory_budget_bytes=budget)

    _, peak = peak_extra_bytes(call, device)
    walls, hosts, cpus = [], [], []
    for _ in range(a.reps):
        synchronize(device)
        start, cpu_start = time.perf_counter(), time.process_time()
        call()
        hosts.append(time.perf_counter() - start)
        synchronize(device)
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu_start)
    cap = f", chunks <= {a.cpu_chunk_mib} MiB" if device.type == "cpu" else ""
    print(f"{device.type}: rows {a.rows} x H {a.heads} x topk {a.topk}, {a.mode}, budget {a.budget_gib:g} GiB{cap}: "
          f"wall {statistics.median(walls) * 1e3:.3f} ms, host {statistics.median(hosts) * 1e3:.3f} ms, "
          f"CPU {statistics.median(cpus) * 1e3:.3f} ms, "
          f"peak extra {'-' if peak is None else f'{peak / (1 << 30):.2f} GiB'}")
    if a.kernels and device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            synchronize(device)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.kernels, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
