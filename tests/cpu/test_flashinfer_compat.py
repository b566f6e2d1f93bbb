"""The FlashInfer compatibility layer's pure parts: version parsing, feature detection from
signatures, the version gates and their skip reasons, the dtype fp8 caches are planned with
(SPEC §6 #6), and the cluster-size rule behind the graph-replay finding."""

from __future__ import annotations

import re

import pytest
import torch

from fast.flashinfer_compat import (
    fa3_mla_cluster_size,
    features_from,
    kernel_kv_view,
    parse_version,
    planning_kv_dtype,
    unsupported_reason,
)

FLAT_PLAN = ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr", "num_heads", "head_dim_ckv", "head_dim_kpe",
             "page_size", "causal", "sm_scale", "q_data_type", "kv_data_type")
FLAT_RUN = ("q_nope", "q_pe", "ckv_cache", "kpe_cache", "out", "lse", "return_lse")
SCALES = ("ckv_scale", "kpe_scale")


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
    assert f.nope and f.fp8_kv and f.csr_page_count_check


def test_0_6_signatures_give_the_flat_forms():
    f = features_from("0.6.18.post1", FLAT_PLAN, FLAT_RUN + ("return_lse_base_on_e",) + SCALES, has_plan_metadata=False)
    assert not f.canonical_plan and not f.structural_run and not f.csr_page_count_check
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
    (132, 128, 132, 2), (3, 128, 132, 1), (66, 128, 132, 1), (67, 128, 132, 1), (68, 128, 132, 2), (132, 64, 132, 1), (0, 128, 8, 1),
])
def test_cluster_size_rule(rows, heads, reserved, cluster):
    assert fa3_mla_cluster_size(rows, heads, reserved) == cluster
