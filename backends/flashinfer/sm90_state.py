"""The SM90 sparse-MLA attention state: plan on the host every step, then convert, lay out and
run on the device with fixed shapes, so that the device part can be captured in a CUDA graph
once at the maximum size and replayed after each replan (docs/computation.md#the-production-path).

One ``BatchMLAPagedAttentionWrapper(workspace, use_cuda_graph=True, backend=config.kernel)``
(``fa3``, what production runs on SM90, or ``fa2``) owns
reserved qo_indptr / kv_indptr / kv_indices / kv_len_arr device buffers sized for
``max_rows`` query rows of ``width`` columns; :meth:`SM90AttentionState.plan` fills host
staging buffers in place (no per-step host tensors of its own) and hands them to the wrapper,
which copies them into the reserved buffers. One query row per token, padded rows empty
(``qo_indptr`` flat past ``num_rows``, their kv_len 0), page_size 1, causal False.

The kv_indices layout (``strided``, ``packed``, ``compacted``) comes from the implementation
under test (``impl.kv_indptr`` on the host, ``impl.write_kv_indices`` on the device); under
``strided`` the convert kernel writes straight into the kv_indices buffer viewed as
``[max_rows, width]``, as production does.

With ``AttentionConfig.reuse_plan`` a replan with the same ``num_rows`` and lens keeps the last
FlashInfer plan instead of planning again (bench/PLAN_COST.md says why that is sound and when
it applies); off by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fast.layouts import check_layout, indices_capacity
from mla_constants import KV_LORA_RANK, ROPE_DIM

from .compat import MLA_KERNELS, Features, MLAWrapper, planning_kv_dtype
from .compat import WORKSPACE_BYTES as WORKSPACE_BYTES  # re-exported: the state allocates it


@dataclass(frozen=True)
class AttentionConfig:
    num_heads: int
    max_rows: int  # query rows the buffers (and a captured graph) are sized for
    width: int  # topk_indices_buffer width W
    layout: str  # strided | packed | compacted
    block_size: int
    sm_scale: float
    rope_dim: int = ROPE_DIM  # 64, or 0 for NoPE
    kv_dtype: torch.dtype = torch.bfloat16  # or torch.float8_e4m3fn (uint8 storage is planned as e4m3)
    k_scale: float = 1.0  # fp8 dequantisation scale (ckv_scale = kpe_scale)
    kernel: str = "fa3"  # FlashInfer's MLA backend: fa3 (SM90's) or fa2
    # Keep the last plan when a replan has the same num_rows and lens (FlashInfer's plan()
    # is a function of those metadata alone here; its device buffers still hold them).
    reuse_plan: bool = False

    def __post_init__(self) -> None:
        check_layout(self.layout)
        if self.max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {self.max_rows}")
        if self.rope_dim not in (0, ROPE_DIM):
            raise ValueError(f"rope_dim must be 64 or 0 (NoPE), got {self.rope_dim}")
        planning_kv_dtype(self.kv_dtype)
        if self.kernel not in MLA_KERNELS:
            raise ValueError(f"kernel must be one of {MLA_KERNELS}, got {self.kernel!r}")


class PlanDuringCaptureError(RuntimeError):
    pass


class SM90AttentionState:
    """Buffers, wrapper and plan parameters for one attention group (docs/computation.md#plan)."""

    def __init__(self, impl, config: AttentionConfig, device="cuda", *, features: Features | None = None,
                 lse_base_e: bool = True):
        self.impl = impl
        self.config = config
        self.device = torch.device(device)
        rows, width = config.max_rows, config.width
        dev = self.device
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        self.qo_indptr = torch.zeros(rows + 1, dtype=torch.int32, device=dev)
        self.kv_indptr = torch.zeros(rows + 1, dtype=torch.int32, device=dev)
        # Zero, not -1: a plan that looks at the indices before the first write sees slot 0.
        self.kv_indices = torch.zeros(indices_capacity(rows, width), dtype=torch.int32, device=dev)
        self.kv_len = torch.zeros(rows, dtype=torch.int32, device=dev)
        if config.layout == "strided":
            self.slots = self.kv_indices[: rows * width].view(rows, width)
        else:
            self.slots = torch.full((rows, width), -1, dtype=torch.int32, device=dev)
        self.wrapper = MLAWrapper(
            self.workspace, qo_indptr=self.qo_indptr, kv_indptr=self.kv_indptr, kv_indices=self.kv_indices,
            kv_len_arr=self.kv_len, features=features, lse_base_e=lse_base_e, kernel=config.kernel,
        )
        self.features = self.wrapper.features
        # Host staging, reused by every plan.
        self._arange = torch.arange(rows + 1, dtype=torch.int32)
        self._qo_host = torch.zeros(rows + 1, dtype=torch.int32)
        self._kv_indptr_host = torch.zeros(rows + 1, dtype=torch.int32)
        self._kv_len_host = torch.zeros(rows, dtype=torch.int32)
        self.num_rows = 0
        self.plans = 0  # plan() calls
        self.reused_plans = 0  # of which kept the last plan (config.reuse_plan)
        self._planned = False  # the last FlashInfer plan succeeded and the staging holds it

    # --- host ----------------------------------------------------------------------------

    def plan(self, num_rows: int, lens: torch.Tensor) -> None:
        """Replan for ``num_rows`` query rows with host int32 ``lens [num_rows]``. Never
        during CUDA-graph capture: captured runs read what the last plan wrote."""
        if torch.cuda.is_current_stream_capturing():
            raise PlanDuringCaptureError("plan() called during CUDA-graph capture; plan on the host before replay")
        cfg = self.config
        if not 0 <= num_rows <= cfg.max_rows:
            raise ValueError(f"num_rows={num_rows} outside [0, max_rows={cfg.max_rows}]")
        if lens.numel() != num_rows:
            raise ValueError(f"lens has {lens.numel()} entries for {num_rows} rows")
        if cfg.reuse_plan and self._same_as_last_plan(num_rows, lens):
            self.plans += 1
            self.reused_plans += 1
            return
        self._planned = False
        torch.clamp(self._arange, max=num_rows, out=self._qo_host)
        self._kv_len_host.zero_()
        self._kv_len_host[:num_rows] = lens.to(torch.int32)
        self._kv_indptr_host.copy_(
            self.impl.kv_indptr(cfg.layout, self._kv_len_host[:num_rows], cfg.max_rows, cfg.width)
        )
        self.wrapper.plan(
            qo_indptr=self._qo_host, kv_indptr=self._kv_indptr_host, kv_indices=self.kv_indices,
            kv_len_arr=self._kv_len_host, num_heads=cfg.num_heads, head_dim_ckv=KV_LORA_RANK,
            head_dim_kpe=cfg.rope_dim, sm_scale=cfg.sm_scale, kv_dtype=cfg.kv_dtype,
        )
        self.num_rows = num_rows
        self.plans += 1
        self._planned = True

    def _same_as_last_plan(self, num_rows: int, lens: torch.Tensor) -> bool:
        """The last plan succeeded with these num_rows and lens (what qo_indptr, kv_indptr
        and kv_len_arr are computed from)."""
        if not self._planned or num_rows != self.num_rows:
            return False
        return torch.equal(self._kv_len_host[:num_rows], lens.to(device="cpu", dtype=torch.int32))

    @property
    def planned_kv_indptr(self) -> torch.Tensor:
        """Host kv_indptr of the last plan ``[max_rows + 1]``."""
        return self._kv_indptr_host

    @property
    def planned_kv_len(self) -> torch.Tensor:
        """Host kv_len of the last plan ``[max_rows]`` (padded rows 0)."""
        return self._kv_len_host

    # --- device (fixed shapes: capturable) -----------------------------------------------

    def write_indices(self, topk_indices: torch.Tensor, block_table: torch.Tensor, req_id: torch.Tensor) -> None:
        """Convert ``topk_indices [max_rows, W]`` into slot ids and lay them out in kv_indices
        with the planned lens and indptr (the reserved device buffers the plan refreshed)."""
        cfg = self.config
        self.impl.convert(topk_indices, block_table, req_id, cfg.block_size, out=self.slots)
        if cfg.layout != "strided":
            self.impl.write_kv_indices(cfg.layout, self.slots, self.kv_len, self.kv_indptr, self.kv_indices)

    def attend(self, q_nope, q_pe, ckv, kpe, out, lse) -> None:
        """Run the planned attention of the first ``num_rows`` rows into ``out``/``lse``
        (natural-log LSE); rows past them are not touched."""
        n = self.num_rows
        self.wrapper.run(q_nope[:n], q_pe[:n], ckv, kpe, out=out[:n], lse=lse[:n], k_scale=self.config.k_scale)

    def step(self, topk_indices, block_table, req_id, q_nope, q_pe, ckv, kpe, out, lse) -> None:
        """convert -> layout -> run: the part of a step a CUDA graph captures."""
        self.write_indices(topk_indices, block_table, req_id)
        self.attend(q_nope, q_pe, ckv, kpe, out, lse)


def make_attention_state(impl, config: AttentionConfig, device="cuda", **kwargs) -> SM90AttentionState:
    return SM90AttentionState(impl, config, device, **kwargs)
