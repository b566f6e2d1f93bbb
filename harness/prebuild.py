"""Build (or load) every FlashInfer kernel variant the GPU tier uses, one after the other, and
print how long each took: a cold JIT cache shows the build time, a warm or restored one the
load time. ``python3 -m harness.prebuild``"""

from __future__ import annotations

import sys
import time

import torch

from fast.impl import default_impl
from mla_constants import TOPK

from .availability import sm90_flashinfer_unavailable_reason
from .cases import VARIANTS, KernelConfig
from .launch import attention_config
from .scenario import batch, build_scenario


def build_variant(impl, kv_dtype: str, rope: bool, k_scale: float) -> float:
    config = KernelConfig(kv_dtype, rope, 16, k_scale)
    scenario = build_scenario(config.apply(batch((9, 1), topk=TOPK, kpool=1)), seed=0)
    state = impl.make_attention_state(attention_config(scenario, "packed", 1), "cuda")
    started = time.perf_counter()
    state.plan(1, torch.tensor([9], dtype=torch.int32))
    torch.cuda.synchronize()
    return time.perf_counter() - started


def main() -> int:
    """Build every variant; where the SM90 FlashInfer path cannot run, one line saying why
    and exit status 2, nothing built."""
    reason = sm90_flashinfer_unavailable_reason()
    if reason:
        print(f"harness.prebuild: nothing to build here: {reason}", file=sys.stderr)
        return 2
    impl = default_impl()
    total = 0.0
    for kv_dtype, rope, k_scale in VARIANTS:
        seconds = build_variant(impl, kv_dtype, rope, k_scale)
        total += seconds
        print(f"jit {KernelConfig(kv_dtype, rope, 16).variant:<14} {seconds:7.1f} s", flush=True)
    print(f"jit total          {total:7.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
