"""The capture context manager, on a program that drives an MLA wrapper the way the
production state does (reserved buffers, convert into kv_indices, plan every step, run).
On CPU the wrapper is a stand-in with FlashInfer's 0.6 flat signatures that computes with
the reference; the GPU tier repeats this with the real wrapper."""

from __future__ import annotations

import torch

from recording.capture import capture_mla
from recording.fixture import load_fixture
from recording.replay import replay
from tests.support.capture_program import StandInWrapper, program_steps, seed_style_program


def test_capture_records_replayable_fixtures_without_changing_results(impl, device, tmp_path):
    steps = program_steps()
    plain = seed_style_program(impl, device, steps, max_rows=4, width=256)
    originals = (StandInWrapper.plan, StandInWrapper.run)
    with capture_mla(tmp_path, every=1, max_cases=10, wrapper_cls=StandInWrapper) as log:
        assert (StandInWrapper.plan, StandInWrapper.run) != originals, "capture did not hook the wrapper"
        captured = seed_style_program(impl, device, steps, max_rows=4, width=256)
    assert len(plain) == len(captured) == len(steps), (
        f"{len(plain)} plain and {len(captured)} captured results of {len(steps)} steps")
    changed = not all(torch.equal(a, b) for a, b in zip(plain, captured, strict=True))
    assert not changed, "capturing changed the program's results"
    assert (StandInWrapper.plan, StandInWrapper.run) == originals, "capture did not restore the wrapper"
    assert len(log.written) == 3, log.skipped
    for path, (scenario, _) in zip(log.written, steps, strict=True):
        fx = load_fixture(path)
        assert fx.num_rows == scenario.num_rows
        report = replay(fx)
        assert report.plan_ok and report.kernel_ok, report.render()


def test_capture_respects_sampling_and_caps(impl, device, tmp_path):
    steps = program_steps() * 3  # nine runs
    with capture_mla(tmp_path / "every", every=4, wrapper_cls=StandInWrapper) as log:
        seed_style_program(impl, device, steps, max_rows=4, width=256)
    assert [load_fixture(p).meta["run_index"] for p in log.written] == [1, 5, 9]
    with capture_mla(tmp_path / "count", max_cases=2, wrapper_cls=StandInWrapper) as log:
        seed_style_program(impl, device, steps, max_rows=4, width=256)
    assert len(log.written) == 2
    with capture_mla(tmp_path / "bytes", max_bytes=1, wrapper_cls=StandInWrapper) as log:
        seed_style_program(impl, device, steps, max_rows=4, width=256)
    assert not log.written and log.skipped.get("byte cap reached") == 9
