"""Build (or load) every FlashInfer kernel variant the GPU tier uses and print how long each
took: a cold JIT cache shows the build time, a warm or restored one the load time.

    python3 -m harness.port.prebuild [--parallel] [--only-missing]

The variants are every one the GPU tier launches: ``mla_constants.KERNEL_VARIANTS`` on the fa3
kernel and ``mla_constants.FA2_KERNEL_VARIANTS`` on fa2 (the port on fa2). One after the other by
default; ``--parallel`` builds each in a process of its own at the same time
(FlashInfer locks each module's build, so a test that needs a variant being built waits for it
and then loads it). ``--only-missing`` builds only the variants whose module FlashInfer's JIT
cache does not hold built, and nothing where it holds them all. The main job starts
``--parallel --only-missing`` in the background at its start (``pytest_sparse_mla/gpus.py``), so
a cold cache builds while the xdist workers start and collect."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import torch

from backends.flashinfer.port import make_attention_state
from fast.impl import default_impl
from mla_constants import FA2_KERNEL_VARIANTS, KERNEL_VARIANTS, ROPE_DIM, TOPK

from ..availability import sm90_flashinfer_unavailable_reason
from ..cases import KernelConfig
from ..scenario import batch, build_scenario
from .launch import attention_config

#: (kernel, kv dtype, rope, k_scale) of every variant built.
VARIANTS = tuple(("fa3", *v) for v in KERNEL_VARIANTS) + tuple(("fa2", *v) for v in FA2_KERNEL_VARIANTS)


def variant_label(kernel: str, kv_dtype: str, rope: bool) -> str:
    return f"{kernel}-{KernelConfig(kv_dtype, rope, 16).variant}"


def build_variant(impl, kernel: str, kv_dtype: str, rope: bool, k_scale: float) -> float:
    config = KernelConfig(kv_dtype, rope, 16, k_scale)
    scenario = build_scenario(config.apply(batch((9, 1), topk=TOPK, kpool=1)), seed=0)
    state_config = dataclasses.replace(attention_config(scenario, "packed", 1), kernel=kernel)
    state = make_attention_state(impl, state_config, "cuda")
    started = time.perf_counter()
    state.plan(1, torch.tensor([9], dtype=torch.int32))
    torch.cuda.synchronize()
    return time.perf_counter() - started


def built_module_glob(kv_dtype: str, rope: bool) -> str:
    """FlashInfer's name for the folder of a variant's built MLA module in its JIT cache (the same
    in every supported release; q and the output are bf16 in every variant; the fa3 module's
    name ends in ``_sm90``, the fa2 one's does not), and the library in it."""
    kv = "e4m3" if kv_dtype == "float8_e4m3fn" else "bf16"
    return f"batch_mla_attention_dtype_q_bf16_dtype_kv_{kv}_*_head_dim_kpe_{ROPE_DIM if rope else 0}_profiler_*/*.so"


def is_built(jit_dir: Path, kernel: str, kv_dtype: str, rope: bool) -> bool:
    folders = [p.parent.name for p in jit_dir.glob(built_module_glob(kv_dtype, rope))]
    return any(name.endswith("_sm90") == (kernel == "fa3") for name in folders)


def missing_variants(jit_dir: Path) -> list[tuple[str, str, bool, float]]:
    """The kernel variants whose module FlashInfer's JIT cache folder does not hold built."""
    return [v for v in VARIANTS if not is_built(jit_dir, *v[:3])]


def flashinfer_jit_dir() -> Path:
    from backends.registry import flashinfer_jit_dir as jit_dir

    return jit_dir()


def variant_by_name(name: str) -> tuple[str, str, bool, float]:
    for variant in VARIANTS:
        if variant_label(*variant[:3]) == name:
            return variant
    raise SystemExit(f"harness.port.prebuild: no kernel variant {name!r}")


def build_in_parallel(variants) -> int:
    """Each of ``variants`` built in a process of its own, all at once; the slowest sets the time."""
    names = [variant_label(*v[:3]) for v in variants]
    started = time.perf_counter()
    children = [subprocess.Popen([sys.executable, "-m", "harness.port.prebuild", "--variant", name]) for name in names]
    codes = [child.wait() for child in children]
    print(f"jit all variants at once {time.perf_counter() - started:7.1f} s", flush=True)
    return max(codes, key=abs)  # a child killed by a signal has a negative code


def main(argv: list[str] | None = None) -> int:
    """Build every variant; where the SM90 FlashInfer path cannot run, one line saying why
    and exit status 2, nothing built."""
    parser = argparse.ArgumentParser(prog="python3 -m harness.port.prebuild", description=__doc__.split("\n\n")[0])
    parser.add_argument("--parallel", action="store_true", help="each variant in a process of its own, at once")
    parser.add_argument("--only-missing", action="store_true",
                        help="nothing where the JIT cache holds every variant built")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    reason = sm90_flashinfer_unavailable_reason()
    if reason:
        print(f"harness.port.prebuild: nothing to build here: {reason}", file=sys.stderr)
        return 2
    chosen = [variant_by_name(args.variant)] if args.variant else list(VARIANTS)
    if args.only_missing:
        missing = missing_variants(flashinfer_jit_dir())
        chosen = [v for v in chosen if v in missing]
        if not chosen:
            print("harness.port.prebuild: the JIT cache holds every variant built; nothing to build", flush=True)
            return 0
    if args.parallel:
        return build_in_parallel(chosen)
    impl = default_impl()
    total = 0.0
    for variant in chosen:
        seconds = build_variant(impl, *variant)
        total += seconds
        print(f"jit {variant_label(*variant[:3]):<18} {seconds:7.1f} s", flush=True)
    if not args.variant:
        print(f"jit total          {total:7.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
