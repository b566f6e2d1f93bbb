"""``--vllm=PATH`` as a user gives it: a wheel, the same wheel unpacked into a folder, a slice
written from it, or a path that names none of these. Each names the same release and the same
files of its backend; a wrong path is one line saying what was expected. Runs with ``--vllm``
naming a wheel (CI names the 0.33.0 wheel)."""

from __future__ import annotations

import zipfile

import pytest

from backends.vllm_source import MODULE_FILES, VllmSourceError, design_of, resolve, write_slice
from pytest_sparse_mla.vllm import NO_VLLM, VLLM_SOURCE

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def wheel(pytestconfig):
    source = pytestconfig.stash.get(VLLM_SOURCE, None)
    if source is None:
        pytest.skip(NO_VLLM)
    if not source.origin.endswith(".whl"):
        pytest.skip(f"--vllm names {source.origin}, not a wheel: these tests unpack and slice a wheel")
    return source.origin


def unpack(wheel: str, folder) -> None:
    """The wheel unpacked as pip would lay it out: the ``vllm`` package and its dist-info."""
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist()
                 if n in MODULE_FILES or (".dist-info/" in n and n.endswith("METADATA"))]
        archive.extractall(folder, members=names)


def test_a_wheel_and_the_same_wheel_unpacked_name_one_release_and_one_backend(wheel, tmp_path):
    from_wheel = resolve(wheel)
    unpack(wheel, tmp_path)
    from_folder = resolve(str(tmp_path))
    assert from_folder.version == from_wheel.version and design_of(from_folder) == design_of(from_wheel)
    for relative in MODULE_FILES:
        assert from_folder.path_of(relative).read_bytes() == from_wheel.path_of(relative).read_bytes(), relative
    assert resolve(str(tmp_path / "vllm")).root == from_folder.root, "the vllm package folder itself names it too"


def test_a_slice_names_the_release_it_was_written_from(wheel, tmp_path):
    write_slice(wheel, tmp_path / "slice", kernels=False)
    sliced, original = resolve(str(tmp_path / "slice")), resolve(wheel)
    assert (sliced.version, design_of(sliced)) == (original.version, design_of(original))
    assert all(sliced.path_of(f).read_bytes() == original.path_of(f).read_bytes() for f in MODULE_FILES)


@pytest.mark.parametrize("spec", ["no/such/path", "README.md"])
def test_a_path_that_names_no_vllm_is_one_line_saying_what_was_expected(spec):
    with pytest.raises(VllmSourceError, match="expected a vLLM wheel file, a folder holding the vllm package"):
        resolve(spec)
