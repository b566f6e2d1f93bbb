"""The benchmark's inputs on the device: scenarios from ``harness.build_scenario`` under one
kernel configuration, random caches and q drawn on the device (their values do not matter for
timing, and drawing tens of GB of them on the host would take minutes), rotated input/output
sets that L2 cannot hold, and a planned state ready to attend."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from backends.flashinfer.port import make_attention_state
from harness import AttentionInputs, batch, build_scenario
from harness.cases import KernelConfig
from harness.timing import synchronize
from mla_constants import KV_LORA_RANK, variant_name

from .context import Context
from .counting import rotation_count
from .selection import KERNEL_LAYOUT


def decode_spec(rows: int, topk: int):
    """``rows`` decode requests whose every row selects topk slots (ctx > topk, kpool 1)."""
    return batch(*[(topk + 64, 1)] * rows, topk=topk, kpool=1)


def prefill_spec(rows: int, topk: int):
    """One chunked-prefill request of ``rows`` query tokens, each with ctx > topk."""
    return batch((rows + topk + 64, rows), topk=topk, kpool=1)


def mixed_decode_spec(rows: int, topk: int):
    """``rows`` decode requests with lengths spread over (topk/2, 5 topk/2): some rows
    shorter than topk (len = ctx), the rest topk."""
    return batch(*[(topk // 2 + (i * 997) % (2 * topk), 1) for i in range(rows)], topk=topk, kpool=1)


def kernel_scenario(kind: str, rows: int, topk: int):
    spec = decode_spec(rows, topk) if kind == "decode" else prefill_spec(rows, topk)
    return build_scenario(spec, seed=rows * 2 + (kind == "prefill"))


def planned_lens(impl, scenario) -> torch.Tensor:
    """Host int32 lens of the planned rows, as the production builder computes them."""
    spec, meta = scenario.spec, scenario.meta
    lens = impl.kv_lens(meta, topk=spec.topk, kpool=spec.kpool, async_scheduling=spec.async_scheduling)
    return impl.planned_lens(meta, lens, topk=spec.topk).to(torch.int32)


def with_config(scenario, kv_dtype: str, rope: bool, k_scale: float, heads: int):
    """The scenario under one kernel configuration (slots and lens do not depend on it)."""
    return dataclasses.replace(scenario, spec=KernelConfig(kv_dtype, rope, heads, k_scale).apply(scenario.spec))


def random_cache(scenario, device: torch.device, generator: torch.Generator) -> torch.Tensor:
    """``[num_blocks, block_size, 512 + R]`` of the spec's dtype, standard normal values."""
    spec = scenario.spec
    cache = torch.empty((scenario.num_blocks, spec.block_size, spec.head_dim), dtype=spec.torch_kv_dtype, device=device)
    flat = cache.view(-1, spec.head_dim)
    step = max(1, (256 << 20) // (2 * spec.head_dim))
    for start in range(0, flat.shape[0], step):
        part = flat[start : start + step]
        part.copy_(torch.randn(part.shape, dtype=torch.bfloat16, device=device, generator=generator))
    return cache


def random_q(rows: int, heads: int, head_dim: int, device: torch.device, generator: torch.Generator) -> torch.Tensor:
    return torch.randn((rows, heads, head_dim), dtype=torch.bfloat16, device=device, generator=generator)


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class Sets:
    """Rotated input/output sets of one shape. Set ``i % count`` pairs ``caches[j % len]`` and
    ``qs[j % len]`` (j = i % count) with its own out/lse, so an output always comes from the
    same inputs whatever the two rotation lengths."""

    caches: list[torch.Tensor]
    qs: list[torch.Tensor]
    outs: list[tuple[torch.Tensor, torch.Tensor]]  # one per set: len(outs) == count

    @property
    def count(self) -> int:
        return max(len(self.caches), len(self.qs))

    def inputs(self, i: int) -> AttentionInputs:
        j = i % self.count
        q = self.qs[j % len(self.qs)]
        return AttentionInputs(
            q_nope=q[..., :KV_LORA_RANK], q_pe=q[..., KV_LORA_RANK:], kv_cache=self.caches[j % len(self.caches)]
        )

    def out(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.outs[i % self.count]


def make_sets(scenario, caches, rows: int, device, generator, l2_bytes: int) -> Sets:
    spec = scenario.spec
    per_set = rows * spec.num_heads * (spec.head_dim * 2 + KV_LORA_RANK * 2 + 4)
    count = rotation_count(per_set, l2_bytes)
    qs = [random_q(rows, spec.num_heads, spec.head_dim, device, generator) for _ in range(count)]
    outs = [(torch.full((rows, spec.num_heads, KV_LORA_RANK), float("nan"), dtype=torch.bfloat16, device=device),
             torch.full((rows, spec.num_heads), float("nan"), dtype=torch.float32, device=device))
            for _ in range(max(count, len(caches)))]
    return Sets(caches, qs, outs)


@dataclass
class Prepared:
    """A planned state with its slots laid out, ready to ``attend`` on rotated sets."""

    scenario: object
    state: object
    launch: object
    sets: Sets
    rows: int

    def attend(self, i: int) -> None:
        x = self.sets.inputs(i)
        out, lse = self.sets.out(i)
        self.state.attend(x.q_nope, x.q_pe, x.ckv, x.kpe, out, lse)

    def step_args(self, i: int):
        x = self.sets.inputs(i)
        out, lse = self.sets.out(i)
        launch = self.launch
        return (launch.topk_indices, launch.block_table, launch.req_id, x.q_nope, x.q_pe, x.ckv, x.kpe, out, lse)

    def outputs_finite(self) -> bool:
        n = self.rows
        return all(
            bool(torch.isfinite(out[:n].float()).all()) and bool(torch.isfinite(lse[:n]).all())
            for out, lse in self.sets.outs
        )


def prepare(ctx: Context, scenario, lens: torch.Tensor, caches, generator, layout: str = KERNEL_LAYOUT) -> Prepared:
    from harness.port.launch import attention_config, launch_inputs

    rows = lens.numel()
    sets = make_sets(scenario, caches, rows, ctx.device, generator, ctx.l2_bytes)
    state = make_attention_state(ctx.impl, attention_config(scenario, layout, rows), ctx.device)
    state.plan(rows, lens)
    launch = launch_inputs(ctx.impl, scenario, sets.inputs(0), rows)
    state.write_indices(launch.topk_indices, launch.block_table, launch.req_id)
    synchronize(ctx.device)
    return Prepared(scenario, state, launch, sets, rows)


def distinct_slots(state, rows: int) -> int:
    slots = state.slots[:rows]
    return int(torch.unique(slots[slots >= 0]).numel())


def shape_record(kind: str, rows: int, scenario) -> dict:
    spec = scenario.spec
    return {"variant": variant_name(spec.kv_dtype, spec.rope), "kind": kind, "rows": rows, "heads": spec.num_heads,
            "topk": spec.topk, "rope_dim": spec.rope_dim, "kv_dtype": spec.kv_dtype}
