"""Recorded cases: one safetensors file per case (tensors kept bit-exact, no pickle ever
loaded) with JSON metadata under the key ``sparse_mla_fixture``.

A fixture holds what one kernel launch consumed and what it returned:

- ``q_nope [T,H,512]``, ``q_pe [T,H,R]``;
- ``ckv [M,512]``, ``kpe [M,R]``: only the KV slots the case references, remapped to local
  ids ``0..M-1`` (``slot_ids [M]`` keeps the original ids);
- ``kv_indptr [T+1]``, ``kv_indices``, ``kv_len [T]``: the plan as handed to the kernel
  (local ids; -1 kept where the plan has it);
- ``intended [T,W]``: the converted indexer rows (local ids, -1 invalid), for reference (a);
- ``out/<version>``, ``lse/<version>`` (natural log): the fast path's outputs, per FlashInfer
  version that recorded them.

Metadata: schema version, scenario spec and seed, layout, plan arguments, per-row regimes and
contexts, and per recorded version the FlashInfer / torch / CUDA / driver versions and GPU.
Every field and every tensor is checked on load, with the bounds of :mod:`recording.checks`,
before anything is built (:data:`REQUIRED_META`, :data:`OPTIONAL_META`; no other field is
accepted): a bad one is one :class:`FixtureError` line naming the file and the field.

Every fixture carries a content digest (``digest``: SHA-256 of each tensor's dtype, shape and
bytes, and of the rest of the metadata), checked on load: a file changed after it was written
is a :class:`FixtureError` naming the tensor or the metadata, never a kernel verdict.

A fixture may leave tensors out that it rebuilds bit for bit at load (metadata ``derived``,
:mod:`recording.derived`): q and the KV slots from its scenario's spec and seed, a recorded
output from another version's identical one. Each keeps its entry in the content digest and is
checked against it once rebuilt. ``save_fixture(..., compact=True)`` writes such a file (the
checked-in fixtures); every other writer stores every tensor.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from harness.bits import bitwise_equal as bitwise_equal  # re-exported: the fixture API compares bits
from harness.bits import same_bits as same_bits

from . import checks

SCHEMA_VERSION = 2  # 2: the content digest
DERIVED_SCHEMA_VERSION = 3  # 3: tensors rebuilt at load (metadata ``derived``)
READ_SCHEMA_VERSIONS = (SCHEMA_VERSION, DERIVED_SCHEMA_VERSION)
METADATA_KEY = "sparse_mla_fixture"
REQUIRED_TENSORS = ("q_nope", "q_pe", "ckv", "kpe", "slot_ids", "kv_indptr", "kv_indices", "kv_len", "intended")


class FixtureError(ValueError):
    """A fixture file that cannot be used; the message names the file and what is wrong."""


@dataclass
class Fixture:
    meta: dict
    tensors: dict[str, torch.Tensor]
    path: Path | None = None
    outputs: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # version -> (out, lse)

    @property
    def name(self) -> str:
        return self.meta.get("name") or (self.path.stem if self.path else "<unsaved>")

    @property
    def num_rows(self) -> int:
        return int(self.tensors["kv_len"].numel())

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]


def remap_slots(*selections: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Map the slot ids used by the given tensors (-1 = none) to local ids ``0..M-1``.
    Returns the original ids ``[M]`` (sorted) and each tensor with local ids."""
    used = torch.cat([s[s >= 0].to(torch.int64).flatten() for s in selections]) if selections else torch.empty(0)
    ids = torch.unique(used)
    remapped = []
    for s in selections:
        local = torch.searchsorted(ids, s.to(torch.int64).clamp(min=0))
        remapped.append(torch.where(s >= 0, local, torch.full_like(local, -1)).to(torch.int32))
    return ids, remapped


def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes."""
    h = hashlib.sha256(f"{str(t.dtype).replace('torch.', '')}|{tuple(t.shape)}|".encode())
    flat = t.detach().contiguous().cpu().reshape(-1)
    if flat.numel():
        h.update(flat.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def metadata_digest(meta: dict) -> str:
    """SHA-256 of the metadata without its digest (keys sorted)."""
    rest = {k: v for k, v in meta.items() if k != "digest"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def content_digest(meta: dict, tensors: dict[str, torch.Tensor]) -> dict:
    return {"algorithm": "sha256", "metadata": metadata_digest(meta),
            "tensors": {name: tensor_digest(t) for name, t in sorted(tensors.items())}}


def check_metadata_digest(path, meta: dict) -> dict:
    """The metadata matches its digest; returns the digest's tensor entries."""
    digest = meta.get("digest")
    if (
        not isinstance(digest, dict)
        or not isinstance(digest.get("tensors"), dict)
        or not isinstance(digest.get("metadata"), str)
    ):
        raise FixtureError(
            f"{path}: metadata field 'digest' is missing or malformed (no content digest to check the file against)"
        )
    if digest["metadata"] != metadata_digest(meta):
        raise FixtureError(
            f"{path}: the metadata does not match its content digest: the file was changed after it was written"
        )
    return digest["tensors"]


def check_digest(path, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    """The file holds what was written: each tensor and the metadata match the digest."""
    listed = check_metadata_digest(path, meta)
    for name in sorted(set(listed) - set(tensors)):
        raise FixtureError(f"{path}: tensor '{name}' is in the content digest but not in the file")
    for name in sorted(set(tensors) - set(listed)):
        raise FixtureError(f"{path}: tensor '{name}' is not in the content digest (added after the file was written)")
    for name, t in sorted(tensors.items()):
        if listed[name] != tensor_digest(t):
            raise FixtureError(
                f"{path}: tensor '{name}' does not match its content digest: the file was changed after it was written"
            )


def fixture_tensors(fixture: Fixture) -> dict[str, torch.Tensor]:
    """Every tensor the file of ``fixture`` holds, outputs as ``out/<version>``, ``lse/<version>``."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in fixture.tensors.items()}
    for version, (out, lse) in fixture.outputs.items():
        tensors[f"out/{version}"] = out.detach().contiguous().cpu()
        tensors[f"lse/{version}"] = lse.detach().contiguous().cpu()
    return tensors


def save_fixture(path: str | Path, fixture: Fixture, compact: bool = False) -> Path:
    """Write ``fixture`` to ``path``. With ``compact`` the tensors the file can rebuild bit for
    bit at load are left out (:func:`recording.derived.derivable`: q and the KV slots its
    scenario rebuilds, outputs equal to another version's); each is rebuilt once here and
    checked before anything is written."""
    from safetensors.torch import save_file

    from .derived import derivable, rebuild_derived

    path = Path(path)
    missing = [k for k in REQUIRED_TENSORS if k not in fixture.tensors]
    if missing:
        raise FixtureError(f"{path}: cannot save, missing tensors {missing}")
    tensors = fixture_tensors(fixture)
    meta = {k: v for k, v in fixture.meta.items() if k not in ("digest", "derived")}
    derived = derivable(meta, tensors) if compact else {}
    stored = {k: v for k, v in tensors.items() if k not in derived}
    if derived:
        meta["derived"] = derived
        rebuilt = rebuild_derived(meta, stored)
        wrong = [k for k in derived if not bitwise_equal(rebuilt[k], tensors[k])]
        if wrong:
            raise FixtureError(f"{path}: cannot save, {wrong} do not rebuild bit for bit")
    meta["schema_version"] = DERIVED_SCHEMA_VERSION if derived else SCHEMA_VERSION
    meta["digest"] = content_digest(meta, tensors)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file(stored, str(tmp), metadata={METADATA_KEY: json.dumps(meta, sort_keys=True)})
    tmp.replace(path)
    return path


#: Metadata fields every fixture has, with their checks (recording.checks).
REQUIRED_META = {
    "num_rows": checks.int_in(0, checks.MAX_ROWS), "num_heads": checks.int_in(1, checks.MAX_HEADS),
    "head_dim_ckv": checks.one_of(checks.HEAD_DIM_CKV), "head_dim_kpe": checks.one_of(*checks.HEAD_DIMS_KPE),
    "width": checks.int_in(0, checks.MAX_SEQ_LEN), "sm_scale": checks.positive_up_to(checks.MAX_SM_SCALE),
    "k_scale": checks.positive_up_to(checks.MAX_K_SCALE), "layout": checks.one_of(*checks.LAYOUTS, "captured"),
}
_REGIME = checks.one_of(*checks.REGIMES)
#: Optional metadata fields, checked when present and not null.
OPTIONAL_META = {
    "name": checks.text, "seed": checks.int_in(0, checks.MAX_SEED), "kv_dtype": checks.one_of(*checks.KV_DTYPE_NAMES),
    "max_rows": checks.int_in(1, checks.MAX_ROWS), "regimes": checks.list_of(_REGIME, "regimes (A to H)"),
    "row_ctx": checks.list_of(checks.int_in(0, checks.MAX_SEQ_LEN), f"ints from 0 to {checks.MAX_SEQ_LEN}"),
    "focus": checks.list_of(_REGIME, "regimes (A to H)"), "refused": checks.texts_by_text,
    "environment": checks.a_dict, "expect_finding": checks.text, "lse_recorded": checks.a_bool,
    "graph_replay": checks.a_bool, "source": checks.text, "impl": checks.impl_spec, "nodeid": checks.text,
    "spec": checks.a_dict, "capture": checks.a_dict, "digest": checks.a_dict, "shrunk": checks.a_dict,
    "rows": checks.list_of(checks.int_in(0, checks.MAX_ROWS - 1), "rows of the batch", distinct=True),
    "heads": checks.list_of(checks.int_in(0, checks.MAX_HEADS - 1), "heads", distinct=True, most=checks.MAX_HEADS),
    "why": checks.text, "scale_case": checks.text, "vllm": checks.text, "drawn": checks.text,
    "derived": checks.a_dict, "page_size": checks.one_of(1), "causal": checks.false,
    "num_slots_original": checks.int_at_least(0), "run_index": checks.int_at_least(0), "built_from": checks.a_dict,
    "schema_version": checks.any_value,
}
#: Each plan argument a ``capture_mla`` fixture records (metadata ``capture``) with its check.
CAPTURE_FIELDS = {
    "num_heads": checks.int_in(1, checks.MAX_HEADS), "head_dim_ckv": checks.one_of(checks.HEAD_DIM_CKV),
    "head_dim_kpe": checks.one_of(*checks.HEAD_DIMS_KPE), "page_size": checks.nullable(checks.one_of(1)),
    "causal": checks.nullable(checks.false), "sm_scale": checks.positive_up_to(checks.MAX_SM_SCALE),
    "lse_mode": checks.nullable(checks.one_of("base2", "basee")),
    "q_data_type": checks.nullable(checks.one_of("bfloat16", "float16")),
    "kv_data_type": checks.nullable(checks.one_of(*checks.KV_DTYPE_NAMES, "uint8")),
    "kv_indices_len": checks.nullable(checks.int_in(0, checks.MAX_SLOTS)),
}
#: Fields of a fixture's ``spec`` that fixtures written before them lack (absent: the default).
OPTIONAL_FIXTURE_SPEC_FIELDS = ("score_offsets", "split_score_signs", "with_host_bound", "with_positions",
                                "full_graph")
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
KV_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.uint8)
INDEX_DTYPES = (torch.int32, torch.int64)
#: Allowed dtypes per tensor (outputs: ``out/*`` and ``lse/*``).
TENSOR_DTYPES = {
    "q_nope": FLOAT_DTYPES, "q_pe": FLOAT_DTYPES, "ckv": KV_DTYPES, "kpe": KV_DTYPES, "slot_ids": INDEX_DTYPES,
    "kv_indptr": INDEX_DTYPES, "kv_indices": INDEX_DTYPES, "kv_len": INDEX_DTYPES, "intended": INDEX_DTYPES,
    "out": FLOAT_DTYPES, "lse": (torch.float32, torch.float64), "capture": INDEX_DTYPES,
}
#: The plan arrays a ``capture_mla`` fixture keeps as handed to FlashInfer.
CAPTURE_TENSORS = ("capture/qo_indptr", "capture/kv_indptr", "capture/kv_len_arr")
#: The storage dtypes of each ``kv_dtype`` (fp8 may be kept as raw bytes).
KV_STORAGE = {"bfloat16": (torch.bfloat16,), "float8_e4m3fn": (torch.float8_e4m3fn, torch.uint8)}


def meta_problem(meta) -> str | None:
    """The first thing wrong with a fixture's metadata (None: every field known and valid)."""
    if not isinstance(meta, dict):
        return f"metadata is a JSON {type(meta).__name__}, expected an object"
    for key in REQUIRED_META:
        if key not in meta:
            return f"metadata field '{key}' is missing"
    for key in meta:
        if key not in REQUIRED_META and key not in OPTIONAL_META:
            return f"metadata field '{key}' is not a fixture metadata field"
    for key, check in {**REQUIRED_META, **OPTIONAL_META}.items():
        if key in meta and (key in REQUIRED_META or meta[key] is not None):
            problem = checks.field_problem(key, meta[key], check, "metadata")
            if problem:
                return problem
    rows, heads = meta["num_rows"], meta["num_heads"]
    for key, count, per in (("regimes", rows, "row (num_rows"), ("row_ctx", rows, "row (num_rows"),
                            ("rows", rows, "row (num_rows"), ("heads", heads, "head (num_heads")):
        if isinstance(meta.get(key), list) and len(meta[key]) != count:
            return f"metadata field '{key}' lists {len(meta[key])} entries, expected one per {per} {count})"
    if meta.get("max_rows") is not None and meta["max_rows"] < rows:
        return f"metadata field 'max_rows' is {meta['max_rows']}, expected at least the {rows} rows (num_rows)"
    if meta.get("capture") is not None:
        problem = checks.fields_problem(meta["capture"], CAPTURE_FIELDS, {}, "metadata", "capture.",
                                        unknown="a plan argument a capture records")
        if problem:
            return problem
        for key in ("num_heads", "head_dim_ckv", "head_dim_kpe", "sm_scale"):
            if meta["capture"][key] != meta[key]:
                return (f"metadata field 'capture.{key}' is {checks.shown(meta['capture'][key])}, but '{key}' is "
                        f"{json.dumps(meta[key])}: the two must agree")
    return spec_meta_problem(meta) if meta.get("spec") is not None else None


def spec_meta_problem(meta: dict) -> str | None:
    """A fixture's ``spec``: valid as a batch spec within the bounds, with its ``seed``, and
    agreeing with the fields the replay reads beside it."""
    spec = meta["spec"]
    optional = {k: v for k, v in {**checks.SPEC_FIELDS, **checks.OPTIONAL_SPEC_FIELDS}.items()
                if k in OPTIONAL_FIXTURE_SPEC_FIELDS}
    required = {k: v for k, v in checks.SPEC_FIELDS.items() if k not in optional}
    problem = (checks.fields_problem(spec, required, optional, "metadata", "spec.", unknown="a field of a batch spec")
               or checks.spec_problem(dict({"score_offsets": [], "split_score_signs": False, "with_host_bound": True,
                                            "with_positions": True}, **spec), "metadata"))
    if problem:
        return problem
    if meta.get("seed") is None:
        return "metadata field 'seed' is missing: a fixture with a spec names the seed that builds its scenario"
    resolved = spec["width"] if spec["width"] is not None else -(-(spec["topk"] + spec["kpool"] - 1) // 128) * 128
    agree = (("sm_scale", meta["sm_scale"], spec["sm_scale"]), ("k_scale", meta["k_scale"], spec["k_scale"]),
             ("kv_dtype", meta.get("kv_dtype", spec["kv_dtype"]), spec["kv_dtype"]),
             ("head_dim_kpe", meta["head_dim_kpe"], checks.rope_dim(spec)), ("width", meta["width"], resolved))
    for key, value, want in agree:
        if value != want:
            return (f"metadata field '{key}' is {checks.shown(value)}, but its spec gives {json.dumps(want)}: the two "
                    "must agree")
    if meta["num_heads"] > spec["num_heads"]:
        return (f"metadata field 'num_heads' is {meta['num_heads']}, more than the {spec['num_heads']} heads of its "
                "spec")
    if isinstance(meta.get("heads"), list) and any(h >= spec["num_heads"] for h in meta["heads"]):
        return f"metadata field 'heads' names a head past the {spec['num_heads']} heads of its spec"
    planned = checks.planned_rows_of(spec)
    batch_rows = meta["rows"] if isinstance(meta.get("rows"), list) else range(meta["num_rows"])
    if any(r >= planned for r in batch_rows):
        field = "rows" if isinstance(meta.get("rows"), list) else "num_rows"
        return f"metadata field '{field}' names rows past the {planned} rows its spec plans"
    return None


def check_meta(path, meta) -> None:
    """The metadata is valid field by field (:func:`meta_problem`); else one FixtureError."""
    problem = meta_problem(meta)
    if problem:
        raise FixtureError(f"{path}: {problem}")


def check_tensor_names(path, tensors: dict[str, torch.Tensor]) -> None:
    """Only the tensors a fixture has: the inputs and plan, ``out/<version>`` and
    ``lse/<version>`` of at most :data:`recording.checks.MAX_VERSIONS` releases, a capture's plan
    arrays."""
    known = set(REQUIRED_TENSORS) | set(CAPTURE_TENSORS)
    for name in sorted(tensors):
        kind, _, version = name.partition("/")
        if name not in known and not (kind in ("out", "lse") and version):
            raise FixtureError(f"{path}: tensor '{name}' is not a fixture tensor (expected "
                               f"{', '.join(REQUIRED_TENSORS)}, out/<version>, lse/<version> or "
                               f"{', '.join(CAPTURE_TENSORS)})")
    versions = sum(1 for name in tensors if name.startswith("out/"))
    if versions > checks.MAX_VERSIONS:
        raise FixtureError(f"{path}: {versions} recorded outputs, expected at most {checks.MAX_VERSIONS}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_dtypes(path, tensors: dict[str, torch.Tensor], kv_dtype: str | None = None) -> None:
    """Each tensor of an allowed dtype; ``ckv`` and ``kpe`` stored as ``kv_dtype`` says."""
    for name, t in tensors.items():
        allowed = TENSOR_DTYPES.get(name.split("/", 1)[0])
        if kv_dtype is not None and name in ("ckv", "kpe"):
            allowed = KV_STORAGE[kv_dtype]
        if allowed is not None and t.dtype not in allowed:
            want = ", ".join(_dtype_name(d) for d in allowed)
            because = f" (metadata field 'kv_dtype' is {kv_dtype})" if name in ("ckv", "kpe") and kv_dtype else ""
            raise FixtureError(
                f"{path}: tensor '{name}' has dtype {_dtype_name(t.dtype)}, expected one of {want}{because}"
            )


def _expected_shapes(meta: dict, t: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    rows, heads = int(meta["num_rows"]), int(meta["num_heads"])
    d_ckv, d_pe, width = int(meta["head_dim_ckv"]), int(meta["head_dim_kpe"]), int(meta["width"])
    m = t["slot_ids"].shape[0] if "slot_ids" in t else None
    shapes = {
        "q_nope": (rows, heads, d_ckv), "q_pe": (rows, heads, d_pe), "kv_indptr": (rows + 1,), "kv_len": (rows,),
        "intended": (rows, width),
    }
    if m is not None:
        shapes.update(ckv=(m, d_ckv), kpe=(m, d_pe))
    return shapes


def check_plan_tensors(path, t: dict[str, torch.Tensor]) -> None:
    """The plan reads inside its buffer and only local slot ids (or -1) that exist."""
    m = t["slot_ids"].shape[0]
    if t["slot_ids"].dim() != 1:
        raise FixtureError(f"{path}: tensor 'slot_ids' has shape {tuple(t['slot_ids'].shape)}, expected one dimension")
    if t["kv_indices"].dim() != 1:
        raise FixtureError(
            f"{path}: tensor 'kv_indices' has shape {tuple(t['kv_indices'].shape)}, expected one dimension"
        )
    indptr, lens = t["kv_indptr"].to(torch.int64), t["kv_len"].to(torch.int64)
    if bool((lens < 0).any()):
        raise FixtureError(f"{path}: tensor 'kv_len' is negative at row {int((lens < 0).nonzero()[0])}")
    if indptr.numel() > 1 and bool((indptr[:-1] < 0).any()):
        raise FixtureError(f"{path}: tensor 'kv_indptr' is negative at row {int((indptr[:-1] < 0).nonzero()[0])}")
    if lens.numel():
        ends = indptr[:-1] + lens
        row = int(ends.argmax())
        if int(ends[row]) > t["kv_indices"].numel():
            raise FixtureError(
                f"{path}: tensor 'kv_indices' has {t['kv_indices'].numel()} entries but kv_indptr/kv_len read up to "
                f"entry {int(ends[row])} (row {row})"
            )
    ids = t["slot_ids"].to(torch.int64)
    if ids.numel() and (int(ids[0]) < 0 or bool((ids[1:] <= ids[:-1]).any())):
        at = 0 if int(ids[0]) < 0 else int((ids[1:] <= ids[:-1]).nonzero()[0]) + 1
        raise FixtureError(f"{path}: tensor 'slot_ids' holds {int(ids[at])} at {at}: expected distinct slot ids "
                           ">= 0 in increasing order")
    for name in CAPTURE_TENSORS:
        if name in t and t[name].dim() != 1:
            raise FixtureError(f"{path}: tensor '{name}' has shape {tuple(t[name].shape)}, expected one dimension")
    for name in ("kv_indices", "intended"):
        x = t[name]
        bad = (x < -1) | (x >= m)
        if bool(bad.any()):
            at = tuple(bad.nonzero()[0].tolist())
            raise FixtureError(
                f"{path}: tensor '{name}' holds slot {int(x[at])} at {at}, outside -1..{m - 1} (the {m} stored slots)"
            )


def load_fixture(path: str | Path) -> Fixture:
    """Read and validate one fixture; any problem raises :class:`FixtureError` naming the file
    and the field."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise FixtureError(f"{path}: no such file")
    try:
        with safe_open(str(path), framework="pt") as f:
            raw_meta = (f.metadata() or {}).get(METADATA_KEY)
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError, TypeError) as exc:
        size = path.stat().st_size
        raise FixtureError(
            f"{path}: not a readable safetensors file ({size} bytes; truncated or another format): {exc}"
        ) from exc
    if raw_meta is None:
        raise FixtureError(f"{path}: safetensors file without '{METADATA_KEY}' metadata (not a sparse-MLA fixture)")
    try:
        meta = json.loads(raw_meta)
    except json.JSONDecodeError as exc:
        raise FixtureError(f"{path}: metadata is not valid JSON: {exc}") from exc
    version = meta.get("schema_version") if isinstance(meta, dict) else None
    if isinstance(meta, dict) and version == 1:
        raise FixtureError(f"{path}: schema version 1, written without a content digest; re-record it or, if you trust "
                           f"the file, migrate it: python3 -m scripts.record_fixtures --migrate {path}")
    if isinstance(meta, dict) and version not in READ_SCHEMA_VERSIONS:
        raise FixtureError(f"{path}: unknown schema version {version!r} (this tool reads "
                           f"{' and '.join(map(str, READ_SCHEMA_VERSIONS))})")
    check_meta(path, meta)
    if meta.get("derived"):
        tensors.update(load_derived(path, meta, tensors))
    missing = [k for k in REQUIRED_TENSORS if k not in tensors]
    if missing:
        raise FixtureError(f"{path}: missing tensors {missing}")
    check_tensor_names(path, tensors)
    check_dtypes(path, tensors, meta.get("kv_dtype"))
    for name, shape in _expected_shapes(meta, tensors).items():
        if tuple(tensors[name].shape) != shape:
            raise FixtureError(f"{path}: tensor '{name}' has shape {tuple(tensors[name].shape)}, expected {shape}")
    check_plan_tensors(path, tensors)
    written = dict(tensors)
    outputs = {}
    for key in [k for k in tensors if k.startswith("out/")]:
        version = key[len("out/"):]
        lse_key = f"lse/{version}"
        if lse_key not in tensors:
            raise FixtureError(f"{path}: '{key}' recorded without '{lse_key}'")
        out, lse = tensors.pop(key), tensors.pop(lse_key)
        if tuple(out.shape) != tuple(tensors["q_nope"].shape):
            raise FixtureError(
                f"{path}: tensor '{key}' has shape {tuple(out.shape)}, expected {tuple(tensors['q_nope'].shape)}"
            )
        if tuple(lse.shape) != tuple(tensors["q_nope"].shape[:2]):
            raise FixtureError(
                f"{path}: tensor '{lse_key}' has shape {tuple(lse.shape)}, "
                f"expected {tuple(tensors['q_nope'].shape[:2])}"
            )
        outputs[version] = (out, lse)
    stray = [k for k in tensors if k.startswith("lse/")]
    if stray:
        raise FixtureError(f"{path}: tensor '{stray[0]}' recorded without its 'out/' tensor")
    check_digest(path, meta, written)
    return Fixture(meta=meta, tensors=tensors, path=path, outputs=outputs)


def load_derived(path, meta: dict, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors the metadata field ``derived`` names, rebuilt and checked against the content
    digest; the metadata and the stored tensors are checked against it first, so the rebuild
    reads only what was written."""
    from .derived import derived_problem, rebuild_derived

    problem = derived_problem(meta, set(stored))
    if problem:
        raise FixtureError(f"{path}: {problem}")
    if meta.get("schema_version") != DERIVED_SCHEMA_VERSION:
        raise FixtureError(f"{path}: metadata field 'derived' in a file of schema version "
                           f"{meta.get('schema_version')!r} (tensors are derived from version "
                           f"{DERIVED_SCHEMA_VERSION})")
    listed = check_metadata_digest(path, meta)
    for name, t in sorted(stored.items()):
        if name in listed and listed[name] != tensor_digest(t):
            raise FixtureError(
                f"{path}: tensor '{name}' does not match its content digest: the file was changed after it was written"
            )
    try:
        rebuilt = rebuild_derived(meta, stored)
    except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as exc:
        raise FixtureError(f"{path}: metadata field 'derived': the tensors cannot be rebuilt: {exc}") from exc
    for name, t in sorted(rebuilt.items()):
        source = meta["derived"][name]
        if name not in listed:
            raise FixtureError(f"{path}: tensor '{name}' (derived from {source}) is not in the content digest")
        if listed[name] != tensor_digest(t):
            why = ("the scenario builder no longer rebuilds what the file was written with"
                   if source.startswith("scenario:") else f"'{source.removeprefix('tensor:')}' differs from it")
            raise FixtureError(
                f"{path}: tensor '{name}' (derived from {source}) does not match its content digest: {why}"
            )
    return rebuilt


#: How the files of written cases end: fixtures, recipes, sequences and backend cases.
CASE_FILE_SUFFIXES = (".safetensors", ".recipe.json", ".sequence.json", ".case.json")


def is_case_file(path) -> bool:
    """A file a dump writes and ``--replay`` runs (by its name)."""
    return Path(path).name.endswith(CASE_FILE_SUFFIXES)


def fixture_paths(paths) -> list[Path]:
    """Expand files and folders (recursively, every :data:`CASE_FILE_SUFFIXES`) into a sorted
    list of files."""
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found.extend(sorted(f for suffix in CASE_FILE_SUFFIXES for f in p.rglob(f"*{suffix}")))
        else:
            found.append(p)
    return found


def build_fixture(
    *,
    meta: dict,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv: torch.Tensor,
    kpe: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_len: torch.Tensor,
    intended: torch.Tensor | None = None,
    outputs: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> Fixture:
    """A fixture of one launch over ``kv_len.numel()`` rows, keeping only referenced slots.

    ``ckv``/``kpe`` are the whole cache (``[N,D]`` or ``[N,1,D]``); ``kv_indices`` the plan's
    buffer; ``intended`` the converted indexer rows (defaults to the planned spans)."""
    from reference.oracle import flatten_slots_view

    rows = kv_len.numel()
    indptr = kv_indptr[: rows + 1].to(torch.int64).cpu()
    lens = kv_len.to(torch.int64).cpu()
    used_end = int((indptr[:-1] + lens).max()) if rows else 0
    indices = kv_indices.cpu()[:used_end].to(torch.int64)
    if intended is None:
        width = int(lens.max()) if rows else 0
        cols = torch.arange(width)
        pos = indptr[:-1].unsqueeze(1) + cols
        intended = (
            torch.where(cols < lens.unsqueeze(1), indices[pos.clamp(max=max(used_end - 1, 0))], -1)
            if used_end
            else torch.full((rows, width), -1)
        )
    intended = intended[:rows].cpu()
    # Only the planned spans are read: entries outside them are kept as -1.
    entry = torch.arange(used_end).unsqueeze(0)
    starts = indptr[:-1].unsqueeze(1)
    in_span = ((entry >= starts) & (entry < starts + lens.unsqueeze(1))).any(dim=0)
    planned = torch.where(in_span, indices, torch.full_like(indices, -1))
    slot_ids, (planned_local, intended_local) = remap_slots(planned, intended)
    ckv2, kpe2 = flatten_slots_view(ckv, "ckv"), flatten_slots_view(kpe, "kpe")
    ids_dev = slot_ids.to(ckv2.device)
    meta = dict(
        meta,
        num_rows=rows,
        num_heads=int(q_nope.shape[1]),
        head_dim_ckv=int(q_nope.shape[2]),
        head_dim_kpe=int(q_pe.shape[2]),
        width=int(intended.shape[1]),
        num_slots_original=int(ckv2.shape[0]),
    )
    tensors = {
        "q_nope": q_nope[:rows],
        "q_pe": q_pe[:rows],
        "ckv": ckv2[ids_dev],
        "kpe": kpe2[ids_dev],
        "slot_ids": slot_ids,
        "kv_indptr": indptr.to(torch.int32),
        "kv_indices": planned_local,
        "kv_len": lens.to(torch.int32),
        "intended": intended_local,
    }
    return Fixture(meta=meta, tensors={k: v.cpu() for k, v in tensors.items()}, outputs=dict(outputs or {}))


def migrate_fixture(path: str | Path, **meta_updates) -> Path:
    """Rewrite a schema-1 fixture (no content digest) as the current schema, with its digest
    and ``meta_updates``; the file is then loaded back to check it. Only for files you trust:
    the digest certifies what the file holds now."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = Path(path)
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {})[METADATA_KEY])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("schema_version") != 1:
        raise FixtureError(f"{path}: schema version {meta.get('schema_version')!r}, only version 1 is migrated")
    meta.update(meta_updates, schema_version=SCHEMA_VERSION)
    meta["digest"] = content_digest(meta, tensors)
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file(tensors, str(tmp), metadata={METADATA_KEY: json.dumps(meta, sort_keys=True)})
    tmp.replace(path)
    load_fixture(path)
    return path


def subset_fixture(fx: Fixture, rows: list[int], heads: list[int] | None = None) -> Fixture:
    """The fixture of ``rows`` (and ``heads``), keeping each row's planned span as recorded and
    only the KV slots the kept rows read."""
    meta, t = fx.meta, fx.tensors
    heads = list(range(int(meta["num_heads"]))) if heads is None else heads
    r = torch.tensor(rows, dtype=torch.int64)
    h = torch.tensor(heads, dtype=torch.int64)
    indptr, lens = t["kv_indptr"].to(torch.int64), t["kv_len"].to(torch.int64)
    spans = [t["kv_indices"][int(indptr[i]) : int(indptr[i] + lens[i])] for i in rows]
    width = int(meta["width"])
    if meta.get("layout") == "strided":  # rows keep their fixed stride
        new_indptr = torch.arange(len(rows) + 1, dtype=torch.int64) * width
        indices = torch.full((len(rows) * width + 1,), -1, dtype=torch.int32)
        for i, span in enumerate(spans):
            indices[i * width : i * width + span.numel()] = span
    else:
        new_indptr = (
            torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lens[r], 0)])
            if rows
            else torch.zeros(1, dtype=torch.int64)
        )
        indices = torch.cat(spans).to(torch.int32) if spans else torch.zeros(0, dtype=torch.int32)
    old_ids, (indices_local, intended_local) = remap_slots(indices, t["intended"][r])
    slot_ids = t["slot_ids"][old_ids] if t["slot_ids"].numel() else t["slot_ids"]
    tensors = dict(
        t,
        q_nope=t["q_nope"][r][:, h],
        q_pe=t["q_pe"][r][:, h],
        ckv=t["ckv"][old_ids],
        kpe=t["kpe"][old_ids],
        slot_ids=slot_ids,
        kv_indptr=new_indptr.to(torch.int32),
        kv_indices=indices_local,
        kv_len=lens[r].to(torch.int32),
        intended=intended_local,
    )
    outputs = {v: (out[r][:, h], lse[r][:, h]) for v, (out, lse) in fx.outputs.items()}
    old_rows = meta.get("rows")
    meta = {k: v for k, v in meta.items() if k != "derived"}  # the subset stores every tensor
    new_meta = dict(meta, num_rows=len(rows), num_heads=len(heads), max_rows=max(len(rows), 1),
                    rows=[old_rows[i] for i in rows] if old_rows is not None else list(rows),
                    heads=[meta["heads"][i] for i in heads] if meta.get("heads") is not None else list(heads))
    for key in ("regimes", "row_ctx"):
        if isinstance(meta.get(key), list):
            new_meta[key] = [meta[key][i] for i in rows]
    if isinstance(meta.get("focus"), list) and isinstance(new_meta.get("regimes"), list):
        new_meta["focus"] = [g for g in meta["focus"] if g in new_meta["regimes"]]
    return dataclasses.replace(fx, meta=new_meta, tensors=tensors, outputs=outputs)
