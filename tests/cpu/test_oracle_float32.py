"""The float32 mode of the oracle: the bf16-product formulation (bf16 x bf16 -> float32 matrix
products, P split into bf16 terms) that the GPU uses for bf16-exact inputs, run here
with an upcasting stand-in for the float32-output product; it must agree with float64 to
float32 precision, keep chunking bitwise, and keep poisoned unselected slots out."""

from __future__ import annotations

import pytest
import torch

import reference.oracle_fast as oracle_fast
from harness.bits import bitwise_equal
from mla_constants import DEEPSEEK_V32_SM_SCALE
from reference.oracle import sparse_mla_reference
from reference.oracle_fast import PROBABILITY_TERMS, bf16_terms

SM_SCALE = DEEPSEEK_V32_SM_SCALE


@pytest.fixture
def bf16_products(monkeypatch):
    """Route float32 mode through the bf16-product path on this device (CPU): the same
    products, written in place with the scale as alpha, from upcast operands."""
    monkeypatch.setattr(oracle_fast, "_bf16_product_into", oracle_fast._upcast_product_into)
    monkeypatch.setattr(oracle_fast, "bf16_products_into_float32", lambda device: True)


def problem(seed: int, t=6, h=4, k=64, n=200, rope=64, kv_dtype=torch.bfloat16, full=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, 512 + rope, generator=g).to(torch.bfloat16)
    kv = torch.randn(n, 512 + rope, generator=g).to(kv_dtype)
    slots = torch.randint(0, n, (t, k), generator=g, dtype=torch.int32)
    lens = torch.randint(0, k + 1, (t,), generator=g)
    lens[0] = 0
    lens[1] = k
    if full:  # every column selected: no masking at all
        lens[:] = k
    return q[..., :512], q[..., 512:], kv[:, :512], kv[:, 512:], slots, lens


def reference(p, mode, **kwargs):
    return sparse_mla_reference(*p[:5], lens=p[5], sm_scale=SM_SCALE, k_scale=0.75, mode=mode, **kwargs)


def awkward_float32_values() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.cat([
        torch.rand(20000, generator=g) ** 4,
        torch.randn(20000, generator=g) * 1e3,
        torch.tensor([0.0, 1.0, 1.0 + 2.0**-23, 2.0**-100, 3.0 * 2.0**-130, -0.0, 0.9999999]),
    ])


def test_three_bf16_terms_are_exact_for_float32_values():
    x = awkward_float32_values()
    terms = bf16_terms(x.clone(), 3)
    assert all(t.dtype == torch.bfloat16 for t in terms)
    assert torch.equal(sum(t.double() for t in terms), x.double())


@pytest.mark.parametrize("count", [1, 2])
def test_fewer_bf16_terms_stay_within_their_bound(count):
    x = awkward_float32_values()
    x = x[x.abs() > 2.0**-120]  # the bound is relative; bf16 has float32's exponent range
    rest = (x.double() - sum(t.double() for t in bf16_terms(x.clone(), count))).abs()
    bound = 2.0 ** (-8 * count) * x.double().abs()
    assert bool((rest <= bound).all()), (
        f"worst {float((rest / x.double().abs()).max()):.3g} vs {2.0 ** (-8 * count):.3g}"
    )
    if count == PROBABILITY_TERMS:
        assert float((rest / x.double().abs()).max()) > 2.0**-24, "the split is not exact: the bound is what it keeps"


def test_cpu_has_no_float32_output_bf16_product():
    assert not oracle_fast.bf16_products_into_float32(torch.device("cpu"))


@pytest.mark.parametrize("selection", ["partial", "full"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("rope", [64, 0])
def test_bf16_products_agree_with_float64(bf16_products, kv_dtype, rope, selection):
    p = problem(3, rope=rope, kv_dtype=kv_dtype, full=selection == "full")
    assert oracle_fast.float32_uses_bf16_products(*p[:4])
    out, lse = reference(p, "float32")
    truth_out, truth_lse = reference(p, "float64")
    assert out.dtype == lse.dtype == torch.float32
    finite = torch.isfinite(truth_lse)
    assert torch.equal(finite, torch.isfinite(lse)) and bool((lse[~finite] == float("-inf")).all())
    assert bool((out[~finite] == 0).all())
    torch.testing.assert_close(lse[finite].double(), truth_lse[finite], rtol=0, atol=2e-5)
    torch.testing.assert_close(out.double(), truth_out, rtol=0, atol=2e-5)


def test_bf16_products_chunked_equals_unchunked_bitwise(bf16_products):
    p = problem(4)
    whole = reference(p, "float32")
    chunked = reference(p, "float32", memory_budget_bytes=1)
    assert len(whole) == len(chunked) and all(bitwise_equal(a, b) for a, b in zip(whole, chunked, strict=True))


def test_bf16_products_keep_poisoned_unselected_slots_out(bf16_products):
    q_nope, q_pe, ckv, kpe, slots, lens = problem(5)
    cols = torch.arange(slots.shape[1]).unsqueeze(0)
    selected = cols < lens.unsqueeze(1)
    slots = torch.where(selected, slots % (ckv.shape[0] - 1) + 1, torch.full_like(slots, -1))
    clean = reference((q_nope, q_pe, ckv, kpe, slots, lens), "float32")
    kv = torch.cat([ckv, kpe], dim=1).clone()
    kv[0] = float("nan")
    poisoned = reference((q_nope, q_pe, kv[:, :512], kv[:, 512:], slots, lens), "float32")
    assert len(clean) == len(poisoned) and all(bitwise_equal(a, b) for a, b in zip(clean, poisoned, strict=True))
    assert not bool(torch.isnan(poisoned[0]).any())


def test_float32_inputs_take_the_float32_products():
    q_nope, q_pe, ckv, kpe, _, _ = problem(6)
    assert not oracle_fast.float32_uses_bf16_products(q_nope.float(), q_pe.float(), ckv, kpe)


def test_device_probes_run_once_per_cuda_device_and_never_elsewhere(monkeypatch):
    monkeypatch.setattr(oracle_fast, "_PROBES", {})
    calls = []

    def check(device):
        calls.append(device)
        if device.index == 1:
            raise RuntimeError("no such kernel")
        return True

    assert not oracle_fast._cuda_probe("x", torch.device("cpu"), check)
    assert oracle_fast._cuda_probe("x", "cuda:0", check) and oracle_fast._cuda_probe("x", torch.device("cuda:0"), check)
    assert not oracle_fast._cuda_probe("x", "cuda:1", check) and not oracle_fast._cuda_probe("x", "cuda:1", check)
    assert calls == [torch.device("cuda:0"), torch.device("cuda:1")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_product_into_ignores_what_dst_held_unless_accumulating(dtype):
    """The oracle writes its products into uninitialised buffers: beta 0 must not read them."""
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(3, 4, 5, generator=g, dtype=dtype), torch.randn(3, 5, 6, generator=g, dtype=dtype)
    dst = torch.full((3, 4, 6), float("nan"), dtype=dtype)
    oracle_fast.product_into(dst, a, b, alpha=0.5)
    torch.testing.assert_close(dst, 0.5 * (a @ b))
    oracle_fast.product_into(dst, a, b, accumulate=True)
    torch.testing.assert_close(dst, 1.5 * (a @ b))


def test_probe_accepts_exact_float32_products_and_refuses_bf16_rounded_ones(monkeypatch):
    monkeypatch.setattr(oracle_fast, "_bf16_product_into", oracle_fast._upcast_product_into)
    assert oracle_fast._bf16_products_keep_float32(torch.device("cpu"))

    def rounded_to_bf16(dst, a, b, alpha, accumulate):
        return dst.copy_(oracle_fast._upcast_product_into(dst, a, b, alpha, accumulate).to(torch.bfloat16))

    monkeypatch.setattr(oracle_fast, "_bf16_product_into", rounded_to_bf16)
    assert not oracle_fast._bf16_products_keep_float32(torch.device("cpu"))

    def reads_dst_at_beta_0(dst, a, b, alpha, accumulate):
        return torch.baddbmm(dst, a.float(), b.float(), beta=1.0, alpha=alpha, out=dst)

    monkeypatch.setattr(oracle_fast, "_bf16_product_into", reads_dst_at_beta_0)
    assert not oracle_fast._bf16_products_keep_float32(torch.device("cpu"))
