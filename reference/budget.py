"""The one tolerance policy: a kernel's error against float64, as a ratio of the error that
working precision alone costs (SPEC §8, after flash-attention's two-reference budget).

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


def _max(x: torch.Tensor) -> float:
    return float(x.max()) if x.numel() else 0.0


def _finite_mismatch(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Positions where one is +-inf and the other is not the same infinity."""
    return (torch.isinf(a) | torch.isinf(b)) & (a != b)


def _worst_rows_heads(err: torch.Tensor, k: int = 5) -> list[tuple[int, int, float]]:
    if err.numel() == 0:
        return []
    per = err.reshape(err.shape[0], err.shape[1], -1).amax(dim=-1) if err.dim() >= 2 else err.unsqueeze(1)
    flat = per.flatten()
    top = torch.topk(flat, min(k, flat.numel()))
    heads = per.shape[1]
    return [(int(i) // heads, int(i) % heads, float(v)) for v, i in zip(top.values, top.indices) if v > 0]


def compare_to_budget(
    name: str,
    actual: torch.Tensor,
    truth: torch.Tensor,
    lowp: torch.Tensor,
    kv_dtype: str = "bfloat16",
    ulps: float = 0.0,
) -> Comparison:
    """Compare ``actual`` with the float64 ``truth`` within the budget set by ``lowp``; ``ulps``
    raises the absolute floor by that many float32 ulps of max|truth| (LSE: ``LSE_ULPS``)."""
    if actual.shape != truth.shape or lowp.shape != truth.shape:
        raise ValueError(f"{name}: shapes differ: actual {tuple(actual.shape)}, truth {tuple(truth.shape)}, lowp {tuple(lowp.shape)}")
    max_factor, mean_factor = FACTORS[kv_dtype]
    a, t, l = (x.detach().to(torch.float64).cpu() for x in (actual, truth, lowp))
    problems = []
    nan = torch.isnan(a)
    if bool(nan.any()):
        problems.append(f"{int(nan.sum())} NaN (first at {tuple(nan.nonzero()[0].tolist())})")
    inf_bad = _finite_mismatch(a, t)
    if bool(inf_bad.any()):
        problems.append(f"{int(inf_bad.sum())} inf mismatches (first at {tuple(inf_bad.nonzero()[0].tolist())})")
    finite = torch.isfinite(t) & torch.isfinite(a)
    err = torch.where(finite, (a - t).abs(), torch.zeros_like(t))
    err_l = torch.where(torch.isfinite(t) & torch.isfinite(l), (l - t).abs(), torch.zeros_like(t))
    n = max(int(finite.sum()), 1)
    max_err, mean_err = _max(err), float(err.sum()) / n
    max_l, mean_l = _max(err_l), float(err_l.sum()) / n
    floor = ABS_FLOOR + ulps * FLOAT32_EPS * _max(torch.where(torch.isfinite(t), t.abs(), torch.zeros_like(t)))
    ok_max = max_err <= max_factor * max_l + floor
    ok_mean = mean_err <= mean_factor * mean_l + floor
    if not ok_max:
        problems.append(f"max err {max_err:.3g} > {max_factor} x lowp {max_l:.3g} + {floor:.3g}")
    if not ok_mean:
        problems.append(f"mean err {mean_err:.3g} > {mean_factor} x lowp {mean_l:.3g} + {floor:.3g}")
    t_fin = torch.where(finite, t, torch.zeros_like(t))
    rel = float(err.norm() / t_fin.norm()) if float(t_fin.norm()) > 0 else float(err.norm())
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
) -> list[Comparison]:
    """The kernel's ``(out, lse)`` against the float64 and low-precision references, with the
    policy for each: output by the factors, LSE with the ``LSE_ULPS`` floor."""
    return [
        compare_to_budget("out" + suffix, out, truth[0], lowp[0], kv_dtype),
        compare_to_budget("lse" + suffix, lse, truth[1], lowp[1], kv_dtype, ulps=LSE_ULPS),
    ]
