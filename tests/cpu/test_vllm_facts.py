"""What a vLLM release is comes from the facts of its version (``backends.vllm.facts``), and its
code is checked against them: a module that lacks a feature its release declares fails, naming
the feature, instead of passing for an older release that lacks it (a skipped step, a new bug
absorbed into an old finding)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from backends.vllm.facts import (
    RELEASES,
    CodeFeatures,
    digest_problem,
    facts_for,
    facts_of_release,
    feature_problems,
    version_key,
)
from mla_constants import FIRST_SLOT, SLOT_ZERO
from scripts.vllm_planted_bugs import FEATURE_DELETIONS, planted_copy
from tests.support.child_runs import ROOT, pytest_run


def features_of(facts) -> CodeFeatures:
    """The code features a module exactly as ``facts`` describe it shows."""
    return CodeFeatures(facts.design, facts.fp8_plan_dtype, facts.reads_block_stride, facts.reads_block_stride,
                        facts.reads_adaptive_verification, facts.minus_one_filler, facts.flashinfer_pin,
                        facts.module_sha256)


def test_every_known_release_has_its_own_row_and_the_shipped_code_matches_it():
    assert list(RELEASES) == sorted(RELEASES, key=version_key)
    for version, facts in RELEASES.items():
        assert facts_for(version, "exact").facts is facts and facts_for(version, "exact").borrowed == ""
        assert feature_problems(version, facts, features_of(facts)) == []


def test_an_unknown_release_is_judged_by_the_newest_known_release_of_its_design_and_says_so():
    judged = facts_for("0.35.0", "bounded")
    assert judged.facts.release == "0.34.0"
    assert judged.describe() == ("vLLM 0.35.0 is not a known release (backends/vllm/facts.py): judged with the facts "
                                 "of 0.34.0, the newest known release of its bounded design")
    assert facts_for("0.35.0rc1", "exact").facts.release == "0.30.0"
    assert version_key("0.35.0rc1+cu130") == (0, 35, 0)


@pytest.mark.parametrize(("change", "named"), [
    ({"design": "exact"}, "declares the bounded design; its _SM90State lacks the device clamp (_clamp_kv_end): "
                          "the exact design"),
    ({"fp8_plan_dtype": "uint8"}, "declares planning an fp8 cache as float8_e4m3fn; its builder plans it as uint8 "
                                  "(it names no float8_e4m3fn)"),
    ({"hands_block_stride": False}, "reads the cache's block stride; its forward_mqa hands the convert kernel no "
                                    "BLOCK_STRIDE_ROWS"),
    ({"declares_block_alignment": False}, "declares a cache whose blocks lie apart (customize_spec with "
                                          "align_blocks_to_rows); its backend class declares no customize_spec"),
    ({"reads_adaptive_verification": False}, "reads adaptive verification; its builder reads no "
                                             "enable_adaptive_verification"),
    ({"minus_one_filler": SLOT_ZERO}, f"packs a -1 inside a row's planned length as {FIRST_SLOT}; its code packs "
                                      f"it as {SLOT_ZERO}"),
    ({"flashinfer_pin": "0.7.4"}, "pins flashinfer-python 0.7.2.post1; its METADATA requires 0.7.4"),
])
def test_each_feature_the_code_lacks_is_named(change, named):
    facts = RELEASES["0.33.0"]
    code = dataclasses.replace(features_of(facts), **change, module_sha256="0" * 64)
    problems = feature_problems("0.33.0", facts, code)
    assert len(problems) == 2 and problems[0] == f"vLLM 0.33.0 {named}", problems
    assert problems[1] == ("its flashinfer_mla_sparse_sm90.py (sha256 000000000000) is not the one vLLM 0.33.0 "
                           "released (480f2060f823)")


@pytest.mark.parametrize(("change", "line"), [
    ({"design": "bounded"}, "declares the exact design; its _SM90State has the device clamp (_clamp_kv_end): the "
                            "bounded design"),
    ({"fp8_plan_dtype": "float8_e4m3fn"}, "declares planning an fp8 cache as uint8; its builder plans it as "
                                          "float8_e4m3fn"),
    ({"hands_block_stride": True}, "reads contiguous blocks; its forward_mqa hands the convert kernel "
                                   "BLOCK_STRIDE_ROWS"),
    ({"declares_block_alignment": True}, "declares contiguous blocks (supported_kv_cache_layouts LBHNC alone); its "
                                         "backend class declares customize_spec"),
    ({"reads_adaptive_verification": True}, "reads no adaptive verification; its builder reads "
                                            "enable_adaptive_verification"),
    ({"minus_one_filler": FIRST_SLOT}, f"packs a -1 inside a row's planned length as {SLOT_ZERO}; its code packs it "
                                       f"as {FIRST_SLOT}"),
    ({"flashinfer_pin": "0.7.4"}, "pins flashinfer-python 0.6.18.post1; its METADATA requires 0.7.4"),
], ids=["design", "fp8", "block-stride", "block-alignment", "adaptive", "filler", "pin"])
def test_each_feature_the_code_has_beyond_its_release_is_named(change, line):
    """The other direction: a module of 0.30.0 that shows a feature its release does not declare
    (a newer release's module under an old name, a backport) fails with one line naming it, and
    the module's digest named after it."""
    facts = RELEASES["0.30.0"]
    code = dataclasses.replace(features_of(facts), **change, module_sha256="f" * 64)
    assert feature_problems("0.30.0", facts, code) == [
        f"vLLM 0.30.0 {line}",
        "its flashinfer_mla_sparse_sm90.py (sha256 ffffffffffff) is not the one vLLM 0.30.0 released (df9fe4970aa3)"]


def test_a_module_the_release_shipped_is_not_named_beside_its_problems():
    """The digest line comes only with a problem, and only for a module the release did not ship."""
    facts = RELEASES["0.33.0"]
    code = dataclasses.replace(features_of(facts), flashinfer_pin="0.7.4")
    assert feature_problems("0.33.0", facts, code) == [
        "vLLM 0.33.0 pins flashinfer-python 0.7.2.post1; its METADATA requires 0.7.4"]
    assert feature_problems("0.33.0", facts, dataclasses.replace(features_of(facts), module_sha256="0" * 64)) == []


def test_every_problem_of_a_module_is_named_at_once():
    facts = RELEASES["0.33.0"]
    code = CodeFeatures("exact", "uint8", False, False, False, SLOT_ZERO, "0.6.18.post1", facts.module_sha256)
    problems = feature_problems("0.33.0", facts, code)
    assert len(problems) == 7 and all(p.startswith("vLLM 0.33.0 ") for p in problems), problems


def test_a_release_of_a_design_the_table_does_not_know_is_judged_by_the_newest_release():
    judged = facts_for("0.40.0", "paged")
    assert judged.facts is RELEASES["0.34.0"]
    assert judged.borrowed.endswith("judged with the facts of 0.34.0, the newest known release of its paged design")


def test_a_digest_is_judged_only_against_a_release_the_table_knows():
    shipped = RELEASES["0.33.0"].module_sha256
    assert digest_problem("0.99.0", shipped) is None
    assert digest_problem(None, shipped) is None
    assert digest_problem("0.30.0", None) is None
    assert digest_problem("0.30.0", "a" * 64) is None, "a module no release shipped is the replay's to name"
    assert digest_problem("0.30.0", shipped).startswith("'backend.release' is 0.30.0, but 'backend.module_digest'")


def test_the_summary_a_header_prints_names_every_fact_and_where_it_comes_from():
    assert facts_for("0.30.0", "exact").summary() == (
        f"exact design, fp8 planned as uint8, contiguous blocks, no adaptive verification, -1 inside a row's length "
        f"packed as {SLOT_ZERO}, pins flashinfer-python 0.6.18.post1; facts of vLLM 0.30.0 (backends/vllm/facts.py)")
    assert facts_for("0.35.0", "bounded").summary() == (
        f"bounded design, fp8 planned as float8_e4m3fn, any block stride, reads adaptive verification, -1 inside a "
        f"row's length packed as {FIRST_SLOT}, pins flashinfer-python 0.7.3; vLLM 0.35.0 is not a known release "
        f"(backends/vllm/facts.py): judged with the facts of 0.34.0, the newest known release of its bounded design")


def test_an_unknown_release_carries_its_own_version_with_the_borrowed_facts():
    facts = facts_of_release("0.35.0", "exact")
    assert facts == dataclasses.replace(RELEASES["0.30.0"], release="0.35.0")
    assert facts_of_release("0.33.0", "exact") is not RELEASES["0.33.0"]
    assert facts_of_release("0.33.0", "exact") == RELEASES["0.33.0"]


@pytest.mark.parametrize(("version", "key"), [("0.33.0", (0, 33, 0)), ("1.2", (1, 2)), ("0.10.1.post2", (0, 10, 1)),
                                              ("dev", ()), ("", ()), ("10.0.0rc1", (10, 0, 0))])
def test_a_version_is_ordered_by_its_leading_numbers(version, key):
    assert version_key(version) == key


def test_what_the_code_does_not_show_is_not_judged():
    facts = RELEASES["0.31.0"]
    code = dataclasses.replace(features_of(facts), minus_one_filler=None, flashinfer_pin=None, module_sha256="x")
    assert feature_problems("0.31.0", facts, code) == []


@pytest.mark.vllm
def test_the_release_code_keeps_every_feature_its_facts_declare(vllm_backend, device):
    """The module under test against the facts of its release: design, fp8 planning dtype, block
    stride and block alignment, adaptive verification, the -1 filler its pack writes (probed on
    the device), the FlashInfer its METADATA pins."""
    problems = vllm_backend.feature_problems(device)
    assert problems == [], "\n".join(problems)
    assert vllm_backend.judged.describe() in vllm_backend.describe()


#: Whether a release's facts declare the feature each of FEATURE_DELETIONS deletes.
DECLARES = {"fp8-mapping": lambda f: f.fp8_plan_dtype == "float8_e4m3fn",
            "block-stride": lambda f: f.reads_block_stride, "block-alignment": lambda f: f.reads_block_stride,
            "adaptive-verification": lambda f: f.reads_adaptive_verification}


@pytest.mark.vllm
@pytest.mark.parametrize(("deletion", "named"), FEATURE_DELETIONS, ids=[d.name for d, _ in FEATURE_DELETIONS])
def test_a_module_without_a_declared_feature_fails_naming_it(vllm_backend, deletion, named, tmp_path):
    """A copy of the release with one declared feature deleted from its SM90 module, run through
    ``--vllm``: the check of its code against its facts fails naming the feature; on the fp8
    mapping, the fp8 planning test fails too (not an expected failure of the older releases'
    uint8 finding)."""
    copy = planted_copy(vllm_backend.source.root, tmp_path / "vllm-without", deletion)
    if copy is None:
        declared = DECLARES[deletion.name](vllm_backend.judged.facts)
        assert not declared, (f"vLLM {vllm_backend.version}'s facts declare {deletion.name}, but its module does not "
                              f"hold the line 0.32.0 to 0.34.0 ship: FEATURE_DELETIONS needs this release's line")
        pytest.skip(f"vLLM {vllm_backend.version}'s module does not hold {deletion.name} as 0.32.0 to 0.34.0 "
                    f"ship it (its facts declare no such feature)")
    tests = "keeps_every_feature or fp8_is_planned_with_the_dtype"
    status, out, counts = pytest_run("-m", "vllm", f"--vllm={copy}", "tests/cpu/test_vllm_facts.py",
                                     "tests/cpu/test_vllm_backend.py", "-k", tests, "-rfEx")
    assert status == 1 and named in out, out[-3000:]
    failed = 2 if deletion.name == "fp8-mapping" else 1
    assert counts.get("failed") == failed and not counts.get("xfailed"), out[-3000:]


def test_a_case_whose_release_was_edited_to_disagree_with_its_module_digest_is_refused(tmp_path):
    """A vLLM case records the release and the sha256 of the module it ran; a release edited to
    one whose module is another (0.30.0's, on 0.33.0's module) is one fixture error naming both.
    The releases that ship one file (0.32.0 to 0.34.0) agree with each other's digest, and a module
    no release shipped (a planted copy) is left to the replay's report."""
    from recording.backend_case import load_backend_case, write_backend_case
    from recording.fixture import FixtureError
    from tests.support.backend_cases import vllm_case as case

    shipped = RELEASES["0.33.0"].module_sha256
    assert load_backend_case(write_backend_case(tmp_path, "ok", case("0.32.0", shipped)))["backend"]["release"] == \
        "0.32.0"
    assert load_backend_case(write_backend_case(tmp_path, "planted", case("0.33.0", "a" * 64)))
    with pytest.raises(FixtureError, match=r"'backend.release' is 0.30.0, but 'backend.module_digest' \(480f2060f823\) "
                                           r"is the SM90 module of vLLM 0.32.0, 0.33.0, 0.34.0"):
        load_backend_case(write_backend_case(tmp_path, "edited", case("0.30.0", shipped)))


@pytest.mark.vllm
def test_the_header_says_what_the_release_is_judged_as_and_an_unknown_release_whose_facts(vllm_backend, tmp_path):
    """A green run's header names every fact the release is judged by and where they come from;
    a release the table does not know (its METADATA's version edited to 0.99.0) is judged with the
    newest known release of its design, and the header says so."""
    import shutil

    from backends.vllm.source import SLICE_METADATA

    unknown = tmp_path / "vllm-0.99.0"
    shutil.copytree(vllm_backend.source.root, unknown)
    metadata = unknown / SLICE_METADATA
    if not metadata.is_file():
        pytest.skip(f"{vllm_backend.source.root} is not a slice (no {SLICE_METADATA} to edit)")
    metadata.write_text(metadata.read_text().replace(f"Version: {vllm_backend.version}\n", "Version: 0.99.0\n", 1))
    for source, judged in ((vllm_backend.source.root, f"facts of vLLM {vllm_backend.version}"),
                           (unknown, "vLLM 0.99.0 is not a known release (backends/vllm/facts.py): judged with the "
                                     f"facts of {facts_for('0.99.0', vllm_backend.design).facts.release}")):
        done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist",
                               f"--vllm={source}", "tests/cpu/test_vllm_facts.py", "-k", "unknown_release_is"],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
        status, out = done.returncode, done.stdout + done.stderr
        header = [line for line in out.splitlines() if line.startswith("vLLM judged as: ")]
        assert status == 0 and len(header) == 1 and judged in header[0], out[-2000:]
        assert f"{vllm_backend.design} design, fp8 planned as " in header[0], header


def test_a_finding_met_on_a_release_whose_facts_do_not_declare_it_is_no_finding():
    """The uint8 refusal is the fp8 finding only on a release whose facts plan fp8 as uint8, and
    slot 0 loaded past a row's length only on one whose facts pack slot 0 there: elsewhere the
    refusal propagates as an error and the NaN rows fail as any output beyond the budget."""
    from types import SimpleNamespace

    from harness.findings import for_backend
    from harness.findings.vllm import UINT8_REFUSAL, Fp8PlannedAsUint8

    scenario = SimpleNamespace(spec=SimpleNamespace(kv_dtype="float8_e4m3fn"), describe=lambda: "case")
    refused = ValueError(f"plan(): {UINT8_REFUSAL}")
    for release in RELEASES.values():
        backend = SimpleNamespace(name=f"vllm-{release.release}", version=release.release,
                                  plans_fp8_as_storage_dtype=release.plans_fp8_as_storage_dtype,
                                  minus_one_filler=release.minus_one_filler)
        finding = for_backend(backend).refusal(backend, scenario, refused)
        assert isinstance(finding, Fp8PlannedAsUint8) is release.plans_fp8_as_storage_dtype, release
        layer = SimpleNamespace(on_flashinfer=True, slots_loaded_past_length=lambda outcome: {0: (0,)})
        inputs = SimpleNamespace(kv_cache=torch.full((1, 1, 4), float("nan")))
        rows = for_backend(backend).rows_loading_a_bad_slot(backend, layer, None, inputs)
        assert rows == ([0] if release.minus_one_filler == SLOT_ZERO else []), release


def test_every_feature_deletion_names_the_fact_it_deletes():
    assert set(DECLARES) == {deletion.name for deletion, _ in FEATURE_DELETIONS}
    newest = RELEASES["0.34.0"]
    assert all(DECLARES[name](newest) for name in DECLARES)
