"""A probe of FlashMLA's sparse kernels' contract on an SM90 GPU, through the release's own
Python interface (``flash_mla_sparse_fwd``, ``flash_mla_with_kvcache``, as vLLM's
FLASHMLA_SPARSE imports them): each test asserts one behaviour, named in its name, that the
``flashmla`` backend and vLLM rely on. Outputs are judged against the float64 oracle within the
error budget of ``reference.budget`` (a failure reports the measured ratios).

The prefill kernel takes ``q [s_q, h, 576]``, ``kv [s_kv, 1, 576]`` bf16 and
``indices [s_q, 1, topk]``; the decode kernel ``q [b, s_q, h, 576]``, the fp8 cache in FlashMLA's
656-byte layout ``[pages, 64, 1, 656]`` and ``indices [b, s_q, topk]``. A call expected to be
refused runs in a process of its own (:func:`refusal`), so that a kernel that faults instead
of refusing cannot take the test process's CUDA context with it.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from backends.vllm.flashmla import FlashMLABackend, FlashMLAUnavailable
from backends.vllm.source import resolve
from mla_constants import DEEPSEEK_V32_SM_SCALE, GPU_TIER_DEFAULT_DEVICE, KV_LORA_RANK
from reference import sparse_mla_reference
from reference.budget import compare_attention, compare_to_budget
from reference.flashmla_layout import TILES, dequantize, pack, tile_scales

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.flashmla]

DEVICE = GPU_TIER_DEFAULT_DEVICE  # FlashMLA's own kernels: never the simulated machine
SM_SCALE = DEEPSEEK_V32_SM_SCALE
S_Q, S_KV, TOPK = 64, 4096, 2048
PAGE = 64


@pytest.fixture(scope="module")
def kernels(flashmla_source):
    """The release's FlashMLA entry points as vLLM's FLASHMLA_SPARSE imports them."""
    try:
        module = FlashMLABackend(flashmla_source).module
    except FlashMLAUnavailable as exc:
        pytest.fail(str(exc))
    return module


# --- inputs and the oracle --------------------------------------------------------------------

def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_rows(gen, rows: int, width: int, s_kv: int) -> torch.Tensor:
    """int64 ``[rows, width]``: distinct indices in ``[0, s_kv)`` per row."""
    return torch.stack([torch.randperm(s_kv, generator=gen)[:width] for _ in range(rows)])


def queries(gen, rows: int, heads: int) -> torch.Tensor:
    return torch.randn(rows, heads, KV_LORA_RANK + 64, generator=gen).to(torch.bfloat16)


def bf16_kv(gen, s_kv: int) -> torch.Tensor:
    return (torch.randn(s_kv, 1, KV_LORA_RANK + 64, generator=gen) * 2).to(torch.bfloat16)


def oracle(q, kv_values, slots, mask):
    """(truth, lowp) ``(out, lse)`` over ``kv_values [N, 576]`` where ``mask``."""
    safe = torch.where(mask, slots, torch.zeros_like(slots))
    args = (q[..., :KV_LORA_RANK], q[..., KV_LORA_RANK:], kv_values[:, :KV_LORA_RANK], kv_values[:, KV_LORA_RANK:],
            safe)
    return (sparse_mla_reference(*args, mask=mask, sm_scale=SM_SCALE, mode="float64"),
            sparse_mla_reference(*args, mask=mask, sm_scale=SM_SCALE, mode="lowp"))


def assert_within_budget(out, lse, q, kv_values, slots, mask, kv_dtype: str = "bfloat16"):
    truth, lowp = oracle(q, kv_values, slots, mask)
    comparisons = compare_attention(out.float(), lse.float(), truth, lowp, kv_dtype, kernel="flashmla")
    assert all(c.ok for c in comparisons), "; ".join(c.summary() for c in comparisons)


def prefill(kernels, q, kv, slots, **kwargs):
    """The prefill kernel on ``slots [s_q, topk]``; ``(out, lse)``."""
    indices = slots.to(torch.int32).view(slots.shape[0], 1, -1).to(DEVICE)
    out, _, lse = kernels.flash_mla_sparse_fwd(q.to(DEVICE), kv.to(DEVICE), indices, SM_SCALE, **kwargs)
    return out.cpu(), lse.cpu()


def fp8_cache(gen, s_kv: int, scales=(1.0, 1.0, 1.0, 1.0)) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed [pages, 64, 1, 656] uint8, values [s_kv, 576] bf16)``: e4m3 NoPE values with the
    tile scales ``scales`` (powers of two, so each value is a bf16 value), a bf16 RoPE part."""
    cache = (torch.randn(s_kv, KV_LORA_RANK + 64, generator=gen) * 4).to(torch.float8_e4m3fn)
    packed = pack(cache, 1.0)
    tile_scales(packed).copy_(torch.tensor(scales, dtype=torch.float32).expand(s_kv, TILES))
    values = dequantize(packed).to(torch.bfloat16)
    return packed.view(s_kv // PAGE, PAGE, 1, -1), values


def decode(kernels, q, packed, slots, **kwargs):
    """The decode kernel, one query row per batch entry, as vLLM's mixed batch calls it;
    ``(out [rows, h, 512], lse [rows, h])``."""
    rows = q.shape[0]
    schedule, _ = kernels.get_mla_metadata()
    out, lse = kernels.flash_mla_with_kvcache(
        q=q.view(1, rows, q.shape[1], q.shape[2]).to(DEVICE), k_cache=packed.to(DEVICE),
        block_table=torch.zeros(1, 1, dtype=torch.int32, device=DEVICE),
        cache_seqlens=torch.full((1,), packed.shape[0] * PAGE, dtype=torch.int32, device=DEVICE),
        head_dim_v=KV_LORA_RANK, tile_scheduler_metadata=schedule, softmax_scale=SM_SCALE, is_fp8_kvcache=True,
        indices=slots.to(torch.int32).view(1, rows, -1).to(DEVICE), **kwargs)
    return out[0].cpu(), lse[0].permute(1, 0).cpu()


def _refusal_in_this_process(root: str, kernel: str, heads: int, with_topk_length: bool) -> str | None:
    """The error a call is refused with (None: it ran), on 4 rows of random inputs."""
    kernels = FlashMLABackend(resolve(root)).module
    gen = generator(heads)
    q, slots = queries(gen, 4, heads), random_rows(gen, 4, TOPK, S_KV)
    try:
        if kernel == "prefill":
            prefill(kernels, q, bf16_kv(gen, S_KV), slots)
        else:
            lengths = torch.full((1,), TOPK // 2, dtype=torch.int32, device=DEVICE) if with_topk_length else None
            decode(kernels, q, fp8_cache(gen, S_KV)[0], slots, topk_length=lengths)
        torch.cuda.synchronize()
    except RuntimeError as exc:
        return str(exc).splitlines()[0] if str(exc) else repr(exc)
    return None


def refusal(source, kernel: str, heads: int, with_topk_length: bool = False) -> str | None:
    """:func:`_refusal_in_this_process` in a fresh process."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_refusal_in_this_process, str(source.root), kernel, heads, with_topk_length).result(600)


# --- the prefill kernel ------------------------------------------------------------------------

@pytest.mark.parametrize("heads", [8, 16, 32, 64, 128])
def test_prefill_kernel_takes_each_sm90_head_count_and_returns_a_natural_log_lse(kernels, heads):
    gen = generator(heads)
    q, kv, slots = queries(gen, S_Q, heads), bf16_kv(gen, S_KV), random_rows(gen, S_Q, TOPK, S_KV)
    out, lse = prefill(kernels, q, kv, slots)
    assert_within_budget(out, lse, q, kv[:, 0], slots, torch.ones_like(slots, dtype=torch.bool))


@pytest.mark.parametrize("heads", [24, 48, 96])
def test_prefill_kernel_refuses_a_head_count_outside_8_16_32_64_128(kernels, flashmla_source, heads):
    assert refusal(flashmla_source, "prefill", heads) is not None, f"the prefill kernel ran {heads} heads"


def test_heads_zero_padded_to_64_leave_the_real_heads_within_budget(kernels):
    """vLLM's padding of 16 heads to 64 for the prefill kernel (zero q in the added heads)."""
    gen = generator(3)
    q, kv, slots = queries(gen, S_Q, 16), bf16_kv(gen, S_KV), random_rows(gen, S_Q, TOPK, S_KV)
    padded = torch.zeros(S_Q, 64, q.shape[2], dtype=q.dtype)
    padded[:, :16] = q
    out, lse = prefill(kernels, padded, kv, slots)
    assert_within_budget(out[:, :16], lse[:, :16], q, kv[:, 0], slots, torch.ones_like(slots, dtype=torch.bool))


def test_prefill_topk_length_reads_each_rows_first_entries_only(kernels):
    gen = generator(4)
    q, kv, slots = queries(gen, S_Q, 64), bf16_kv(gen, S_KV), random_rows(gen, S_Q, TOPK, S_KV)
    lengths = torch.randint(1, TOPK + 1, (S_Q,), generator=gen)
    lengths[0], lengths[1] = 1, TOPK
    out, lse = prefill(kernels, q, kv, slots, topk_length=lengths.to(torch.int32).to(DEVICE))
    prefix = torch.arange(TOPK).unsqueeze(0) < lengths.unsqueeze(1)
    assert_within_budget(out, lse, q, kv[:, 0], slots, prefix)


def test_prefill_skips_minus_one_entries(kernels):
    gen = generator(5)
    q, kv, slots = queries(gen, S_Q, 64), bf16_kv(gen, S_KV), random_rows(gen, S_Q, TOPK, S_KV)
    invalid = torch.rand(S_Q, TOPK, generator=gen) < 0.3
    slots = torch.where(invalid, torch.full_like(slots, -1), slots)
    out, lse = prefill(kernels, q, kv, slots)
    assert_within_budget(out, lse, q, kv[:, 0], slots, ~invalid)


def test_prefill_skips_indices_at_or_past_s_kv(kernels):
    """The rows past ``s_kv`` in memory hold NaN: an index there that were read would show."""
    gen = generator(6)
    memory = bf16_kv(gen, S_KV + PAGE)
    memory[S_KV:] = float("nan")
    q, slots = queries(gen, S_Q, 64), random_rows(gen, S_Q, TOPK, S_KV)
    past = torch.rand(S_Q, TOPK, generator=gen) < 0.3
    slots = torch.where(past, S_KV + torch.randint(0, PAGE, slots.shape, generator=gen), slots)
    out, lse = prefill(kernels, q, memory[:S_KV], slots)
    assert_within_budget(out, lse, q, memory[:S_KV, 0], slots, ~past)


def test_prefill_row_with_no_valid_index_gives_zero_output_and_lse_plus_inf(kernels):
    """FlashMLA's convention for a row that reads nothing (its reference, and vLLM 0.34 under
    context parallelism, rely on it); the project's oracle gives out 0 and lse -inf there."""
    gen = generator(7)
    q, kv, slots = queries(gen, 4, 64), bf16_kv(gen, S_KV), random_rows(gen, 4, TOPK, S_KV)
    slots[1] = -1
    out, lse = prefill(kernels, q, kv, slots)
    assert bool((out[1] == 0).all()) and bool((lse[1] == float("inf")).all()), (out[1].abs().max(), lse[1])


def _sink_inputs(seed: int):
    gen = generator(seed)
    q, kv, slots = queries(gen, S_Q, 64), bf16_kv(gen, S_KV), random_rows(gen, S_Q, TOPK, S_KV)
    sink = torch.randn(64, generator=gen) * 4
    return q, kv, slots, sink


def test_attn_sink_scales_the_output_by_exp_lse_over_exp_lse_plus_exp_sink(kernels):
    q, kv, slots, sink = _sink_inputs(8)
    out, _ = prefill(kernels, q, kv, slots, attn_sink=sink.to(DEVICE))
    truth, lowp = oracle(q, kv[:, 0], slots, torch.ones_like(slots, dtype=torch.bool))
    weight = torch.sigmoid(truth[1] - sink.double())
    lowp_weight = torch.sigmoid(lowp[1] - sink.float())
    comparison = compare_to_budget("out", out.float(), truth[0] * weight.unsqueeze(-1),
                                   (lowp[0].float() * lowp_weight.unsqueeze(-1)).to(torch.bfloat16), "bfloat16")
    assert comparison.ok, comparison.summary()


def test_attn_sink_leaves_the_lse_unchanged(kernels):
    q, kv, slots, sink = _sink_inputs(9)
    _, lse = prefill(kernels, q, kv, slots)
    _, lse_sink = prefill(kernels, q, kv, slots, attn_sink=sink.to(DEVICE))
    assert torch.equal(lse, lse_sink)


def test_attn_sink_plus_inf_zeroes_the_output(kernels):
    q, kv, slots, _ = _sink_inputs(10)
    out, _ = prefill(kernels, q, kv, slots, attn_sink=torch.full((64,), float("inf"), device=DEVICE))
    assert bool((out == 0).all())


# --- the decode kernel on the fp8 layout ---------------------------------------------------------

@pytest.mark.parametrize("heads", [64, 128])
def test_decode_kernel_takes_64_and_128_heads_on_the_656_byte_layout(kernels, heads):
    gen = generator(20 + heads)
    packed, values = fp8_cache(gen, S_KV)
    q, slots = queries(gen, S_Q, heads), random_rows(gen, S_Q, TOPK, S_KV)
    out, lse = decode(kernels, q, packed, slots)
    assert_within_budget(out, lse, q, values, slots, torch.ones_like(slots, dtype=torch.bool), "float8_e4m3fn")


@pytest.mark.parametrize("heads", [16, 32])
def test_decode_kernel_refuses_heads_other_than_64_and_128(kernels, flashmla_source, heads):
    assert refusal(flashmla_source, "decode", heads) is not None, f"the decode kernel ran {heads} heads"


def test_decode_kernel_reads_each_tiles_own_scale(kernels):
    gen = generator(40)
    packed, values = fp8_cache(gen, S_KV, scales=(0.25, 2.0, 1.0, 0.5))
    q, slots = queries(gen, S_Q, 64), random_rows(gen, S_Q, TOPK, S_KV)
    out, lse = decode(kernels, q, packed, slots)
    assert_within_budget(out, lse, q, values, slots, torch.ones_like(slots, dtype=torch.bool), "float8_e4m3fn")


def test_decode_kernel_skips_minus_one_entries(kernels):
    """The decode kernel's one invalid index (FlashMLA's reference masks ``== -1`` only; unlike
    the prefill kernel it has no ``s_kv`` bound to skip by)."""
    gen = generator(41)
    packed, values = fp8_cache(gen, S_KV)
    q, slots = queries(gen, S_Q, 64), random_rows(gen, S_Q, TOPK, S_KV)
    minus_one = torch.rand(S_Q, TOPK, generator=gen) < 0.3
    slots = torch.where(minus_one, torch.full_like(slots, -1), slots)
    out, lse = decode(kernels, q, packed, slots)
    assert_within_budget(out, lse, q, values, slots, ~minus_one, "float8_e4m3fn")


def test_decode_row_with_no_valid_index_gives_zero_output_and_lse_plus_inf(kernels):
    gen = generator(43)
    packed, _ = fp8_cache(gen, S_KV)
    q, slots = queries(gen, 4, 64), random_rows(gen, 4, TOPK, S_KV)
    slots[2] = -1
    out, lse = decode(kernels, q, packed, slots)
    assert bool((out[2] == 0).all()) and bool((lse[2] == float("inf")).all()), (out[2].abs().max(), lse[2])


def test_decode_kernel_refuses_topk_length_on_the_v32_layout(kernels, flashmla_source):
    """vLLM (0.34) passes no ``topk_length`` to the SM90 decode kernel for this layout, which it
    says the kernel refuses ("V3.2 does not support dynamic topk length")."""
    assert refusal(flashmla_source, "decode", 64, with_topk_length=True) is not None, "the decode kernel ran"
