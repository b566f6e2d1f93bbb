"""Malformed fixture files: each gets a FixtureError naming the file and the field (never a
traceback from deep inside), on its own and through ``--replay``; inputs that are not finite
are reported as bad inputs, not excluded as poisoned rows."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from recording.fixture import METADATA_KEY, FixtureError, load_fixture, migrate_fixture, save_fixture
from recording.replay import replay

ROOT = Path(__file__).resolve().parents[2]
GOOD = ROOT / "fixtures" / "a-identity-fill-bf16.safetensors"  # 4 rows, 517 stored slots


def rewrite(path: Path, tensors=None, meta=None, raw_meta: str | None = None) -> Path:
    """A copy of ``path`` with its tensors and/or metadata changed (``raw_meta``: the JSON text)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), framework="pt") as f:
        old_meta = json.loads(f.metadata()[METADATA_KEY])
    t = load_file(str(path))
    t = tensors(t) if tensors else t
    text = raw_meta if raw_meta is not None else json.dumps(meta(old_meta) if meta else old_meta)
    out = path.with_name("bad.safetensors")
    save_file({k: v.contiguous() for k, v in t.items()}, str(out), metadata={METADATA_KEY: text})
    return out


def with_tensor(name, make):
    return lambda t: dict(t, **{name: make(t)})


def short_indices(t):
    end = int((t["kv_indptr"][:-1].long() + t["kv_len"].long()).max())
    return t["kv_indices"][: end - 1]


MALFORMED = {
    # case: (tensors, meta, raw_meta, the field the message must name)
    "meta-json-list": (None, None, "[1, 2, 3]", "metadata is a JSON list"),
    "meta-json-string": (None, None, '"hello"', "metadata is a JSON str"),
    "num-heads-as-string": (None, lambda m: dict(m, num_heads="16"), None, "field 'num_heads' is str"),
    "num-rows-as-bool": (None, lambda m: dict(m, num_rows=True), None, "field 'num_rows' is bool"),
    "sm-scale-as-list": (None, lambda m: dict(m, sm_scale=[0.1]), None, "field 'sm_scale' is list"),
    "layout-as-number": (None, lambda m: dict(m, layout=3), None, "field 'layout' is int"),
    "regimes-as-string": (None, lambda m: dict(m, regimes="AAAA"), None, "field 'regimes' is str"),
    "regimes-too-short": (None, lambda m: dict(m, regimes=["A"]), None, "field 'regimes' lists 1 entries"),
    "refused-as-list": (None, lambda m: dict(m, refused=["0.7.4"]), None, "field 'refused' is list"),
    "missing-layout": (None, lambda m: {k: v for k, v in m.items() if k != "layout"}, None,
                       "metadata field 'layout' is missing"),
    "q-nope-int32": (
        with_tensor("q_nope", lambda t: t["q_nope"].to(torch.int32)),
        None,
        None,
        "tensor 'q_nope' has dtype int32",
    ),
    "kv-indices-float": (
        with_tensor("kv_indices", lambda t: t["kv_indices"].float()),
        None,
        None,
        "tensor 'kv_indices' has dtype float32",
    ),
    "out-int16": (
        with_tensor("out/0.7.4", lambda t: t["out/0.7.4"].view(torch.int16)),
        None,
        None,
        "tensor 'out/0.7.4' has dtype int16",
    ),
    "intended-wrong-shape": (
        with_tensor("intended", lambda t: t["intended"][:, :10]),
        None,
        None,
        "tensor 'intended' has shape",
    ),
    "kv-indptr-wrong-shape": (
        with_tensor("kv_indptr", lambda t: t["kv_indptr"][:-1]),
        None,
        None,
        "tensor 'kv_indptr' has shape",
    ),
    "out-wrong-shape": (
        with_tensor("out/0.7.4", lambda t: t["out/0.7.4"][:2]),
        None,
        None,
        "tensor 'out/0.7.4' has shape",
    ),
    "lse-wrong-shape": (
        with_tensor("lse/0.7.4", lambda t: t["lse/0.7.4"][:, :3]),
        None,
        None,
        "tensor 'lse/0.7.4' has shape",
    ),
    "kv-indices-past-stored-slots": (
        with_tensor("kv_indices", lambda t: t["kv_indices"] + t["slot_ids"].numel()),
        None,
        None,
        "tensor 'kv_indices' holds slot",
    ),
    "kv-indices-below-minus-one": (
        with_tensor("kv_indices", lambda t: t["kv_indices"] - 5),
        None,
        None,
        "tensor 'kv_indices' holds slot",
    ),
    "intended-past-stored-slots": (
        with_tensor("intended", lambda t: t["intended"] * 0 + 10_000),
        None,
        None,
        "tensor 'intended' holds slot 10000",
    ),
    "kv-indices-shorter-than-indptr": (
        with_tensor("kv_indices", short_indices),
        None,
        None,
        "tensor 'kv_indices' has 516 entries but kv_indptr/kv_len read up to entry 517",
    ),
    "negative-kv-len": (with_tensor("kv_len", lambda t: t["kv_len"] * -1), None, None, "tensor 'kv_len' is negative"),
    "lse-without-out": (
        lambda t: {k: v for k, v in t.items() if k != "out/0.7.4"},
        None,
        None,
        "tensor 'lse/0.7.4' recorded without its 'out/' tensor",
    ),
}


@pytest.fixture
def good_copy(tmp_path) -> Path:
    """GOOD written with every tensor stored (the checked-in file rebuilds its inputs at load)."""
    return save_fixture(tmp_path / "good.safetensors", load_fixture(GOOD))


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_file_gets_a_fixture_error_naming_file_and_field(good_copy, case):
    tensors, meta, raw_meta, message = MALFORMED[case]
    path = rewrite(good_copy, tensors=tensors, meta=meta, raw_meta=raw_meta)
    with pytest.raises(FixtureError) as info:
        load_fixture(path)
    assert str(path) in str(info.value)
    assert message in str(info.value), str(info.value)


def test_the_checked_in_fixtures_are_well_formed():
    paths = sorted((ROOT / "fixtures").glob("*.safetensors"))
    assert len(paths) >= 14, f"fixtures/ holds {len(paths)} fixture files, the checked-in set has 14"
    for path in paths:
        fx = load_fixture(path)
        assert "SPEC" not in json.dumps(fx.meta) and "\u00a7" not in json.dumps(fx.meta), (
            f"{path}: cites a document this repo lacks"
        )
        if fx.meta.get("expect_finding"):
            assert "docs/findings.md#" in fx.meta["expect_finding"], path


def safetensors_header(path: Path) -> tuple[int, dict]:
    """(length, parsed JSON) of a safetensors file's header."""
    data = path.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    return length, json.loads(data[8 : 8 + length])


def flip_bit(path: Path, tensor: str, byte: int, bit: int) -> None:
    """Flip one bit of ``tensor``'s data in the file, in place (byte counted from its start)."""
    length, header = safetensors_header(path)
    start, end = header[tensor]["data_offsets"]
    assert 0 <= byte < end - start
    data = bytearray(path.read_bytes())
    data[8 + length + start + byte] ^= 1 << bit
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("tensor", "byte", "bit"), [
    ("ckv", 0, 0),  # the low mantissa bit of the first bf16 value: replayed green without the digest
    ("ckv", 1, 6),  # a high exponent bit: was judged as the kernel past its budget
    ("q_nope", 101, 3),
    ("out/0.7.4", 7, 0),
])
def test_a_flipped_bit_in_a_tensor_is_a_fixture_error_naming_it(good_copy, tensor, byte, bit):
    flip_bit(good_copy, tensor, byte, bit)
    with pytest.raises(FixtureError) as info:
        load_fixture(good_copy)
    assert str(good_copy) in str(info.value)
    assert f"tensor '{tensor}' does not match its content digest" in str(info.value), str(info.value)


def test_a_changed_byte_in_the_metadata_is_a_fixture_error_naming_the_metadata(good_copy):
    data = good_copy.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    old = b'{\\"q_len\\": 1, \\"seq_len\\": 256}'
    assert data[: 8 + length].count(old) == 1, "the spec's 256-token request, as the header writes it"
    good_copy.write_bytes(data.replace(old, old.replace(b"256", b"246"), 1))  # same length: still a valid file
    with pytest.raises(FixtureError) as info:
        load_fixture(good_copy)
    assert "the metadata does not match its content digest" in str(info.value), str(info.value)


def test_a_fixture_without_digest_is_refused_with_the_migration_command(good_copy):
    path = rewrite(good_copy, meta=lambda m: {**{k: v for k, v in m.items() if k != "digest"}, "schema_version": 1})
    with pytest.raises(FixtureError, match="schema version 1, written without a content digest.*--migrate"):
        load_fixture(path)
    migrate_fixture(path)
    assert load_fixture(path).num_rows == 4


def test_a_changed_file_replays_as_a_fixture_error_not_a_kernel_verdict(pytester, tmp_path, good_copy):
    flip_bit(good_copy, "ckv", 1, 6)
    result = run_pytest(pytester, str(ROOT / "tests/test_replay.py"), f"--replay={good_copy}", "--replay-recorded-only")
    out = "\n".join(result.outlines + result.errlines)
    assert result.ret == 1 and "1 failed" in out, out[-3000:]
    assert "tensor 'ckv' does not match its content digest" in out and "budget" not in out, out[-3000:]


def run_pytest(pytester, *args: str):
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "--rootdir", str(ROOT), *args)


def test_replay_of_malformed_files_fails_each_with_its_message_and_no_traceback(pytester, tmp_path, good_copy):
    folder = tmp_path / "cases"
    folder.mkdir()
    for case in ("meta-json-list", "kv-indices-shorter-than-indptr", "q-nope-int32"):
        tensors, meta, raw_meta, _ = MALFORMED[case]
        rewrite(good_copy, tensors=tensors, meta=meta, raw_meta=raw_meta).rename(folder / f"{case}.safetensors")
    result = run_pytest(pytester, str(ROOT / "tests/test_replay.py"), f"--replay={folder}", "--replay-recorded-only")
    out = "\n".join(result.outlines + result.errlines)
    assert result.ret == 1 and "3 failed" in out, out[-3000:]
    assert "metadata is a JSON list" in out and "tensor 'q_nope' has dtype int32" in out, out[-3000:]
    assert "Traceback" not in out and "recording/fixture.py:" not in out, out[-3000:]


def test_nan_in_q_is_a_bad_input_not_a_poisoned_row(tmp_path):
    fx = load_fixture(GOOD)
    fx.tensors["q_nope"] = fx["q_nope"].clone()
    fx.tensors["q_nope"][2, 5, 7] = float("nan")
    report = replay(load_fixture(save_fixture(tmp_path / "nan-q.safetensors", fx)))
    assert list(report.bad_inputs) == [2] and "q_nope holds NaN/Inf" in report.bad_inputs[2]
    assert 2 not in report.poisoned_rows
    assert report.kernel_ok, "the other rows are still judged, and pass"
    assert any("bad inputs" in f and "[2]" in f for f in report.failures())
    assert "bad input at row 2 (regime A): q_nope holds NaN/Inf" in report.render()


def test_nan_in_an_intended_kv_slot_is_a_bad_input(tmp_path):
    fx = load_fixture(GOOD)
    slot = int(fx["intended"][3, 0])
    fx.tensors["ckv"] = fx["ckv"].clone()
    fx.tensors["ckv"][slot, 0] = float("inf")
    report = replay(fx)
    assert list(report.bad_inputs) == [3] and f"intended KV slot {slot}" in report.bad_inputs[3]
    assert report.failures() and not report.poisoned_rows


def test_a_replay_of_an_empty_folder_is_a_usage_error(pytester, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for path in (empty, tmp_path / "missing"):
        result = run_pytest(pytester, str(ROOT / "tests"), f"--replay={path}", "--replay-recorded-only")
        err = "\n".join(result.errlines)
        assert result.ret == pytest.ExitCode.USAGE_ERROR, "\n".join(result.outlines[-20:] + result.errlines)
        assert f"--replay={path}:" in err and "Traceback" not in err, err


def test_the_replay_test_fails_when_the_fixture_folder_is_empty(pytester, tmp_path, monkeypatch):
    import pytest_sparse_mla.replay as replay_plugin

    monkeypatch.setattr(replay_plugin, "DEFAULT_FIXTURES", tmp_path)  # as if fixtures/ had vanished
    result = run_pytest(pytester, str(ROOT / "tests/test_replay.py"), "--replay-recorded-only")
    out = "\n".join(result.outlines)
    assert result.ret == 1 and "1 failed" in out and f"no fixture files under {tmp_path}" in out, out[-2000:]


def test_a_replay_run_collects_only_the_replay_tests(pytester):
    result = run_pytest(pytester, str(ROOT / "tests"), f"--replay={GOOD}", "--replay-recorded-only", "--co", "-q")
    out = "\n".join(result.outlines)
    assert result.ret == 0 and "1 test collected" in out and "deselected" not in out, out[-2000:]


# --- every field, its bounds, one line before anything is built --------------------------------


@pytest.fixture
def nothing_built(monkeypatch):
    """Fails the test where the scenario builder is called: a bad file stops before it."""
    import harness.builder
    import harness.scenario

    def refuse(*args, **kwargs):
        raise AssertionError("the scenario builder ran on a file that should have been refused")

    monkeypatch.setattr(harness.scenario, "build_scenario", refuse)
    monkeypatch.setattr(harness.builder, "build_scenario", refuse)


@pytest.fixture(scope="module")
def good_fixture():
    """GOOD as loaded (its inputs rebuilt once, before any test refuses the builder)."""
    return load_fixture(GOOD)


def meta_edited(tmp_path: Path, good, change, tensors=None) -> Path:
    """``good`` with its metadata changed by ``change`` (and its tensors by ``tensors``), written
    with every tensor stored and its content digest recomputed by the project's own writer: a
    hand edit that also fixes the digest."""
    import dataclasses

    meta = change(json.loads(json.dumps(good.meta)))
    fx = dataclasses.replace(good, meta=meta, tensors=tensors(dict(good.tensors)) if tensors else dict(good.tensors))
    return save_fixture(tmp_path / "bad.safetensors", fx)


def spec_with(**changes):
    return lambda m: dict(m, spec=dict(m["spec"], **changes))


def meta_without(key):
    return lambda m: {k: v for k, v in m.items() if k != key}


#: The plan arguments a capture of GOOD's launch would record (metadata ``capture``).
CAPTURE = {"num_heads": 16, "head_dim_ckv": 512, "head_dim_kpe": 64, "page_size": 1, "causal": False,
           "sm_scale": 0.1352, "lse_mode": None, "q_data_type": "bfloat16", "kv_data_type": "bfloat16",
           "kv_indices_len": 517}


def captured(**changes):
    return lambda m: dict(m, capture=dict(CAPTURE, **changes))


#: Each field of a fixture's metadata, a bad value of it and the line that refuses it ({path}: the file).
META_FIELDS = {
    "num_rows-negative": (lambda m: dict(m, num_rows=-1), "metadata field 'num_rows' is int -1, expected an int from 0 "
                                                          "to 65536"),
    "num_rows-past-its-bound": (lambda m: dict(m, num_rows=10**9), "metadata field 'num_rows' is int 1000000000, "
                                                                  "expected an int from 0 to 65536"),
    "num_heads-as-string": (lambda m: dict(m, num_heads="16"), "metadata field 'num_heads' is str \"16\", expected an "
                                                              "int from 1 to 256"),
    "num_heads-zero": (lambda m: dict(m, num_heads=0), "metadata field 'num_heads' is int 0, expected an int from 1 to "
                                                      "256"),
    "head_dim_ckv-256": (lambda m: dict(m, head_dim_ckv=256), "metadata field 'head_dim_ckv' is int 256, expected one "
                                                             "of 512"),
    "head_dim_kpe-32": (lambda m: dict(m, head_dim_kpe=32), "metadata field 'head_dim_kpe' is int 32, expected one of "
                                                           "64, 0"),
    "width-negative": (lambda m: dict(m, width=-1), "metadata field 'width' is int -1, expected an int from 0 to "
                                                   "1048576"),
    "sm_scale-nan": (lambda m: dict(m, sm_scale=float("nan")), "metadata field 'sm_scale' is float NaN, expected a "
                                                               "finite number in (0, 16]"),
    "sm_scale-zero": (lambda m: dict(m, sm_scale=0.0), "metadata field 'sm_scale' is float 0.0, expected a finite "
                                                      "number in (0, 16]"),
    "sm_scale-1e300": (lambda m: dict(m, sm_scale=1e300), "metadata field 'sm_scale' is float 1e+300, expected a "
                                                         "finite number in (0, 16]"),
    "k_scale-negative": (lambda m: dict(m, k_scale=-1.0), "metadata field 'k_scale' is float -1.0, expected a finite "
                                                         "number in (0, 1024]"),
    "k_scale-infinite": (lambda m: dict(m, k_scale=float("inf")), "metadata field 'k_scale' is float Infinity, "
                                                                  "expected a finite number in (0, 1024]"),
    "layout-diagonal": (lambda m: dict(m, layout="diagonal"), "metadata field 'layout' is str \"diagonal\", expected "
                                                             "one of strided, packed, compacted, captured"),
    "kv_dtype-int4": (lambda m: dict(m, kv_dtype="int4"), "metadata field 'kv_dtype' is str \"int4\", expected one of "
                                                         "bfloat16, float8_e4m3fn"),
    "name-as-number": (lambda m: dict(m, name=7), "metadata field 'name' is int 7, expected a string"),
    "seed-negative": (lambda m: dict(m, seed=-3), "metadata field 'seed' is int -3, expected an int from 0 to "
                                                 "9223372036854775807"),
    "seed-past-63-bits": (lambda m: dict(m, seed=2**64), "metadata field 'seed' is int 18446744073709551616, expected "
                                                        "an int from 0 to 9223372036854775807"),
    "max_rows-zero": (lambda m: dict(m, max_rows=0), "metadata field 'max_rows' is int 0, expected an int from 1 to "
                                                    "65536"),
    "max_rows-below-the-rows": (lambda m: dict(m, max_rows=2), "metadata field 'max_rows' is 2, expected at least the "
                                                              "4 rows (num_rows)"),
    "regimes-unknown": (lambda m: dict(m, regimes=["A", "A", "A", "Z"]),
                        "metadata field 'regimes' is list [\"A\", \"A\", \"A\", \"Z\"], expected a list of at most "
                        "65536 regimes (A to H)"),
    "regimes-one-for-four-rows": (lambda m: dict(m, regimes=["A"]), "metadata field 'regimes' lists 1 entries, "
                                                                   "expected one per row (num_rows 4)"),
    "row_ctx-negative": (lambda m: dict(m, row_ctx=[-1, 5, 255, 256]),
                         "metadata field 'row_ctx' is list [-1, 5, 255, 256], expected a list of at most 65536 ints "
                         "from 0 to 1048576"),
    "row_ctx-two-for-four-rows": (lambda m: dict(m, row_ctx=[1, 5]), "metadata field 'row_ctx' lists 2 entries, "
                                                                    "expected one per row (num_rows 4)"),
    "focus-unknown": (lambda m: dict(m, focus=["Q"]), "metadata field 'focus' is list [\"Q\"], expected a list of at "
                                                     "most 65536 regimes (A to H)"),
    "refused-not-text": (lambda m: dict(m, refused={"0.7.4": 3}), "metadata field 'refused' is dict {\"0.7.4\": 3}, "
                                                                  "expected an object of strings"),
    "environment-as-list": (lambda m: dict(m, environment=[]), "metadata field 'environment' is list [], expected an "
                                                              "object"),
    "expect_finding-as-number": (lambda m: dict(m, expect_finding=3), "metadata field 'expect_finding' is int 3, "
                                                                     "expected a string"),
    "lse_recorded-as-string": (lambda m: dict(m, lse_recorded="yes"), "metadata field 'lse_recorded' is str \"yes\", "
                                                                     "expected true or false"),
    "graph_replay-as-int": (lambda m: dict(m, graph_replay=1), "metadata field 'graph_replay' is int 1, expected true "
                                                              "or false"),
    "source-as-number": (lambda m: dict(m, source=1), "metadata field 'source' is int 1, expected a string"),
    "impl-without-factory": (lambda m: dict(m, impl="tests.bugs"), "metadata field 'impl' is str \"tests.bugs\", "
                                                                   "expected MODULE:FACTORY"),
    "nodeid-as-number": (lambda m: dict(m, nodeid=1), "metadata field 'nodeid' is int 1, expected a string"),
    "capture-as-list": (lambda m: dict(m, capture=[]), "metadata field 'capture' is list [], expected an object"),
    "shrunk-as-list": (lambda m: dict(m, shrunk=[]), "metadata field 'shrunk' is list [], expected an object"),
    "capture-num_heads": (captured(num_heads=0), "metadata field 'capture.num_heads' is int 0, expected an int from 1 "
                                                 "to 256"),
    "capture-head_dim_ckv": (captured(head_dim_ckv=128), "metadata field 'capture.head_dim_ckv' is int 128, expected "
                                                         "one of 512"),
    "capture-head_dim_kpe": (captured(head_dim_kpe=32), "metadata field 'capture.head_dim_kpe' is int 32, expected "
                                                        "one of 64, 0"),
    "capture-page_size": (captured(page_size=16), "metadata field 'capture.page_size' is int 16, expected one of 1, "
                                                  "or null"),
    "capture-causal": (captured(causal=True), "metadata field 'capture.causal' is bool true, expected false, or null"),
    "capture-sm_scale": (captured(sm_scale=float("nan")), "metadata field 'capture.sm_scale' is float NaN, expected a "
                                                          "finite number in (0, 16]"),
    "capture-lse_mode": (captured(lse_mode="base10"), "metadata field 'capture.lse_mode' is str \"base10\", expected "
                                                      "one of base2, basee, or null"),
    "capture-q_data_type": (captured(q_data_type="int8"), "metadata field 'capture.q_data_type' is str \"int8\", "
                                                          "expected one of bfloat16, float16, or null"),
    "capture-kv_data_type": (captured(kv_data_type="int4"), "metadata field 'capture.kv_data_type' is str \"int4\", "
                                                            "expected one of bfloat16, float8_e4m3fn, uint8, or null"),
    "capture-kv_indices_len": (captured(kv_indices_len=10**12), "metadata field 'capture.kv_indices_len' is int "
                                                                "1000000000000, expected an int from 0 to 33554432, or "
                                                                "null"),
    "capture-unknown-argument": (captured(backend="fa2"), "metadata field 'capture.backend' is not a plan argument a "
                                                          "capture records"),
    "capture-missing-argument": (lambda m: dict(m, capture=meta_without("sm_scale")(CAPTURE)),
                                 "metadata field 'capture.sm_scale' is missing"),
    "capture-heads-other-than-q": (captured(num_heads=32), "metadata field 'capture.num_heads' is int 32, but "
                                                           "'num_heads' is 16: the two must agree"),
    "rows-repeated": (lambda m: dict(m, rows=[0, 0, 1, 2]), "metadata field 'rows' is list [0, 0, 1, 2], expected a "
                                                           "list of at most 65536 distinct rows of the batch"),
    "rows-three-for-four-rows": (lambda m: dict(m, rows=[0, 1, 2]), "metadata field 'rows' lists 3 entries, expected "
                                                                   "one per row (num_rows 4)"),
    "rows-past-the-batch": (lambda m: dict(m, rows=[0, 1, 2, 7]), "metadata field 'rows' names rows past the 4 rows "
                                                                 "its spec plans"),
    "heads-one-for-sixteen": (lambda m: dict(m, heads=[0]), "metadata field 'heads' lists 1 entries, expected one per "
                                                           "head (num_heads 16)"),
    "heads-past-the-spec": (lambda m: dict(m, heads=list(range(1, 17))), "metadata field 'heads' names a head past "
                                                                        "the 16 heads of its spec"),
    "why-as-number": (lambda m: dict(m, why=1), "metadata field 'why' is int 1, expected a string"),
    "scale_case-as-number": (lambda m: dict(m, scale_case=1), "metadata field 'scale_case' is int 1, expected a "
                                                             "string"),
    "vllm-as-number": (lambda m: dict(m, vllm=1), "metadata field 'vllm' is int 1, expected a string"),
    "drawn-as-number": (lambda m: dict(m, drawn=1), "metadata field 'drawn' is int 1, expected a string"),
    "page_size-2": (lambda m: dict(m, page_size=2), "metadata field 'page_size' is int 2, expected one of 1"),
    "causal-true": (lambda m: dict(m, causal=True), "metadata field 'causal' is bool true, expected false"),
    "num_slots_original-negative": (lambda m: dict(m, num_slots_original=-1),
                                    "metadata field 'num_slots_original' is int -1, expected an int >= 0"),
    "run_index-negative": (lambda m: dict(m, run_index=-1), "metadata field 'run_index' is int -1, expected an int "
                                                           ">= 0"),
    "built_from-as-number": (lambda m: dict(m, built_from=1), "metadata field 'built_from' is int 1, expected an "
                                                             "object"),
    "unknown-field": (lambda m: dict(m, colour="red"), "metadata field 'colour' is not a fixture metadata field"),
    "missing-layout": (meta_without("layout"), "metadata field 'layout' is missing"),
    "spec-as-list": (lambda m: dict(m, spec=[]), "metadata field 'spec' is list [], expected an object"),
    "spec-block-size-0": (spec_with(block_size=0), "metadata field 'spec.block_size' is int 0, expected an int from 1 "
                                                   "to 4096"),
    "spec-topk-1e9": (spec_with(topk=10**9), "metadata field 'spec.topk' is int 1000000000, expected an int from 1 to "
                                             "2048"),
    "spec-unknown-field": (spec_with(page_size=1), "metadata field 'spec.page_size' is not a field of a batch spec"),
    "spec-without-topk": (lambda m: dict(m, spec=meta_without("topk")(m["spec"])),
                          "metadata field 'spec.topk' is missing"),
    "spec-past-the-row-bound": (spec_with(padded_rows=65536),
                                "metadata field 'spec' plans 65540 query rows (its requests' q_len and padded_rows), "
                                "expected at most 65536"),
    "spec-refused-together": (spec_with(kpool=3), "metadata field 'spec' is not a batch spec: topk=256 must be a "
                                                  "positive multiple of kpool=3"),
    "sm_scale-other-than-its-spec": (spec_with(sm_scale=0.2), "metadata field 'sm_scale' is float 0.1352, but its spec "
                                                              "gives 0.2: the two must agree"),
    "kv_dtype-other-than-its-spec": (spec_with(kv_dtype="float8_e4m3fn", k_scale=0.5),
                                     "metadata field 'k_scale' is float 1.0, but its spec gives 0.5: the two must "
                                     "agree"),
    "seed-missing-beside-a-spec": (meta_without("seed"), "metadata field 'seed' is missing: a fixture with a spec "
                                                         "names the seed that builds its scenario"),
}


@pytest.mark.parametrize("case", sorted(META_FIELDS))
def test_every_metadata_field_is_checked_with_its_bound_before_anything_is_built(tmp_path, good_fixture,
                                                                                nothing_built, case):
    change, line = META_FIELDS[case]
    path = meta_edited(tmp_path, good_fixture, change)
    with pytest.raises(FixtureError) as info:
        load_fixture(path)
    assert str(info.value) == f"{path}: {line}"


def swapped_slot_ids(t):
    ids = t["slot_ids"].clone()
    ids[[0, 1]] = ids[[1, 0]]
    return dict(t, slot_ids=ids)


#: Each rule on a fixture's tensors not shown by MALFORMED, a tensor breaking it and the line.
TENSOR_RULES = {
    "unknown-tensor": (lambda t: dict(t, notes=torch.zeros(3)),
                       "tensor 'notes' is not a fixture tensor (expected q_nope, q_pe, ckv, kpe, slot_ids, kv_indptr, "
                       "kv_indices, kv_len, intended, out/<version>, lse/<version> or capture/qo_indptr, "
                       "capture/kv_indptr, capture/kv_len_arr)"),
    "ckv-other-than-kv-dtype": (lambda t: dict(t, ckv=t["ckv"].to(torch.float8_e4m3fn)),
                                "tensor 'ckv' has dtype float8_e4m3fn, expected one of bfloat16 (metadata field "
                                "'kv_dtype' is bfloat16)"),
    "slot-ids-out-of-order": (swapped_slot_ids, "tensor 'slot_ids' holds 16 at 1: expected distinct slot ids >= 0 in "
                                                "increasing order"),
    "slot-ids-negative": (lambda t: dict(t, slot_ids=t["slot_ids"] - 100),
                          "tensor 'slot_ids' holds -84 at 0: expected distinct slot ids >= 0 in increasing order"),
    "capture-plan-of-two-dimensions": (lambda t: dict(t, **{"capture/qo_indptr": torch.zeros(2, 3, dtype=torch.int32)}),
                                       "tensor 'capture/qo_indptr' has shape (2, 3), expected one dimension"),
}


@pytest.mark.parametrize("case", sorted(TENSOR_RULES))
def test_every_tensor_rule_is_one_line_naming_the_tensor(tmp_path, good_fixture, nothing_built, case):
    tensors, line = TENSOR_RULES[case]
    path = meta_edited(tmp_path, good_fixture, lambda m: m, tensors)
    with pytest.raises(FixtureError) as info:
        load_fixture(path)
    assert str(info.value) == f"{path}: {line}"


def test_more_recorded_releases_than_the_bound_is_one_line(tmp_path, good_fixture, monkeypatch):
    from recording import checks

    monkeypatch.setattr(checks, "MAX_VERSIONS", 1)
    path = meta_edited(tmp_path, good_fixture, lambda m: m)
    with pytest.raises(FixtureError) as info:
        load_fixture(path)
    assert str(info.value) == f"{path}: 2 recorded outputs, expected at most 1"


def compact_edited(tmp_path: Path, change) -> Path:
    """The checked-in (compact) GOOD with its metadata changed and the metadata's digest
    recomputed (the tensors' entries stay as written)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from recording.fixture import metadata_digest

    with safe_open(str(GOOD), framework="pt") as f:
        meta = json.loads(f.metadata()[METADATA_KEY])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta = change(meta)
    meta["digest"]["metadata"] = metadata_digest(meta)
    path = tmp_path / "bad.safetensors"
    save_file(tensors, str(path), metadata={METADATA_KEY: json.dumps(meta)})
    return path


def derived_with(**changes):
    return lambda m: dict(m, derived=dict(m["derived"], **changes))


#: Each way the field ``derived`` of a compact fixture can be wrong, and its line.
DERIVED = {
    "unknown-source": (derived_with(ckv="scenario:magic"),
                       "metadata field 'derived' maps 'ckv' to 'scenario:magic', expected one of scenario:q, "
                       "scenario:kv, scenario:kv-sequential, tensor:NAME"),
    "source-of-other-tensors": (derived_with(ckv="scenario:q"),
                                "metadata field 'derived' maps 'ckv' to 'scenario:q', which rebuilds only q_nope, "
                                "q_pe"),
    "a-tensor-the-file-lacks": (derived_with(**{"out/0.7.4": "tensor:out/9.9"}),
                                "metadata field 'derived' maps 'out/0.7.4' to 'tensor:out/9.9', but the file stores no "
                                "tensor 'out/9.9'"),
    "a-tensor-the-file-stores": (derived_with(slot_ids="scenario:kv"),
                                 "metadata field 'derived' maps 'slot_ids' to 'scenario:kv', but the file stores "
                                 "'slot_ids' too"),
    "source-not-a-string": (derived_with(ckv=3), "metadata field 'derived' maps 'ckv' to int 3, expected a string"),
    "not-an-object": (lambda m: dict(m, derived=[]), "metadata field 'derived' is list [], expected an object"),
    "in-a-file-of-schema-2": (lambda m: dict(m, schema_version=2),
                              "metadata field 'derived' in a file of schema version 2 (tensors are derived from "
                              "version 3)"),
}


@pytest.mark.parametrize("case", sorted(DERIVED))
def test_a_bad_derived_field_is_one_line_before_anything_is_rebuilt(tmp_path, nothing_built, case):
    change, line = DERIVED[case]
    path = compact_edited(tmp_path, change)
    with pytest.raises(FixtureError) as info:
        load_fixture(path)
    assert str(info.value) == f"{path}: {line}"


#: The bad files of issue 37 replayed with --replay: each is one line at load, never a verdict.
REPLAYED = {
    "sm_scale-nan": "a replay that judged no row passed",
    "sm_scale-zero": "the kernel was blamed",
    "sm_scale-1e300": "the kernel was blamed",
    "k_scale-negative": "the kernel was blamed",
    "layout-diagonal": "the host stages were blamed",
    "spec-block-size-0": "the host stages were blamed",
    "kv_dtype-int4": "a KeyError traceback",
}


@pytest.fixture(scope="module")
def replayed(good_fixture, tmp_path_factory):
    """One ``pytest --replay`` of a folder holding each bad file of :data:`REPLAYED`: its exit
    status, output and the folder."""
    import subprocess
    import sys

    folder = tmp_path_factory.mktemp("replayed")
    for case in REPLAYED:
        meta_edited(tmp_path_factory.mktemp(case), good_fixture, META_FIELDS[case][0]).rename(
            folder / f"{case}.safetensors")
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "--rootdir",
                          str(ROOT), str(ROOT / "tests"), f"--replay={folder}"], capture_output=True, text=True,
                         cwd=ROOT, timeout=600)
    return run.returncode, run.stdout + run.stderr, folder


def test_a_replay_of_bad_files_fails_each_at_load_and_judges_none(replayed):
    code, out, _ = replayed
    assert code == 1 and f"{len(REPLAYED)} failed in" in out, out[-3000:]
    assert "fixture replay diagnostics" not in out and "Traceback" not in out, out[-3000:]


@pytest.mark.parametrize("case", sorted(REPLAYED))
def test_a_bad_file_is_one_line_printed_once_and_carried_by_its_failed_line(replayed, case):
    """Once where the test fails and once on its FAILED line, nothing judged: not '1 passed'
    (sm_scale NaN), not the kernel (sm_scale 0 or 1e300, k_scale -1), not the host stages (layout
    diagonal, block size 0), not a traceback (kv_dtype int4)."""
    _, out, folder = replayed
    path = folder / f"{case}.safetensors"
    line = f"{path}: {META_FIELDS[case][1]}"
    assert f"FAILED tests/test_replay.py::test_replay_fixture[{path}] - Failed: {line}" in out.splitlines(), out[-3000:]
    assert out.count(line) == 2, out[-3000:]
    for blamed in ("error budget", "raised in the host stages", "KeyError", "max err"):
        assert blamed not in out, (REPLAYED[case], out[-3000:])


def test_a_replay_that_judges_no_row_fails_with_the_reason(good_fixture):
    """A fixture read past the file checks (an in-memory fixture with a NaN softmax scale): every
    row's reference is NaN, so every row is left out of the kernel check while its plan is the
    intended selection. That is no pass."""
    import dataclasses

    fx = dataclasses.replace(good_fixture, meta=dict(good_fixture.meta, sm_scale=float("nan")))
    report = replay(fx)
    assert report.kernel_ok and report.plan_ok and report.poisoned_rows == [0, 1, 2, 3]
    assert report.failures() == [
        "no row judged: the kernel check of [0.6.18.post1] left out all 4 rows (poisoned: [0, 1, 2, 3]) though their "
        "plan is the intended selection; a replay that judges no row is not a pass"
    ]
    assert not replay(good_fixture).failures()
