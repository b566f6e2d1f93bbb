"""FlashMLA beside FA3 (``--vllm``): vLLM's FLASHMLA_SPARSE backend (``backends.vllm.flashmla``) on
the kernel section's shapes, caches and q.

What is timed: the FlashMLA kernel calls that vLLM's ``forward_mqa`` makes for one step
(``sparse_prefill_fwd`` for a bf16 cache; ``sparse_decode_fwd`` for an fp8 cache, and from 32
heads on ``sparse_prefill_fwd`` for its prefill rows), replayed with the arguments FlashMLA's
op namespace received. One step through the layer runs first, untimed: vLLM's ``build`` (the
metadata), its convert kernel, the q concat and head padding, the fp8 cache packed into
FlashMLA's layout, the fp8 prefill rows' context gathered and upconverted into a bf16
workspace, and the decode kernel's tile schedule (built by its first call; the replays hand it
back, as the later layers of a step do), as FA3's ``attend`` is timed after its plan, its convert
and its layout.

Rotation, as FA3's: replay set ``j`` hands the kernel the same view of cache ``j % len(caches)``
in the kernel's layout, and its own copy of q, so that L2 cannot hold them; a workspace the
kernel reads (the fp8 prefill rows' bf16 context) and an ``out`` buffer vLLM hands the kernel
are the step's own in every set.

Counting (``bench.counting``): FLOPs of the layer's heads (the kernels compute vLLM's padded
head count: 16 heads run as 64) over each row's executed length; bytes with each KV row as the
kernel is handed it (656 bytes in FlashMLA's fp8 layout).

Error: each kernel's output against the oracle's float32 mode on the same q and cache over the
scenario's intended selection (``rel_l2_vs_reference``: FlashMLA's output of the step, taken
before the replays; ``fa3_rel_l2_vs_reference``: FA3's output of the same inputs where FA3 ran).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from backends.registry import open_backend
from backends.vllm.flashmla import RECORDED_OPS, SIGNATURES, FlashMLAUnavailable
from backends.vllm.source import VllmSourceError, resolve
from harness import AttentionInputs
from harness.backend_step import layer_config, step_input
from harness.device_inputs import intended_slots_on
from mla_constants import KV_LORA_RANK
from reference import sparse_mla_reference

from .context import Context, error_text
from .counting import attention_bytes, attention_flops, rotation_count
from .reference_section import rel_l2
from .scenarios import kernel_scenario, planned_lens, random_cache, random_q, shape_record, tensor_bytes, with_config
from .selection import REFERENCE_BUDGET_BYTES
from .timed import timed_record

#: The seed of the q that FlashMLA draws where FA3 did not run (FA3's own draws stay as they are).
FLASHMLA_SEED = 4321
NO_VLLM = "no --vllm given (name a vLLM wheel, a slice folder or `installed` to time FlashMLA beside FA3)"


def open_flashmla(spec: str | None):
    """``(backend, None)``, or ``(None, why)`` where FlashMLA cannot be opened from ``spec``."""
    if spec is None:
        return None, NO_VLLM
    try:
        return open_backend("flashmla", resolve(spec)), None
    except (VllmSourceError, FlashMLAUnavailable) as exc:
        return None, error_text(exc, limit=1000)


# --- one step's kernel calls ------------------------------------------------------------------

@dataclass
class KernelCall:
    """One call of a FlashMLA sparse kernel as its op received it, and what it returned."""

    name: str  # "sparse_prefill_fwd" or "sparse_decode_fwd"
    op: object
    args: tuple
    kwargs: dict
    result: tuple

    def bound(self):
        return SIGNATURES[self.name].bind(*self.args, **self.kwargs)

    @property
    def q(self) -> torch.Tensor:
        return self.bound().arguments["q"]

    @property
    def kv(self) -> torch.Tensor:
        return self.bound().arguments["kv"]

    @property
    def rows(self) -> int:
        """Query rows: ``q [s_q, h, d]`` (prefill) or ``[b, s_q, h, d]`` (decode)."""
        q = self.q
        return q.shape[0] * (q.shape[1] if self.name == "sparse_decode_fwd" else 1)

    @property
    def heads(self) -> int:
        return self.q.shape[-2]

    @property
    def out(self) -> torch.Tensor:
        return self.result[0]


class _CapturingOps:
    """FlashMLA's op namespace with each sparse kernel call kept."""

    def __init__(self, ops, calls: list[KernelCall]):
        self._ops, self._calls = ops, calls

    def __getattr__(self, name):
        op = getattr(self._ops, name)
        if name not in RECORDED_OPS:
            return op

        def captured(*args, **kwargs):
            result = op(*args, **kwargs)
            self._calls.append(KernelCall(name, op, args, kwargs, result))
            return result

        return captured


@contextlib.contextmanager
def kernel_calls_kept(interface):
    """The calls FlashMLA's interface module makes to its op namespace while in force."""
    ops = interface.flash_mla_cuda
    calls: list[KernelCall] = []
    interface.flash_mla_cuda = _CapturingOps(ops, calls)
    try:
        yield calls
    finally:
        interface.flash_mla_cuda = ops


def captured_step(layer, step):
    """``(outcome, kernel calls, the cache as the layer handed it to vLLM)`` of one step."""
    made = []
    kernel_cache = layer.kernel_cache

    def kept_kernel_cache(kv_cache):
        made.append(kernel_cache(kv_cache))
        return made[-1]

    layer.kernel_cache = kept_kernel_cache
    try:
        with kernel_calls_kept(layer.backend.interface) as calls:
            outcome = layer.step(step)
    finally:
        del layer.kernel_cache
    return outcome, calls, made[0] if made else None


# --- the replay -------------------------------------------------------------------------------

def shares_storage(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    return b is not None and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def same_view(kv: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """``cache`` (in the kernel's layout, shaped as the step's) seen as the kernel saw the step's
    cache in ``kv``."""
    return cache.view(kv.dtype).as_strided(kv.size(), kv.stride(), kv.storage_offset())


def launch(call: KernelCall, q: torch.Tensor, kv: torch.Tensor) -> tuple:
    """``(op, args, kwargs)`` of ``call`` on ``q`` and ``kv``; a decode call gets the tile
    schedule its first call built where it was handed none."""
    bound = call.bound()
    bound.arguments["q"], bound.arguments["kv"] = q, kv
    if call.name == "sparse_decode_fwd" and bound.arguments.get("tile_scheduler_metadata") is None:
        bound.arguments["tile_scheduler_metadata"], bound.arguments["num_splits"] = call.result[2], call.result[3]
    return call.op, bound.args, bound.kwargs


@dataclass
class Replay:
    """The step's kernel calls on rotated sets; ``replay(i)`` launches set ``i % count``."""

    sets: list[list[tuple]]
    cache_sets: int

    @property
    def count(self) -> int:
        return len(self.sets)

    def __call__(self, i: int) -> None:
        for op, args, kwargs in self.sets[i % self.count]:
            op(*args, **kwargs)


def replay_of(calls: list[KernelCall], step_cache, kernel_cache, caches: list, l2_bytes: int) -> Replay:
    """Set ``j``: each call on cache ``j % len(caches)`` (where the step's call read the cache)
    and on its own copy of q (set 0: the step's own)."""
    per_set = sum(tensor_bytes(c.q) + tensor_bytes(c.out) for c in calls)
    count = max(len(caches), rotation_count(per_set, l2_bytes))
    in_layout = {0: step_cache}
    sets = []
    for j in range(count):
        c = j % len(caches)
        if c not in in_layout:
            in_layout[c] = kernel_cache(caches[c])
        sets.append([launch(call, call.q if j == 0 else call.q.clone(),
                            same_view(call.kv, in_layout[c]) if shares_storage(call.kv, step_cache) else call.kv)
                     for call in calls])
    return Replay(sets, len(in_layout) if any(shares_storage(c.kv, step_cache) for c in calls) else 1)


# --- counting ---------------------------------------------------------------------------------

def kv_row_bytes(kv: torch.Tensor) -> int:
    """Bytes of one KV row as the kernel is handed it (its last dimension)."""
    return kv.shape[-1] * kv.element_size()


def call_spans(calls: list[KernelCall]) -> list[tuple[int, int]]:
    """``(start, stop)`` of each call's rows among the step's rows (calls serve them in order)."""
    spans, start = [], 0
    for call in calls:
        spans.append((start, start + call.rows))
        start += call.rows
    return spans


def step_counts(calls: list[KernelCall], outcome, heads: int, rope_dim: int, kv_dtype: str) -> dict:
    """FLOPs and bytes of the step's calls: the layer's heads over each row's executed length,
    each call's KV rows as its kernel is handed them (``unique``: each distinct slot once)."""
    lengths = outcome.executed_lengths
    slots, mask = outcome.executed_slots
    total, gathered, unique = 0, 0, 0
    for call, (start, stop) in zip(calls, call_spans(calls), strict=True):
        length = int(lengths[start:stop].sum())
        read = slots[start:stop][mask[start:stop]].to(outcome.out.device)
        distinct = int(torch.unique(read).numel())
        moved = attention_bytes(stop - start, heads, length, rope_dim, kv_dtype, distinct,
                                kv_row_bytes=kv_row_bytes(call.kv))
        total, gathered, unique = total + length, gathered + moved["gathered"], unique + moved["unique"]
    return {"total_len": total, "flops": attention_flops(heads, total, rope_dim),
            "moved": {"gathered": gathered, "unique": unique}}


def call_records(calls: list[KernelCall], step_cache) -> list[dict]:
    return [{"op": c.name, "rows": c.rows, "kernel_heads": c.heads, "kv_row_bytes": kv_row_bytes(c.kv),
             "kv": "cache" if shares_storage(c.kv, step_cache) else "workspace (bf16, filled before the kernel)",
             "tile_schedule": "built by the step, handed in" if c.name == "sparse_decode_fwd" else None}
            for c in calls]


# --- error against the reference --------------------------------------------------------------

def errors_vs_reference(ctx: Context, scenario, inputs: AttentionInputs, lens: torch.Tensor,
                        outputs: dict[str, torch.Tensor]) -> dict[str, float]:
    """``{name: rel L2}`` of each output against the oracle's float32 mode on the same inputs,
    over the scenario's intended selection."""
    spec, rows = scenario.spec, lens.numel()
    slots = intended_slots_on(scenario, ctx.device)[:rows]
    truth, _ = sparse_mla_reference(
        inputs.q_nope[:rows], inputs.q_pe[:rows], inputs.ckv, inputs.kpe, slots,
        lens=lens.to(device=ctx.device, dtype=torch.int64), sm_scale=spec.sm_scale, k_scale=spec.k_scale,
        mode="float32", memory_budget_bytes=REFERENCE_BUDGET_BYTES)
    return {name: rel_l2(out[:rows], truth) for name, out in outputs.items()}


# --- one shape --------------------------------------------------------------------------------

def drawn_inputs(scenario, rows: int, cache: torch.Tensor, device, generator) -> AttentionInputs:
    q = random_q(rows, scenario.spec.num_heads, scenario.spec.head_dim, device, generator)
    return AttentionInputs(q_nope=q[..., :KV_LORA_RANK], q_pe=q[..., KV_LORA_RANK:], kv_cache=cache)


def flashmla_unit(ctx: Context, scenario, lens: torch.Tensor, caches: list, generator,
                  fa3_inputs: AttentionInputs | None = None, fa3_out: torch.Tensor | None = None) -> dict:
    """Time FlashMLA's kernel calls of one step of ``scenario`` (FA3's inputs of set 0 where
    given, else q drawn here on ``caches[0]``) and measure the outputs' error."""
    backend, spec, rows = ctx.flashmla, scenario.spec, lens.numel()
    config = layer_config(spec, max(scenario.topk_indices.shape[0], 1))
    reason = backend.unsupported(config)
    if reason:
        return {"unsupported": reason}
    inputs = fa3_inputs if fa3_inputs is not None else drawn_inputs(scenario, rows, caches[0], ctx.device, generator)
    layer = backend.open_layer(config, ctx.device)
    outcome, calls, step_cache = captured_step(layer, step_input(scenario, inputs))
    if outcome.planned_rows != rows or not calls:
        raise RuntimeError(f"FlashMLA served {outcome.planned_rows} rows in {len(calls)} kernel calls; FA3 serves "
                           f"{rows}")
    outputs = {"rel_l2_vs_reference": outcome.out} | ({"fa3_rel_l2_vs_reference": fa3_out} if fa3_out is not None
                                                     else {})
    checked = {"finite": bool(torch.isfinite(outcome.out.float()).all()) and bool(torch.isfinite(outcome.lse).all()),
               "problems": list(outcome.schedule_problems),
               **errors_vs_reference(ctx, scenario, inputs, lens, outputs)}  # before the replays write any buffer
    counts = step_counts(calls, outcome, spec.num_heads, spec.rope_dim, spec.kv_dtype)
    replay = replay_of(calls, step_cache, layer.kernel_cache, caches, ctx.l2_bytes)
    record = timed_record(ctx, replay, replay.count, counts["flops"], counts["moved"])
    return {**record, "total_len": counts["total_len"], "calls": call_records(calls, step_cache),
            "rotation": {"caches": replay.cache_sets, "q_sets": replay.count}, **checked}


def run_flashmla_alone(ctx: Context) -> None:
    """FlashMLA on the selection's shapes without FA3 beside it (a machine without FlashInfer's
    kernels: the CPU, where a test has put the stand-in kernels in place)."""
    sel = ctx.sel
    generator = torch.Generator(device=ctx.device).manual_seed(FLASHMLA_SEED)
    for kind, rows in sel.scenario_order():
        base = kernel_scenario(kind, rows, sel.topk)
        lens = planned_lens(ctx.impl, base)
        for kv_dtype, rope, k_scale in sel.variants:
            for heads in sel.heads:
                scenario = with_config(base, kv_dtype, rope, k_scale, heads)
                caches = [random_cache(scenario, ctx.device, generator)]
                ctx.guarded("flashmla", shape_record(kind, rows, scenario),
                            functools.partial(flashmla_unit, ctx, scenario, lens, caches, generator))
