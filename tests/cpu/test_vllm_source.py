"""``--vllm=PATH`` as a user gives it: a wheel, the same wheel unpacked into a folder, a slice
written from it, or a path that names none of these. Each names the same release and the same
files of its backend; a wrong path is one line saying what was expected. Runs with ``--vllm``
naming a wheel (CI names the 0.33.0 wheel).

A wheel's files are checked against its own RECORD: the bad wheels here are small copies of
the wheel under test (its modules, METADATA and RECORD only), one byte of the backend module
flipped in the compressed data (its CRC-32 then fails) or changed before zipping (a valid zip
whose file no longer matches RECORD). Each is one line naming the file, with a cold cache and
with a warm one; ``slice`` leaves nothing behind when it fails and writes only into a new or
empty folder."""

from __future__ import annotations

import base64
import email.parser
import hashlib
import re
import struct
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import pytest

from backends.vllm.source import (
    MODULE_FILES,
    SLICE_METADATA,
    SLICE_MODULE_FILES,
    VllmSourceError,
    design_of,
    flashinfer_pin,
    resolve,
    write_slice,
)
from pytest_sparse_mla.vllm import NO_VLLM, VLLM_SOURCE
from tests.support.child_runs import assert_one_usage_error, usage_run

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
BACKEND_MODULE = MODULE_FILES[0]


@pytest.fixture(scope="module")
def wheel(pytestconfig):
    source = pytestconfig.stash.get(VLLM_SOURCE, None)
    if source is None:
        pytest.skip(NO_VLLM)
    if not source.origin.endswith(".whl"):
        pytest.skip(f"--vllm names {source.origin}, not a wheel: these tests unpack and slice a wheel")
    return str(Path(pytestconfig.invocation_params.dir, source.origin).resolve())  # pytester runs elsewhere


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A slice cache of the test's own (``SPARSE_MLA_VLLM_CACHE``), cold."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("SPARSE_MLA_VLLM_CACHE", str(folder))
    return folder


def unpack(wheel: str, folder) -> None:
    """The wheel unpacked as pip would lay it out: the ``vllm`` package and its dist-info."""
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist()
                 if n in MODULE_FILES or (".dist-info/" in n and n.endswith("METADATA"))]
        archive.extractall(folder, members=names)


def small_wheel(wheel: str, folder: Path, *, changed: bytes | None = None, recorded: bool = False) -> Path:
    """A copy of ``wheel`` under the same file name in ``folder`` holding only the slice's
    modules and the dist-info's METADATA and RECORD (as the wheel has them). ``changed``: the
    backend module's content instead of its own, RECORD left as it was (a valid zip whose RECORD
    no longer fits) or, with ``recorded``, its RECORD row made to fit (a wheel of other content)."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / Path(wheel).name
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as copy:
        for name in source.namelist():
            if name in SLICE_MODULE_FILES or re.fullmatch(r"vllm-[^/]+\.dist-info/(METADATA|RECORD)", name):
                data = source.read(name)
                if changed is not None and name == BACKEND_MODULE:
                    data = changed
                if changed is not None and recorded and name.endswith("/RECORD"):
                    row = f"{BACKEND_MODULE},sha256={record_hash(changed)},{len(changed)}"
                    data = re.sub(rf"^{re.escape(BACKEND_MODULE)},.*$", row, data.decode(), flags=re.M).encode()
                copy.writestr(name, data)
    return target


def record_hash(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def flip_byte(path: Path, member: str) -> None:
    """Flip every bit of the byte in the middle of ``member``'s compressed data (the archive's
    size and directory unchanged)."""
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo(member)
    data = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    data[info.header_offset + 30 + name_len + extra_len + info.compress_size // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def slice_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "backends.vllm.source", "slice", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def tree(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


def corrupt_line(wheel: Path) -> str:
    """What a wheel with a flipped byte in the backend module's compressed data is refused with:
    the byte breaks either the deflate stream or, where it still decompresses, the CRC-32."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            archive.read(BACKEND_MODULE)
    except zlib.error:
        why = "cannot be decompressed"
    except zipfile.BadZipFile:
        why = "fails its CRC-32 check"
    else:
        raise AssertionError(f"{wheel}: the flipped byte left {BACKEND_MODULE} readable")
    return f"{BACKEND_MODULE} {why}: the wheel is corrupt (download it again)"


# --- a wheel, unpacked, sliced --------------------------------------------------------------------


def test_a_wheel_and_the_same_wheel_unpacked_name_one_release_and_one_backend(wheel, tmp_path):
    from_wheel = resolve(wheel)
    unpack(wheel, tmp_path)
    from_folder = resolve(str(tmp_path))
    assert from_folder.version == from_wheel.version and design_of(from_folder) == design_of(from_wheel)
    for relative in MODULE_FILES:
        assert from_folder.path_of(relative).read_bytes() == from_wheel.path_of(relative).read_bytes(), relative
    assert resolve(str(tmp_path / "vllm")).root == from_folder.root, "the vllm package folder itself names it too"
    assert flashinfer_pin(from_folder) == flashinfer_pin(from_wheel)


def test_a_slice_names_the_release_it_was_written_from(wheel, tmp_path):
    write_slice(wheel, tmp_path / "slice", kernels=False)
    sliced, original = resolve(str(tmp_path / "slice")), resolve(wheel)
    assert (sliced.version, design_of(sliced)) == (original.version, design_of(original))
    assert all(sliced.path_of(f).read_bytes() == original.path_of(f).read_bytes() for f in MODULE_FILES)
    assert flashinfer_pin(sliced) == flashinfer_pin(original)


def test_a_slice_whose_files_were_edited_is_named_as_modified_with_the_files(wheel, tmp_path):
    write_slice(wheel, tmp_path / "slice", kernels=False)
    assert resolve(str(tmp_path / "slice")).modified == ()
    module = tmp_path / "slice" / BACKEND_MODULE
    module.write_text(module.read_text() + "\n# edited\n")
    source = resolve(str(tmp_path / "slice"))
    assert source.modified == (BACKEND_MODULE,)
    assert source.describe() == (f"vLLM {source.version} ({tmp_path / 'slice'}), modified: {BACKEND_MODULE} not as "
                                 "the release ships")


def test_a_slice_missing_a_file_its_manifest_lists_is_a_damaged_slice(wheel, tmp_path):
    write_slice(wheel, tmp_path / "slice", kernels=False)
    (tmp_path / "slice" / "vllm/v1/attention/backends/mla/sparse_utils.py").unlink()
    with pytest.raises(VllmSourceError, match=r"damaged slice: sparse_utils\.py missing .*write it again"):
        resolve(str(tmp_path / "slice"))


def test_the_flashinfer_pin_is_the_wheels_requirement(wheel):
    """``flashinfer_pin`` against the wheel's METADATA read here: its ``flashinfer-python==``
    requirement outside any extra."""
    with zipfile.ZipFile(wheel) as archive:
        meta = next(n for n in archive.namelist() if re.fullmatch(r"vllm-[^/]+\.dist-info/METADATA", n))
        fields = email.parser.Parser().parsestr(archive.read(meta).decode())
    pinned = [r.split("==")[1].strip() for r in fields.get_all("Requires-Dist") or ()
              if r.startswith("flashinfer-python==") and "extra" not in r]
    assert flashinfer_pin(resolve(wheel)) == (pinned[0] if pinned else None)


def test_a_slice_into_an_empty_folder_takes_its_place(wheel, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    run = slice_cli(wheel, "-o", str(out), "--modules-only")
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert (out / SLICE_METADATA).is_file() and all((out / f).is_file() for f in MODULE_FILES)
    assert tree(tmp_path)[0] == "empty", tree(tmp_path)  # nothing beside it


# --- bad wheels: one line naming the file, cold cache and warm -------------------------------------


def test_a_corrupt_wheel_is_one_line_naming_the_file_with_a_cold_cache(wheel, tmp_path, cache, pytester):
    corrupt = small_wheel(wheel, tmp_path / "wheels")
    flip_byte(corrupt, BACKEND_MODULE)
    with pytest.raises(VllmSourceError) as excinfo:
        resolve(str(corrupt))
    assert str(excinfo.value) == f"--vllm={corrupt}: {corrupt_line(corrupt)}"
    result, out = usage_run(pytester, f"--vllm={corrupt}")
    assert_one_usage_error(result, out, f"--vllm={corrupt}: {corrupt_line(corrupt)}")
    assert not cache.exists() or tree(cache) == [], "nothing of the corrupt wheel is cached"


def test_a_corrupt_wheel_is_refused_with_a_warm_cache_too(wheel, tmp_path, cache, pytester):
    """The same name and size as a wheel whose slice is cached: the wheel is read and checked
    again, and the cached slice (named by content) is not taken for it."""
    good = small_wheel(wheel, tmp_path / "wheels")
    cached = resolve(str(good))
    size = good.stat().st_size
    flip_byte(good, BACKEND_MODULE)
    assert good.stat().st_size == size
    result, out = usage_run(pytester, f"--vllm={good}")
    assert_one_usage_error(result, out, f"--vllm={good}: {corrupt_line(good)}")
    assert [p.name for p in cache.iterdir()] == [cached.root.name], "the good slice is all the cache holds"


def test_a_wheel_changed_after_it_was_built_does_not_match_its_record(wheel, tmp_path, cache, pytester):
    """A valid zip whose backend module differs (one byte) from what its RECORD says: refused
    whether or not the original wheel's slice is cached."""
    with zipfile.ZipFile(wheel) as archive:
        original = archive.read(BACKEND_MODULE)
        record = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/RECORD"))).decode()
    changed = original.replace(b"kv_lens", b"kv_lenz", 1)
    assert changed != original
    resolve(str(small_wheel(wheel, tmp_path / "good")))  # a warm cache of the unchanged files
    altered = small_wheel(wheel, tmp_path / "altered", changed=changed)
    expected = re.search(rf"^{re.escape(BACKEND_MODULE)},sha256=([^,]+),", record, re.M).group(1)
    found = record_hash(changed)
    line = (f"--vllm={altered}: {BACKEND_MODULE} does not match the wheel's RECORD (sha256 {found}, RECORD: "
            f"{expected}): the wheel was changed after it was built")
    result, out = usage_run(pytester, f"--vllm={altered}")
    assert_one_usage_error(result, out, line)


# --- slice: one line, nothing partial, a new or empty folder -------------------------------------


def test_a_slice_of_a_corrupt_wheel_is_one_line_and_leaves_nothing(wheel, tmp_path):
    corrupt = small_wheel(wheel, tmp_path / "wheels")
    flip_byte(corrupt, BACKEND_MODULE)
    out = tmp_path / "slices" / "vllm"
    run = slice_cli(str(corrupt), "-o", str(out))
    assert run.returncode == 2 and run.stdout == "", run.stdout + run.stderr
    assert run.stderr.splitlines() == [f"error: {corrupt}: {corrupt_line(corrupt)}"], run.stderr
    assert not (tmp_path / "slices").exists() or tree(tmp_path / "slices") == [], tree(tmp_path / "slices")


def test_a_slice_into_a_file_is_one_line_and_leaves_the_file(wheel, tmp_path):
    target = tmp_path / "a-file"
    target.write_text("kept")
    run = slice_cli(wheel, "-o", str(target))
    assert run.returncode == 2 and run.stdout == "", run.stdout + run.stderr
    assert run.stderr.splitlines() == [f"error: {target} exists and is not a folder"], run.stderr
    assert target.read_text() == "kept" and tree(tmp_path) == ["a-file"]


def test_a_slice_into_a_folder_holding_a_slice_is_refused(wheel, tmp_path):
    """A --modules-only slice over a full one would leave the other's FlashMLA kernels beside
    this release's modules: refused, the folder as it was."""
    out = tmp_path / "slice"
    write_slice(wheel, out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    version = resolve(wheel).version
    run = slice_cli(wheel, "-o", str(out), "--modules-only")
    assert run.returncode == 2 and run.stdout == "", run.stdout + run.stderr
    assert run.stderr.splitlines() == [
        f"error: {out} is not empty (it holds vLLM {version}'s slice): a slice is written into a new or empty folder"]
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["slice"], "nothing left beside it"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("")
    run = slice_cli(wheel, "-o", str(tmp_path / "other"))
    assert run.stderr.splitlines() == [f"error: {tmp_path / 'other'} is not empty (it holds other files): a slice is "
                                       "written into a new or empty folder"], run.stderr


@pytest.mark.parametrize("spec", ["no/such/path", "README.md"])
def test_a_path_that_names_no_vllm_is_one_line_saying_what_was_expected(spec):
    with pytest.raises(VllmSourceError, match="expected a vLLM wheel file, a folder holding the vllm package"):
        resolve(spec)


def test_the_cache_is_named_by_content(wheel, tmp_path, cache):
    """The same content under two paths reuses one slice; a wheel of the same name whose module
    (and its RECORD row) differ gets a slice of its own, holding its own module."""
    first = resolve(str(small_wheel(wheel, tmp_path / "a")))
    assert resolve(str(small_wheel(wheel, tmp_path / "b"))).root == first.root
    changed = b"# another release's module\n" + first.path_of(BACKEND_MODULE).read_bytes()
    other = resolve(str(small_wheel(wheel, tmp_path / "c", changed=changed, recorded=True)))
    assert other.root != first.root and other.path_of(BACKEND_MODULE).read_bytes() == changed
    assert sorted(p.name for p in cache.iterdir()) == sorted([first.root.name, other.root.name])
