"""Which shapes a benchmark run measures: the full run, ``--quick`` and ``--cpu-smoke``, and
what each section covers in words."""

from __future__ import annotations

from dataclasses import dataclass

from fast.layouts import LAYOUTS
from harness.cases import VARIANTS
from mla_constants import FP8_ROPE64, TOPK, variant_name

KERNEL_LAYOUT = "packed"  # the layout of later production (the kernel reads the same either way)
REFERENCE_BUDGET_BYTES = 1 << 30  # memory_budget_bytes handed to the oracle
REFERENCE_MODES = ("float32", "float64")


@dataclass(frozen=True)
class Selection:
    """Which shapes a run measures."""

    name: str
    topk: int
    variants: tuple[tuple[str, bool, float], ...]  # (kv_dtype, rope, k_scale), as harness.cases.VARIANTS
    heads: tuple[int, ...]
    decode_rows: tuple[int, ...]
    prefill_rows: tuple[int, ...]
    plan_rows: tuple[int, ...]
    plan_heads: tuple[int, ...]
    plan_fp8_heads: tuple[int, ...]
    plan_layouts: tuple[str, ...]
    graph_rows: tuple[int, ...]
    graph_heads: tuple[int, ...]
    graph_layouts: tuple[str, ...]
    reference_rows: tuple[int, ...]
    reference_heads: tuple[int, ...]
    kernel_target_s: float = 0.15  # device time aimed at per kernel shape
    plan_target_s: float = 0.25
    ceiling_copy_bytes: int = 1 << 30
    ceiling_matmul_n: int = 8192
    ceiling_reps: int = 20

    def __post_init__(self) -> None:
        for name in ("graph", "reference"):
            rows, heads = getattr(self, f"{name}_rows"), getattr(self, f"{name}_heads")
            if not set(rows) <= set(self.decode_rows) or not set(heads) <= set(self.heads):
                raise ValueError(f"{self.name}: {name} shapes must be decode shapes of the kernel section")

    def scenario_order(self) -> list[tuple[str, int]]:
        return [("decode", r) for r in self.decode_rows] + [("prefill", r) for r in self.prefill_rows]


FULL = Selection(
    name="full", topk=TOPK, variants=VARIANTS, heads=(16, 64, 128),
    decode_rows=(1, 64, 256, 1024, 8192), prefill_rows=(64, 256, 1024, 8192),
    plan_rows=(1, 64, 256, 1024, 8192), plan_heads=(16, 64, 128), plan_fp8_heads=(128,), plan_layouts=LAYOUTS,
    graph_rows=(1, 64, 1024), graph_heads=(16, 128), graph_layouts=LAYOUTS,
    reference_rows=(1, 64, 256, 1024, 8192), reference_heads=(16, 64, 128),
)
QUICK = Selection(
    name="quick", topk=TOPK, variants=VARIANTS[:1], heads=(16, 128),
    decode_rows=(1, 256), prefill_rows=(1024,),
    plan_rows=(64, 256), plan_heads=(128,), plan_fp8_heads=(), plan_layouts=LAYOUTS,
    graph_rows=(256,), graph_heads=(128,), graph_layouts=("packed",),
    reference_rows=(1, 256), reference_heads=(16, 128),
    kernel_target_s=0.05, plan_target_s=0.1, ceiling_copy_bytes=256 << 20, ceiling_matmul_n=4096, ceiling_reps=10,
)
CPU_SMOKE = Selection(  # its kernel shapes are FlashMLA's on the CPU (the stand-in kernels, under a test)
    name="cpu-smoke", topk=128, variants=VARIANTS[:2], heads=(4, 8),
    decode_rows=(1, 4), prefill_rows=(),
    plan_rows=(), plan_heads=(), plan_fp8_heads=(), plan_layouts=(),
    graph_rows=(), graph_heads=(), graph_layouts=(),
    reference_rows=(1, 4), reference_heads=(4, 8),
    kernel_target_s=0.01, plan_target_s=0.01, ceiling_copy_bytes=32 << 20, ceiling_matmul_n=256, ceiling_reps=5,
)


def describe_subset(sel: Selection) -> dict[str, str]:
    """What each section covers, in words (recorded in the JSON and the markdown)."""
    variants = ", ".join(variant_name(k, r) for k, r, _ in sel.variants)
    return {
        "kernel": (
            f"variants {variants} (each its own JIT build; fp8 NoPE would be a fourth) x H {list(sel.heads)} "
            f"x decode rows {list(sel.decode_rows)} (one request per row, distinct KV) and prefill rows "
            f"{list(sel.prefill_rows)} (one request of that many query tokens, its rows share one KV pool; "
            f"a 1-row prefill is a decode row); topk {sel.topk}, kpool 1, every row selecting topk slots; "
            f"layout {KERNEL_LAYOUT}; the state plans one query row per token, so decode and prefill differ "
            "only in how much KV the rows share"
        ),
        "flashmla": (
            "with --vllm: FlashMLA's kernels as vLLM's FLASHMLA_SPARSE calls them, on each kernel shape above "
            "(the same caches and q as FA3's set 0) that vLLM's backend serves"
        ),
        "plan": (
            f"layouts {list(sel.plan_layouts)} x rows {list(sel.plan_rows)} x H {list(sel.plan_heads)} "
            f"({variant_name(*sel.variants[0][:2])}), plus {FP8_ROPE64} at H {list(sel.plan_fp8_heads)}; "
            "decode rows of mixed lengths (some shorter than topk); with and without reuse_plan"
        ),
        "graph": (
            f"decode rows {list(sel.graph_rows)} x H {list(sel.graph_heads)} x layouts {list(sel.graph_layouts)}, "
            f"{variant_name(*sel.variants[0][:2])}"
        ),
        "reference": (
            f"decode rows {list(sel.reference_rows)} x H {list(sel.reference_heads)}, "
            f"{variant_name(*sel.variants[0][:2])}, modes {list(REFERENCE_MODES)}, "
            f"memory_budget_bytes {REFERENCE_BUDGET_BYTES}"
        ),
    }
