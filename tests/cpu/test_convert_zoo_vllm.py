"""The invalid-index zoo (``tests/support/index_zoo.py``) through a vLLM release's own convert
kernel (``--vllm``): ``triton_convert_req_index_to_global_index`` of its ``sparse_utils.py``,
called as its SM90 backend calls it (``BLOCK_SIZE``, ``NUM_TOPK_TOKENS`` the row width, and
``BLOCK_STRIDE_ROWS`` where the release's backend hands one: from 0.32.0, here the block size of a
contiguous cache), judged entry for entry against the contract (``reference.rules.convert_rule``)
as the project's convert is in ``tests/cpu/test_convert.py``.

- the compacting call (``return_valid_counts=True``, what every SM90 backend runs): each row's
  valid slots at its front (as a multiset: 0.30.0 compacts a row of several tiles through an
  atomic counter, its order unspecified), -1 past them, and the count equal to the row's valid
  entries;
- the plain call (``return_valid_counts=False``, column-preserving): slot for slot the rule.

On a machine without a GPU the release's kernel runs in Triton's interpreter."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from backends.vllm.shims import SPARSE_UTILS_MODULE
from mla_constants import INVALID
from reference.rules import convert_rule, request_ids_per_row
from tests.support.index_zoo import BS, ZOO, ZOO_Q_LENS, ZOO_ROWS, ZOO_TABLE, ZOO_WIDTHS, zoo_rows

pytestmark = pytest.mark.vllm


def release_convert(vllm_backend, topk, table, req, *, compact: bool):
    """The release's convert on the inputs, with the arguments its SM90 backend's ``forward_mqa``
    passes (``BLOCK_STRIDE_ROWS`` where its facts say the backend hands the kernel a block stride;
    a contiguous cache's is the block size)."""
    convert = vllm_backend.module.triton_convert_req_index_to_global_index
    assert convert.__module__ == SPARSE_UTILS_MODULE, f"the backend's convert comes from {convert.__module__}"
    kwargs = {"BLOCK_SIZE": BS, "NUM_TOPK_TOKENS": topk.shape[1], "return_valid_counts": compact}
    if vllm_backend.reads_block_stride:
        kwargs["BLOCK_STRIDE_ROWS"] = BS
    return convert(req, table, topk, **kwargs)


def zoo_case(width: int, device):
    """The zoo's rows, the slots the contract gives them (checked against the rule), the
    columns of its entries and the request of each row, the inputs on ``device``."""
    topk, expected, cols = zoo_rows(width)
    qsl = torch.tensor([0, *torch.tensor(ZOO_Q_LENS).cumsum(0).tolist()], dtype=torch.int32)
    req = request_ids_per_row(qsl, ZOO_ROWS)
    assert req.tolist() == [0, 1, 0], "test setup: requests 0 and 1, then a padded row"
    assert torch.equal(expected, convert_rule(topk, ZOO_TABLE, req, BS)), "the rule disagrees with the zoo"
    return expected, cols, tuple(t.to(device) for t in (topk, ZOO_TABLE, req))


def entry_of_slot(row: int, slot: int) -> str:
    """The zoo entry whose expected slot on ``row`` is ``slot`` (request 0 for the padded row)."""
    for tok, s0, s1, why in ZOO:
        if (s1 if row == 1 else s0) == slot:
            return f"{why} (token {tok})"
    return "no entry of the zoo"


def compacted_problems(slots: torch.Tensor, counts: torch.Tensor, expected: torch.Tensor) -> list[str]:
    """What a compacting convert's host copies get wrong against the contract's ``expected``
    slots: per row, the count against its valid entries, the valid slots at its front (a
    multiset, each missing one named by its zoo entry), and -1 past them."""
    problems = []
    for row in range(expected.shape[0]):
        want = [int(s) for s in expected[row] if int(s) != INVALID]
        count = int(counts[row])
        if count != len(want):
            problems.append(f"row {row}: valid count {count}, expected {len(want)}")
        front, tail = slots[row, : len(want)].tolist(), slots[row, len(want):]
        missing, extra = Counter(want) - Counter(front), Counter(front) - Counter(want)
        problems += [f"row {row}: {entry_of_slot(row, s)}: slot {s} missing from the row's valid front"
                     for s in missing.elements()]
        problems += [f"row {row}: slot {s} in the row's valid front, which no zoo entry maps to"
                     for s in extra.elements() if s != INVALID]
        if extra[INVALID]:
            holes = [c for c, s in enumerate(front) if s == INVALID]
            problems.append(f"row {row}: -1 inside the row's valid front, at columns {holes[:6]}")
        past = (tail != INVALID).nonzero().flatten()
        if past.numel():
            cols = (past + len(want)).tolist()
            problems.append(f"row {row}: {past.numel()} entries past the valid front are not -1: columns {cols[:6]} "
                            f"hold {tail[past[:6]].tolist()}")
    return problems


def in_place_problems(slots: torch.Tensor, expected: torch.Tensor, cols) -> list[str]:
    """What a column-preserving convert's host copy gets wrong: each zoo entry's slot on each
    row, then the -1 padding between the entries."""
    problems = [
        f"{why}: token {tok} on row {row} -> {int(slots[row, col])}, expected {int(expected[row, col])}"
        for col, (tok, _, _, why) in zip(cols, ZOO, strict=True)
        for row in range(expected.shape[0])
        if int(slots[row, col]) != int(expected[row, col])
    ]
    elsewhere = int((slots != expected).sum()) - len(problems)
    if elsewhere:
        problems.append(f"{elsewhere} entries of -1 padding between the zoo's columns are not -1")
    return problems


@pytest.mark.parametrize("width", ZOO_WIDTHS)
def test_the_zoo_compacted_by_the_release_convert_matches_the_contract(vllm_backend, device, width):
    """Each row's valid slots at its front as a multiset, -1 past them, and the count the number
    of valid entries; the padded row maps through request 0."""
    expected, _, (topk, table, req) = zoo_case(width, device)
    slots, counts = release_convert(vllm_backend, topk, table, req, compact=True)
    assert slots.device == topk.device and counts.device == topk.device, f"{slots.device} {counts.device}"
    slots, counts = slots.cpu(), counts.cpu()
    assert slots.dtype == torch.int32 and slots.shape == expected.shape, f"{slots.dtype} {tuple(slots.shape)}"
    assert counts.dtype == torch.int32 and counts.shape == (ZOO_ROWS,), f"{counts.dtype} {tuple(counts.shape)}"
    problems = compacted_problems(slots, counts, expected)
    assert not problems, f"vLLM {vllm_backend.version}, width {width}: " + "; ".join(problems)


@pytest.mark.parametrize("width", ZOO_WIDTHS)
def test_the_zoo_in_place_by_the_release_convert_matches_the_contract_slot_for_slot(vllm_backend, device, width):
    """The plain call keeps each entry in its column: every column of every row is the rule's slot."""
    expected, cols, (topk, table, req) = zoo_case(width, device)
    slots = release_convert(vllm_backend, topk, table, req, compact=False)
    assert isinstance(slots, torch.Tensor), f"the plain call returned {type(slots).__name__}, not the slots alone"
    assert slots.device == topk.device, f"slots on {slots.device}, inputs on {topk.device}"
    slots = slots.cpu()
    assert slots.dtype == torch.int32 and slots.shape == expected.shape, f"{slots.dtype} {tuple(slots.shape)}"
    problems = in_place_problems(slots, expected, cols)
    assert not problems, f"vLLM {vllm_backend.version}, width {width}: " + "; ".join(problems)


def test_the_checks_name_what_a_convert_gets_wrong(vllm_backend, device):
    """The release's own output at width 2176, altered as a convert without the table bound
    would write it (the token at the table width mapped through the next row's first block, the
    count one more), and with a row's valid slots reversed (which passes: the order is free)."""
    expected, cols, (topk, table, req) = zoo_case(2176, device)
    slots, counts = (t.cpu() for t in release_convert(vllm_backend, topk, table, req, compact=True))
    assert not compacted_problems(slots, counts, expected)
    reordered = slots.clone()
    reordered[0, :5] = slots[0, :5].flip(0)
    assert not compacted_problems(reordered, counts, expected), "a reordered valid front is still the contract's"
    leaked_slot = int(ZOO_TABLE[1, 0]) * BS  # block column 4 of request 0 read on into request 1's row
    unbounded, more = slots.clone(), counts.clone()
    unbounded[0, :6], more[0] = torch.tensor([leaked_slot, *slots[0, :5].tolist()]), counts[0] + 1
    problems = compacted_problems(unbounded, more, expected)
    assert "row 0: valid count 6, expected 5" in problems, problems
    assert f"row 0: slot {leaked_slot} in the row's valid front, which no zoo entry maps to" in problems, problems
    lost = slots.clone()
    lost[1, 4] = INVALID
    assert compacted_problems(lost, counts, expected) == [
        f"row 1: {entry_of_slot(1, int(slots[1, 4]))}: slot {int(slots[1, 4])} missing from the row's valid front",
        "row 1: -1 inside the row's valid front, at columns [4]"]
    plain = release_convert(vllm_backend, topk, table, req, compact=False).cpu()
    assert not in_place_problems(plain, expected, cols)
    plain[0, cols[3]] = leaked_slot
    assert in_place_problems(plain, expected, cols) == [
        f"block column == table width: token {4 * BS} on row 0 -> {leaked_slot}, expected -1"]
