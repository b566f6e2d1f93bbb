"""The dense oracle (reference.oracle.sparse_mla_reference) against hand-computed answers, a
naive per-element float64 loop, and the algebraic properties of attention over a multiset of
slots (docs/computation.md#the-computation); its float32 and lowp modes against the float64
definition; plus its input validation and memory chunking."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mla_constants import DEEPSEEK_V32_SM_SCALE, KV_LORA_RANK, ROPE_DIM
from reference.contract import (
    FIRST_SLOT,
    SLOT_ZERO,
    OracleDifference,
    contract_reference,
    filled_slots,
    implementation_reference,
    oracle_differences,
)
from reference.oracle import (
    COMPUTE_MODES,
    DEFAULT_MEMORY_BUDGET_BYTES,
    LOG2_E,
    lse_from_base2,
    lse_to_base2,
    sparse_mla_float64,
    sparse_mla_reference,
)
from reference.oracle_fast import CPU_CHUNK_BYTES, _row_bytes, chunk_budget_bytes, joined_parts, rows_per_chunk
from reference.oracle_inputs import SelectionFacts, check_selection, selection_mask

D = KV_LORA_RANK
ROPE = ROPE_DIM
SM_SCALE = DEEPSEEK_V32_SM_SCALE
F32_UNIT = 2.0**-24  # float32 unit roundoff
BF16_UNIT = 2.0**-8  # bf16 unit roundoff (7 stored mantissa bits)
F64_TIGHT = dict(rtol=1e-13, atol=1e-13)  # float64 results that differ only in summation order
INF = math.inf


# --- problems ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    q_nope: torch.Tensor  # [T, H, 512]
    q_pe: torch.Tensor  # [T, H, R]
    ckv: torch.Tensor  # [N, 512]
    kpe: torch.Tensor  # [N, R]
    slots: torch.Tensor  # [T, K]
    lens: torch.Tensor  # [T]
    sm_scale: float = SM_SCALE

    @property
    def mask(self) -> torch.Tensor:
        return selection_mask(self.slots, self.lens)

    @property
    def num_slots(self) -> int:
        return self.ckv.shape[0]

    def describe(self) -> str:
        t, h, _ = self.q_nope.shape
        return (f"T={t} H={h} K={self.slots.shape[1]} N={self.num_slots} R={self.q_pe.shape[2]} "
                f"lens={self.lens.tolist()} slots={self.slots.tolist()}")


def random_problem(seed: int, t: int, h: int, k: int, num_slots: int, rope: int = ROPE, lens=None,
                   dtype=torch.bfloat16) -> Problem:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, D + rope, generator=g).to(dtype)
    kv = torch.randn(num_slots, D + rope, generator=g).to(dtype)
    slots = torch.randint(0, num_slots, (t, k), generator=g, dtype=torch.int32)
    if lens is None:
        lens = torch.randint(0, k + 1, (t,), generator=g)
    lens = torch.as_tensor(lens, dtype=torch.int64)
    cols = torch.arange(k).unsqueeze(0)
    slots = torch.where(cols < lens.unsqueeze(1), slots, torch.full_like(slots, -1))
    return Problem(q[..., :D], q[..., D:], kv[:, :D], kv[:, D:], slots, lens)


def run(p: Problem, mode: str = "float64", *, use_mask=None, **kwargs):
    """The oracle on a problem: selection by ``p.lens``, or by ``use_mask`` when given."""
    select = {"mask": use_mask} if use_mask is not None else {"lens": p.lens}
    return sparse_mla_reference(p.q_nope, p.q_pe, p.ckv, p.kpe, p.slots, sm_scale=p.sm_scale, mode=mode,
                                **select, **kwargs)


@st.composite
def problems(draw, min_len: int = 0) -> Problem:
    t = draw(st.integers(1, 6))
    h = draw(st.integers(1, 4))
    k = draw(st.integers(max(1, min_len), 16))
    n = draw(st.integers(1, 64))
    rope = draw(st.sampled_from((ROPE, 0)))
    lens = draw(st.lists(st.integers(min_len, k), min_size=t, max_size=t))
    return random_problem(draw(st.integers(0, 2**31 - 1)), t, h, k, n, rope, lens)


# --- helpers -------------------------------------------------------------------------------


def naive_attention(p: Problem, mask: torch.Tensor, k_scale: float = 1.0):
    """Per row, head and selected entry, in float64 Python loops: the definition
    (docs/computation.md#the-computation) written independently of reference/oracle.py."""
    t_rows, heads, _ = p.q_nope.shape
    qn, qp = p.q_nope.double(), p.q_pe.double()
    ckv, kpe = p.ckv.double() * k_scale, p.kpe.double() * k_scale
    out = torch.zeros(t_rows, heads, D, dtype=torch.float64)
    lse = torch.full((t_rows, heads), -INF, dtype=torch.float64)
    for t in range(t_rows):
        selected = [int(p.slots[t, j]) for j in range(p.slots.shape[1]) if bool(mask[t, j])]
        if not selected:
            continue
        for h in range(heads):
            scores = [p.sm_scale * (float(torch.dot(qn[t, h], ckv[j])) + float(torch.dot(qp[t, h], kpe[j])))
                      for j in selected]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = math.fsum(weights)
            lse[t, h] = top + math.log(total)
            acc = torch.zeros(D, dtype=torch.float64)
            for w, j in zip(weights, selected, strict=True):
                acc += (w / total) * ckv[j]
            out[t, h] = acc
    return out, lse


def merge(out_a, lse_a, out_b, lse_b):
    """Combine attention over two disjoint parts of a selection by their LSEs."""
    lse = torch.logaddexp(lse_a, lse_b)
    ref = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w_a, w_b = torch.exp(lse_a - ref).unsqueeze(-1), torch.exp(lse_b - ref).unsqueeze(-1)
    return w_a * out_a + w_b * out_b, lse


def float32_score_error_bound(p: Problem, mask: torch.Tensor) -> float:
    """Worst-case float32 rounding error of one score: n * u * sm_scale * sum|q_i k_i| (n = D + R)."""
    qn, qp = p.q_nope.double().abs(), p.q_pe.double().abs()
    kc, kp = p.ckv.double().abs(), p.kpe.double().abs()
    worst = 0.0
    for t in range(p.slots.shape[0]):
        sel = p.slots[t][mask[t]].long()
        if sel.numel():
            mags = qn[t] @ kc[sel].T + (qp[t] @ kp[sel].T if qp.shape[-1] else 0.0)
            worst = max(worst, float(mags.max()))
    return (D + p.q_pe.shape[2] + 2) * F32_UNIT * p.sm_scale * worst


def assert_same(actual, expected, what: str):
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    same = (actual == expected) | (torch.isnan(actual) & torch.isnan(expected))
    if not bool(same.all()):
        first = tuple(same.logical_not().nonzero()[0].tolist())
        raise AssertionError(f"{what}: {int((~same).sum())} entries differ, first at {first}: "
                             f"{actual[first].item()} vs {expected[first].item()}")


def one_hot(i: int, scale: float = 1.0, dim: int = D) -> torch.Tensor:
    v = torch.zeros(dim, dtype=torch.float64)
    v[i] = scale
    return v


# --- hand-computed cases -------------------------------------------------------------------


def test_equal_scores_give_uniform_weights_exactly():
    """q = 0: every score is 0, out is the plain mean of the selected rows, lse = ln(count)."""
    ckv = torch.stack([one_hot(j, j + 1.0) for j in range(4)])
    p = Problem(q_nope=torch.zeros(1, 1, D, dtype=torch.float64), q_pe=torch.zeros(1, 1, 0, dtype=torch.float64),
                ckv=ckv, kpe=torch.zeros(4, 0, dtype=torch.float64),
                slots=torch.tensor([[3, 0, 2, 1, -1]]), lens=torch.tensor([4]), sm_scale=0.37)
    out, lse = run(p)
    expected = torch.zeros(D, dtype=torch.float64)
    expected[:4] = torch.tensor([0.25, 0.5, 0.75, 1.0])
    assert_same(out[0, 0], expected, "out")
    assert lse[0, 0].item() == math.log(4)


def test_rope_part_sets_the_weights_and_only_ckv_is_averaged():
    """q_nope orthogonal to ckv, q_pe . kpe = ln 3 / sm_scale on slot 0: weights 3/4, 1/4."""
    sm = 0.5
    ckv = torch.stack([one_hot(1, 2.0), one_hot(2, 4.0)])
    kpe = torch.stack([one_hot(3, math.log(3) / sm, ROPE), torch.zeros(ROPE, dtype=torch.float64)])
    p = Problem(q_nope=one_hot(0).view(1, 1, D), q_pe=one_hot(3, dim=ROPE).view(1, 1, ROPE), ckv=ckv, kpe=kpe,
                slots=torch.tensor([[0, 1]]), lens=torch.tensor([2]), sm_scale=sm)
    out, lse = run(p)
    expected = 0.75 * ckv[0] + 0.25 * ckv[1]  # 1.5 e1 + 1.0 e2
    torch.testing.assert_close(out[0, 0], expected, rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(lse[0, 0].item(), math.log(4), rtol=1e-15, atol=1e-15)


def test_hand_computed_heads_rows_duplicates_and_empty_row():
    """sm_scale 1, ckv = [e0, e1]. Head 0 has q = ln2 e0, head 1 q = -ln2 e0.
    Row 0 selects {0, 1}: head 0 weights (2/3, 1/3), lse ln 3; head 1 weights (1/3, 2/3), lse ln 1.5.
    Row 1 selects nothing: out 0, lse -inf. Row 2 selects {1, 1}: out e1, lse ln 2 on both heads."""
    ln2 = math.log(2)
    q_head = torch.stack([one_hot(0, ln2), one_hot(0, -ln2)])  # [H=2, D]
    p = Problem(q_nope=q_head.expand(3, 2, D).clone(), q_pe=torch.zeros(3, 2, ROPE, dtype=torch.float64),
                ckv=torch.stack([one_hot(0), one_hot(1)]), kpe=torch.zeros(2, ROPE, dtype=torch.float64),
                slots=torch.tensor([[0, 1, -1], [-1, -1, -1], [1, 1, -1]]), lens=torch.tensor([2, 0, 2]),
                sm_scale=1.0)
    out, lse = run(p)
    e0, e1 = one_hot(0), one_hot(1)
    expected_out = torch.stack([
        torch.stack([2 / 3 * e0 + 1 / 3 * e1, 1 / 3 * e0 + 2 / 3 * e1]),
        torch.zeros(2, D, dtype=torch.float64),
        torch.stack([e1, e1]),
    ])
    expected_lse = torch.tensor([[math.log(3), math.log(1.5)], [-INF, -INF], [ln2, ln2]], dtype=torch.float64)
    torch.testing.assert_close(out, expected_out, rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-15, atol=1e-15)


# --- against the naive loop ----------------------------------------------------------------


def naive_case() -> tuple[Problem, torch.Tensor]:
    """T=3, H=2, N=10, K=6: duplicates, -1 and garbage past each row's selection, one row
    selected by a non-prefix mask."""
    p = random_problem(seed=11, t=3, h=2, k=6, num_slots=10, lens=[6, 3, 4])
    slots = torch.tensor([[4, 7, 4, 1, 9, 4],  # slot 4 three times
                          [2, 2, 5, -1, 123, -9],  # garbage past len 3
                          [0, 8, 3, 8, 0, 0]], dtype=torch.int32)
    mask = torch.tensor([[True] * 6,
                         [True, True, True, False, False, False],
                         [True, False, True, True, False, True]])  # non-prefix: skips columns 1 and 4
    return replace(p, slots=slots), mask


def test_float64_matches_naive_loop():
    p, mask = naive_case()
    out, lse = run(p, use_mask=mask)
    ref_out, ref_lse = naive_attention(p, mask)
    torch.testing.assert_close(out, ref_out, **F64_TIGHT)
    torch.testing.assert_close(lse, ref_lse, **F64_TIGHT)


def test_float64_mode_is_the_definition():
    """The entry point's float64 mode is sparse_mla_float64 on the checked inputs, bit for bit."""
    p, mask = naive_case()
    for a, b, what in zip(run(p, use_mask=mask), sparse_mla_float64(p.q_nope, p.q_pe, p.ckv, p.kpe, p.slots, mask,
                                                                    sm_scale=p.sm_scale), ("out", "lse"), strict=True):
        assert_same(a, b, f"float64 {what}")


def test_float32_matches_naive_loop_within_float32_rounding():
    """Inputs are bf16 (exact in float32); the only error is float32 arithmetic: each score is
    off by at most the dot-product bound, the weights by twice that, relatively."""
    p, mask = naive_case()
    out, lse = run(p, "float32", use_mask=mask)
    ref_out, ref_lse = naive_attention(p, mask)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    ds = float32_score_error_bound(p, mask)
    max_kv = float(p.ckv.double().abs().max())
    torch.testing.assert_close(lse.double(), ref_lse, rtol=4 * F32_UNIT, atol=ds)
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=(2 * ds + 16 * F32_UNIT) * max_kv)


def test_lowp_matches_naive_loop_within_bf16_rounding():
    """lowp rounds probabilities and the output to bf16: |error| <= 2u(1+u) max|ckv| plus the
    float32 score error; LSE stays float32."""
    p, mask = naive_case()
    out, lse = run(p, "lowp", use_mask=mask)
    ref_out, ref_lse = naive_attention(p, mask)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ds = float32_score_error_bound(p, mask)
    max_kv = float(p.ckv.double().abs().max())
    bound = (2 * BF16_UNIT * (1 + BF16_UNIT) + 2 * ds + 16 * F32_UNIT) * max_kv
    torch.testing.assert_close(lse.double(), ref_lse, rtol=4 * F32_UNIT, atol=ds)
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=bound)


def test_lowp_error_exceeds_float32_error():
    """lowp is the working-precision yardstick: it must actually round (more error than float32)."""
    p = random_problem(seed=5, t=4, h=4, k=16, num_slots=40, lens=[16] * 4)
    truth, _ = run(p)
    err32 = (run(p, "float32")[0].double() - truth).abs().max()
    errlp = (run(p, "lowp")[0].double() - truth).abs().max()
    assert errlp > 10 * err32 > 0, f"lowp max err {errlp:.3g} vs float32 {err32:.3g}"


def test_lowp_rounds_the_probabilities_not_only_the_output():
    """Weights 0.5005 / 0.4995 on ckv = +1000 e0 / -1000 e0: the answer (about 1.0) is a
    cancellation, so bf16 probabilities (spacing 2^-9 near 0.5) move it by far more than rounding
    the output alone could (2^-8 relative)."""
    x = float(torch.tensor(math.log(0.5005 / 0.4995), dtype=torch.float32))
    p = Problem(q_nope=torch.zeros(1, 1, D, dtype=torch.bfloat16), q_pe=one_hot(0, dim=ROPE).view(1, 1, ROPE),
                ckv=torch.stack([one_hot(0, 1000.0), one_hot(0, -1000.0)]),
                kpe=torch.stack([one_hot(0, x, ROPE), torch.zeros(ROPE, dtype=torch.float64)]),
                slots=torch.tensor([[0, 1]]), lens=torch.tensor([2]), sm_scale=1.0)
    truth = run(p)[0][0, 0, 0].item()
    lowp = run(p, "lowp")[0][0, 0, 0].item()
    assert truth == pytest.approx(1.0, rel=1e-3)
    assert abs(lowp - truth) > 16 * BF16_UNIT * abs(truth), f"lowp {lowp} vs truth {truth}"


@given(p=problems())
def test_float64_matches_naive_loop_on_random_problems(p):
    out, lse = run(p)
    ref_out, ref_lse = naive_attention(p, p.mask)
    torch.testing.assert_close(out, ref_out, **F64_TIGHT, msg=lambda m: f"{p.describe()}\n{m}")
    torch.testing.assert_close(lse, ref_lse, **F64_TIGHT, msg=lambda m: f"{p.describe()}\n{m}")


# --- properties ----------------------------------------------------------------------------


@given(p=problems(), seed=st.integers(0, 2**31 - 1))
def test_permuting_selected_slots_changes_nothing(p, seed):
    g = torch.Generator().manual_seed(seed)
    slots = p.slots.clone()
    for t, n in enumerate(p.lens.tolist()):
        slots[t, :n] = slots[t, :n][torch.randperm(n, generator=g)]
    out, lse = run(p)
    out_perm, lse_perm = run(replace(p, slots=slots))
    torch.testing.assert_close(out_perm, out, **F64_TIGHT, msg=lambda m: f"{p.describe()}\n{m}")
    torch.testing.assert_close(lse_perm, lse, **F64_TIGHT, msg=lambda m: f"{p.describe()}\n{m}")


@given(p=problems(min_len=1))
def test_duplicated_slot_counts_twice(p):
    """Appending a second copy of column 0's slot adds exp(score of that slot) to the sum:
    lse' = logaddexp(lse, s0), out' = merge(out, lse; ckv[s0], s0)."""
    slots = torch.cat([p.slots, p.slots[:, :1]], dim=1)
    mask = torch.cat([p.mask, torch.ones(p.slots.shape[0], 1, dtype=torch.bool)], dim=1)
    out_dup, lse_dup = run(replace(p, slots=slots), use_mask=mask)
    out, lse = run(p)
    only_first = torch.zeros_like(p.mask)
    only_first[:, 0] = True
    out_one, lse_one = run(p, use_mask=only_first)  # out_one = ckv[s0], lse_one = s0
    exp_out, exp_lse = merge(out, lse, out_one, lse_one)
    torch.testing.assert_close(lse_dup, exp_lse, **F64_TIGHT, msg=lambda m: f"{p.describe()}\n{m}")
    torch.testing.assert_close(out_dup, exp_out, **F64_TIGHT, msg=lambda m: f"{p.describe()}\n{m}")


def test_slot_selected_twice_alone_has_its_value_and_lse_plus_ln2():
    p = random_problem(seed=3, t=2, h=3, k=2, num_slots=6, lens=[1, 2])
    p = replace(p, q_nope=p.q_nope[:1].expand(2, -1, -1).clone(), q_pe=p.q_pe[:1].expand(2, -1, -1).clone(),
                slots=torch.tensor([[4, -1], [4, 4]], dtype=torch.int32))
    out, lse = run(p)
    torch.testing.assert_close(out[1], out[0], rtol=1e-15, atol=0)
    torch.testing.assert_close(lse[1], lse[0] + math.log(2), **F64_TIGHT)
    torch.testing.assert_close(out[0], p.ckv[4].double().expand(3, D), rtol=0, atol=0)


GARBAGE = (-1, -2, -(2**31), 2**31 - 1, 64, 10**6)


@given(p=problems(), garbage=st.sampled_from(GARBAGE))
def test_unselected_entries_and_lens_vs_mask_do_not_matter(p, garbage):
    """Entries outside the selection may hold anything; lens and the equivalent mask agree bitwise."""
    out, lse = run(p)
    dirty = torch.where(p.mask, p.slots, torch.full_like(p.slots, garbage))
    for label, kwargs in (("lens", {}), ("mask", {"use_mask": p.mask})):
        for slots_label, slots in (("clean", p.slots), (f"garbage {garbage}", dirty)):
            out_var, lse_var = run(replace(p, slots=slots), **kwargs)
            assert_same(out_var, out, f"out with {label}, {slots_label} unselected entries; {p.describe()}")
            assert_same(lse_var, lse, f"lse with {label}, {slots_label} unselected entries; {p.describe()}")


@given(p=problems(), seed=st.integers(0, 2**31 - 1))
def test_non_prefix_mask_equals_its_compacted_prefix(p, seed):
    """A mask with holes attends the same multiset as the selected entries moved to the front."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(p.slots.shape, generator=g) < 0.5
    slots = torch.where(mask, torch.randint(0, p.num_slots, p.slots.shape, generator=g, dtype=torch.int32),
                        torch.full_like(p.slots, -1))
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices
    compact = replace(p, slots=torch.gather(slots, 1, order), lens=mask.sum(dim=1))
    out, lse = run(replace(p, slots=slots), use_mask=mask)
    out_c, lse_c = run(compact)
    torch.testing.assert_close(out, out_c, **F64_TIGHT, msg=lambda m: f"mask={mask.tolist()}\n{m}")
    torch.testing.assert_close(lse, lse_c, **F64_TIGHT, msg=lambda m: f"mask={mask.tolist()}\n{m}")


@given(p=problems(), seed=st.integers(0, 2**31 - 1))
def test_two_disjoint_halves_merge_to_the_whole_row(p, seed):
    """out and lse are consistent: attention over A and over B, merged by their LSEs, is
    attention over A + B (either half may be empty)."""
    g = torch.Generator().manual_seed(seed)
    half = torch.rand(p.slots.shape, generator=g) < 0.5
    out_a, lse_a = run(p, use_mask=p.mask & half)
    out_b, lse_b = run(p, use_mask=p.mask & ~half)
    out, lse = run(p)
    m_out, m_lse = merge(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(m_lse, lse, **F64_TIGHT, msg=lambda m: f"{p.describe()}\n{m}")
    torch.testing.assert_close(m_out, out, **F64_TIGHT, msg=lambda m: f"{p.describe()}\n{m}")


@pytest.mark.parametrize("mode", COMPUTE_MODES)
def test_empty_rows_give_zero_output_and_minus_inf_lse(mode):
    p = random_problem(seed=7, t=4, h=3, k=8, num_slots=20, lens=[0, 5, 0, 8])
    poisoned = p.ckv.clone()
    poisoned[0] = float("nan")  # an empty row must not even read slot 0
    out, lse = run(replace(p, ckv=poisoned, slots=p.slots.clamp(min=1)), mode)
    for row in (0, 2):
        assert bool((out[row] == 0).all()), f"{mode}: empty row {row} out is not 0: {out[row].abs().max()}"
        assert bool((lse[row] == -INF).all()), f"{mode}: empty row {row} lse {lse[row].tolist()} != -inf"
    for row in (1, 3):
        assert bool(torch.isfinite(lse[row]).all()) and bool(torch.isfinite(out[row]).all()), f"{mode}: row {row}"


def test_zero_width_selection_gives_empty_rows():
    p = random_problem(seed=8, t=2, h=2, k=4, num_slots=5, lens=[0, 0])
    out, lse = run(replace(p, slots=p.slots[:, :0]))
    assert bool((out == 0).all()) and bool((lse == -INF).all())


def test_lse_base2_helpers_round_trip():
    lse = torch.tensor([-INF, -3.5, 0.0, math.log(8), 1e3], dtype=torch.float64)
    base2 = lse_to_base2(lse)
    assert base2[3].item() == pytest.approx(3.0, rel=1e-15)
    assert base2[0].item() == -INF and lse_from_base2(base2)[0].item() == -INF
    torch.testing.assert_close(lse_from_base2(base2), lse, rtol=1e-15, atol=0)
    assert LOG2_E == pytest.approx(1 / math.log(2), rel=1e-16)


def test_lse_to_base2_is_log2_of_the_sum_of_exponentials():
    p = random_problem(seed=9, t=3, h=2, k=8, num_slots=16, lens=[8, 3, 1])
    _, lse = run(p)
    scores = torch.einsum("thd,tkd->thk", p.q_nope.double(), p.ckv.double()[p.slots.clamp(min=0).long()])
    scores = scores + torch.einsum("thr,tkr->thk", p.q_pe.double(), p.kpe.double()[p.slots.clamp(min=0).long()])
    scores = (scores * p.sm_scale).masked_fill(~p.mask.unsqueeze(1), -INF)
    expected = torch.log2(torch.exp2(scores * LOG2_E).sum(dim=-1))
    torch.testing.assert_close(lse_to_base2(lse), expected, **F64_TIGHT)


@pytest.mark.parametrize("mode", COMPUTE_MODES)
def test_nope_equals_rope_with_a_zero_rope_query(mode):
    """R = 0 (NoPE) is the R = 64 computation with the rope part contributing nothing."""
    p = random_problem(seed=12, t=3, h=2, k=8, num_slots=20, lens=[8, 2, 5])
    nope = replace(p, q_pe=p.q_pe[..., :0], kpe=p.kpe[:, :0])
    zero_rope = replace(p, q_pe=torch.zeros_like(p.q_pe))
    out, lse = run(nope, mode)
    out_r, lse_r = run(zero_rope, mode)
    assert out.shape == (3, 2, D)
    assert_same(out, out_r, f"{mode} out")
    assert_same(lse, lse_r, f"{mode} lse")
    torch.testing.assert_close(run(nope)[0], naive_attention(nope, nope.mask)[0], **F64_TIGHT)


def fp8_problem(seed: int) -> tuple[Problem, torch.Tensor]:
    p = random_problem(seed=seed, t=4, h=2, k=10, num_slots=24, lens=[10, 4, 0, 7])
    g = torch.Generator().manual_seed(seed + 1)
    cache8 = (torch.randn(24, D + ROPE, generator=g) * 3).to(torch.float8_e4m3fn)
    return p, cache8


@pytest.mark.parametrize("mode", COMPUTE_MODES)
def test_fp8_with_power_of_two_scale_equals_bf16_of_dequantised_values(mode):
    """fp8 e4m3 values times 2 are exact in bf16, and scaling by 2 commutes with rounding, so the
    fp8 path with k_scale 2 equals the bf16 path on the dequantised cache bitwise."""
    p, cache8 = fp8_problem(seed=21)
    dequant = cache8.to(torch.bfloat16) * 2.0
    assert torch.equal(dequant.double(), cache8.double() * 2.0)
    fp8 = replace(p, ckv=cache8[:, :D], kpe=cache8[:, D:])
    bf16 = replace(p, ckv=dequant[:, :D], kpe=dequant[:, D:])
    out8, lse8 = run(fp8, mode, k_scale=2.0)
    out16, lse16 = run(bf16, mode)
    assert_same(out8, out16, f"{mode} out")
    assert_same(lse8, lse16, f"{mode} lse")


def test_fp8_with_arbitrary_scale_equals_float64_dequantised_values():
    p, cache8 = fp8_problem(seed=22)
    k_scale = 0.37
    dequant = cache8.double() * k_scale
    out8, lse8 = run(replace(p, ckv=cache8[:, :D], kpe=cache8[:, D:]), k_scale=k_scale)
    deq = replace(p, ckv=dequant[:, :D], kpe=dequant[:, D:])
    out, lse = run(deq)
    torch.testing.assert_close(out8, out, **F64_TIGHT)
    torch.testing.assert_close(lse8, lse, **F64_TIGHT)
    torch.testing.assert_close(out8, naive_attention(deq, deq.mask)[0], **F64_TIGHT)
    # the scale matters: ignoring it changes the answer
    out_unscaled, _ = run(replace(p, ckv=cache8[:, :D], kpe=cache8[:, D:]))
    assert not torch.allclose(out_unscaled[0], out8[0])


def test_kernel_style_n_1_d_views_are_accepted():
    p = random_problem(seed=13, t=2, h=2, k=6, num_slots=12, lens=[6, 3])
    cache = torch.cat([p.ckv, p.kpe], dim=1).view(-1, 1, D + ROPE)
    out, lse = run(replace(p, ckv=cache[..., :D], kpe=cache[..., D:]))
    out_ref, lse_ref = run(p)
    assert_same(out, out_ref, "out")
    assert_same(lse, lse_ref, "lse")


def test_joined_parts_is_one_view_only_for_adjacent_halves():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, D + ROPE, generator=g)
    (joined,) = joined_parts(q[..., :D], q[..., D:])
    assert joined.data_ptr() == q.data_ptr() and torch.equal(joined, q)
    cache = torch.randn(7, 1, D + ROPE, generator=g)[:, 0, :]
    (joined,) = joined_parts(cache[:, :D], cache[:, D:])
    assert torch.equal(joined, cache)
    (nope,) = joined_parts(cache[:, :D], cache[:, D:D])  # R = 0
    assert nope.shape == (7, D)
    assert len(joined_parts(q[..., :D].clone(), q[..., D:].clone())) == 2, "separate buffers"
    assert len(joined_parts(q[..., :D], q[..., D - ROPE : D])) == 2, "overlapping, not following"
    assert len(joined_parts(q[1:, :, :D], q[:-1, :, D:])) == 2, "different rows"
    assert len(joined_parts(q[..., :D].double(), q[..., D:].double())) == 2


@pytest.mark.parametrize("mode", COMPUTE_MODES)
def test_joined_and_separate_buffers_agree_bitwise(mode):
    """q and the cache as halves of one buffer (gathered and multiplied as one) or as separate
    tensors (joined piece by piece) give the same bits."""
    p = random_problem(seed=21, t=5, h=3, k=12, num_slots=30)
    separate = replace(p, q_nope=p.q_nope.clone(), q_pe=p.q_pe.clone(), ckv=p.ckv.clone(), kpe=p.kpe.clone())
    for a, b, what in zip(run(p, mode), run(separate, mode), ("out", "lse"), strict=True):
        assert_same(b, a, f"{mode} {what}: separate buffers vs one buffer")


@pytest.mark.parametrize("mode", COMPUTE_MODES)
@pytest.mark.parametrize("rows_per", [1, 2])
def test_chunked_path_equals_unchunked_bitwise(mode, rows_per):
    p = random_problem(seed=14, t=5, h=3, k=12, num_slots=30)
    budget = rows_per * _row_bytes(3, 12, D, ROPE, 8 if mode == "float64" else 4) if rows_per > 1 else 1
    assert rows_per_chunk(3, 12, D, ROPE, mode, budget) == rows_per
    out, lse = run(p, mode)
    out_c, lse_c = run(p, mode, memory_budget_bytes=budget)
    assert_same(out_c, out, f"{mode} out with {rows_per} row(s) per chunk")
    assert_same(lse_c, lse, f"{mode} lse with {rows_per} row(s) per chunk")


@pytest.mark.parametrize("mode", COMPUTE_MODES)
def test_poisoned_slots_that_are_not_selected_do_not_leak(mode):
    """NaN in slot 0 (what unselected columns gather) and in every slot only referenced by
    unselected entries stays out of the result; a selected NaN slot shows up."""
    base = random_problem(seed=15, t=4, h=2, k=8, num_slots=32, lens=[8, 3, 0, 5])
    p = replace(base, slots=torch.where(base.mask, base.slots % 31 + 1, torch.full_like(base.slots, -1)))
    used = set(p.slots[p.mask].tolist())
    unused = [s for s in range(32) if s not in used]
    assert unused[0] == 0 and len(unused) > 1, "test setup: slot 0 and another slot must be unselected"
    # unselected entries: -1 (gathers slot 0) and poisoned slots that no selection uses
    cols = torch.arange(p.slots.shape[1]).expand_as(p.slots)
    filler = torch.where(cols % 2 == 0, torch.full_like(p.slots, -1), torch.full_like(p.slots, unused[-1]))
    slots = torch.where(p.mask, p.slots, filler)
    poisoned_ckv, poisoned_kpe = p.ckv.clone(), p.kpe.clone()
    poisoned_ckv[unused] = float("nan")
    poisoned_kpe[unused] = float("nan")
    out, lse = run(replace(p, slots=slots, ckv=poisoned_ckv, kpe=poisoned_kpe), mode)
    out_ref, lse_ref = run(p, mode)
    assert_same(out, out_ref, f"{mode} out with poisoned unselected slots")
    assert_same(lse, lse_ref, f"{mode} lse with poisoned unselected slots")
    selected_nan = p.slots.clone()
    selected_nan[0, 0] = unused[0]
    out_nan, _ = run(replace(p, slots=selected_nan, ckv=poisoned_ckv, kpe=poisoned_kpe), mode)
    assert bool(torch.isnan(out_nan[0]).all()) and not bool(torch.isnan(out_nan[1:]).any())


@pytest.mark.parametrize("mode", ["float64", "float32"])
def test_gpu_sized_problem_chunks_fit_the_default_budget(mode):
    """T=8192, H=128, topk 2048, R=64: each chunk's estimated memory stays under the 1 GiB
    default budget, the estimate covers at least the gathered KV and the scores, and the whole
    problem would not fit in one chunk (so chunking is what keeps it within memory)."""
    t, h, k, r = 8192, 128, 2048, ROPE
    elem = 8 if mode == "float64" else 4
    per_row = _row_bytes(h, k, D, r, elem)
    chunk = rows_per_chunk(h, k, D, r, mode, DEFAULT_MEMORY_BUDGET_BYTES)
    assert per_row >= k * (D + r) * elem + h * k * elem
    assert 1 <= chunk < t
    assert chunk * per_row <= DEFAULT_MEMORY_BUDGET_BYTES, f"{chunk} rows x {per_row} B > budget"
    assert (chunk + 1) * per_row > DEFAULT_MEMORY_BUDGET_BYTES, "chunk is not the largest that fits"
    assert t * per_row > DEFAULT_MEMORY_BUDGET_BYTES


def test_budget_smaller_than_one_row_still_makes_progress():
    assert rows_per_chunk(128, 2048, D, ROPE, "float64", 1) == 1
    assert rows_per_chunk(128, 2048, D, ROPE, "float64", 0) == 1


def test_cpu_chunks_stay_within_the_allocators_reused_blocks_and_a_gpus_use_the_budget():
    """On a CPU a chunk gets at most CPU_CHUNK_BYTES (a smaller budget still wins); on a GPU the
    whole budget."""
    assert chunk_budget_bytes(DEFAULT_MEMORY_BUDGET_BYTES, torch.device("cpu")) == CPU_CHUNK_BYTES
    assert chunk_budget_bytes(CPU_CHUNK_BYTES // 4, torch.device("cpu")) == CPU_CHUNK_BYTES // 4
    assert chunk_budget_bytes(DEFAULT_MEMORY_BUDGET_BYTES, torch.device("cuda", 0)) == DEFAULT_MEMORY_BUDGET_BYTES
    assert CPU_CHUNK_BYTES < DEFAULT_MEMORY_BUDGET_BYTES


@pytest.mark.parametrize("mode", COMPUTE_MODES)
def test_a_cpu_call_computes_its_rows_in_chunks_under_the_cpu_cap(mode, monkeypatch):
    """A call on the CPU with the default budget chunks its rows as CPU_CHUNK_BYTES allows, with
    the answer of one chunk holding every row."""
    g = torch.Generator().manual_seed(7)
    t, h, k, n = 6, 4, 64, 256
    q_nope, q_pe = torch.randn(t, h, D, generator=g).bfloat16(), torch.randn(t, h, ROPE, generator=g).bfloat16()
    ckv, kpe = torch.randn(n, D, generator=g).bfloat16(), torch.randn(n, ROPE, generator=g).bfloat16()
    slots, lens = torch.randint(0, n, (t, k), generator=g), torch.randint(1, k + 1, (t,), generator=g)
    whole = sparse_mla_reference(q_nope, q_pe, ckv, kpe, slots, lens=lens, sm_scale=SM_SCALE, mode=mode)
    per_row = _row_bytes(h, k, D, ROPE, 8 if mode == "float64" else 4)
    monkeypatch.setattr("reference.oracle_fast.CPU_CHUNK_BYTES", 2 * per_row)  # two rows a chunk
    chunk_rows = []

    def recorded_rows_per_chunk(*args):
        chunk_rows.append(rows_per_chunk(*args))
        return chunk_rows[-1]

    monkeypatch.setattr("reference.oracle.rows_per_chunk", recorded_rows_per_chunk)
    monkeypatch.setattr("reference.oracle_fast.rows_per_chunk", recorded_rows_per_chunk)
    chunked = sparse_mla_reference(q_nope, q_pe, ckv, kpe, slots, lens=lens, sm_scale=SM_SCALE, mode=mode)
    assert chunk_rows == [2]
    assert_same(chunked[0], whole[0], f"{mode} out in chunks of two rows")
    assert_same(chunked[1], whole[1], f"{mode} lse in chunks of two rows")


# --- bad input -----------------------------------------------------------------------------


def valid_args() -> dict:
    p = random_problem(seed=16, t=2, h=2, k=4, num_slots=8, lens=[4, 2])
    return dict(q_nope=p.q_nope, q_pe=p.q_pe, ckv=p.ckv, kpe=p.kpe, slots=p.slots, lens=p.lens,
                sm_scale=SM_SCALE)


_DROP = object()  # marks an argument to leave out


def call_with(**changes):
    args = valid_args()
    args.update(changes)
    args = {k: v for k, v in args.items() if v is not _DROP}
    return sparse_mla_reference(**args)


def _mask():
    return selection_mask(valid_args()["slots"], valid_args()["lens"])


BAD_INPUTS = {
    "q_nope rank 2": (lambda a: dict(q_nope=a["q_nope"][0]), r"q_nope: expected \[T, H, D_ckv\]"),
    "q_pe wrong heads": (lambda a: dict(q_pe=a["q_pe"][:, :1]), r"q_pe: expected \[T=2, H=2, R\]"),
    "q_pe rank 2": (lambda a: dict(q_pe=a["q_pe"][:, 0]), r"q_pe"),
    "ckv head dim": (lambda a: dict(ckv=a["ckv"][:, :256]), r"ckv: head dim 256 != q_nope head dim 512"),
    "ckv rank 1": (lambda a: dict(ckv=a["ckv"][0]), r"ckv: expected shape"),
    "ckv rank 3 not a [N,1,D] view": (lambda a: dict(ckv=a["ckv"].view(2, 4, D)), r"ckv: expected shape"),
    "kpe head dim": (lambda a: dict(kpe=a["kpe"][:, :32]), r"kpe: head dim 32 != q_pe head dim 64"),
    "kpe slot count": (lambda a: dict(kpe=a["kpe"][:7]), r"kpe: 7 slots but ckv has 8"),
    "slots rank 1": (lambda a: dict(slots=a["slots"][0]), r"slots: expected \[T=2, K\]"),
    "slots rows": (lambda a: dict(slots=a["slots"][:1]), r"slots: expected \[T=2, K\]"),
    "slots float": (lambda a: dict(slots=a["slots"].float()), r"slots: expected an integer dtype"),
    "slots bool": (lambda a: dict(slots=a["slots"] > 0), r"slots: expected an integer dtype"),
    "slot == num_slots selected": (lambda a: dict(slots=torch.tensor([[0, 1, 2, 8], [3, 4, -1, -1]])),
                                   r"slots: row 0 column 3 selects slot 8, outside \[0, 8\)"),
    "slot negative selected": (lambda a: dict(slots=torch.tensor([[0, 1, 2, 3], [3, -1, -1, -1]])),
                               r"slots: row 1 column 1 selects slot -1"),
    "slot out of range under mask": (lambda a: dict(lens=_DROP, mask=torch.tensor([[True, False, False, True],
                                                                                  [False, True, False, False]]),
                                                    slots=torch.tensor([[0, 1, 2, 3], [3, 99, 4, 4]])),
                                     r"slots: row 1 column 1 selects slot 99"),
    "lens longer than the row": (lambda a: dict(lens=torch.tensor([4, 5])), r"lens: row 1 has len 5 outside \[0, 4\]"),
    "lens negative": (lambda a: dict(lens=torch.tensor([-1, 2])), r"lens: row 0 has len -1"),
    "lens shape": (lambda a: dict(lens=torch.tensor([4, 2, 1])), r"lens: expected shape \[T=2\]"),
    "lens float": (lambda a: dict(lens=torch.tensor([4.0, 2.0])), r"lens: expected an integer dtype"),
    "mask not bool": (lambda a: dict(lens=_DROP, mask=_mask().int()), r"mask: expected bool"),
    "mask shape": (lambda a: dict(lens=_DROP, mask=_mask()[:, :3]), r"mask: expected bool of shape \(2, 4\)"),
    "lens and mask": (lambda a: dict(mask=_mask()), r"give exactly one of lens or mask"),
    "neither lens nor mask": (lambda a: dict(lens=_DROP), r"give exactly one of lens or mask"),
    "q_nope on another device": (lambda a: dict(q_nope=a["q_nope"].to("meta")),
                                 r"one device.*'q_nope': device\(type='meta'\)"),
    "ckv on another device": (lambda a: dict(ckv=a["ckv"].to("meta")), r"one device.*'ckv': device\(type='meta'\)"),
    "slots on another device": (lambda a: dict(slots=a["slots"].to("meta")),
                                r"one device.*'slots': device\(type='meta'\)"),
    "lens on another device": (lambda a: dict(lens=a["lens"].to("meta")), r"one device.*'lens': device\(type='meta'\)"),
    "unknown mode": (lambda a: dict(mode="bfloat16"), r"mode: expected one of"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_is_rejected_naming_the_argument(name):
    change, pattern = BAD_INPUTS[name]
    with pytest.raises(ValueError, match=pattern):
        call_with(**change(valid_args()))


def test_out_of_range_slots_outside_the_selection_are_accepted():
    out, _ = call_with(slots=torch.tensor([[0, 1, 2, 3], [3, 4, 99, -(2**31)]]))
    assert bool(torch.isfinite(out).all())


@pytest.mark.parametrize("select", ["lens", "mask"])
def test_empty_cache_with_nothing_selected_gives_empty_rows(select):
    p = random_problem(seed=17, t=2, h=2, k=4, num_slots=3, lens=[0, 0])
    p = replace(p, ckv=p.ckv[:0], kpe=p.kpe[:0], slots=torch.tensor([[0, 5, -1, 2], [7, 7, 7, 7]], dtype=torch.int32))
    out, lse = run(p, use_mask=p.mask if select == "mask" else None)
    assert bool((out == 0).all()) and bool((lse == -INF).all())
    with pytest.raises(ValueError, match=r"slots: row 1 column 0 selects slot 7, outside \[0, 0\)"):
        run(replace(p, lens=torch.tensor([0, 1])))


@pytest.mark.parametrize("select", ["lens", "mask"])
@pytest.mark.parametrize("lens", [[4, 4, 4], [4, 0, 2], [0, 0, 0], [1, 2, 3]])
def test_full_partial_and_empty_selections_take_their_paths_to_the_same_answer(select, lens):
    """Every row full (no masking), some rows empty (filled at the end), nothing selected (early
    return): each path must give what a row-by-row evaluation gives."""
    p = random_problem(seed=18, t=3, h=2, k=4, num_slots=9, lens=lens)
    out, lse = run(p, use_mask=p.mask if select == "mask" else None)
    for row in range(3):
        row_out, row_lse = run(
            replace(
                p,
                q_nope=p.q_nope[row : row + 1],
                q_pe=p.q_pe[row : row + 1],
                slots=p.slots[row : row + 1],
                lens=p.lens[row : row + 1],
            )
        )
        assert torch.equal(lse[row], row_lse[0]) and torch.equal(out[row], row_out[0]), f"row {row} of lens {lens}"


@pytest.mark.parametrize("lens, facts", [
    ([4, 4], SelectionFacts(all_selected=True, any_row_empty=False, any_selected=True)),
    ([4, 1], SelectionFacts(all_selected=False, any_row_empty=False, any_selected=True)),
    ([0, 3], SelectionFacts(all_selected=False, any_row_empty=True, any_selected=True)),
    ([0, 0], SelectionFacts(all_selected=False, any_row_empty=True, any_selected=False)),
])
def test_selection_facts_from_lens_and_from_the_same_mask(lens, facts):
    slots = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
    lens = torch.tensor(lens)
    assert check_selection(slots, lens, selection_mask(slots, lens), 8) == facts
    assert check_selection(slots, None, selection_mask(slots, lens), 8) == facts


# --- lowp of a row read in several parts (a split kernel) ---------------------------------------


@given(p=problems(), seed=st.integers(0, 2**31 - 1))
def test_lowp_in_one_part_is_lowp(p, seed):
    """Every column in part 0 (whatever unselected columns hold) is the unsplit lowp, bit for bit."""
    g = torch.Generator().manual_seed(seed)
    garbage = torch.randint(-3, 9, p.slots.shape, generator=g)
    parts = torch.where(p.mask, torch.zeros_like(garbage), garbage)
    out, lse = run(p, "lowp")
    out_p, lse_p = run(p, "lowp", parts=parts)
    assert torch.equal(out, out_p) and torch.equal(lse, lse_p)


@given(p=problems(min_len=2), seed=st.integers(0, 2**31 - 1))
def test_lowp_in_two_parts_merges_bf16_partial_outputs_by_their_lse(p, seed):
    """Two parts (a split at a random column): each part's lowp output, rounded to bf16, merged
    by the parts' LSEs in float32 and rounded again, as a split kernel stores and merges them;
    the LSE is the parts' log-sum-exp."""
    g = torch.Generator().manual_seed(seed)
    at = torch.randint(1, p.slots.shape[1] + 1, (p.slots.shape[0], 1), generator=g)
    second = torch.arange(p.slots.shape[1]).unsqueeze(0) >= at
    out, lse = run(p, "lowp", parts=second.long())
    out_a, lse_a = run(p, "lowp", use_mask=p.mask & ~second)
    out_b, lse_b = run(p, "lowp", use_mask=p.mask & second)
    empty = ~p.mask.any(dim=1)
    lse_a, lse_b = (torch.where((p.mask & m).any(dim=1)[:, None], x, -INF) for x, m in ((lse_a, ~second),
                                                                                        (lse_b, second)))
    m_out, m_lse = merge(out_a.float(), lse_a, out_b.float(), lse_b)
    m_out = m_out.to(torch.bfloat16).masked_fill(empty[:, None, None], 0.0)
    m_lse = m_lse.masked_fill(empty[:, None], -INF)
    torch.testing.assert_close(lse, m_lse, rtol=4 * F32_UNIT, atol=4 * F32_UNIT, msg=lambda m: f"{p.describe()}\n{m}")
    one_rounding = 2 * BF16_UNIT * float(p.ckv.double().abs().max())  # the merged sum's last rounding
    torch.testing.assert_close(out.float(), m_out.float(), rtol=0, atol=one_rounding,
                               msg=lambda m: f"{p.describe()}\n{m}")


def test_a_split_row_rounds_once_more_than_a_whole_row():
    """The merge of two bf16 partial outputs is not the bf16 output of the whole row: the split
    lowp differs from the unsplit one on a row read in two parts, and both stay within bf16
    rounding of the truth."""
    p = random_problem(seed=11, t=2, h=8, k=64, num_slots=200, lens=[64, 64])
    parts = (torch.arange(64) >= 32).long().expand(2, 64)
    truth = run(p)[0]
    whole, split = run(p, "lowp")[0], run(p, "lowp", parts=parts)[0]
    assert not torch.equal(whole, split)
    bound = 4 * BF16_UNIT * float(p.ckv.double().abs().max())
    assert float((split.double() - truth).abs().max()) < bound and float((whole.double() - truth).abs().max()) < bound


def test_parts_are_for_lowp_and_shaped_as_slots():
    p = random_problem(seed=1, t=2, h=2, k=8, num_slots=20, lens=[8, 8])
    with pytest.raises(ValueError, match="parts: for mode 'lowp'"):
        run(p, "float64", parts=torch.zeros(2, 8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"parts: for mode 'lowp', shaped as slots \(2, 8\)"):
        run(p, "lowp", parts=torch.zeros(2, 7, dtype=torch.long))


# --- the contract and the implementation: -1 inside a row's length (reference.contract) -------


def with_holes(p: Problem, seed: int) -> Problem:
    """``p`` with about a third of each row's columns before its length set to -1."""
    g = torch.Generator().manual_seed(seed)
    holes = (torch.rand(p.slots.shape, generator=g) < 1 / 3) & p.mask
    return replace(p, slots=torch.where(holes, torch.full_like(p.slots, -1), p.slots))


def contract(p: Problem, mode: str = "float64"):
    return contract_reference(p.q_nope, p.q_pe, p.ckv, p.kpe, p.slots, p.lens, sm_scale=p.sm_scale, mode=mode)


def implementation(p: Problem, filler: str, mode: str = "float64"):
    return implementation_reference(p.q_nope, p.q_pe, p.ckv, p.kpe, p.slots, p.lens, filler, sm_scale=p.sm_scale,
                                    mode=mode)


@given(p=problems(), seed=st.integers(0, 2**31 - 1))
def test_the_contract_attends_the_valid_entries_within_the_length(p, seed):
    """vLLM's stated semantics: column c of row t is attended when c < len and the index >= 0;
    that is the oracle over the row's valid entries within its length moved to the front."""
    p = with_holes(p, seed)
    valid = p.mask & (p.slots >= 0)
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
    compact = replace(p, slots=torch.gather(p.slots, 1, order), lens=valid.sum(dim=1))
    out, lse = contract(p)
    out_c, lse_c = run(compact)
    torch.testing.assert_close(out, out_c, **F64_TIGHT, msg=lambda m: f"{p.describe()}\n{m}")
    torch.testing.assert_close(lse, lse_c, **F64_TIGHT, msg=lambda m: f"{p.describe()}\n{m}")


@pytest.mark.parametrize("mode", COMPUTE_MODES)
def test_a_row_of_holes_is_empty_under_the_contract(mode):
    p = random_problem(seed=5, t=2, h=3, k=4, num_slots=9, lens=[3, 4])
    p = replace(p, slots=torch.tensor([[-1, -1, -1, 7], [1, -1, 2, -1]], dtype=torch.int32))
    out, lse = contract(p, mode)
    assert bool((out[0] == 0).all()) and bool((lse[0] == -INF).all()), (out[0].abs().max(), lse[0])
    assert bool(torch.isfinite(lse[1]).all())


@pytest.mark.parametrize(("filler", "filled"), [(SLOT_ZERO, [[5, 0, 3, 0, -1], [0, 0, -1, -1, -1]]),
                                                (FIRST_SLOT, [[5, 5, 3, 5, -1], [0, 0, -1, -1, -1]])])
def test_the_implementation_reads_a_hole_as_its_filler(filler, filled):
    """Within the length, -1 becomes physical slot 0 (vLLM 0.31.0's pack) or the row's column 0
    (0.32.0 on; slot 0 where column 0 is -1 too); past it nothing changes; the oracle is then
    the multiset of the first len slots."""
    p = random_problem(seed=6, t=2, h=2, k=5, num_slots=9, lens=[4, 2])
    p = replace(p, slots=torch.tensor([[5, -1, 3, -1, -1], [-1, -1, -1, -1, -1]], dtype=torch.int32))
    assert filled_slots(p.slots, p.lens, filler).tolist() == filled
    out, lse = implementation(p, filler)
    out_f, lse_f = run(replace(p, slots=torch.tensor(filled, dtype=torch.int32)))
    assert torch.equal(out, out_f) and torch.equal(lse, lse_f)


@given(p=problems(), seed=st.integers(0, 2**31 - 1), filler=st.sampled_from((SLOT_ZERO, FIRST_SLOT)))
def test_the_oracles_differ_exactly_on_the_rows_named(p, seed, filler):
    """oracle_differences names the rows with a -1 inside their length, with their counts; on
    every other row the two oracles agree bit for bit, on the rows named the output or LSE moves."""
    p = with_holes(p, seed)
    named = oracle_differences(p.slots, p.lens)
    inside = p.mask & (p.slots < 0)
    expected = [OracleDifference(r, int(p.lens[r]), int((p.mask[r] & (p.slots[r] >= 0)).sum()),
                                 int(inside[r].sum())) for r in range(p.slots.shape[0]) if bool(inside[r].any())]
    assert named == expected
    out_c, lse_c = contract(p)
    out_i, lse_i = implementation(p, filler)
    rows = {d.row for d in named}
    for r in range(p.slots.shape[0]):
        same = torch.equal(out_c[r], out_i[r]) and torch.equal(lse_c[r], lse_i[r])
        assert same != (r in rows), f"row {r}: the oracles {'agree' if same else 'differ'}; {p.describe()}"
