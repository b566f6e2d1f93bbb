"""What each field of a case file may hold: the checks fixtures, recipes and sequences share,
and the bounds that keep a file from asking the scenario builder or the planner for more than
they take.

Each check takes a field's value and returns None where it is good, else what was expected
(``expected an int from 1 to 2048``); :func:`field_problem` turns that into the one line a
:class:`~recording.fixture.FixtureError` carries (``recipe field 'spec.topk' is int
1000000000, expected an int from 1 to 2048``). A batch spec (``spec`` of a fixture or a recipe,
each step of a sequence) is checked field by field (:data:`SPEC_FIELDS`), then for its size
(rows, tokens, cache slots, block-table and indexer entries: :func:`spec_size_problem`), then by
the batch spec's own rules, all before anything is built.
"""

from __future__ import annotations

import json
import math

from mla_constants import KV_LORA_RANK, ROPE_DIM, TOPK

# --- bounds ----------------------------------------------------------------------------------

#: The planner's top-k: a DSA indexer row selects at most 2048 slots, and every planned row
#: reads at most top-k of them.
MAX_TOPK = TOPK
#: A pool of kpool slots per indexer entry divides top-k.
MAX_KPOOL = TOPK
#: The indexer buffer's width: ``roundup(topk + kpool - 1, 128)`` at most.
MAX_WIDTH = 2 * TOPK
#: Query heads of one launch (FlashInfer's fa3 plans 16 to 128; FlashMLA's kernels take 256).
MAX_HEADS = 256
#: Tokens per KV-cache block (vLLM's caches use 16 to 576).
MAX_BLOCK_SIZE = 4096
#: Requests and query rows (padded rows included) of one step; the scale cases reach 32768 rows.
MAX_REQUESTS = 1 << 16
MAX_ROWS = 1 << 16
#: One request's context, and all requests' tokens together (the scale cases: 131072 and 2.5M).
MAX_SEQ_LEN = 1 << 20
MAX_TOKENS = 1 << 23
#: KV-cache slots of a step (blocks x block size; slot ids past 2**23 included).
MAX_SLOTS = 1 << 25
#: Entries of the block table (requests x its width) and of the indexer rows (rows x width).
MAX_TABLE_ENTRIES = 1 << 25
MAX_INDEXER_ENTRIES = 1 << 27
#: Steps of a sequence.
MAX_STEPS = 256
#: FlashInfer releases recorded in one fixture.
MAX_VERSIONS = 64
MAX_SEED = 2**63 - 1
#: The softmax scale is 1/sqrt(head dim) times a YaRN factor (0.04 to 0.14 for the sparse MLA
#: models); 16 keeps every scaled score of the suite's inputs far inside float32.
MAX_SM_SCALE = 16.0
#: The fp8 KV dequantisation scale (0.5 and 1.0 in the suite; e4m3 holds up to 448).
MAX_K_SCALE = 1024.0
#: A raw score offset (the magnitude edge reaches 2**10; q carries it as a bf16 value).
MAX_SCORE_OFFSET = float(1 << 20)
LAYOUTS = ("strided", "packed", "compacted")
#: q_nope's and ckv's width, and q_pe's and kpe's (rope 64 or NoPE).
HEAD_DIM_CKV = KV_LORA_RANK
HEAD_DIMS_KPE = (ROPE_DIM, 0)
KV_DTYPE_NAMES = ("bfloat16", "float8_e4m3fn")
REGIMES = ("A", "B", "C", "D", "E", "F", "G", "H")
HEX64 = frozenset("0123456789abcdef")


# --- checks of one value -----------------------------------------------------------------------


def shown(value) -> str:
    """A value as a message shows it: its JSON type and at most 60 characters of it."""
    return f"{type(value).__name__} {json.dumps(value)[:60]}"


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


def int_in(low: int, high: int):
    def check(value) -> str | None:
        return None if is_int(value) and low <= value <= high else f"expected an int from {low} to {high}"
    return check


def int_at_least(low: int):
    def check(value) -> str | None:
        return None if is_int(value) and value >= low else f"expected an int >= {low}"
    return check


def positive_up_to(high: float):
    """A finite number in ``(0, high]``."""
    def check(value) -> str | None:
        return None if is_number(value) and 0 < value <= high else f"expected a finite number in (0, {high:g}]"
    return check


def a_bool(value) -> str | None:
    return None if isinstance(value, bool) else "expected true or false"


def false(value) -> str | None:
    return None if value is False else "expected false"


def text(value) -> str | None:
    return None if isinstance(value, str) else "expected a string"


def one_of(*allowed):
    def check(value) -> str | None:
        ok = value in allowed and isinstance(value, type(allowed[0])) and not isinstance(value, bool)
        return None if ok else f"expected one of {', '.join(map(str, allowed))}"
    return check


def sha256_hex(value) -> str | None:
    ok = isinstance(value, str) and len(value) == 64 and set(value) <= HEX64
    return None if ok else "expected 64 hexadecimal digits (a SHA-256)"


def impl_spec(value) -> str | None:
    ok = isinstance(value, str) and value.count(":") == 1 and all(value.split(":"))
    return None if ok else "expected MODULE:FACTORY"


def a_dict(value) -> str | None:
    return None if isinstance(value, dict) else "expected an object"


def nullable(check):
    """``check``, or null."""
    def checks(value) -> str | None:
        wrong = None if value is None else check(value)
        return None if wrong is None else f"{wrong}, or null"
    return checks


def any_value(value) -> str | None:
    return None


def texts_by_text(value) -> str | None:
    ok = isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
    return None if ok else "expected an object of strings"


def list_of(check, what: str, *, distinct: bool = False, most: int = MAX_ROWS):
    """A list of at most ``most`` entries that ``check`` accepts (``what``: how a message says it)."""
    def checks(value) -> str | None:
        ok = (isinstance(value, list) and len(value) <= most and all(check(v) is None for v in value)
              and (not distinct or len(set(value)) == len(value)))
        return None if ok else f"expected a list of at most {most} {'distinct ' if distinct else ''}{what}"
    return checks


def requests(value) -> str | None:
    what = (f"expected a list of at most {MAX_REQUESTS} {{seq_len, q_len}} objects of ints from 0 to "
            f"{MAX_SEQ_LEN}")
    if not isinstance(value, list):
        return what
    if len(value) > MAX_REQUESTS:
        return f"{what} (it holds {len(value)})"
    for r in value:
        if not (isinstance(r, dict) and set(r) == {"seq_len", "q_len"}
                and all(is_int(v) and 0 <= v <= MAX_SEQ_LEN for v in r.values())):
            return f"{what}, got an entry {shown(r)}"
    return None


def width(value) -> str | None:
    return None if value is None or (is_int(value) and 1 <= value <= MAX_WIDTH) else \
        f"expected null or an int from 1 to {MAX_WIDTH}"


def score_offsets(value) -> str | None:
    ok = isinstance(value, list) and len(value) <= MAX_ROWS and all(
        is_number(v) and abs(v) <= MAX_SCORE_OFFSET for v in value)
    return None if ok else f"expected a list of at most {MAX_ROWS} finite numbers from -{MAX_SCORE_OFFSET:.0f} to " \
                           f"{MAX_SCORE_OFFSET:.0f}"


# --- fields of a file ------------------------------------------------------------------------


def field_problem(name: str, value, check, kind: str = "recipe") -> str | None:
    """``KIND field 'NAME' is TYPE VALUE, expected ...`` where ``check`` refuses ``value``."""
    wrong = check(value)
    return None if wrong is None else f"{kind} field '{name}' is {shown(value)}, {wrong}"


def fields_problem(data: dict, required: dict, optional: dict, kind: str = "recipe", prefix: str = "",
                   unknown: str | None = None) -> str | None:
    """The first field of ``data`` missing, unknown, or refused by its check (``required`` and
    ``optional``: field -> check), named ``prefix + name`` (an unknown one "is not ``unknown``",
    by default a ``kind`` field)."""
    for name in required:
        if name not in data:
            return f"{kind} field '{prefix}{name}' is missing"
    for name in data:
        if name not in required and name not in optional:
            return f"{kind} field '{prefix}{name}' is not {unknown or f'a {kind} field'}"
    for name, check in {**required, **optional}.items():
        problem = field_problem(prefix + name, data[name], check, kind) if name in data else None
        if problem:
            return problem
    return None


#: Each field of a batch spec (:class:`harness.spec.BatchSpec` as JSON) with its check.
SPEC_FIELDS = {
    "requests": requests, "topk": int_in(1, MAX_TOPK), "kpool": int_in(1, MAX_KPOOL), "width": width,
    "block_size": int_in(1, MAX_BLOCK_SIZE), "rope": a_bool, "kv_dtype": one_of(*KV_DTYPE_NAMES),
    "k_scale": positive_up_to(MAX_K_SCALE), "num_heads": int_in(1, MAX_HEADS),
    "sm_scale": positive_up_to(MAX_SM_SCALE), "async_scheduling": a_bool,
    "host_bound_slack": int_in(0, MAX_SEQ_LEN), "decode_threshold": int_in(1, MAX_ROWS),
    "padded_rows": int_in(0, MAX_ROWS), "table_slack": int_in(0, MAX_SEQ_LEN), "spare_blocks": int_in(0, MAX_SLOTS),
    "min_block_id": int_in(1, MAX_SLOTS), "score_offsets": score_offsets, "split_score_signs": a_bool,
    "with_host_bound": a_bool, "with_positions": a_bool,
}
#: Fields of a spec that files written before them lack (absent: the default).
OPTIONAL_SPEC_FIELDS = {"full_graph": a_bool}


def spec_size_problem(spec: dict, kind: str = "recipe", prefix: str = "spec.") -> str | None:
    """What of a spec (its fields each valid) is larger than the bounds: its query rows, tokens,
    cache slots, block-table or indexer entries; None where it fits. Computed from the fields
    alone, nothing built."""
    field = prefix.rstrip(".")
    reqs = spec["requests"]
    rows = sum(r["q_len"] for r in reqs) + spec["padded_rows"]
    if rows > MAX_ROWS:
        return (f"{kind} field '{field}' plans {rows} query rows (its requests' q_len and padded_rows), expected at "
                f"most {MAX_ROWS}")
    tokens = sum(r["seq_len"] for r in reqs)
    if tokens > MAX_TOKENS:
        return f"{kind} field '{prefix}requests' holds {tokens} tokens, expected at most {MAX_TOKENS}"
    bs = spec["block_size"]
    blocks = [-(-r["seq_len"] // bs) for r in reqs]
    slots = (spec["min_block_id"] + sum(blocks) + spec["spare_blocks"]) * bs
    if slots > MAX_SLOTS:
        return (f"{kind} field '{field}' needs a cache of {slots} slots ((min_block_id + blocks + spare_blocks) x "
                f"block_size), expected at most {MAX_SLOTS}")
    table = len(reqs) * (max(blocks, default=0) + spec["table_slack"])
    if table > MAX_TABLE_ENTRIES:
        return (f"{kind} field '{field}' needs a block table of {table} entries (requests x (blocks + table_slack)), "
                f"expected at most {MAX_TABLE_ENTRIES}")
    resolved = spec["width"] if spec["width"] is not None else -(-(spec["topk"] + spec["kpool"] - 1) // 128) * 128
    if rows * resolved > MAX_INDEXER_ENTRIES:
        return (f"{kind} field '{field}' needs {rows * resolved} indexer entries (rows x width {resolved}), expected "
                f"at most {MAX_INDEXER_ENTRIES}")
    return None


def spec_problem(spec, kind: str = "recipe", prefix: str = "spec.") -> str | None:
    """What is wrong with a batch spec: a missing, unknown or ill-typed field, a field or a size
    past its bound, or values the batch spec refuses together (its own message)."""
    field = prefix.rstrip(".")
    if not isinstance(spec, dict):
        return field_problem(field, spec, a_dict, kind)
    problem = fields_problem(spec, SPEC_FIELDS, OPTIONAL_SPEC_FIELDS, kind, prefix,
                             unknown="a field of a batch spec") or spec_size_problem(spec, kind, prefix)
    if problem:
        return problem
    from harness.spec import spec_from_dict

    try:
        spec_from_dict(spec)
    except (TypeError, ValueError) as exc:
        return f"{kind} field '{field}' is not a batch spec: {exc}"
    return None


def planned_rows_of(spec: dict) -> int:
    """The rows the batch of a (valid) spec plans, without building it."""
    from harness.builder import plan_rows
    from harness.spec import spec_from_dict

    return plan_rows(spec_from_dict(spec)).planned_rows


def rope_dim(spec: dict) -> int:
    """The rope width R of a (valid) spec: 64, or 0 for NoPE."""
    return ROPE_DIM if spec["rope"] else 0
