"""Re-running fixtures (recording.rerun) and judging the re-run (recording.replay), on CPU: the
GPU glue drives a stand-in for FlashInfer's wrapper that computes with the low-precision
reference, so plan/convert/layout run through the implementation under test as on the GPU.
The report: the new output against the reference, the new plan against the intent, the drift
against every recorded version, which releases agree, and a refusal as its own outcome."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from fast.impl import FastImpl
from recording.fixture import load_fixture
from recording.replay import Rerun, agreeing_groups, output_drift, replay
from recording.rerun import rerun_fixture
from tests.bugs import CompactionPlansPrefix, KpoolFromWrongSpec, OptimisticBoundAsExact

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures"
STRIDED_REFUSAL = "ValueError: CSR metadata page counts in kv_indptr must equal ceil(kv_len_arr / page_size)."


def regime_rows(fx, regime: str) -> list[int]:
    return [r for r, g in enumerate(fx.meta["regimes"]) if g == regime]


# --- the report on synthetic re-runs (pure) ------------------------------------------------


def test_drift_counts_bitwise_equal_elements_and_names_the_worst_rows():
    old = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    new = old.clone()
    new[2, 1, 3] = 0.5
    new[0, 0, 0] = 0.125
    drift = output_drift(new, old, "0.7.4")
    assert (drift.equal, drift.total, drift.max_abs) == (62, 64, 0.5)
    assert drift.worst_rows == [(2, 0.5), (0, 0.125)]
    assert "62/64 elements bitwise equal" in drift.summary(
        ["A", "B", "C", "D"]
    ) and "row 2 0.5 (regime C)" in drift.summary(["A", "B", "C", "D"])
    nan = old.clone()
    nan[1, 0, 0] = float("nan")
    assert output_drift(nan, old, "x").max_abs == float("inf") and output_drift(nan, nan, "x").equal == 64


def test_agreement_groups_releases_by_bitwise_identity():
    a = (torch.zeros(2, 1, 4), torch.zeros(2, 1))
    b = (torch.ones(2, 1, 4), torch.zeros(2, 1))
    assert agreeing_groups({"0.6": a, "0.7": b, "0.8 re-run": a}) == [["0.6", "0.8 re-run"], ["0.7"]]


def test_a_rerun_equal_to_the_recorded_outputs_passes_and_says_who_agrees():
    fx = load_fixture(FIXTURES / "c-compacted-fp8.safetensors")
    out, lse = fx.outputs["0.7.4"]
    report = replay(fx, rerun=Rerun("0.7.9", "re-run", out.clone(), lse.clone()))
    assert report.failures() == []
    assert [(d.what, d.equal == d.total) for d in report.drift] == [("out", True), ("lse", True)] * 2
    assert report.agreement == [["0.6.18.post1", "0.7.4", "0.7.9 re-run"]]
    assert "implementation under test" not in report.render(), "no implementation was used"


def test_an_lse_that_differs_shows_in_the_drift_and_splits_the_agreement():
    """The packed regime C fixture: 0.6.18.post1 wrote NaN LSE where 0.7.4 wrote finite values
    (same output bits), so the drift names the LSE and the releases do not agree."""
    fx = load_fixture(FIXTURES / "c-packed-finding-bf16.safetensors")
    out, lse = fx.outputs["0.7.4"]
    report = replay(fx, rerun=Rerun("0.7.9", "re-run", out.clone(), lse.clone()))
    by = {(d.against, d.what): d for d in report.drift}
    assert by[("0.6.18.post1", "out")].equal_share == 1.0 and by[("0.6.18.post1", "lse")].equal_share < 1.0
    assert by[("0.7.4", "lse")].equal_share == 1.0
    assert report.agreement == [["0.6.18.post1"], ["0.7.4", "0.7.9 re-run"]]


def test_a_perturbed_rerun_fails_on_its_row_with_the_drift_of_that_row():
    fx = load_fixture(FIXTURES / "c-compacted-fp8.safetensors")
    out, lse = fx.outputs["0.7.4"]
    bad = out.clone()
    bad[2, 7] += 0.25
    report = replay(fx, rerun=Rerun("0.7.9", "re-run", bad, lse.clone(), impl="pkg:make"))
    assert any("kernel != as-planned reference" in f and "0.7.9 re-run" in f for f in report.failures())
    assert report.kernel["0.7.9 re-run"][0].worst[0][0] == 2
    out_drift = [d for d in report.drift if d.what == "out"]
    assert len(out_drift) == 2 and all(d.worst_rows[0][0] == 2 and d.equal == d.total - 512 for d in out_drift)
    assert all(d.equal == d.total for d in report.drift if d.what == "lse"), "only the output was perturbed"
    text = report.render()
    assert "[0.7.9 re-run] drift of out vs [0.7.4]" in text and "implementation under test: pkg:make" in text
    assert "releases agreeing bitwise: {0.6.18.post1, 0.7.4} | {0.7.9 re-run}" in text


def test_the_rerun_decides_and_a_wrong_recorded_output_is_history():
    """A kernel-input bug fixed since the recording: the recorded output is wrong, the re-run
    through the fixed implementation is right, and the replay passes, showing the recorded
    comparison as history; without a re-run the recorded output alone decides and fails."""
    fx = load_fixture(FIXTURES / "c-compacted-fp8.safetensors")
    out, lse = fx.outputs["0.7.4"]
    wrong = out.clone()
    wrong[1] = torch.roll(wrong[1], 1, dims=0)  # q_pe's heads rolled by one: another head's output
    recorded = dataclasses.replace(fx, outputs={"0.7.4": (wrong, lse)})
    assert any("0.7.4" in f for f in replay(recorded).failures()), "recorded outputs judged alone without a re-run"
    report = replay(recorded, rerun=Rerun("0.7.4", "re-run", out.clone(), lse.clone()))
    assert report.rerun_decides and report.judged_versions == ["0.7.4 re-run"]
    assert report.failures() == []
    text = report.render()
    assert "[0.7.4, recorded: history, the re-run decides] out vs (b)" in text
    broken = replay(recorded, rerun=Rerun("0.7.4", "re-run", wrong.clone(), lse.clone()))
    assert any("0.7.4 re-run" in f for f in broken.failures()), "a re-run as wrong as the recording fails"


def test_a_refusal_is_an_outcome_of_its_own_expected_where_a_recorded_release_refused_too():
    fx = load_fixture(FIXTURES / "strided-seed-layout-bf16.safetensors")
    assert fx.meta["refused"] == {"0.7.4": STRIDED_REFUSAL}
    report = replay(fx, rerun=Rerun("0.7.2", "re-run", refused=STRIDED_REFUSAL))
    assert report.failures() == [] and not report.drift
    assert f"REFUSED: {STRIDED_REFUSAL} (as 0.7.4 did when recorded)" in report.render()
    assert f"[0.7.4] refused when recorded: {STRIDED_REFUSAL}" in report.render()
    other = replay(fx, rerun=Rerun("0.8.0", "re-run", refused="RuntimeError: no kernel for sm_90"))
    assert other.failures() == ["flashinfer 0.8.0 refused the re-run: RuntimeError: no kernel for sm_90"]


# --- the GPU glue, driven on CPU -----------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "c-compacted-fp8",
        "c-packed-finding-bf16",
        "graph-replay-smaller-bf16",
        "h-kpool1-decode-bf16",
        "empty-batch-bf16",
    ],
)
def test_a_pipeline_fixture_reruns_through_the_implementation(stand_in, device, name):
    fx = load_fixture(FIXTURES / f"{name}.safetensors")
    rerun = rerun_fixture(fx, FastImpl(), "fast.impl:default_impl", device=device)
    assert rerun.refused is None, rerun.refused
    assert "lens the implementation's kv_len rule" in rerun.how and rerun.impl == "fast.impl:default_impl"
    assert torch.equal(rerun.plan["kv_len"], fx["kv_len"]) and torch.equal(rerun.plan["kv_indptr"], fx["kv_indptr"])
    report = replay(fx, rerun=rerun)
    assert report.failures() == [], report.render()
    assert [(d.against, d.what) for d in report.drift] == [(v, w) for v in fx.outputs for w in ("out", "lse")]


def test_a_wrong_layout_reruns_and_fails_on_the_regime_c_rows(stand_in, device):
    fx = load_fixture(FIXTURES / "c-compacted-fp8.safetensors")
    report = replay(
        fx, rerun=rerun_fixture(fx, CompactionPlansPrefix(), "tests.bugs:CompactionPlansPrefix", device=device)
    )
    assert report.plan_mismatch_rows == [], "the recorded plan was right"
    assert report.rerun_plan_mismatch_rows == regime_rows(fx, "C") and report.rerun_plan_mismatch_rows
    assert "plan != intent" in report.failures()


def test_a_wrong_kv_len_rule_reruns_with_its_own_lens(stand_in, device):
    fx = load_fixture(FIXTURES / "bdefg-pooled-decode-bf16.safetensors")
    report = replay(fx, rerun=rerun_fixture(fx, KpoolFromWrongSpec(), "tests.bugs:KpoolFromWrongSpec", device=device))
    wrong = [r for r, g in enumerate(fx.meta["regimes"]) if g in ("E", "G")]
    assert wrong and report.rerun_plan_mismatch_rows == wrong
    assert "plan != intent" in report.failures()


def test_a_plan_that_would_read_outside_the_cache_is_not_launched_and_fails_on_its_plan(stand_in, device):
    """An implementation whose lengths run past a row's valid entries hands the kernel -1 entries
    (on a GPU, an illegal address that poisons the worker's CUDA context for every later test):
    the re-run launches nothing, names the rows, and the replay fails on the plan it laid out."""
    fx = load_fixture(FIXTURES / "async-spec-decode-fp8.safetensors")
    ran = len(stand_in.plans)
    rerun = rerun_fixture(fx, OptimisticBoundAsExact(), "tests.bugs:OptimisticBoundAsExact", device=device)
    assert len(stand_in.plans) == ran, "planned on FlashInfer all the same"
    assert rerun.withheld.startswith("planned rows [0, 4, 5, 6, 7, 11] ") and rerun.out is None
    assert rerun.refused is None, "FlashInfer refused nothing"
    report = replay(fx, rerun=rerun)
    assert report.rerun_plan_mismatch_rows and report.failures() == ["plan != intent"]
    assert "NOT LAUNCHED: planned rows [0, 4, 5, 6, 7, 11]" in report.render()


def test_a_refused_plan_is_reported_as_the_refusal(stand_in, device):
    fx = load_fixture(FIXTURES / "strided-seed-layout-bf16.safetensors")
    stand_in.refuse = STRIDED_REFUSAL.split(": ", 1)[1]
    rerun = rerun_fixture(fx, FastImpl(), "fast.impl:default_impl", device=device)
    assert rerun.refused == STRIDED_REFUSAL and "refused at plan" in rerun.how and rerun.out is None
    assert replay(fx, rerun=rerun).failures() == []


def test_a_captured_fixture_reruns_exactly_as_recorded(stand_in, impl, device, tmp_path):
    from recording.capture import capture_mla
    from tests.support.capture_program import StandInWrapper, program_steps, seed_style_program

    with capture_mla(tmp_path, every=1, max_cases=1, wrapper_cls=StandInWrapper) as log:
        seed_style_program(impl, device, program_steps(), max_rows=4, width=256)
    fx = load_fixture(log.written[0])
    assert fx.meta["capture"]["num_heads"] == 2 and fx.meta["capture"]["page_size"] == 1
    rerun = rerun_fixture(fx, CompactionPlansPrefix(), "tests.bugs:CompactionPlansPrefix", device=device)
    assert rerun.refused is None and rerun.impl is None and rerun.plan is None and "exactly as captured" in rerun.how
    handed = stand_in.plans[-1]
    for key in ("qo_indptr", "kv_indptr", "kv_len_arr"):
        assert torch.equal(handed[key], fx[f"capture/{key}"]), key
    report = replay(fx, rerun=rerun)
    assert report.failures() == [], report.render()
    assert "implementation under test" not in report.render()


def test_replaying_dumped_failures_reruns_them_and_fails_on_the_same_rows(
    stand_in, device, pytester, tmp_path, monkeypatch
):
    """The debugging loop end to end, with the stand-in as FlashInfer: a wrong layout through
    --impl dumps its failing cases; --replay re-runs them through the same --impl and fails on
    the rows the tests named, and through the fixed implementation passes."""
    import harness.availability
    import harness.port.launch

    dump = tmp_path / "dumps"
    run = lambda *args: pytester.runpytest_inprocess("-p", "no:cacheprovider", "--rootdir", str(ROOT), *args)  # noqa: E731
    result = run(
        str(ROOT / "tests/cpu/test_kvlen_regimes.py"),
        "--impl=tests.bugs:CompactionPlansPrefix",
        "-k",
        "test_plan_reads_the_intended_slots and compacted and (ctx5-kpool4 or decode-mixed-lengths-kpool4)",
        f"--dump-failures={dump}",
    )
    assert result.parseoutcomes().get("failed") == 2, "\n".join(result.outlines[-20:])
    files = sorted(dump.glob("*.safetensors"))
    assert len(files) == 2
    c_rows = {f.name: regime_rows(load_fixture(f), "C") for f in files}
    monkeypatch.setattr(harness.availability, "sm90_flashinfer_unavailable_reason", lambda: None)
    monkeypatch.setattr(harness.port.launch, "DEVICE", device.type)
    result = run(
        str(ROOT / "tests/test_replay.py"), f"--replay={dump}", "--impl=tests.bugs:CompactionPlansPrefix", "-rA"
    )
    out = "\n".join(result.outlines)
    assert result.parseoutcomes().get("failed") == 2, out[-3000:]
    for rows in c_rows.values():
        assert rows
        for r in rows:
            assert f"re-run] plan != intent at row {r} (regime C" in out, out[-3000:]
    assert "implementation under test: tests.bugs:CompactionPlansPrefix" in out
    result = run(str(ROOT / "tests/test_replay.py"), f"--replay={dump}")
    assert result.ret == 0, "\n".join(result.outlines[-40:])


def test_a_shrunk_fixture_converts_only_its_own_rows_of_the_rebuilt_batch(monkeypatch):
    """The lens of a shrunk fixture come from the kv_len rule on the rebuilt batch, but only
    the fixture's rows of it are converted and compared (a batch may hold thousands)."""
    import recording.rerun as rerun_module
    from recording.fixture import subset_fixture

    fx = load_fixture(FIXTURES / "bdefg-pooled-decode-bf16.safetensors")
    keep = [r for r, g in enumerate(fx.meta["regimes"]) if g in ("E", "G")][:1]
    small = subset_fixture(fx, keep)
    converted = []
    real = rerun_module.convert_rule

    def counting(topk, *args):
        converted.append(topk.shape[0])
        return real(topk, *args)

    monkeypatch.setattr(rerun_module, "convert_rule", counting, raising=False)
    rerun_module._rebuilt_rows_and_lens.cache_clear()
    lens = rerun_module.lens_from_impl(small, KpoolFromWrongSpec())
    assert converted == [1], f"rows converted per call: {converted} (the fixture has 1 of {fx.num_rows})"
    full = rerun_module.lens_from_impl(fx, KpoolFromWrongSpec())
    assert lens is not None and full is not None and torch.equal(lens, full[keep])
