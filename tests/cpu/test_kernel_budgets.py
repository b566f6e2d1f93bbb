"""The per-kernel parts of the one tolerance policy: fa2's LSE floor."""

from __future__ import annotations

import torch

from reference.budget import LSE_ULPS, compare_attention, lse_ulps


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
