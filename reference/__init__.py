"""Pure-PyTorch reference models of sparse MLA attention and everything around it (any device)."""

from .budget import Comparison, compare_to_budget
from .indexer import buffer_width, indexer_row, indexer_rows
from .invariants import (
    Violation,
    check_plan_invariants,
    check_row_invariants,
    intended_selection,
    planned_selection,
)
from .oracle import lse_from_base2, lse_to_base2, sparse_mla_reference
from .rules import (
    REGIMES,
    classify_row,
    classify_rows,
    convert_rule,
    kv_len_rule,
    request_ids_per_row,
    route_prefills_to_mha,
    row_context,
    valid_counts,
    valid_is_prefix,
)

__all__ = [
    "Comparison",
    "compare_to_budget",
    "buffer_width",
    "indexer_row",
    "indexer_rows",
    "Violation",
    "check_plan_invariants",
    "check_row_invariants",
    "intended_selection",
    "planned_selection",
    "lse_from_base2",
    "lse_to_base2",
    "sparse_mla_reference",
    "REGIMES",
    "classify_row",
    "classify_rows",
    "convert_rule",
    "kv_len_rule",
    "request_ids_per_row",
    "route_prefills_to_mha",
    "row_context",
    "valid_counts",
    "valid_is_prefix",
]
