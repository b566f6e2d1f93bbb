"""compute-sanitizer memcheck and initcheck on one small case of each kernel variant
(docs/edges.md#sanitizer), through ``scripts/sanitize.py``. Skipped, with the reason, where
compute-sanitizer is not installed, and, because its runs take minutes, unless
``SPARSE_MLA_SANITIZE=1`` asks for them (``python3 -m scripts.sanitize`` is the same check as a
script)."""

from __future__ import annotations

import os

import pytest

from scripts import sanitize

pytestmark = [pytest.mark.gpu, pytest.mark.edge("sanitizer")]


def test_memcheck_and_initcheck_find_no_error_in_any_variant(record_property):
    path = sanitize.find_sanitizer()
    if path is None:
        pytest.skip(sanitize.not_found_reason())
    if os.environ.get("SPARSE_MLA_SANITIZE") != "1":
        pytest.skip(f"compute-sanitizer found at {path}; its runs take minutes, so they run only with "
                    "SPARSE_MLA_SANITIZE=1 (or python3 -m scripts.sanitize)")
    results = sanitize.run_all(path)
    record_property("sanitizer", results)
    text = sanitize.report_markdown(path, results)
    print(text)
    problems = [p for r in results for p in sanitize.run_problems(r)]
    assert not problems, text + "\n" + "\n".join(problems)
