#!/usr/bin/env python3
"""The oracle's outputs against a saved copy of an older ``reference/oracle.py``, bit for bit.

    git show <commit>:reference/oracle.py > /tmp/old_oracle.py      # where git is
    python3 scripts/check_oracle_bitwise.py --old /tmp/old_oracle.py [--device cuda]

The old file is loaded as a module of its own (it must import only torch and the standard
library, as the one-file oracle did). Every case is run through both, in each mode (float64,
float32, lowp): bf16 rope 64, fp8 rope 64 with k_scale 0.5 and 0.37, bf16 NoPE; random lens
with empty rows, or every row full; q and cache as halves of one buffer or as separate ones;
selected by lens and by a mask with holes; one row per chunk or the default budget. out and
LSE must be equal with ``torch.equal`` (NaN nowhere). Prints one line per case; exit status 1 on any
difference.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mla_constants import DEEPSEEK_V32_SM_SCALE, GLM_NOPE_SM_SCALE
from reference.oracle import COMPUTE_MODES, sparse_mla_reference

# (label, kv dtype, rope dim, k_scale, sm_scale)
VARIANTS = (
    ("bf16-rope64", torch.bfloat16, 64, 1.0, DEEPSEEK_V32_SM_SCALE),
    ("fp8-rope64", torch.float8_e4m3fn, 64, 0.5, DEEPSEEK_V32_SM_SCALE),
    ("fp8-rope64 k_scale 0.37", torch.float8_e4m3fn, 64, 0.37, DEEPSEEK_V32_SM_SCALE),
    ("bf16-nope", torch.bfloat16, 0, 1.0, GLM_NOPE_SM_SCALE),
)
# (rows, heads, topk, cache slots, chunk budget in bytes or None for the default, rows' lens)
SHAPES = ((7, 4, 64, 300, None, "random"), (33, 16, 256, 2000, None, "random"), (9, 8, 128, 500, 1, "random"),
          (5, 4, 64, 100, None, "full"))


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location("old_oracle", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def case_inputs(seed: int, rows: int, heads: int, topk: int, num_slots: int, kv_dtype, rope: int, lens_kind: str,
                device: str):
    """q and the cache as halves of one buffer each (the kernel's layout), random slots, and
    random lens with two empty rows and one full one, or every row full; -1 past each row's len."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, 512 + rope, generator=g).to(torch.bfloat16)
    cache = (torch.randn(num_slots, 1, 512 + rope, generator=g) * 2).to(kv_dtype)
    slots = torch.randint(0, num_slots, (rows, topk), generator=g, dtype=torch.int32)
    lens = torch.randint(0, topk + 1, (rows,), generator=g)
    lens[0], lens[rows // 2], lens[-1] = 0, 0, topk
    if lens_kind == "full":
        lens[:] = topk
    cols = torch.arange(topk).unsqueeze(0)
    slots = torch.where(cols < lens.unsqueeze(1), slots, torch.full_like(slots, -1))
    holes = (torch.rand(rows, topk, generator=g) < 0.7) & (slots >= 0)
    q, cache, slots, lens, holes = (x.to(device) for x in (q, cache, slots, lens, holes))
    return q[..., :512], q[..., 512:], cache[..., :512], cache[..., 512:], slots, lens, holes


def differences(old_result, new_result) -> list[str]:
    found = []
    for what, a, b in zip(("out", "lse"), old_result, new_result, strict=True):
        if a.dtype != b.dtype or a.shape != b.shape:
            found.append(f"{what}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}")
        elif bool(torch.isnan(a).any()) or bool(torch.isnan(b).any()):
            found.append(f"{what}: NaN in the output")
        elif not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().nan_to_num(posinf=float("inf"))
            found.append(f"{what}: {int((a != b).sum())} entries differ, max |diff| {float(diff.max()):.3g}")
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", type=Path, required=True, help="a saved copy of the old reference/oracle.py")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default cpu)")
    args = p.parse_args(argv)
    old = load_module(args.old)
    failures = cases = 0
    for variant, kv_dtype, rope, k_scale, sm_scale in VARIANTS:
        for seed, (rows, heads, topk, num_slots, budget, lens_kind) in enumerate(SHAPES):
            q_nope, q_pe, ckv, kpe, slots, lens, holes = case_inputs(seed, rows, heads, topk, num_slots, kv_dtype,
                                                                     rope, lens_kind, args.device)
            buffers = {"one buffer": (q_nope, q_pe, ckv, kpe),
                       "separate buffers": tuple(x.contiguous() for x in (q_nope, q_pe, ckv, kpe))}
            for (layout, inputs), (select, selection) in itertools.product(
                    buffers.items(), (("lens", {"lens": lens}), ("mask", {"mask": holes}))):
                for mode in COMPUTE_MODES:
                    kwargs = dict(sm_scale=sm_scale, k_scale=k_scale, mode=mode, **selection)
                    if budget is not None:
                        kwargs["memory_budget_bytes"] = budget
                    found = differences(old.sparse_mla_reference(*inputs, slots, **kwargs),
                                        sparse_mla_reference(*inputs, slots, **kwargs))
                    label = (f"{variant} T={rows} H={heads} K={topk} N={num_slots} {lens_kind} lens, {layout}, "
                             f"by {select}{', budget 1 B' if budget else ''}: {mode}")
                    print(f"{'DIFFERS' if found else 'equal  '} {label}" + "".join(f"\n    {f}" for f in found))
                    cases += 1
                    failures += bool(found)
    print(f"{cases - failures} of {cases} cases bitwise equal on {args.device}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
