"""Every test that opens vLLM's or FlashMLA's backend carries the marker that selects it
(``pytest_sparse_mla.vllm.MARKED_FIXTURES``): the matrix's sessions narrowed by ``-m vllm`` and
``-m "not flashmla"`` (``scripts/gpu_runner.py --matrix``) would otherwise run a test twice or
leave it out. A test that opens one unmarked fails, whether it names the fixture or asks for it
while it runs."""

from __future__ import annotations

from pytest_sparse_mla.vllm import MARKED_FIXTURES, unmarked_use

# Stand-ins of the plugin's fixtures under the same names: what is checked is the names a test
# used, not what the fixtures open.
CONFTEST = """
import pytest

@pytest.fixture
def vllm_on_stand_in():
    return "vllm"

@pytest.fixture
def flashmla_on_stand_in():
    return "flashmla"
"""

TESTS = """
import pytest

def test_named_unmarked(vllm_on_stand_in):
    pass

@pytest.mark.vllm
def test_named_marked(vllm_on_stand_in):
    pass

@pytest.fixture(params=["port", "flashmla"])
def backend(request):
    return request.param if request.param == "port" else request.getfixturevalue("flashmla_on_stand_in")

def test_asked_for_while_running(backend):
    pass

@pytest.mark.vllm
@pytest.mark.flashmla
def test_flashmla_marked_both(flashmla_on_stand_in):
    pass
"""


def test_a_test_opening_a_backend_it_is_not_marked_for_fails_naming_the_marker(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_marked=TESTS)
    result = pytester.runpytest_inprocess("-p", "pytest_sparse_mla", "-p", "no:cacheprovider", "-p", "no:xdist", "-rE")
    out = "\n".join(result.outlines)
    # the marked ones skip: no --vllm here
    result.assert_outcomes(passed=3, skipped=2, errors=2)
    assert "test_named_unmarked opens what the marker(s) vllm select but is not marked so" in out, out
    assert "test_asked_for_while_running[flashmla] opens what the marker(s) vllm, flashmla select" in out, out
    assert "test_asked_for_while_running[port]" not in out, out


def test_the_marked_fixtures_name_flashmla_under_vllm_too():
    assert MARKED_FIXTURES["flashmla"] < MARKED_FIXTURES["vllm"]
    assert unmarked_use(["flashmla_backend", "tmp_path"], lambda m: m == "vllm") == ["flashmla"]
    assert unmarked_use(["judge"], lambda m: False) == []
