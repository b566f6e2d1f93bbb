"""capture_mla around a program that drives FlashInfer's wrapper the way production does
(the SM90 state: reserved buffers, plan every step, convert into kv_indices, run): the
program's results are unchanged and every captured fixture replays within the budget."""

from __future__ import annotations

import pytest
import torch

from backends.flashinfer.port import make_attention_state
from harness import AttentionInputs, batch, build_attention_inputs, build_scenario
from harness.port.launch import DEVICE, attention_config, launch_inputs, nan_buffers, prepared, sync
from recording.capture import capture_mla
from recording.fixture import bitwise_equal, load_fixture
from recording.replay import replay

pytestmark = pytest.mark.gpu


def program(impl, layout: str, regime_log) -> list[torch.Tensor]:
    """Three steps of one state (max 8 rows): plan on the host, then convert -> layout -> run."""
    specs = [batch((70, 1), (3000, 1), (300, 2), topk=256, kpool=4, num_heads=16, block_size=16),
             batch((2050, 1), (9, 1), topk=256, kpool=4, num_heads=16, block_size=16),
             batch((5000, 4), (261, 4), topk=256, kpool=4, num_heads=16, block_size=16, decode_threshold=4)]
    scenarios = [build_scenario(s, seed=50 + i) for i, s in enumerate(specs)]
    state = make_attention_state(impl, attention_config(scenarios[0], layout, max_rows=8), DEVICE)
    # One KV cache for the whole program, as in an engine (a FlashInfer that checks cache
    # coverage at run, Features.run_checks_cache_coverage, refuses a cache short of the
    # planned slots).
    spec = scenarios[0].spec
    cache = torch.empty((max(s.num_blocks for s in scenarios), spec.block_size, spec.head_dim), dtype=torch.bfloat16,
                        device=DEVICE)
    results = []
    for scenario in scenarios:
        step = prepared(impl, scenario, layout, max_rows=8)
        own = build_attention_inputs(scenario, DEVICE)
        cache.view(torch.int16).fill_(0x7FC0)  # NaN
        cache[: scenario.num_blocks] = own.kv_cache
        inputs = AttentionInputs(own.q_nope, own.q_pe, cache)
        launch = launch_inputs(impl, scenario, inputs, 8)
        out, lse = nan_buffers(8, 16)
        state.plan(step.num_planned, step.planned_lens)
        state.step(*launch.step_args(out, lse))
        sync()
        regime_log.kernel_ran()
        results.append(torch.cat([out[: step.num_planned].float(), lse[: step.num_planned, :, None]], dim=-1).cpu())
    return results


def test_capture_of_the_production_state(impl, regime_log, tmp_path):
    plain = program(impl, "compacted", regime_log)
    with capture_mla(tmp_path, every=1, max_cases=8) as log:
        captured = program(impl, "compacted", regime_log)
    assert len(plain) == len(captured) == 3, f"{len(plain)} plain and {len(captured)} captured results of 3 steps"
    # NaN bits count as equal
    changed = [i for i, (a, b) in enumerate(zip(plain, captured, strict=True)) if not bitwise_equal(a, b)]
    assert not changed, f"capturing changed the program's results at steps {changed}"
    assert len(log.written) == 3, f"written {log.written}, skipped {log.skipped}"
    for path in log.written:
        report = replay(load_fixture(path))
        assert report.plan_ok and report.kernel_ok, report.render()
