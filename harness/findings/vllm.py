"""vLLM's own SM90 backend's findings (``backends.vllm.sm90``, the ``vllm`` family): what a
release is known to do wrong, as the judge asks it of every family
(:class:`harness.findings.FamilyFindings`):

- an fp8 cache planned as uint8 (refused at plan) on a release that declares that planning
  dtype, else an fp8 cache with rope and k_scale != 1 whose kpe is read without k_scale;
- a padded FULL CUDA graph step whose query rows the plan does not hold, on a FlashInfer that
  checks the query shape at run;
- a -1 packed as slot 0, which FlashInfer's kernel loads past a row's length: a non-finite slot 0
  makes the row NaN (judged by running the same plan again with slot 0 finite).
"""

from __future__ import annotations

import dataclasses

import torch

from mla_constants import SLOT_ZERO as SLOT_ZERO_FILLER

from . import FINDINGS_DOC, FamilyFindings, KnownFinding

#: vLLM's builder plans a FULL graph step's query rows (``query_start_loc_cpu[-1]``) while its
#: forward_mqa runs the padded token count; a FlashInfer that checks the query shape at run refuses.
PADDED_GRAPH_ROWS_FINDING = (
    "vLLM plans a padded FULL graph step's query rows and runs its padded rows: "
    + FINDINGS_DOC + "#vllm-padded-graph-rows-unplanned"
)
#: What FlashInfer 0.7.4's run() raises on q rows other than the planned ones.
QUERY_SHAPE_REFUSAL = "q_nope rows and heads must match the planned query shape"


class PaddedGraphRowsUnplanned(AssertionError):
    """FlashInfer's run() refused a padded FULL graph step of vLLM's backend: the plan has the
    step's query rows, q the padded token count."""


def padded_graph_step(spec) -> bool:
    """A FULL CUDA graph step with padded token rows (``harness.spec.graph_padded``)."""
    return bool(spec.full_graph) and spec.padded_rows > 0


#: vLLM dequantises the kpe part of an fp8 cache with 1.0, not the layer's k_scale.
KPE_SCALE_FINDING = "vLLM's fp8 kpe read without k_scale: " + FINDINGS_DOC + "#vllm-fp8-kpe-scale"
#: vLLM plans an fp8 cache with its storage dtype (its cache spec's uint8), which FlashInfer refuses.
FP8_AS_UINT8_FINDING = "vLLM plans an fp8 cache as uint8: " + FINDINGS_DOC + "#vllm-fp8-planned-as-uint8"
#: What FlashInfer's plan() raises on a kv_data_type of uint8.
UINT8_REFUSAL = "kv_data_type torch.uint8 is not supported"
#: vLLM 0.31.0 packs a -1 inside a row's planned length as slot 0, which FlashInfer's fa3 kernel
#: loads past the row's executed length with weight 0: a non-finite slot 0 makes the row NaN.
SLOT_ZERO_FINDING = ("vLLM's -1 packed as slot 0, loaded past a row's length: " + FINDINGS_DOC
                     + "#vllm-slot-0-loaded-past-a-rows-length")


class Fp8PlannedAsUint8(AssertionError):
    """FlashInfer refused vLLM's plan of an fp8 cache with kv_data_type uint8."""


class KpeScaleIgnored(AssertionError):
    """vLLM's output is beyond the budget on an fp8 cache with rope and k_scale != 1, and only
    there (its forward_mqa passes kpe_scale=1.0)."""


class SlotZeroLoaded(AssertionError):
    """The output rows that are not finite are exactly those whose kernel tiles load a non-finite
    slot 0 past their executed length."""


def kpe_scale_ignored(config) -> bool:
    """A configuration (a ``KernelConfig`` or a ``BatchSpec``) where vLLM's fp8 kpe finding decides
    the output: an fp8 cache with rope and k_scale != 1."""
    return config.kv_dtype == "float8_e4m3fn" and bool(config.rope) and config.k_scale != 1.0


FP8_AS_UINT8 = KnownFinding(Fp8PlannedAsUint8, FP8_AS_UINT8_FINDING)
KPE_SCALE = KnownFinding(KpeScaleIgnored, KPE_SCALE_FINDING, decides_output=True)
PADDED_GRAPH_ROWS = KnownFinding(PaddedGraphRowsUnplanned, PADDED_GRAPH_ROWS_FINDING)
SLOT_ZERO = KnownFinding(SlotZeroLoaded, SLOT_ZERO_FINDING)


def with_slot_zero_finite(layer, step, inputs, outcome):
    """``outcome`` with the output of the same plan run again (the layer's ``forward_again`` on
    ``step``, the step's input) on the cache with slot 0 zeroed, restored afterwards; None where the
    layer cannot run its plan again. Slot 0 is no row's intended slot (physical block 0 is
    reserved), so the references do not change."""
    again = getattr(layer, "forward_again", None)
    if not callable(again):
        return None
    slot0 = inputs.kv_cache[0, 0]
    held = slot0.clone()
    slot0.view(torch.uint8).zero_()
    try:
        out = again(step, outcome)
    finally:
        slot0.copy_(held)
    return dataclasses.replace(outcome, out=out)


class VllmFindings(FamilyFindings):
    def expected(self, backend, spec, query_shape_checked) -> list[KnownFinding]:
        """An fp8 cache on a release that plans it as uint8 (refused at plan), else an fp8 cache
        with rope and k_scale != 1 (kpe read without k_scale); a padded FULL graph step on a
        FlashInfer that checks the query shape at run (``query_shape_checked()``, asked only of
        such a step)."""
        found = []
        if spec.kv_dtype == "float8_e4m3fn" and backend.plans_fp8_as_storage_dtype:
            found.append(FP8_AS_UINT8)
        elif kpe_scale_ignored(spec):
            found.append(KPE_SCALE)
        if padded_graph_step(spec) and query_shape_checked():
            found.append(PADDED_GRAPH_ROWS)
        return found

    def refusal(self, backend, scenario, exc: ValueError) -> AssertionError | None:
        text = str(exc)
        if UINT8_REFUSAL in text and scenario.spec.kv_dtype == "float8_e4m3fn" and backend.plans_fp8_as_storage_dtype:
            return Fp8PlannedAsUint8(f"vLLM {backend.version}: FlashInfer refused the plan: {exc}; "
                                     f"{scenario.describe()}")
        if QUERY_SHAPE_REFUSAL in text and padded_graph_step(scenario.spec):
            return PaddedGraphRowsUnplanned(
                f"vLLM {backend.version}: FlashInfer's run() refused the padded FULL graph step: {exc}; vLLM's "
                f"build() planned the {scenario.num_rows} query rows (query_start_loc_cpu[-1]) and forward_mqa "
                f"ran {scenario.meta.num_actual_tokens} rows (num_actual_tokens, padded); {scenario.describe()}")
        return None

    def rows_loading_a_bad_slot(self, backend, layer, outcome, inputs) -> list[int]:
        """On FlashInfer's own kernel, the rows that load, past their executed length, an entry
        vLLM packed as slot 0 whose KV row is not finite (``VllmLayer.slots_loaded_past_length``).
        None on a release whose facts pack the row's first slot there (it reads finite data and
        meets none): slot 0 loaded there is a failure of its own, not this finding."""
        if inputs is None or not getattr(layer, "on_flashinfer", False) or backend.minus_one_filler != SLOT_ZERO_FILLER:
            return []
        loaded = layer.slots_loaded_past_length(outcome)
        if not loaded:
            return []
        cache = inputs.kv_cache.reshape(-1, inputs.kv_cache.shape[-1])
        if bool(torch.isfinite(cache[0].float()).all()):
            return []
        return sorted(r for r, slots in loaded.items() if 0 in slots)

    def bad_slot_verdict(self, verdict, layer, scenario, inputs, rows, compare, kernel, summary) -> AssertionError:
        """The finding (expected from here on) where the same plan run again with slot 0 finite
        puts every planned row within the budget, so that slot 0 alone made them NaN; else a
        failure of its own, with what the run again measured."""
        from ..backend_step import step_input

        where = verdict.where
        again = with_slot_zero_finite(layer, step_input(scenario, inputs), inputs, verdict.outcome)
        if again is None:
            return AssertionError(f"{where}\nrows {rows} load slot 0 (not finite) past their executed length and "
                                  f"are not finite; the layer cannot run its plan again with slot 0 finite, so "
                                  f"nothing shows that slot 0 alone made them so\n{summary}")
        bad = [c for c in compare(again, scenario, inputs, kernel=kernel) if not c.ok]
        if bad:
            return AssertionError(f"{where}\nrows {rows} load slot 0 (not finite) past their executed length, and "
                                  f"with slot 0 finite the same plan is still off:\n"
                                  + "\n".join(c.summary(scenario.row_regime) for c in bad))
        verdict.expected.append(SLOT_ZERO)
        return SlotZeroLoaded(f"{where}\nrows {rows} load slot 0 (not finite) past their executed length and are "
                              f"not finite; with slot 0 finite the same plan is within the budget\n{summary}")

    def hole_filler(self, backend, device) -> str | None:
        return backend.minus_one_filler


FINDINGS = VllmFindings()
