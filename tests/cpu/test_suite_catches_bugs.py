"""Tests of the suite itself: each CPU-visible production bug (docs/findings.md), re-created in
``tests/bugs.py`` and plugged in with ``--impl``, must make the suite fail, with a message
that names what broke."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KVLEN = "tests/cpu/test_kvlen_regimes.py"
CONVERT = "tests/cpu/test_convert.py"

# (docs/findings.md anchor of the bug, re-creation, tests that must catch it, -k selection, message the failure shows)
BUG_CASES = [
    ("kpool-wrong-cache-spec", "KpoolFromWrongSpec", KVLEN, "test_kv_len_equals_valid_count and kpool4", r"kv_len != valid count on \d+ rows"),
    ("prefills-to-mha-still-planned", "PrefillsStillPlanned", KVLEN, "test_kv_len_equals_valid_count and to-mha", r"rows planned but q has \d+ rows"),
    ("regime-c-compacted", "CompactionPlansPrefix", KVLEN, "test_plan_reads_the_intended_slots and compacted and kpool4",
     r"planned slots != intended slots .*regime C"),
    ("packed-clamp-with-a-wrong-length", "PackedWithMaxTailLength", KVLEN, "test_plan_reads_the_intended_slots and packed and kpool4",
     r"\[len==valid\] row \d+: planned len \d+ != \d+ valid entries"),
    ("ctx-off-by-one", "ContextIsPosition", KVLEN, "test_kv_len_equals_valid_count", r"kv_len != valid count on \d+ rows"),
    ("optimistic-async-bounds", "OptimisticBoundAsExact", KVLEN, "test_kv_len_equals_valid_count and async",
     r"kv_len != valid count on \d+ rows"),
    ("convert-block-column-out-of-range", "ConvertWithoutTableBound", CONVERT, "", r"FAILED \S*test_convert\.py::"),
    ("convert-request-id-rows-mismatch", "ConvertAcceptsMismatchedReqIds", CONVERT, "", r"FAILED \S*test_convert\.py::"),
]


def run_suite(pytester, impl: str, path: str, select: str):
    """Run part of the suite in a nested in-process session with another implementation."""
    args = [str(ROOT / path), f"--impl={impl}", "-x", "-p", "no:cacheprovider", "--rootdir", str(ROOT)]
    if select:
        args += ["-k", select]
    return pytester.runpytest_inprocess(*args)


@pytest.mark.suite_self_test
@pytest.mark.parametrize(("entry", "bug", "path", "select", "message"), BUG_CASES, ids=[c[1] for c in BUG_CASES])
def test_suite_fails_on_recreated_bug(pytester, entry, bug, path, select, message):
    result = run_suite(pytester, f"tests.bugs:{bug}", path, select)
    output = "\n".join(result.outlines + result.errlines)
    assert result.ret == 1, f"docs/findings.md#{entry}: the suite did not fail on tests.bugs:{bug} (exit {result.ret})\n{output[-3000:]}"
    assert re.search(message, output, flags=re.S), f"docs/findings.md#{entry}: expected /{message}/ in\n{output[-3000:]}"


def test_bad_impl_spec_is_a_clear_usage_error(pytester):
    result = run_suite(pytester, "tests.bugs:NoSuchThing", KVLEN, "identity")
    assert result.ret != 0
    assert "cannot load the factory" in "\n".join(result.outlines + result.errlines)
