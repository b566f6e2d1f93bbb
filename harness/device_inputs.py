"""q and the KV cache of a scenario, materialised on a device.

:func:`build_attention_inputs` draws q from a NumPy generator and the KV cache from the
counter-based hash (:func:`harness.hashed_values.slot_values`); with ``poison`` every slot no
row should read holds NaN. For production batch sizes (docs/edges.md#scale)
:func:`build_attention_inputs_on` generates the same KV cache on the device, and q per row from
a key (:func:`harness.hashed_values.query_rows`), so a row keeps its q in any batch;
:func:`intended_slots_on` and :func:`readable_slots_on` apply the convert rule there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from backends.seam import blocks_apart
from mla_constants import INVALID, KV_LORA_RANK
from reference.rules import convert_rule

from . import hashed_values
from .hashed_values import component_seed, query_rows, slot_values, slot_values_on
from .spec import KV_DTYPES, SCORE_OFFSET_KEY, Scenario, score_offset_coordinate


@dataclass
class AttentionInputs:
    q_nope: torch.Tensor  # [rows incl. padding, H, 512] bf16
    q_pe: torch.Tensor  # [rows incl. padding, H, R] bf16
    kv_cache: torch.Tensor  # [num_blocks, block_size, 512 + R] bf16 or float8_e4m3fn

    @property
    def ckv(self) -> torch.Tensor:
        """``[num_slots, 1, 512]``, slot ``block * block_size + offset`` at its index (a view of a
        contiguous cache, a copy of one whose blocks lie apart)."""
        return self.kv_cache.reshape(-1, 1, self.kv_cache.shape[-1])[..., :KV_LORA_RANK]

    @property
    def kpe(self) -> torch.Tensor:
        """``[num_slots, 1, R]``, as :attr:`ckv`."""
        return self.kv_cache.reshape(-1, 1, self.kv_cache.shape[-1])[..., KV_LORA_RANK:]


def with_blocks_apart(inputs: AttentionInputs, block_stride: int) -> AttentionInputs:
    """The same step inputs with the cache's blocks ``block_stride`` rows apart in a larger buffer
    whose rows between blocks hold NaN (``backends.seam.blocks_apart``): the cache view vLLM 0.32+
    hands a layer whose pages sit between other layers' (docs/input-space.md#blocks-apart). Slot
    ids keep their meaning (``block * block_size + offset``); only where the rows lie changes."""
    return AttentionInputs(inputs.q_nope, inputs.q_pe, blocks_apart(inputs.kv_cache, block_stride))


_NAN_BITS = {"bfloat16": (torch.int16, 0x7FC0), "float8_e4m3fn": (torch.uint8, 0x7F)}


def _normal(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(size=shape, dtype=np.float32))



def nan_kv_buffer(shape: tuple[int, ...], kv_dtype: str, device) -> torch.Tensor:
    """A KV buffer of ``kv_dtype`` on ``device`` with every element NaN: a slot no builder
    wrote shows in any output that reads it."""
    bits, pattern = _NAN_BITS[kv_dtype]
    buffer = torch.empty(shape, dtype=KV_DTYPES[kv_dtype], device=device)
    buffer.view(bits).fill_(pattern)
    return buffer


def _kv_cache_buffer(scenario: Scenario, device, poison: bool) -> torch.Tensor:
    """The scenario's KV cache buffer on ``device``: every slot NaN with ``poison`` (the builder
    then writes the slots some row reads), uninitialised without (the builder writes every slot)."""
    spec = scenario.spec
    shape = (scenario.num_blocks, spec.block_size, spec.head_dim)
    if poison:
        return nan_kv_buffer(shape, spec.kv_dtype, device)
    return torch.empty(shape, dtype=spec.torch_kv_dtype, device=device)


def build_attention_inputs(
    scenario: Scenario, device: torch.device | str = "cpu", *, poison: bool = True, q_seed_component: str = "q"
) -> AttentionInputs:
    """q and the KV cache on ``device``. With ``poison`` only the slots some row's intended
    selection reads get data (:meth:`Scenario.readable_slots`) and every other slot, slot 0
    included, holds NaN, so a read outside the selection shows in the output; without it every
    slot gets data. A slot's values depend only on the seed and the slot (:func:`slot_values`)."""
    spec = scenario.spec
    rows = scenario.topk_indices.shape[0]
    q = _normal(component_seed(scenario.seed, q_seed_component), (rows, spec.num_heads, spec.head_dim))
    q = q.to(torch.bfloat16).to(device)
    cache = _kv_cache_buffer(scenario, device, poison)
    flat = cache.view(-1, spec.head_dim)
    kv_seed = component_seed(scenario.seed, "kv")
    if poison:
        slots = scenario.readable_slots()
        values = torch.from_numpy(slot_values(kv_seed, slots.numpy(), spec.head_dim)).to(spec.torch_kv_dtype)
        flat[slots.to(device)] = values.to(device)
    else:
        slots = torch.arange(scenario.num_slots)
        values = slot_values(kv_seed, slots.numpy(), spec.head_dim)
        flat.copy_(torch.from_numpy(values).to(spec.torch_kv_dtype))
    if spec.score_offsets:
        _carry_score_offsets(scenario, q, flat, slots)
    return AttentionInputs(q_nope=q[..., :KV_LORA_RANK], q_pe=q[..., KV_LORA_RANK:], kv_cache=cache)


def _carry_score_offsets(scenario: Scenario, q: torch.Tensor, flat: torch.Tensor, filled: torch.Tensor) -> None:
    """Write the offset coordinate: ``SCORE_OFFSET_KEY`` times the slot's sign into every filled
    slot, each row's offset over ``SCORE_OFFSET_KEY * k_scale`` into its q (every head)."""
    spec = scenario.spec
    coord = score_offset_coordinate(spec)
    query = scenario.row_score_offsets() / (SCORE_OFFSET_KEY * spec.k_scale)
    q[:, :, coord] = query.to(torch.bfloat16).to(q.device).unsqueeze(1)
    keys = (scenario.slot_score_signs(filled) * SCORE_OFFSET_KEY).to(torch.float32).to(spec.torch_kv_dtype)
    flat[filled.to(flat.device), coord] = keys.to(flat.device)



def intended_slots_on(scenario: Scenario, device) -> torch.Tensor:
    """:meth:`Scenario.intended_slots` (the reference convert rule) computed on ``device``."""
    return convert_rule(
        scenario.topk_indices.to(device), scenario.block_table.to(device), scenario.request_ids().to(device),
        scenario.spec.block_size,
    )


def readable_slots_on(scenario: Scenario, device) -> torch.Tensor:
    """:meth:`Scenario.readable_slots` computed on ``device`` (sorted int64 slot ids there)."""
    slots = intended_slots_on(scenario, device)
    return torch.unique(slots[slots != INVALID].to(torch.int64))


def build_attention_inputs_on(
    scenario: Scenario, device, *, poison: bool = True, row_keys: torch.Tensor | None = None,
    q_seed_component: str = "q-rows",
) -> AttentionInputs:
    """q and the KV cache generated on ``device`` (for batches of 10^4-10^5 rows). The cache is
    bitwise that of :func:`build_attention_inputs` (same slots filled, same values); q row i is
    drawn from its key ``row_keys[i]`` (default: the row index) by :func:`query_rows`, so a row
    given the same key in another batch gets the same q."""
    spec = scenario.spec
    rows = scenario.topk_indices.shape[0]
    keys = torch.arange(rows, dtype=torch.int64) if row_keys is None else row_keys.to(torch.int64)
    if keys.numel() != rows:
        raise ValueError(f"row_keys has {keys.numel()} keys for {rows} rows")
    q = query_rows(component_seed(scenario.seed, q_seed_component), keys, spec.num_heads, spec.head_dim, device)
    cache = _kv_cache_buffer(scenario, device, poison)
    flat = cache.view(-1, spec.head_dim)
    kv_seed = component_seed(scenario.seed, "kv")
    if poison:
        slots = readable_slots_on(scenario, device)
    else:
        slots = torch.arange(scenario.num_slots, dtype=torch.int64, device=device)
    for start in range(0, slots.numel(), hashed_values._HASH_ELEMENTS // 64):
        part = slots[start : start + hashed_values._HASH_ELEMENTS // 64]
        flat[part] = slot_values_on(kv_seed, part, spec.head_dim).to(spec.torch_kv_dtype)
    if spec.score_offsets:
        _carry_score_offsets(scenario, q, flat, slots.cpu())
    return AttentionInputs(q_nope=q[..., :KV_LORA_RANK], q_pe=q[..., KV_LORA_RANK:], kv_cache=cache)
