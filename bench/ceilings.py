"""The ceilings of the run: a device-to-device copy (bytes/s) and a bf16 matmul (FLOP/s),
measured in the same run as the kernel they bound."""

from __future__ import annotations

import torch

from .context import Context, error_text, free_memory


def measure_ceilings(ctx: Context) -> None:
    from harness.timing import copy_ceiling, matmul_ceiling

    sel = ctx.sel
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    for name, fn in (("copy", lambda: copy_ceiling(ctx.timer, sel.ceiling_copy_bytes, sel.ceiling_reps)),
                     ("matmul", lambda: matmul_ceiling(ctx.timer, sel.ceiling_matmul_n, sel.ceiling_reps, dtype))):
        try:
            ctx.ceilings[name] = fn()
        except Exception as exc:
            ctx.ceilings[name] = {"error": error_text(exc)}
        free_memory(ctx.device)
