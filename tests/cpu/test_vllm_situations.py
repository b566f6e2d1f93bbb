"""Situations of production steps that a bug in vLLM's SM90 builder needs all at once
(docs/input-space.md#situations), through vLLM's own backend (``--vllm``) on the CPU tier, each
with a bug planted in the loaded module that only its situation catches.

A planted bug is one source edit of a method of vLLM's loaded module (``planted``), compiled in
that module's namespace and set on its class for the test alone. Each bug passes on the steps
nearest its situation that the suite drew before (single-token decodes beside prefills routed to
dense MHA; drafts without prefills; adaptive verification with the longest request first; a
host bound beside positions), and fails on the situation's own step.
"""

from __future__ import annotations

import pytest

from harness.case_runner import run_case
from harness.cases import longest_request_cases, situation_cases
from harness.input_space import SITUATIONS, classify_case, covering_cases
from tests import fa3_stand_in
from tests.support.vllm_planting import BF16, BUILDER, UnreportedJudge, planted, stand_in_for

pytestmark = pytest.mark.vllm


#: situation -> (method of the builder, ((vLLM 0.33.0's line, the planted line), ...))
PLANTED = {
    # the MHA route plans the decode requests, not their tokens: equal while every decode is one token
    "drafts-beside-dense-mha": ("build", (
        ("num_rows = metadata.num_decode_tokens", "num_rows = metadata.num_decodes"),
    )),
    # without positions the host bound goes through the exact length rule, unclamped: right while
    # the bound is exact (sync scheduling, or no draft rejected)
    "async-bound-without-positions": ("_kv_lens_host", (
        ("if sl_host is None:", "if sl_host is None or cam.positions is None:"),
        ("ctx = self._row_contexts(qsl, cam.seq_lens[:num_reqs].cpu())",
         "ctx = self._row_contexts(qsl, (cam.seq_lens if sl_host is None else sl_host)[:num_reqs].cpu())"),
    )),
}
#: adaptive verification bounding every row by one request's bound, not the longest's
ADAPTIVE_BUGS = {
    "first-request": ("_kv_lens_host", (("int(sl_host[:num_reqs].max())", "int(sl_host[0])"),)),
    "last-request": ("_kv_lens_host", (("int(sl_host[:num_reqs].max())", "int(sl_host[num_reqs - 1])"),)),
}


def bounded_release(vllm_backend) -> None:
    if vllm_backend.design != "bounded":
        pytest.skip(f"vLLM {vllm_backend.version} has the exact design: the planted lines are the bounded design's")


def situation_case(name: str):
    """The ci covering design's case of the situation ``name``."""
    situation = next(s for s in SITUATIONS if s.name == name)
    return next(c for c in covering_cases(1) if situation.reached_by(classify_case(c)))


def steps_before(name: str) -> list:
    """The specs nearest the situation ``name`` that the suite drew before it: each has all but
    one of the situation's ingredients."""
    cases = {c.name: BF16.apply(c.spec) for c in situation_cases(4)}
    if name == "drafts-beside-dense-mha":
        return [cases[n] for n in ("decode+prefill-to-mha-kpool4", "spec-decode-straddling-topk-kpool4",
                                   "async-spec-decode-kpool4")]
    spec = cases["async-spec-decode-kpool4"]
    return [spec,  # the bound beside positions
            spec.replace(with_host_bound=False, with_positions=False),  # seq_lens alone
            spec.replace(async_scheduling=False, host_bound_slack=0, with_positions=False)]  # an exact bound alone


def caught(vllm_backend, spec, device, *, seed: int = 0, adaptive_verification: bool = False) -> bool:
    with pytest.MonkeyPatch.context() as mp:
        fa3_stand_in.install(mp, stand_in_for(vllm_backend))
        try:
            run_case(UnreportedJudge(), vllm_backend, spec, device, seed=seed, compare=False,
                     adaptive_verification=adaptive_verification)
        except AssertionError:
            return True
    return False


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_situation_runs_clean(vllm_backend, device, judge, name):
    """The situation's covering case through the release as it ships: every row served, its
    valid count executed, its intended slots read, its output within budget."""
    case = situation_case(name)
    with pytest.MonkeyPatch.context() as mp:
        fa3_stand_in.install(mp, stand_in_for(vllm_backend))
        run_case(judge, vllm_backend, case.spec, device, seed=1)


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_situation_catches_the_bug_the_steps_before_it_miss(vllm_backend, device, monkeypatch, name):
    bounded_release(vllm_backend)
    planted(monkeypatch, vllm_backend.module, BUILDER, *PLANTED[name])
    missed_by = [i for i, spec in enumerate(steps_before(name)) if caught(vllm_backend, spec, device)]
    assert not missed_by, f"{name}: the planted bug fails steps drawn before the situation: {missed_by}"
    assert caught(vllm_backend, situation_case(name).spec, device, seed=1), (
        f"{name}: the situation's covering case passes with the bug planted")


@pytest.mark.parametrize("case", longest_request_cases(), ids=lambda c: c.name)
def test_adaptive_verification_with_the_longest_request_anywhere(vllm_backend, device, judge, case):
    """Under adaptive verification the bounded design bounds every row by the longest request,
    wherever it sits, and each row still executes its valid count."""
    with pytest.MonkeyPatch.context() as mp:
        fa3_stand_in.install(mp, stand_in_for(vllm_backend))
        outcome = run_case(judge, vllm_backend, case.spec, device, seed=2, adaptive_verification=True)
    if vllm_backend.design == "bounded":
        spec = case.spec
        longest = min(max(r.seq_len for r in spec.requests), spec.topk + spec.kpool - 1)
        assert outcome.host_lengths.tolist() == [longest] * sum(r.q_len for r in spec.requests)


@pytest.mark.parametrize("bug", sorted(ADAPTIVE_BUGS))
def test_longest_request_elsewhere_catches_a_bound_from_one_request(vllm_backend, device, monkeypatch, bug):
    """A bound taken from one request, not the longest, passes the step the suite drew before (the
    spec-decode situation, whose first and last requests are both past topk) and fails where the
    longest request sits elsewhere."""
    bounded_release(vllm_backend)
    planted(monkeypatch, vllm_backend.module, BUILDER, *ADAPTIVE_BUGS[bug])
    before = BF16.apply(next(c for c in situation_cases(4) if c.name.startswith("spec-decode")).spec)
    assert not caught(vllm_backend, before, device, seed=5, adaptive_verification=True)
    hits = [c.name for c in longest_request_cases() if caught(vllm_backend, c.spec, device, adaptive_verification=True)]
    assert hits, f"{bug}: no longest-request case catches it"
