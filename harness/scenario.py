"""The scenario names in one place, for callers that import them from here: a batch spec + a
seed -> a step's tensors. Each job has a module of its own:

- :mod:`harness.spec`: :class:`BatchSpec` and :class:`Request` (what a step is made of), the
  engine metadata (:class:`StepMetadata`), the :class:`Scenario` and its truth about every row;
- :mod:`harness.builder`: :func:`build_scenario`, the one scenario builder every tier uses;
- :mod:`harness.indexer_fill`: the indexer rows of a whole step (:func:`indexer_rows_fast`);
- :mod:`harness.hashed_values`: the counter-based value generator (:func:`slot_values`,
  :func:`query_rows`, :func:`component_seed`);
- :mod:`harness.device_inputs`: q and the KV cache on a device (:func:`build_attention_inputs`,
  :func:`build_attention_inputs_on`, :func:`nan_kv_buffer`).
"""

from __future__ import annotations

from .builder import build_scenario
from .device_inputs import (
    AttentionInputs,
    build_attention_inputs,
    build_attention_inputs_on,
    intended_slots_on,
    nan_kv_buffer,
    readable_slots_on,
)
from .hashed_values import (
    component_seed,
    fill_hashed_normals,
    query_rows,
    slot_values,
    slot_values_on,
    splitmix64_torch,
)
from .indexer_fill import indexer_rows_fast
from .spec import (
    KV_DTYPES,
    SCORE_OFFSET_KEY,
    BatchSpec,
    Request,
    Scenario,
    StepMetadata,
    batch,
    score_offset_coordinate,
    score_offset_problem,
    score_offset_query_value,
    spec_from_dict,
    with_empty_rows,
)

__all__ = [
    "KV_DTYPES", "SCORE_OFFSET_KEY", "AttentionInputs", "BatchSpec", "Request", "Scenario", "StepMetadata", "batch",
    "build_attention_inputs", "build_attention_inputs_on", "build_scenario", "component_seed", "fill_hashed_normals",
    "indexer_rows_fast", "intended_slots_on", "nan_kv_buffer", "query_rows", "readable_slots_on",
    "score_offset_coordinate", "score_offset_problem", "score_offset_query_value", "slot_values", "slot_values_on",
    "spec_from_dict", "splitmix64_torch", "with_empty_rows",
]
