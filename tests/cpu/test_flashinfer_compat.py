"""The FlashInfer compatibility layer's pure parts: version parsing, feature detection from
signatures, the version gates and their skip reasons, the dtype fp8 caches are planned with
(docs/findings.md#fp8-planned-as-uint8), the cluster-size rule behind the graph-replay finding,
and the behaviour probe
against stand-ins for FlashInfer releases that check, or do not check, before launching."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from backends.flashinfer.compat import (
    PROBE_SLOT,
    PROBED_BEHAVIOURS,
    PROBED_NAMES,
    RELEASES_READ,
    Behaviour,
    ProbeError,
    classify_run,
    fa3_mla_cluster_size,
    features_from,
    kernel_kv_view,
    parse_version,
    planning_kv_dtype,
    probe_behaviour,
    refusal,
    unsupported_reason,
)
from harness.port.full_width_strided import outcome_problem

FLAT_PLAN = ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr", "num_heads", "head_dim_ckv", "head_dim_kpe",
             "page_size", "causal", "sm_scale", "q_data_type", "kv_data_type")
FLAT_RUN = ("q_nope", "q_pe", "ckv_cache", "kpe_cache", "out", "lse", "return_lse")
SCALES = ("ckv_scale", "kpe_scale")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("text", "expected"), [
    ("0.6.18.post1", (0, 6, 18)), ("0.7.4", (0, 7, 4)), ("0.5.3", (0, 5, 3)), ("0.7", (0, 7, 0)),
    ("0.8.0rc1", (0, 8, 0)), ("0.6.14+cu130", (0, 6, 14)),
])
def test_parse_version(text, expected):
    assert parse_version(text) == expected


def test_unparseable_version_is_an_error():
    with pytest.raises(ValueError, match="cannot parse"):
        parse_version("nightly")


def test_0_7_signatures_give_the_canonical_forms():
    f = features_from("0.7.4", FLAT_PLAN + ("metadata", "query_layout", "kv_cache_layout", "lse_mode"),
                      FLAT_RUN + ("query", "kv_cache", "return_lse_base_on_e") + SCALES, has_plan_metadata=True)
    assert f.canonical_plan and f.structural_run and f.plan_lse_mode and f.run_lse_base_e
    assert f.nope and f.fp8_kv


def test_0_6_signatures_give_the_flat_forms():
    f = features_from("0.6.18.post1", FLAT_PLAN, FLAT_RUN + ("return_lse_base_on_e",) + SCALES, has_plan_metadata=False)
    assert not f.canonical_plan and not f.structural_run
    assert f.nope and f.fp8_kv and f.run_lse_base_e


@pytest.mark.parametrize(("version", "rope_dim", "kv_dtype", "reason"), [
    ("0.6.17", 0, torch.bfloat16, "NoPE .* needs flashinfer >= 0.6.18"),
    ("0.6.13", 64, torch.float8_e4m3fn, "fp8 KV needs flashinfer >= 0.6.14"),
    ("0.8.0", 64, torch.bfloat16, "outside the supported range"),
    ("0.5.2", 64, torch.bfloat16, "outside the supported range"),
])
def test_version_gates_say_why(version, rope_dim, kv_dtype, reason):
    f = features_from(version, FLAT_PLAN, FLAT_RUN + SCALES, has_plan_metadata=False)
    found = unsupported_reason(f, rope_dim=rope_dim, kv_dtype=kv_dtype)
    assert found is not None and re.search(reason, found), found


@pytest.mark.parametrize("version", ["0.6.18.post1", "0.7.4"])
def test_supported_configurations_have_no_reason(version):
    f = features_from(version, FLAT_PLAN, FLAT_RUN + SCALES, has_plan_metadata=False)
    for rope_dim in (0, 64):
        for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            assert unsupported_reason(f, rope_dim=rope_dim, kv_dtype=kv_dtype) is None


def test_fp8_without_run_scales_is_not_supported():
    f = features_from("0.6.18", FLAT_PLAN, FLAT_RUN, has_plan_metadata=False)
    assert "fp8 KV needs" in unsupported_reason(f, rope_dim=64, kv_dtype=torch.float8_e4m3fn)


def test_fp8_caches_are_planned_as_e4m3_never_their_storage_dtype():
    assert planning_kv_dtype(torch.uint8) == torch.float8_e4m3fn
    assert planning_kv_dtype(torch.float8_e4m3fn) == torch.float8_e4m3fn
    assert planning_kv_dtype(torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="unsupported KV cache dtype"):
        planning_kv_dtype(torch.float32)
    raw = torch.tensor([0x38, 0xB8], dtype=torch.uint8)  # 1.0 and -1.0 in e4m3
    assert kernel_kv_view(raw).float().tolist() == [1.0, -1.0]


@pytest.mark.parametrize(("rows", "heads", "reserved", "cluster"), [
    (132, 128, 132, 2), (3, 128, 132, 1), (66, 128, 132, 1), (67, 128, 132, 1), (68, 128, 132, 2),
    (132, 64, 132, 1), (0, 128, 8, 1),
])
def test_cluster_size_rule(rows, heads, reserved, cluster):
    assert fa3_mla_cluster_size(rows, heads, reserved) == cluster


def test_signatures_alone_probe_nothing():
    f = features_from("0.7.4", FLAT_PLAN + ("metadata", "query_layout", "kv_cache_layout"), FLAT_RUN, True)
    assert [getattr(f, name) for name in PROBED_NAMES] == [None] * len(PROBED_BEHAVIOURS)
    assert not f.probed and f.describe().endswith("; probed: not probed")


def test_describe_names_each_probed_behaviour():
    f = features_from("0.7.2.post1", FLAT_PLAN, FLAT_RUN, has_plan_metadata=False)
    f = dataclasses.replace(f, behaviour=Behaviour.of(plan_checks_page_counts=True, run_checks_cache_coverage=False,
                                                      coverage_from_plan_slots=False, run_checks_query_shape=False))
    assert f.probed and f.plan_checks_page_counts is True and f.run_checks_query_shape is False
    assert f.describe().endswith(
        "probed: plan_checks_page_counts yes, run_checks_cache_coverage no, coverage_from_plan_slots no, "
        "run_checks_query_shape no"
    ), f.describe()


# --- the probe, against stand-ins for the wrapper ------------------------------------------


class FakeRelease:
    """Stands in for backends.flashinfer.compat.MLAWrapper on a release that does (or does not)
    check page counts at plan, cache coverage (of the slots kv_indices held at plan, or of those
    it holds at run) and q rows at run. A launch writes zeros into the planned rows of ``out``
    after reading the slots kv_indices holds from the storage under the cache view (as the
    kernel would)."""

    checks = Behaviour.in_source("0.6.18.post1")
    run_error: Exception | None = None

    def __init__(self, workspace, *, qo_indptr, kv_indptr, kv_indices, kv_len_arr, features=None):
        self.kv_indices = kv_indices
        self.planned_rows = 0
        self.planned_slots: list[int] = []
        self.launches = 0

    def plan(self, *, qo_indptr, kv_indptr, kv_indices, kv_len_arr, **kwargs):
        pages = (kv_indptr[1:] - kv_indptr[:-1]).tolist()
        if self.checks.plan_checks_page_counts and pages != kv_len_arr.tolist():
            raise ValueError("CSR metadata page counts in kv_indptr must equal ceil(kv_len_arr / page_size).")
        self.planned_rows = int(qo_indptr[-1])
        self.planned_slots = kv_indices[int(kv_indptr[0]):int(kv_indptr[-1])].tolist()

    def run(self, q_nope, q_pe, ckv, kpe, *, out, lse):
        if self.run_error is not None:
            raise self.run_error
        if self.checks.run_checks_query_shape and q_nope.shape[0] != self.planned_rows:
            raise ValueError("q_nope rows and heads must match the planned query shape.")
        read = self.kv_indices[: len(self.planned_slots)].tolist()  # what the kernel reads: the slots at run
        judged = self.planned_slots if self.checks.coverage_from_plan_slots else read
        if self.checks.run_checks_cache_coverage and ckv.shape[0] < max(judged) + 1:
            raise ValueError("KV cache does not cover the planned CSR page indices.")
        storage = ckv.untyped_storage().nbytes() // (ckv.element_size() * ckv[0].numel())
        assert max(read) < storage, "the probe let the kernel read past the allocation"
        self.launches += 1
        out[: self.planned_rows] = 0
        lse[: self.planned_rows] = 0


def release(checks: Behaviour, **attrs):
    return type("Release", (FakeRelease,), {"checks": checks, **attrs})


EVERY_CHECK = Behaviour.of(**{name: True for name in PROBED_NAMES})


@pytest.mark.parametrize("checks", [
    *(Behaviour.in_source(r) for r in RELEASES_READ),  # as each release's source reads
    Behaviour.of(plan_checks_page_counts=False, run_checks_cache_coverage=True, coverage_from_plan_slots=False,
                 run_checks_query_shape=False),
], ids=[*RELEASES_READ, "cache-coverage-at-run-only"])
def test_probe_finds_what_the_release_checks(checks):
    made = []

    def make(*args, **kwargs):
        made.append(release(checks)(*args, **kwargs))
        return made[-1]

    assert probe_behaviour("cpu", make_wrapper=make) == checks
    assert made[0].planned_slots == [PROBE_SLOT], "the probe must leave the wrapper planned for its one row"
    assert made[0].launches == (1 + (not checks.run_checks_cache_coverage) + (not checks.run_checks_query_shape)
                                + (not checks.coverage_from_plan_slots))


def test_a_behaviour_is_read_by_the_declared_names_only():
    b = Behaviour.in_source("0.7.2.post1")
    assert b.items() == [("plan_checks_page_counts", True), ("run_checks_cache_coverage", False),
                         ("coverage_from_plan_slots", False), ("run_checks_query_shape", False)]
    with pytest.raises(AttributeError, match="plan_checks_pages"):
        _ = b.plan_checks_pages
    with pytest.raises(ValueError, match="exactly"):
        Behaviour.of(plan_checks_page_counts=True)
    with pytest.raises(AttributeError):
        _ = features_from("0.7.4", FLAT_PLAN, FLAT_RUN, True).run_checks_cache


def test_the_findings_doc_tables_are_the_declared_behaviours():
    """docs/findings.md describes each probed behaviour and what each release's source checks,
    as declared in PROBED_BEHAVIOURS (a new behaviour: add its declaration, then these rows)."""
    doc = (ROOT / "docs" / "findings.md").read_text()
    rows = [f"| `{b.name}` | {b.how} |" for b in PROBED_BEHAVIOURS]
    rows += ["| | " + " | ".join(RELEASES_READ) + " |"]
    rows += [f"| `{b.name}` ({b.source}) | "
             + " | ".join("yes" if r in b.releases_checking else "no" for r in RELEASES_READ) + " |"
             for b in PROBED_BEHAVIOURS]
    missing = [row for row in rows if row not in doc.splitlines()]
    assert not missing, "docs/findings.md#probed-checks-before-launch lacks the rows:\n" + "\n".join(missing)


def test_probe_lets_other_exceptions_through():
    with pytest.raises(TypeError, match="unexpected keyword"):
        probe_behaviour("cpu", make_wrapper=release(EVERY_CHECK, run_error=TypeError("unexpected keyword")))


def test_probe_refused_control_run_is_an_error():
    with pytest.raises(ProbeError, match="control run .* refused: ValueError: no"):
        probe_behaviour("cpu", make_wrapper=release(EVERY_CHECK, run_error=ValueError("no")))


def test_refusal_is_a_value_error_message_or_none():
    assert refusal(lambda: None) is None

    def refuse():
        raise ValueError("KV cache does not cover")

    assert refusal(refuse) == "ValueError: KV cache does not cover"


@pytest.mark.parametrize(("refused", "wrote", "expected"), [("ValueError: x", False, True), (None, True, False)])
def test_classify_run(refused, wrote, expected):
    assert classify_run("run", refused, wrote) is expected


@pytest.mark.parametrize(("refused", "wrote", "message"), [
    ("ValueError: x", True, "refused .* after writing"), (None, False, "without writing"),
])
def test_classify_run_rejects_what_it_cannot_tell(refused, wrote, message):
    with pytest.raises(ProbeError, match=message):
        classify_run("run", refused, wrote)


# --- what the full-width strided process may end with (tests/gpu/test_flashinfer_compat.py) --------

REFUSED = {"stage": "run", "error": "ValueError: KV cache does not cover the planned CSR page indices."}
FINISHED = {"stage": "done", "nan_rows": 3}
FAULTED = {"stage": "sync", "error": "AcceleratorError: CUDA error: an illegal memory access was encountered"}
KILLED = {"stage": "sync", "returncode": -11, "died": True}


@pytest.mark.parametrize(("outcome", "checks", "ok"), [
    (REFUSED, True, True),
    ({**REFUSED, "returncode": -6, "died": True}, True, False),  # refused, then the process died
    (FINISHED, True, False),  # launched where the probe found the check
    (FINISHED, False, True),
    (FAULTED, False, True),
    (KILLED, False, True),
    ({"stage": "plan", "returncode": -11, "died": True}, False, False),  # died before run() returned
    ({"stage": None, "returncode": 1, "died": True}, False, False),  # died before any stage (an import error, say)
    ({"stage": "run", "error": "TypeError: run() got an unexpected keyword"}, False, False),
    ({"stage": "sync", "error": "RuntimeError: out of memory"}, False, False),  # not the launch's fault
    ({**FINISHED, "returncode": -11, "died": True}, False, False),  # died after finishing
    (REFUSED, False, False),  # refused where the probe found no check
])
def test_the_full_width_process_outcome_must_be_the_one_the_probe_predicts(outcome, checks, ok):
    assert (outcome_problem(outcome, run_checks_cache_coverage=checks) == "") == ok
