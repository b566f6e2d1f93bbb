"""How large a noted step's fixture would be, and which of its rows to keep when it is too large
to build whole: shared by the dump (:mod:`recording.dump`) and the recipes (:mod:`recording.recipe`)."""

from __future__ import annotations

import torch

from mla_constants import KV_LORA_RANK

#: A noted step whose fixture would take more host memory than this is written as a recipe
#: without being built (a failing batch of tens of thousands of rows, say).
MAX_BUILD_BYTES = 1 << 30


def build_bytes(step) -> int:
    """About the host bytes the fixture of a noted step takes before shrinking: q and out of
    every planned row, and the KV slots their plans read."""
    spec = step.scenario.spec
    width = KV_LORA_RANK + spec.rope_dim
    slots = int(step.planned_lens.to(torch.int64).sum()) if step.num_planned else 0
    return step.num_planned * spec.num_heads * width * 2 * 2 + slots * width * 2


#: At most this many failing rows (those that read the fewest KV slots) go into the fixture of
#: a batch too large to build; the shrink then keeps fewer.
MAX_FAILING_ROWS = 64

def smallest_rows(step, rows: list[int], limit: int) -> list[int]:
    """At most ``limit`` of ``rows``, those that read the fewest KV slots first."""
    size = step.planned_lens.to(torch.int64).cpu() + step.counts[: step.num_planned].to(torch.int64).cpu()
    return sorted(sorted(rows, key=lambda r: (int(size[r]), r))[:limit])
