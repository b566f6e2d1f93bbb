"""The invalid-index zoo: top-k entries a convert kernel must map to -1 (negatives, INT32_MIN,
block columns at and past the block table's width, INT32_MAX) beside valid ones at the table's
edges (the first token, the last column, slot ids past 2^23 up to INT32_MAX, a token past the
request's allocation that maps through a stale table entry), each with the slot the contract
(``reference.rules.convert_rule``) gives it.

Every convert under test runs it: the project's (``tests/cpu/test_convert.py``) and each vLLM
release's ``triton_convert_req_index_to_global_index`` (``tests/cpu/test_convert_zoo_vllm.py``)."""

from __future__ import annotations

import numpy as np
import torch

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1

#: The zoo's block size.
BS = 16
#: Top-k widths the zoo runs at: one tile of 128, and GLM's 2176 (17 tiles, not a power of two).
ZOO_WIDTHS = (128, 2176)
#: Query tokens per request: rows 0 and 1 are requests 0 and 1, row 2 is CUDA-graph padding.
ZOO_Q_LENS = (1, 1)
ZOO_ROWS = 3

# request 0 owns blocks [7, 3]; columns 2-3 are stale entries past its allocation.
# request 1 owns [2, 8, 6]; column 3 is stale and large (slot ids >= 2**23, up to INT32_MAX).
ZOO_TABLE = torch.tensor([[7, 3, 9, 5], [2, 8, 6, INT32_MAX // BS]], dtype=torch.int32)
ZOO = [  # (token, slot for request 0, slot for request 1, why)
    (-1, -1, -1, "-1"),
    (-2, -1, -1, "other negative"),
    (INT32_MIN, -1, -1, "INT32_MIN"),
    (4 * BS, -1, -1, "block column == table width"),
    (4 * BS + 5, -1, -1, "block column == table width, nonzero offset"),
    (1000, -1, -1, "block column > table width"),
    (INT32_MAX, -1, -1, "INT32_MAX"),
    (0, 7 * BS, 2 * BS, "first token"),
    (17, 3 * BS + 1, 8 * BS + 1, "second block"),
    (40, 9 * BS + 8, 6 * BS + 8, "past request 0's allocation, inside the table: maps through the stale entry"),
    (63, 5 * BS + 15, INT32_MAX, "last column of the table; request 1: the largest int32 slot"),
    (50, 5 * BS + 2, (INT32_MAX // BS) * BS + 2, "slot id >= 2**23 for request 1"),
]


def zoo_rows(width: int = 128):
    """Row 0 (request 0) and row 1 (request 1) hold the zoo at spread-out columns, the last one at
    the row's last column; row 2 is padding (request 0)."""
    cols = np.linspace(0, width - 1, len(ZOO)).astype(int)
    topk = torch.full((ZOO_ROWS, width), -1, dtype=torch.int32)
    expected = torch.full((ZOO_ROWS, width), -1, dtype=torch.int32)
    for col, (tok, s0, s1, _) in zip(cols, ZOO, strict=True):
        topk[:, col] = tok
        expected[0, col], expected[1, col], expected[2, col] = s0, s1, s0
    return topk, expected, cols
