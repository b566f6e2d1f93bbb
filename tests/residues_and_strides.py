"""What both tiers' tests of every residue and every stride share (docs/input-space.md#every-residue-every-stride):
the cases as pytest parameters and the kernel's ckv and kpe handed as contiguous copies. A step
whose cache has its blocks apart, or whose single-token decodes had drafts rejected the step
before, runs through ``harness.case_runner.run_case`` (``kv_block_stride``, ``rejected_drafts``), which
records both in a written case.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from harness.builder import single_token_decodes
from harness.cases import (
    OFFSET_BOUNDARIES,
    ROW_576,
    ROW_656,
    KernelConfig,
    blocks_apart_cases,
    kv_parts_cases,
    rejected_drafts_cases,
    residue_cases,
    slot_offset_case,
)

#: Why the kv-parts class does not reach FlashMLA: its kernels take each cache row whole.
FLASHMLA_TAKES_WHOLE_ROWS = "FlashMLA's kernels take each cache row whole (one kv tensor), not ckv and kpe views"


def residue_params():
    return [pytest.param(case, id=case.id) for case in residue_cases()]


def kv_parts_params():
    return [pytest.param(case, id=case.id) for case in kv_parts_cases()]


def blocks_apart_params():
    return [pytest.param(case, stride, id=f"{case.id}-stride{stride}") for case, stride in blocks_apart_cases()]


def rejected_drafts_params():
    return [pytest.param(case, slack, id=f"{case.id}-slack{slack}") for case, slack in rejected_drafts_cases()]


#: The configurations the slot-offset class runs each boundary in, with the row width each
#: multiplies slot ids by: bf16 and FlashInfer's fp8 rows are 576 elements, FlashMLA's fp8 656 bytes.
OFFSET_CONFIGS = ((KernelConfig("bfloat16", True, 16), ROW_576), (KernelConfig("float8_e4m3fn", True, 16), ROW_576),
                  (KernelConfig("float8_e4m3fn", True, 16), ROW_656))


def slot_offset_params(boundaries=OFFSET_BOUNDARIES):
    """Each boundary in each of :data:`OFFSET_CONFIGS`, as ``(case, row width)``."""
    return [pytest.param(case, width, id=f"{case.id}-{config.id}")
            for boundary in boundaries for config, width in OFFSET_CONFIGS
            for case in [slot_offset_case(boundary, width, config)]]


def row_width(backend, spec) -> int:
    """The width slot ids are multiplied by on ``backend``: FlashMLA's 656-byte row for an fp8
    cache, else the cache's row (512 + rope elements)."""
    if backend.kernel == "flashmla" and spec.kv_dtype == "float8_e4m3fn":
        return ROW_656
    return spec.head_dim


@contextlib.contextmanager
def kv_parts_handed(layer, contiguous: bool, order: dict | None = None):
    """While open, the layer's attention kernel (``layer.state.wrapper.run(q_nope, q_pe, ckv,
    kpe, ...)``: the port's and vLLM's) gets contiguous copies of ckv and kpe where
    ``contiguous``, else the views it is handed; yields a list of ``(ckv, kpe)`` contiguity of
    what each call was handed before any copy.

    ``order`` (shared by the runs compared) keeps the kv_indices the first run handed its kernel;
    each later run's kernel gets them in that order, after a check that they hold the same
    entries as the run's own. A convert that compacts each row's entries in an order that varies
    from run to run (vLLM 0.30.0's atomic slot allocator on a GPU) would otherwise change the
    output bits by summation order alone, the strides aside."""
    wrapper = layer.state.wrapper
    run, handed = wrapper.run, []

    def handing_run(q_nope, q_pe, ckv, kpe, *args, **kwargs):
        handed.append((ckv.is_contiguous(), kpe.is_contiguous()))
        if order is not None:
            same_order(layer.state.kv_indices, order)
        if contiguous:
            ckv, kpe = ckv.contiguous(), kpe.contiguous()
        return run(q_nope, q_pe, ckv, kpe, *args, **kwargs)

    wrapper.run = handing_run
    try:
        yield handed
    finally:
        del wrapper.run


def same_order(kv_indices, order: dict) -> None:
    """kv_indices in the order ``order`` kept from the first run (kept there on the first);
    ``order["reordered"]``: a later run's own order differed."""
    if "kv_indices" not in order:
        order["kv_indices"] = kv_indices.clone()
        return
    first = order["kv_indices"]
    if torch.equal(first, kv_indices):
        return
    assert torch.equal(first.sort().values, kv_indices.sort().values), \
        "the two runs' kv_indices hold different entries, not the same entries in another order"
    order["reordered"] = True
    kv_indices.copy_(first)


def single_token_rows(scenario, planned: int) -> torch.Tensor:
    """The planned rows of the requests that decode one token (int64)."""
    starts = scenario.meta.query_start_loc_cpu
    rows = torch.tensor([int(starts[i]) for i in single_token_decodes(scenario.spec)], dtype=torch.int64)
    return rows[rows < planned]
