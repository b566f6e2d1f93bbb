"""The per-kernel parts of the one tolerance policy: fa2's LSE floor, and what the bf16 NoPE
rounding finding accepts (only the output's max error, within its ceiling, on bf16 NoPE)."""

from __future__ import annotations

import torch

from harness.cases import KernelConfig, context_case
from harness.findings import NOPE_ROUNDING_CEILING, nope_rounding_only
from reference.budget import LSE_ULPS, Comparison, compare_attention, lse_ulps


def _pair(shift: float):
    truth = torch.full((2, 4), 10.0, dtype=torch.float64)
    lowp = truth + 1e-7
    return truth, lowp, truth + shift


def test_fa2_lse_floor_is_its_own_and_others_keep_the_common_one():
    assert lse_ulps(None) == lse_ulps("fa3") == LSE_ULPS
    assert lse_ulps("fa2") > LSE_ULPS
    truth, lowp, lse = _pair(1e-3)  # fa2's measured size of LSE error at |lse| 10
    out_t = torch.zeros(2, 4, 8, dtype=torch.float64)
    fa3 = compare_attention(out_t, lse, (out_t, truth), (out_t, lowp))
    fa2 = compare_attention(out_t, lse, (out_t, truth), (out_t, lowp), kernel="fa2")
    assert not fa3[1].ok and fa2[1].ok
    _, _, far = _pair(1e-2)  # ten times more is beyond fa2's floor too
    assert not compare_attention(out_t, far, (out_t, truth), (out_t, lowp), kernel="fa2")[1].ok


def _comparison(name, ratio, problems):
    return Comparison(name, not problems, ratio, 1.1, 0.0, 0.0, 0.0, problems)


def test_nope_rounding_finding_accepts_only_the_output_max_on_bf16_nope():
    nope = KernelConfig("bfloat16", False, 32).apply(context_case(2049, 4).spec)
    rope = KernelConfig("bfloat16", True, 32).apply(context_case(2049, 4).spec)
    just_past = [_comparison("out", 2.02, ["max err 0.0026 > 2.0 x lowp"]), _comparison("lse", 3.0, [])]
    assert nope_rounding_only(nope, just_past)
    assert not nope_rounding_only(rope, just_past)
    assert not nope_rounding_only(nope, [_comparison("out", NOPE_ROUNDING_CEILING + 0.5, ["max err x"])])
    assert not nope_rounding_only(nope, [_comparison("out", 2.1, ["max err x", "mean err y"])])
    assert not nope_rounding_only(nope, [_comparison("lse", 2.1, ["max err x"])])
    assert not nope_rounding_only(nope, [_comparison("out", 1.0, [])])
