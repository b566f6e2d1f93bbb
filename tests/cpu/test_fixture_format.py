"""The fixture format: round trip, small files, replay diagnostics, corrupt files, and the
--replay / --dump-failures options end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import batch, build_attention_inputs, build_scenario
from harness.pipeline import as_planned, intended, prepare_step
from recording.case_log import fixture_from_step
from recording.fixture import METADATA_KEY, FixtureError, bitwise_equal, load_fixture, save_fixture
from recording.replay import replay
from reference import sparse_mla_reference

ROOT = Path(__file__).resolve().parents[2]


def small_step(impl, device, layout="compacted", kv_dtype="bfloat16", kpool=4):
    spec = batch((1001, 1), (2051, 1), (132, 1), (5000, 1), topk=2048, kpool=kpool, num_heads=2, kv_dtype=kv_dtype,
                 k_scale=0.5 if kv_dtype != "bfloat16" else 1.0, block_size=16)
    scenario = build_scenario(spec, seed=11)
    return prepare_step(impl, scenario, layout, device), build_attention_inputs(scenario)


def stand_in_kernel(step, inputs):
    """The low-precision reference over the planned slots stands in for a kernel output."""
    from harness.pipeline import as_planned

    slots, mask = as_planned(step)
    n = step.num_planned
    mask = mask & (slots >= 0)
    out, lse = sparse_mla_reference(
        inputs.q_nope[:n],
        inputs.q_pe[:n],
        inputs.ckv,
        inputs.kpe,
        slots,
        mask=mask,
        sm_scale=step.scenario.spec.sm_scale,
        k_scale=step.scenario.spec.k_scale,
        mode="lowp",
    )
    return out, lse


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
def test_round_trip_is_bit_exact_and_keeps_only_referenced_slots(impl, device, tmp_path, kv_dtype):
    step, inputs = small_step(impl, device, kv_dtype=kv_dtype)
    fx = fixture_from_step(step, inputs, outputs={"stand-in": stand_in_kernel(step, inputs)}, name="rt")
    back = load_fixture(save_fixture(tmp_path / "rt.safetensors", fx))
    for key, value in fx.tensors.items():
        assert back[key].dtype == value.dtype, key
        assert bitwise_equal(back[key], value), key
    assert back.meta["regimes"] == step.scenario.row_regime
    assert back.meta["spec"]["kv_dtype"] == kv_dtype
    a_slots, a_mask = intended(step)
    b_slots, b_mask = as_planned(step)
    read = set(a_slots[a_mask].tolist()) | set(b_slots[b_mask].tolist())
    assert set(back["slot_ids"].tolist()) == read, "the fixture must store exactly the slots the case reads"
    assert len(read) < step.scenario.num_slots
    assert bitwise_equal(back["ckv"], inputs.ckv[back["slot_ids"], 0].contiguous())


def test_replay_passes_a_good_case_and_names_the_row_of_a_bad_one(impl, device, tmp_path):
    step, inputs = small_step(impl, device)
    out, lse = stand_in_kernel(step, inputs)
    assert replay(fixture_from_step(step, inputs, outputs={"good": (out, lse)})).kernel_ok
    bad = out.clone()
    bad[1] += 0.25
    report = replay(fixture_from_step(step, inputs, outputs={"bad": (bad, lse)}))
    assert not report.kernel_ok
    text = report.render("cmd")
    assert "row 1 head" in text and f"regime {step.scenario.row_regime[1]}" in text and "reproduce: cmd" in text


def test_replay_shows_the_regime_c_finding_of_the_packed_layout(impl, device):
    step, inputs = small_step(impl, device, layout="packed")
    report = replay(fixture_from_step(step, inputs, outputs={"stand-in": stand_in_kernel(step, inputs)}))
    c_rows = [r for r, g in enumerate(step.scenario.row_regime) if g == "C"]
    assert c_rows and report.plan_mismatch_rows == c_rows
    assert report.poisoned_rows == c_rows, "packed regime C rows read the poisoned slot 0"
    assert report.kernel_ok, "rows reading poison are left out of the kernel check"


# --- corrupt files -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_bytes(impl, device, tmp_path_factory) -> bytes:
    """A good fixture file's bytes, built once for the tests here."""
    step, inputs = small_step(impl, device, kpool=1)
    fx = fixture_from_step(step, inputs, outputs={"v": stand_in_kernel(step, inputs)})
    return save_fixture(tmp_path_factory.mktemp("good") / "good.safetensors", fx).read_bytes()


@pytest.fixture
def good_file(good_bytes, tmp_path) -> Path:
    """A copy of the good fixture file of the test's own."""
    path = tmp_path / "good.safetensors"
    path.write_bytes(good_bytes)
    return path


def rewrite(path: Path, tensors=None, meta=None) -> Path:
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), framework="pt") as f:
        old_meta = json.loads(f.metadata()[METADATA_KEY])
    t = load_file(str(path))
    t = tensors(t) if tensors else t
    m = meta(old_meta) if meta else old_meta
    out = path.with_name("bad.safetensors")
    save_file(t, str(out), metadata={METADATA_KEY: json.dumps(m)})
    return out


CORRUPTIONS = {
    "truncated": (lambda p: _overwrite(p, p.read_bytes()[: len(p.read_bytes()) // 2]), "truncated or another format"),
    "not-safetensors": (lambda p: _overwrite(p, b'{"hello": 1}'), "not a readable safetensors file"),
    "unknown-schema": (lambda p: rewrite(p, meta=lambda m: dict(m, schema_version=99)), "unknown schema version 99"),
    "missing-tensor": (
        lambda p: rewrite(p, tensors=lambda t: {k: v for k, v in t.items() if k != "kv_len"}),
        r"missing tensors \['kv_len'\]",
    ),
    "shape-mismatch": (
        lambda p: rewrite(p, tensors=lambda t: dict(t, q_pe=t["q_pe"][:, :1].contiguous())),
        "tensor 'q_pe' has shape",
    ),
    "no-metadata": (lambda p: _strip_metadata(p), "without 'sparse_mla_fixture' metadata"),
}


def _overwrite(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _strip_metadata(path: Path) -> Path:
    from safetensors.torch import load_file, save_file

    out = path.with_name("bad.safetensors")
    save_file(load_file(str(path)), str(out))
    return out


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupt_file_gets_a_clear_error_naming_the_file(good_file, corruption):
    corrupt, message = CORRUPTIONS[corruption]
    path = corrupt(good_file)
    with pytest.raises(FixtureError, match=message) as info:
        load_fixture(path)
    assert str(path) in str(info.value)


def run_pytest(pytester, *args: str):
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "--rootdir", str(ROOT), *args)


def test_replay_option_runs_each_file_and_a_corrupt_one_affects_no_other(pytester, good_file, tmp_path):
    folder = tmp_path / "cases"
    folder.mkdir()
    (folder / "good.safetensors").write_bytes(good_file.read_bytes())
    (folder / "zz-broken.safetensors").write_bytes(good_file.read_bytes()[:100])
    result = run_pytest(pytester, str(ROOT / "tests"), f"--replay={folder}", "-rA")
    out = "\n".join(result.outlines + result.errlines)
    assert result.ret == 1, out[-3000:]
    assert "1 failed, 1 passed" in out and "zz-broken.safetensors: not a readable safetensors file" in out, out[-3000:]
    assert "fixture replay diagnostics" in out and "reproduce: pytest --replay" in out, out[-3000:]


def test_dump_failures_writes_a_replayable_fixture(pytester, tmp_path):
    dump = tmp_path / "dumps"
    result = run_pytest(
        pytester,
        str(ROOT / "tests/cpu/test_kvlen_regimes.py"),
        "--impl=tests.bugs:CompactionPlansPrefix",
        "-k",
        "test_plan_reads_the_intended_slots and ctx1-kpool4-compacted",
        f"--dump-failures={dump}",
    )
    assert result.ret == 1, "\n".join(result.outlines[-30:])
    files = list(dump.glob("*.safetensors"))
    assert len(files) == 1, "\n".join(result.outlines[-30:])
    report = replay(load_fixture(files[0]))
    assert report.plan_mismatch_rows == [0] and report.regimes[0] == "C"


# --- tensors rebuilt at load (the checked-in fixtures) --------------------------------------

FIXTURES = ROOT / "fixtures"
COMPACT = FIXTURES / "a-identity-fill-bf16.safetensors"  # 4 rows x 16 heads, bf16, two releases recorded


def test_the_checked_in_fixtures_fit_in_4_mb_and_store_no_input_their_scenario_rebuilds():
    paths = sorted(FIXTURES.glob("*.safetensors"))
    total = sum(p.stat().st_size for p in paths)
    assert len(paths) == 14 and total <= 4_000_000, f"{len(paths)} fixtures, {total} bytes"
    for path in paths:
        derived = load_fixture(path).meta["derived"]
        assert all(derived.get(k, "").startswith("scenario:") for k in ("q_nope", "q_pe", "ckv", "kpe")), path


def test_a_compact_file_loads_what_its_full_copy_holds_and_writes_back_byte_for_byte(tmp_path):
    compact = load_fixture(COMPACT)
    assert set(compact.meta["derived"]) == {"q_nope", "q_pe", "ckv", "kpe", "out/0.7.4", "lse/0.7.4"}
    full_path = save_fixture(tmp_path / "full.safetensors", compact)
    full = load_fixture(full_path)
    assert "derived" not in full.meta and full_path.stat().st_size > 8 * COMPACT.stat().st_size
    for key, value in full.tensors.items():
        assert bitwise_equal(compact[key], value), key
    for version, (out, lse) in full.outputs.items():
        assert bitwise_equal(compact.outputs[version][0], out) and bitwise_equal(compact.outputs[version][1], lse)
    again = save_fixture(tmp_path / "again.safetensors", full, compact=True)
    assert again.read_bytes() == COMPACT.read_bytes()


@pytest.mark.parametrize(("tensor", "source"), [("ckv", "scenario:kv-sequential"), ("q_nope", "scenario:q")])
def test_a_tensor_the_builder_no_longer_rebuilds_is_a_fixture_error_naming_it(monkeypatch, tmp_path, tensor, source):
    import harness.scenario
    from recording import derived

    path = tmp_path / COMPACT.name
    path.write_bytes(COMPACT.read_bytes())
    monkeypatch.setattr(derived, "_SEQUENTIAL_KV", {})
    if source == "scenario:kv-sequential":  # another stream of values
        monkeypatch.setattr(harness.scenario, "component_seed", lambda seed, component: 12345)
    else:  # q drawn otherwise
        build = harness.scenario.build_attention_inputs

        def other_q(scenario):
            inputs = build(scenario)
            inputs.q_nope.mul_(2)
            return inputs

        monkeypatch.setattr(harness.scenario, "build_attention_inputs", other_q)
    with pytest.raises(FixtureError) as info:
        load_fixture(path)
    assert str(info.value) == (
        f"{path}: tensor '{tensor}' (derived from {source}) does not match its content digest: the scenario builder "
        "no longer rebuilds what the file was written with"
    )


def test_a_compact_fixture_has_a_reproducer_only_as_a_standalone_copy(tmp_path, capsys):
    from recording.repro import main as repro_main

    assert repro_main([str(COMPACT)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {COMPACT} rebuilds ckv, kpe, lse/0.7.4, out/0.7.4, q_nope, q_pe at load and the reproducer reads "
        "every tensor from its file: give -o DIR for a copy that stores them, beside the script"
    )
    assert not list(FIXTURES.glob("*.repro.py"))
    assert repro_main([str(COMPACT), "-o", str(tmp_path)]) == 0
    copy = load_fixture(tmp_path / COMPACT.name)
    assert "derived" not in copy.meta and bitwise_equal(copy["ckv"], load_fixture(COMPACT)["ckv"])


@pytest.mark.parametrize("name", ["case.recipe.json", "case.sequence.json"])
def test_the_reproducer_of_a_recipe_or_a_sequence_says_what_to_run_instead(tmp_path, capsys, name):
    from recording.repro import main as repro_main

    path = tmp_path / name
    path.write_text("{}")
    kind = "a recipe" if name.endswith(".recipe.json") else "a sequence"
    assert repro_main([str(path), "-o", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {path} is {kind}: recipes and sequences have no standalone reproducer (they rebuild their case "
        f"through this project); replay it: pytest --replay={path}, or give a fixture (*.safetensors) of the case"
    )
    assert not (tmp_path / "out").exists()
