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
    "regimes-too-short": (None, lambda m: dict(m, regimes=["A"]), None, "field 'regimes' must list one regime"),
    "refused-as-list": (None, lambda m: dict(m, refused=["0.7.4"]), None, "field 'refused' is list"),
    "missing-layout": (None, lambda m: {k: v for k, v in m.items() if k != "layout"}, None, "metadata lacks 'layout'"),
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
    import tests.test_replay as replay_tests

    monkeypatch.setattr(replay_tests, "DEFAULT_FIXTURES", tmp_path)  # as if fixtures/ had vanished
    result = run_pytest(pytester, str(ROOT / "tests/test_replay.py"), "--replay-recorded-only")
    out = "\n".join(result.outlines)
    assert result.ret == 1 and "1 failed" in out and f"no fixture files under {tmp_path}" in out, out[-2000:]


def test_a_replay_run_collects_only_the_replay_tests(pytester):
    result = run_pytest(pytester, str(ROOT / "tests"), f"--replay={GOOD}", "--replay-recorded-only", "--co", "-q")
    out = "\n".join(result.outlines)
    assert result.ret == 0 and "1 test collected" in out and "deselected" not in out, out[-2000:]
