"""The one tolerance policy: a kernel's error against float64, as a ratio of the error that
working precision alone costs (docs/error-budget.md#two-references, after flash-attention's
two-reference budget).

``err_kernel = |out - truth|``, ``err_lowp = |lowp - truth|`` where ``lowp`` is the reference
computed with the kernel's roundings. A case passes when

    max|err_kernel|  <= MAX_FACTOR  * max|err_lowp|  + ABS_FLOOR
    mean|err_kernel| <= MEAN_FACTOR * mean|err_lowp| + ABS_FLOOR

(fp8 KV: the fp8 factors), LSE the same way, NaN never passes, and +-inf positions must
match. The report names the worst rows and heads with their regimes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# flash-attention hopper/test_util.py factors; fp8 gets the wider pair it uses for fp8.
FACTORS = {"bfloat16": (2.0, 1.5), "float8_e4m3fn": (4.0, 3.0)}
ABS_FLOOR = 1e-5
FLOAT32_EPS = 2.0 ** -23
#: LSE floor in float32 ulps of max|truth|: the kernel's softmax runs in float32 with exp2/log2
#: approximations the lowp reference (exact exp, float32 logsumexp) does not model. Measured on
#: an H200 (fa3, FlashInfer 0.6.18.post1 and 0.7.4, bf16 and fp8 KV): LSE max |err| up to
#: 2.55e-5 at |lse| of 12 to 15 (about 16 ulps), 3x to 16x the lowp reference's error.
LSE_ULPS = 32
#: The LSE floor of each attention kernel, in float32 ulps of max|truth|, where it is not
#: LSE_ULPS. FlashInfer's fa2 MLA kernel, measured on an H200 (0.7.4, 38 cases of the backend
#: axis, bf16 and fp8 KV, rope 64 and NoPE): LSE max |err| 1.2e-4 to 1.5e-3, up to 1406 ulps of
#: max|truth| (at |lse| 8.9, 3 slots, 128 heads), while its output stays within the factors.
KERNEL_LSE_ULPS = {"fa2": 2048}


def lse_ulps(kernel: str | None) -> float:
    """The LSE floor in ulps for ``kernel`` (None or a kernel without its own: LSE_ULPS)."""
    return KERNEL_LSE_ULPS.get(kernel or "", LSE_ULPS)


@dataclass
class Comparison:
    name: str
    ok: bool
    max_ratio: float  # max|err_kernel| / max|err_lowp|
    mean_ratio: float
    max_err: float
    mean_err: float
    rel_l2: float  # ||out - truth|| / ||truth||
    problems: list[str] = field(default_factory=list)
    worst: list[tuple[int, int, float]] = field(default_factory=list)  # (row, head, max abs err)

    def summary(self, regimes: list[str] | None = None) -> str:
        worst = ", ".join(
            f"row {r} head {h} err {e:.3g}" + (f" regime {regimes[r]}" if regimes and r < len(regimes) else "")
            for r, h, e in self.worst
        )
        head = (
            f"{self.name}: max err {self.max_err:.3g} ({self.max_ratio:.2f}x lowp), mean err {self.mean_err:.3g} "
            f"({self.mean_ratio:.2f}x lowp), rel L2 {self.rel_l2:.3g}"
        )
        return "; ".join([head] + self.problems + ([f"worst: {worst}"] if worst else []))


def finite_mismatch(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Positions where one is +-inf and the other is not the same infinity."""
    return (torch.isinf(a) | torch.isinf(b)) & (a != b)


def check_same_shapes(name: str, actual: torch.Tensor, truth: torch.Tensor, lowp: torch.Tensor) -> None:
    """A ``ValueError`` naming the three shapes unless they are one."""
    if actual.shape != truth.shape or lowp.shape != truth.shape:
        raise ValueError(
            f"{name}: shapes differ: actual {tuple(actual.shape)}, truth {tuple(truth.shape)}, lowp {tuple(lowp.shape)}"
        )


def element_errors(
    a: torch.Tensor, t: torch.Tensor, lo: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(err_kernel, err_lowp, both_finite)``: ``|a - t|`` where ``a`` and the truth ``t`` are
    both finite (else 0), ``|lo - t|`` where ``lo`` and ``t`` are (else 0), and the first mask. The
    means of the policy divide by the count of that mask."""
    zero = torch.zeros((), dtype=t.dtype, device=t.device)
    t_finite = torch.isfinite(t)
    both = t_finite & torch.isfinite(a)
    return (
        torch.where(both, (a - t).abs(), zero),
        torch.where(t_finite & torch.isfinite(lo), (lo - t).abs(), zero),
        both,
    )


def error_floor(max_abs_truth, ulps: float = 0.0):
    """The absolute floor of the budget: ``ABS_FLOOR`` plus ``ulps`` float32 ulps of the largest
    finite ``|truth|`` (a float or a tensor of them)."""
    return ABS_FLOOR + ulps * FLOAT32_EPS * max_abs_truth


def allowed_errors(max_lowp, mean_lowp, max_abs_truth, kv_dtype: str = "bfloat16", ulps: float = 0.0):
    """``(max, mean)`` error the kernel may have given the low-precision reference's (floats or
    tensors of them): the factors of ``kv_dtype`` times the reference's error, plus the floor."""
    max_factor, mean_factor = FACTORS[kv_dtype]
    floor = error_floor(max_abs_truth, ulps)
    return max_factor * max_lowp + floor, mean_factor * mean_lowp + floor


def _first_position(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(mask.nonzero()[0].tolist())


def _worst_rows_heads(err: torch.Tensor, k: int = 5) -> list[tuple[int, int, float]]:
    if err.numel() == 0:
        return []
    per = err.reshape(err.shape[0], err.shape[1], -1).amax(dim=-1) if err.dim() >= 2 else err.unsqueeze(1)
    flat = per.flatten()
    values, indices = (x.tolist() for x in torch.topk(flat, min(k, flat.numel())))
    heads = per.shape[1]
    return [(i // heads, i % heads, v) for v, i in zip(values, indices, strict=True) if v > 0]


def _error_sums(a: torch.Tensor, t: torch.Tensor, lo: torch.Tensor) -> tuple[dict[str, float], torch.Tensor]:
    """The comparison's summary numbers, computed where the tensors live and brought back in one
    transfer, and the kernel's absolute error (0 where it or the truth is not finite)."""
    err, err_l, finite = element_errors(a, t, lo)
    zero = torch.zeros((), dtype=t.dtype, device=t.device)
    t_abs = torch.where(torch.isfinite(t), t.abs(), zero)
    t_fin = torch.where(finite, t, zero)
    if t.numel():
        maxima = [err.max(), err_l.max(), t_abs.max()]
    else:
        maxima = [zero, zero, zero]
    names = ("nan", "inf_bad", "finite", "max_err", "max_l", "max_abs_t", "err_sum", "err_l_sum", "err_norm", "t_norm")
    values = torch.stack([
        torch.isnan(a).sum().to(t.dtype), finite_mismatch(a, t).sum().to(t.dtype), finite.sum().to(t.dtype), *maxima,
        err.sum(), err_l.sum(), err.norm(), t_fin.norm(),
    ]).tolist()
    return dict(zip(names, values, strict=True)), err


def compare_to_budget(
    name: str,
    actual: torch.Tensor,
    truth: torch.Tensor,
    lowp: torch.Tensor,
    kv_dtype: str = "bfloat16",
    ulps: float = 0.0,
) -> Comparison:
    """Compare ``actual`` with the float64 ``truth`` within the budget set by ``lowp``; ``ulps``
    raises the absolute floor by that many float32 ulps of max|truth| (LSE: ``LSE_ULPS``).
    Computed in float64 on ``truth``'s device; only the summary numbers and the worst rows
    come back to the host."""
    check_same_shapes(name, actual, truth, lowp)
    max_factor, mean_factor = FACTORS[kv_dtype]
    a, t, lo = (x.detach().to(device=truth.device, dtype=torch.float64) for x in (actual, truth, lowp))
    sums, err = _error_sums(a, t, lo)
    problems = []
    if sums["nan"]:
        problems.append(f"{int(sums['nan'])} NaN (first at {_first_position(torch.isnan(a))})")
    if sums["inf_bad"]:
        problems.append(f"{int(sums['inf_bad'])} inf mismatches (first at {_first_position(finite_mismatch(a, t))})")
    n = max(int(sums["finite"]), 1)
    max_err, mean_err = sums["max_err"], sums["err_sum"] / n
    max_l, mean_l = sums["max_l"], sums["err_l_sum"] / n
    floor = error_floor(sums["max_abs_t"], ulps)
    max_allowed, mean_allowed = allowed_errors(max_l, mean_l, sums["max_abs_t"], kv_dtype, ulps)
    ok_max = max_err <= max_allowed
    ok_mean = mean_err <= mean_allowed
    if not ok_max:
        problems.append(f"max err {max_err:.3g} > {max_factor} x lowp {max_l:.3g} + {floor:.3g}")
    if not ok_mean:
        problems.append(f"mean err {mean_err:.3g} > {mean_factor} x lowp {mean_l:.3g} + {floor:.3g}")
    rel = sums["err_norm"] / sums["t_norm"] if sums["t_norm"] > 0 else sums["err_norm"]
    return Comparison(
        name=name,
        ok=not problems,
        max_ratio=max_err / max_l if max_l > 0 else (0.0 if max_err == 0 else float("inf")),
        mean_ratio=mean_err / mean_l if mean_l > 0 else (0.0 if mean_err == 0 else float("inf")),
        max_err=max_err,
        mean_err=mean_err,
        rel_l2=rel,
        problems=problems,
        worst=_worst_rows_heads(err),
    )


def compare_attention(
    out: torch.Tensor,
    lse: torch.Tensor,
    truth: tuple[torch.Tensor, torch.Tensor],
    lowp: tuple[torch.Tensor, torch.Tensor],
    kv_dtype: str = "bfloat16",
    suffix: str = "",
    kernel: str | None = None,
) -> list[Comparison]:
    """The kernel's ``(out, lse)`` against the float64 and low-precision references, with the
    policy for each: output by the factors, LSE with the floor of ``kernel`` (:func:`lse_ulps`)."""
    return [
        compare_to_budget("out" + suffix, out, truth[0], lowp[0], kv_dtype),
        compare_to_budget("lse" + suffix, lse, truth[1], lowp[1], kv_dtype, ulps=lse_ulps(kernel)),
    ]
