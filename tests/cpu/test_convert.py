"""The convert kernel (request-local top-k token indices -> global slot ids, docs/computation.md#convert-kernel)
bit-exact against reference.rules.convert_rule, through the implementation under test
(``impl.convert`` / ``impl.request_ids``) on the test device (``--device``: the compiled
kernel on a GPU; on CPU the Triton kernel runs interpreted). Inputs are built on the host and
moved to the device; the rule runs on the host.

Tests marked ``input_rules`` check the project's own input rules (exception types, accepted
dtypes and strides, ``out=`` buffers) rather than what the kernel computes; an external
implementation is judged with ``-m "not input_rules"``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harness.isolation import crashes_noted
from harness.pipeline import run_step_in_child
from harness.scenario import BatchSpec, build_scenario
from mla_constants import INVALID
from reference.rules import convert_rule, request_ids_per_row, valid_counts
from tests.cpu.host_stages import host_stages_apart
from tests.support.index_zoo import BS, INT32_MIN, ZOO, ZOO_TABLE, ZOO_WIDTHS, zoo_rows

DIRTY = 0x5A5A5A5A


# --- helpers -------------------------------------------------------------------------------


def qsl_tensor(q_lens, device="cpu") -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int32, device=device)


impl = pytest.fixture(scope="module", name="impl")(host_stages_apart)


def on(device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(device) for t in tensors)


def mismatches(
    actual: torch.Tensor, expected: torch.Tensor, topk: torch.Tensor, req: torch.Tensor, limit: int = 6
) -> str:
    bad = (actual != expected).nonzero().tolist()
    lines = [
        f"row {r} (request {int(req[r])}) column {c}: token {int(topk[r, c])} -> {int(actual[r, c])}, "
        f"expected {int(expected[r, c])}"
        for r, c in bad[:limit]
    ]
    return f"{len(bad)} entries differ: " + "; ".join(lines)


def assert_matches_rule(impl, topk, table, req, block_size, **kwargs):
    """Run the kernel on the inputs' device and check it bit-exactly against the rule, run on
    the host (and its counts if asked). Returns host copies of the slots and counts."""
    result = impl.convert(topk, table, req, block_size, **kwargs)
    slots, counts = result if kwargs.get("with_counts") else (result, None)
    assert slots.device == topk.device, f"slots on {slots.device}, inputs on {topk.device}"
    if kwargs.get("out") is not None:
        assert slots.data_ptr() == kwargs["out"].data_ptr(), "the kernel did not write into the given buffer"
    slots = slots.cpu()
    counts = None if counts is None else counts.cpu()
    topk, table, req = topk.cpu(), table.cpu(), req.cpu()
    expected = convert_rule(topk, table, req, block_size)
    assert slots.dtype == torch.int32 and slots.shape == topk.shape, f"{slots.dtype} {tuple(slots.shape)}"
    assert torch.equal(slots, expected), f"block_size={block_size}: " + mismatches(slots, expected, topk, req)
    if counts is not None:
        exp_counts = valid_counts(expected)
        bad = (counts != exp_counts).nonzero().flatten().tolist()
        assert counts.dtype == torch.int32 and not bad, (
            f"valid counts differ on rows {bad[:8]}: got {counts[bad[:8]].tolist()}, "
            f"expected {exp_counts[bad[:8]].tolist()}"
        )
    return slots, counts


def random_case(seed: int, rows: int, width: int, num_reqs: int, table_width: int, block_size: int,
                invalid_frac: float = 0.3, num_blocks: int = 1000):
    """Random indices: -1, other negatives, tokens inside the table, and block columns past it."""
    rng = np.random.default_rng(seed)
    table = rng.integers(1, num_blocks, size=(num_reqs, table_width)).astype(np.int32)
    span = table_width * block_size
    tok = rng.integers(0, span, size=(rows, width))
    kind = rng.random((rows, width))
    tok = np.where(kind < invalid_frac, -1, tok)
    tok = np.where(
        (kind >= invalid_frac) & (kind < invalid_frac + 0.05), rng.integers(span, 4 * span + 2, size=(rows, width)), tok
    )
    tok = np.where(
        (kind >= invalid_frac + 0.05) & (kind < invalid_frac + 0.08),
        rng.integers(INT32_MIN, 0, size=(rows, width)),
        tok,
    )
    req = rng.integers(0, num_reqs, size=rows).astype(np.int32)
    return (torch.from_numpy(tok.astype(np.int32)), torch.from_numpy(table), torch.from_numpy(req))


# --- the invalid-index zoo ----------------------------------------------------------------

# the zoo (its entries, table and rows): tests/support/index_zoo.py


@pytest.mark.parametrize("width", ZOO_WIDTHS)
def test_invalid_index_zoo_maps_exactly(impl, device, width):
    topk, expected, cols = zoo_rows(width)
    req = impl.request_ids(qsl_tensor([1, 1], device), 3)
    assert req.tolist() == [0, 1, 0]
    slots, counts = impl.convert(*on(device, topk, ZOO_TABLE), req, BS, with_counts=True)
    slots, counts, req = slots.cpu(), counts.cpu(), req.cpu()
    for col, (tok, _, _, why) in zip(cols, ZOO, strict=True):
        for row in range(3):
            assert int(slots[row, col]) == int(expected[row, col]), (
                f"{why}: token {tok} on row {row} -> {int(slots[row, col])}, expected {int(expected[row, col])}"
            )
    assert torch.equal(slots, expected), mismatches(slots, expected, topk, req)
    assert torch.equal(expected, convert_rule(topk, ZOO_TABLE, req, BS)), "the rule disagrees with the zoo"
    assert counts.tolist() == [int((expected[r] != INVALID).sum()) for r in range(3)]


def test_table_view_narrower_than_its_storage_uses_the_view_width(impl, device):
    """A column-sliced table: block columns past the view's width are invalid even though the
    storage behind the row holds entries there."""
    storage = torch.arange(1, 25, dtype=torch.int32).view(2, 12).to(device)
    table = storage[:, :3]
    topk = torch.full((2, 128), -1, dtype=torch.int32)
    topk[:, :4] = torch.tensor([0, 2 * BS + 1, 3 * BS, 5 * BS])
    req = torch.tensor([0, 1], dtype=torch.int32)
    slots, _ = assert_matches_rule(impl, topk.to(device), table, req.to(device), BS)
    assert slots[:, :4].tolist() == [[1 * BS, 3 * BS + 1, -1, -1], [13 * BS, 15 * BS + 1, -1, -1]]


# --- widths, block sizes, counts -----------------------------------------------------------


@pytest.mark.parametrize("width", [128, 2048, 2176])
def test_random_rows_match_rule_at_production_widths(impl, device, width):
    """70 rows: more than one program's worth of rows in the interpreter."""
    topk, table, req = random_case(seed=width, rows=70, width=width, num_reqs=3, table_width=40, block_size=64)
    assert_matches_rule(impl, *on(device, topk, table, req), 64, with_counts=True)


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_block_sizes_match_rule(impl, device, block_size):
    topk, table, req = random_case(seed=block_size, rows=9, width=256, num_reqs=2, table_width=2048 // block_size + 1,
                                   block_size=block_size)
    slots, _ = assert_matches_rule(impl, *on(device, topk, table, req), block_size, with_counts=True)
    tok = int(topk[0][topk[0] >= 0][0])
    col = int((topk[0] == tok).nonzero()[0])
    if tok // block_size < table.shape[1]:
        want = int(table[int(req[0]), tok // block_size]) * block_size + tok % block_size
        assert int(slots[0, col]) == want, f"block_size={block_size}: token {tok} -> {int(slots[0, col])}, want {want}"


@pytest.mark.parametrize("width", [128, 2176])
def test_counts_equal_valid_entries(impl, device, width):
    topk, table, req = random_case(seed=7, rows=5, width=width, num_reqs=2, table_width=8, block_size=16,
                                   invalid_frac=0.6)
    topk[1] = -1  # a row with nothing valid
    topk[2, 3] = 8 * 16  # a lone out-of-table column must not count
    slots, counts = assert_matches_rule(impl, *on(device, topk, table, req), 16, with_counts=True)
    assert int(counts[1]) == 0
    assert counts.tolist() == (slots != -1).sum(dim=1).tolist()


def test_empty_batch(impl, device):
    topk = torch.empty((0, 2176), dtype=torch.int32, device=device)
    req = impl.request_ids(torch.zeros(1, dtype=torch.int32, device=device), 0)
    slots, counts = impl.convert(topk, ZOO_TABLE.to(device), req, BS, with_counts=True)
    assert slots.shape == (0, 2176) and counts.shape == (0,)


#: A CUDA-graph step of padded rows only at block size 16: no request, so the block table has no row.
PADDING_ONLY_BS16 = BatchSpec(requests=(), topk=128, kpool=1, block_size=16, padded_rows=3)


def test_padded_rows_of_a_step_with_no_request(impl, device):
    """Padded rows only (a CUDA-graph step with no request): the block table has no row and,
    built on the host from an empty numpy array, strides (0, 0); every slot is -1. An
    implementation that kills its process on it fails this test and leaves the step's recipe."""
    scenario = build_scenario(PADDING_ONLY_BS16, 0)
    table, topk = scenario.block_table, scenario.topk_indices
    assert table.shape == (0, 2) and table.stride() == (0, 0), "test setup: numpy's empty array strides"
    assert topk.shape == (3, 128) and bool((topk == -1).all()), "test setup: three padded rows"
    with crashes_noted(scenario, "compacted"):
        req = impl.request_ids(torch.zeros(1, dtype=torch.int32, device=device), 3)
        slots, counts = assert_matches_rule(impl, *on(device, topk, table), req, 16, with_counts=True)
    assert bool((slots == -1).all()) and counts.tolist() == [0, 0, 0]


def test_a_padded_rows_only_step_with_an_empty_block_table_runs_apart(request, device):
    """The step's host stages run in a child process, where an implementation that faults on
    the empty table (reading ``block_table[req, 0]`` for the -1 entries) fails this test with
    the stage it died in, instead of killing the worker; ``--dump-failures`` keeps a recipe."""
    from pytest_sparse_mla.impl import IMPL_SPEC
    from recording.case_log import note_crash

    result = run_step_in_child(request.config.stash[IMPL_SPEC], PADDING_ONLY_BS16, 0, "compacted", device)
    if result["outcome"] != "ok":
        note_crash(build_scenario(PADDING_ONLY_BS16, 0), "compacted", result["stage"], result["detail"])
        pytest.fail(f"padded rows only, empty block table, block_size 16: {result['detail']}", pytrace=False)


# --- block ids the table may hold -------------------------------------------------------------


def test_block_id_zero_maps_like_any_block(impl, device):
    """Physical block 0 is an ordinary block to the kernel: token ``b*BS + off`` in a column
    holding 0 maps to slot ``off``, and counts as valid (the scenarios never allocate block 0,
    so that an attended slot 0 shows the packed layout's clamp, docs/regimes.md)."""
    table = torch.tensor([[0, 5, 2], [3, 0, 0]], dtype=torch.int32)
    topk = torch.full((2, 128), -1, dtype=torch.int32)
    topk[:, :4] = torch.tensor([0, 7, BS + 2, 2 * BS + 15])
    req = torch.tensor([0, 1], dtype=torch.int32)
    slots, counts = assert_matches_rule(impl, *on(device, topk, table, req), BS, with_counts=True)
    assert slots[0, :4].tolist() == [0, 7, 5 * BS + 2, 2 * BS + 15], "request 0: block 0 in column 0"
    assert slots[1, :4].tolist() == [3 * BS, 3 * BS + 7, 2, 15], "request 1: block 0 in columns 1 and 2"
    assert counts.tolist() == [4, 4]


@pytest.mark.parametrize("stale", ["zeroed", "left by an earlier request"])
def test_tokens_past_the_allocation_map_through_stale_table_entries(impl, device, stale):
    """The kernel knows the table width, not each request's allocation: a token past the
    request's allocated blocks but inside the table maps through whatever the table holds
    there (a zeroed entry: block 0; an earlier request's block id), never to -1. Only
    columns past the table width are -1; kv_len keeps the stale columns out of the plan."""
    allocated = [4, 9]  # the request's two blocks
    past = [0, 0, 0] if stale == "zeroed" else [7, 2, 11]
    table = torch.tensor([allocated + past, [1, 3, 6, 8, 10]], dtype=torch.int32)
    tokens = [BS - 1, BS, 2 * BS, 3 * BS + 4, 5 * BS - 1, 5 * BS]  # two allocated, three stale, one past the width
    topk = torch.full((2, 128), -1, dtype=torch.int32)
    topk[:, : len(tokens)] = torch.tensor(tokens)
    req = torch.tensor([0, 1], dtype=torch.int32)
    slots, counts = assert_matches_rule(impl, *on(device, topk, table, req), BS, with_counts=True)
    want = [4 * BS + BS - 1, 9 * BS, past[0] * BS, past[1] * BS + 4, past[2] * BS + BS - 1, -1]
    assert slots[0, : len(tokens)].tolist() == want, f"stale entries {stale}"
    assert int(counts[0]) == 5


# --- request ids and padded rows -----------------------------------------------------------


@pytest.mark.parametrize(("q_lens", "num_rows"), [
    ([2, 3], 5),
    ([2, 3], 8),  # three padded rows
    ([0, 3, 0, 1], 6),  # requests with no query token
    ([1] * 5, 5),
    ([], 3),  # empty batch, padding only
])
def test_request_ids_repeat_over_query_start_loc_padding_maps_to_zero(impl, device, q_lens, num_rows):
    qsl = qsl_tensor(q_lens)
    got = impl.request_ids(qsl.to(device), num_rows)
    assert got.device == qsl.to(device).device, f"request ids on {got.device}, query_start_loc on {device}"
    got = got.cpu()
    want = request_ids_per_row(qsl, num_rows)
    assert got.dtype == torch.int32 and got.tolist() == want.tolist(), (
        f"qsl={qsl.tolist()}: {got.tolist()} != {want.tolist()}"
    )
    tokens = sum(q_lens)
    assert got[tokens:].tolist() == [0] * (num_rows - tokens)


@pytest.mark.input_rules
def test_fewer_rows_than_query_tokens_are_refused_naming_both(impl, device):
    with pytest.raises(ValueError, match=r"^num_rows=2 < 3 query tokens$"):
        impl.request_ids(torch.tensor([0, 3], dtype=torch.int32, device=device), 2)


def test_padded_rows_map_through_request_zero(impl, device):
    table = torch.tensor([[5, 6, 7], [1, 2, 3], [9, 8, 4]], dtype=torch.int32)
    req = impl.request_ids(qsl_tensor([1, 2, 1], device), 7)
    topk = torch.full((7, 128), -1, dtype=torch.int32)
    topk[:, :3] = torch.tensor([0, 17, 40])  # every row, padding included, holds the same tokens
    slots, _ = assert_matches_rule(impl, *on(device, topk, table), req, 16)
    request_zero = [5 * 16, 6 * 16 + 1, 7 * 16 + 8]
    for row in range(4, 7):
        assert slots[row, :3].tolist() == request_zero, f"padded row {row} did not map through request 0"
    assert slots[1, :3].tolist() == [16, 2 * 16 + 1, 3 * 16 + 8]


# --- output buffers and input views --------------------------------------------------------


@pytest.mark.input_rules
def test_dirty_out_buffer_is_fully_overwritten(impl, device):
    topk, table, req = on(device, *random_case(seed=3, rows=66, width=2176, num_reqs=2, table_width=10, block_size=64,
                                               invalid_frac=0.7))
    out = torch.full_like(topk, DIRTY)
    assert_matches_rule(impl, topk, table, req, 64, out=out, with_counts=True)
    assert not bool((out == DIRTY).any())


@pytest.mark.input_rules
def test_row_strided_view_of_a_flat_buffer(impl, device):
    """``out`` is rows of a bigger flat buffer (the strided kv_indices layout with padding
    between rows): the rows are written, the gaps and the tail are left alone."""
    rows, width, stride, tail = 5, 128, 384, 7
    topk, table, req = random_case(seed=4, rows=rows, width=width, num_reqs=2, table_width=6, block_size=16)
    flat = torch.full((rows * stride + tail,), DIRTY, dtype=torch.int32, device=device)
    out = flat[: rows * stride].view(rows, stride)[:, :width]
    assert_matches_rule(impl, *on(device, topk, table, req), 16, out=out)
    flat = flat.cpu()
    gaps = flat[: rows * stride].view(rows, stride)[:, width:]
    assert bool((gaps == DIRTY).all()), f"{int((gaps != DIRTY).sum())} entries written between rows"
    assert bool((flat[rows * stride:] == DIRTY).all()), "the tail past the last row was written"


@pytest.mark.input_rules
def test_row_strided_input_view(impl, device):
    big, table, req = on(device, *random_case(seed=5, rows=4, width=384, num_reqs=2, table_width=6, block_size=16))
    assert_matches_rule(impl, big[:, 128:256], table, req, 16)


# --- rejected inputs -----------------------------------------------------------------------


def ok_inputs(device):
    return on(device, *random_case(seed=6, rows=4, width=128, num_reqs=2, table_width=4, block_size=16))


@pytest.mark.parametrize("req_rows", [3, 5])
def test_req_id_rows_must_equal_token_rows(impl, device, req_rows):
    """A req_id that does not give every token row its request is refused rather than mapped
    through a guess (fewer ids would leave rows to request 0)."""
    topk, table, _ = ok_inputs(device)
    with pytest.raises(Exception) as refused:
        impl.convert(topk, table, torch.zeros(req_rows, dtype=torch.int32, device=device), 16)
    assert not isinstance(refused.value, AssertionError), refused.value


@pytest.mark.input_rules
@pytest.mark.parametrize("req_rows", [3, 5])
def test_req_id_rows_mismatch_is_a_value_error_naming_req_id(impl, device, req_rows):
    topk, table, _ = ok_inputs(device)
    with pytest.raises(ValueError, match="req_id"):
        impl.convert(topk, table, torch.zeros(req_rows, dtype=torch.int32, device=device), 16)
    with pytest.raises(ValueError, match="req_id"):
        convert_rule(topk.cpu(), table.cpu(), torch.zeros(req_rows, dtype=torch.int32), 16)


#: The whole message convert raises for an input whose columns are not adjacent.
UNIT_STRIDE = "^topk_indices and block_table need unit column stride$"


@pytest.mark.input_rules
@pytest.mark.parametrize(("name", "make", "pattern"), [
    ("topk_indices int64", lambda t, b, r: (t.long(), b, r, {}), "topk_indices"),
    ("topk_indices 1-d", lambda t, b, r: (t[0], b, r[:1], {}), "topk_indices"),
    ("width not a multiple of 128", lambda t, b, r: (t[:, :100], b, r, {}), "multiple of 128"),
    ("block_table int64", lambda t, b, r: (t, b.long(), r, {}), "block_table"),
    ("block_table 1-d", lambda t, b, r: (t, b[0], r, {}), "block_table"),
    ("out int64", lambda t, b, r: (t, b, r, {"out": torch.empty(t.shape, dtype=torch.int64, device=t.device)}), "out"),
    ("out wrong shape", lambda t, b, r: (t, b, r, {"out": torch.empty((4, 256), dtype=torch.int32, device=t.device)}),
     "out"),
    ("out column-strided",
     lambda t, b, r: (t, b, r, {"out": torch.empty((4, 256), dtype=torch.int32, device=t.device)[:, ::2]}), "out"),
    ("topk_indices column-strided", lambda t, b, r: (torch.cat([t, t], 1)[:, ::2], b, r, {}), UNIT_STRIDE),
    ("block_table of two columns, column-strided",
     lambda t, b, r: (t, torch.zeros((b.shape[0], 4), dtype=torch.int32, device=b.device)[:, ::2], r, {}),
     UNIT_STRIDE),
])
def test_bad_inputs_are_rejected(impl, device, name, make, pattern):
    topk, table, req, kwargs = make(*ok_inputs(device))
    with pytest.raises(ValueError, match=pattern):
        impl.convert(topk, table, req, 16, **kwargs)


@pytest.mark.input_rules
def test_an_out_buffer_on_another_device_is_refused(impl, device):
    """``out`` on another device than the inputs (the meta device where the inputs are on the
    host) is refused, naming the devices, before any kernel runs."""
    topk, table, req = ok_inputs(device)
    other = "meta" if device.type == "cpu" else "cpu"
    with pytest.raises(ValueError, match="^inputs on several devices: "):
        impl.convert(topk, table, req, 16, out=torch.empty(topk.shape, dtype=torch.int32, device=other))


def test_host_tensors_are_refused_where_the_kernel_is_compiled(monkeypatch):
    """The compiled kernel takes CUDA tensors only: host tensors where the kernel is not run by
    Triton's interpreter are refused with what to set."""
    import fast.convert

    monkeypatch.setattr(fast.convert, "INTERPRETED", False)
    topk, table, req = ok_inputs(torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"^the convert kernel runs on CPU tensors only in Triton's interpreter: "
                       r"set TRITON_INTERPRET=1 before fast\.convert is imported$"):
        fast.convert.convert_topk_to_slots(topk, table, req, 16)


def test_a_one_column_block_table_of_any_column_stride_maps_by_the_rule(impl, device):
    """Requests of one block each: a [R, 1] block table never steps along its columns, so one
    whose column stride is not 1 (a column of a transposed buffer) is accepted and maps by the rule."""
    table = torch.arange(3, 3 + 16, dtype=torch.int32).view(4, 4).t()[:, :1]
    assert table.shape == (4, 1) and table.stride(1) != 1, "test setup: a one-column view with column stride 4"
    rng = np.random.default_rng(7)
    topk = torch.from_numpy(rng.integers(-1, BS, size=(8, 128), dtype=np.int32))
    req = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3], dtype=torch.int32)
    slots, _ = assert_matches_rule(impl, topk.to(device), table.to(device) if device.type != "cpu" else table,
                                   req.to(device), BS)
    assert bool((slots[topk >= 0] >= 3 * BS).all()), "valid tokens map into the table's blocks"


def test_convert_returns_the_slots_alone_unless_counts_are_asked_for(device):
    from fast.convert import convert_topk_to_slots

    topk = torch.full((2, 128), -1, dtype=torch.int32, device=device)
    table = torch.ones((1, 1), dtype=torch.int32, device=device)
    req = torch.zeros(2, dtype=torch.int32, device=device)
    slots = convert_topk_to_slots(topk, table, req, BS)
    assert isinstance(slots, torch.Tensor) and slots.shape == (2, 128) and bool((slots.cpu() == -1).all())


# --- random tables and indices -------------------------------------------------------------


@st.composite
def convert_cases(draw):
    q_lens = draw(st.lists(st.integers(0, 40), min_size=1, max_size=4))
    padded = draw(st.integers(0, 3))
    rows = sum(q_lens) + padded
    width = draw(st.sampled_from((128, 256)))
    block_size = draw(st.sampled_from((1, 16, 64)))
    table_width = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    invalid = draw(st.sampled_from((0.0, 0.3, 0.9)))
    return q_lens, rows, width, block_size, table_width, seed, invalid, draw(st.booleans())


@given(case=convert_cases())
def test_random_tables_and_indices_match_rule(impl, device, case):
    q_lens, rows, width, block_size, table_width, seed, invalid, with_counts = case
    topk, table, _ = random_case(seed, rows, width, len(q_lens), table_width, block_size, invalid_frac=invalid,
                                 num_blocks=2**31 // max(block_size, 64))
    req = impl.request_ids(qsl_tensor(q_lens, device), rows)
    assert req.tolist() == request_ids_per_row(qsl_tensor(q_lens), rows).tolist()
    assert_matches_rule(impl, *on(device, topk, table), req, block_size, with_counts=with_counts)
