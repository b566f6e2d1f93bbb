"""Where vLLM's code under test comes from: ``--vllm=PATH``.

PATH is one of

- a vLLM wheel file (``vllm-0.33.0-cp38-abi3-....whl``): the files the suite needs
  (:data:`SLICE_FILES`) are read from it, each checked against the hash the wheel's own
  ``RECORD`` gives it (a file that cannot be read, or reads other than its hash, is an error of
  one line naming it), and kept in a cache folder named by those hashes, so a cached slice
  is reused only for a wheel with the same content;
- a folder holding the ``vllm`` package (an unpacked wheel, a source checkout, or a slice this
  module wrote), or the ``vllm`` package folder itself;
- ``installed``: the ``vllm`` package the interpreter would import.

A wheel is 240-340 MB and a GPU runner may receive only a few tens of MB, so
``python3 -m backends.vllm.source slice WHEEL -o DIR`` writes the slice: the modules the SM90
backend's code under test is read from (:data:`MODULE_FILES`), those of the FLASHMLA_SPARSE
backend and FlashMLA's Python interface (:data:`FLASHMLA_MODULE_FILES`), FlashMLA's compiled
kernels when the wheel has them (:data:`OPTIONAL_FILES`, left out by ``--modules-only``), and the
wheel's METADATA (the release's version). ``--vllm=DIR`` then loads from the slice. A slice is
written into a new or empty folder only, through a folder of its own beside it that is renamed
into place when complete: a failed slice leaves nothing behind, and two releases never mix.
"""

from __future__ import annotations

import argparse
import base64
import csv
import email.parser
import hashlib
import importlib.util
import os
import re
import shutil
import sys
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

#: vLLM's modules the suite executes as they ship (the code under test and the launch
#: machinery of its Triton kernels), relative to the folder that holds ``vllm/``.
MODULE_FILES = (
    "vllm/v1/attention/backends/mla/flashinfer_mla_sparse_sm90.py",
    "vllm/v1/attention/backends/mla/sparse_utils.py",
    "vllm/model_executor/warmup/jit_warmup.py",
    "vllm/model_executor/warmup/jit_warmup_triton_helper.py",
    "vllm/utils/math_utils.py",
)
#: vLLM's FLASHMLA_SPARSE backend and the FlashMLA interface it calls, executed as they ship by
#: the ``flashmla`` backend (``backends.vllm.flashmla``); ``backends/utils.py`` lends the backend its
#: batch-reshaping and prefill-chunking functions (``backends.vllm.shims.release_functions``).
FLASHMLA_MODULE_FILES = (
    "vllm/v1/attention/backends/mla/flashmla_sparse.py",
    "vllm/v1/attention/ops/flashmla.py",
    "vllm/third_party/flashmla/__init__.py",
    "vllm/third_party/flashmla/flash_mla_interface.py",
    "vllm/v1/attention/backends/utils.py",
)
#: vLLM's V2 model runner: the step's counts, ``query_start_loc`` and ``seq_lens`` as the runner
#: builds them, the counts each graph mode hands the attention builders, and the CUDA-graph
#: dispatcher with the graph modes it reads (``backends.vllm.v2_runner``).
V2_RUNNER_FILES = (
    "vllm/v1/worker/gpu/input_batch.py",
    "vllm/v1/worker/gpu/model_runner.py",
    "vllm/v1/worker/gpu/model_states/default.py",
    "vllm/v1/worker/gpu/cudagraph_utils.py",
    "vllm/config/compilation.py",
)
#: Compiled kernels a slice carries when the wheel has them (FlashMLA's sparse kernels).
OPTIONAL_FILES = ("vllm/_flashmla_C.abi3.so", "vllm/_flashmla_extension_C.abi3.so")
SLICE_MODULE_FILES = MODULE_FILES + FLASHMLA_MODULE_FILES + V2_RUNNER_FILES
SLICE_FILES = SLICE_MODULE_FILES + OPTIONAL_FILES
#: The command that writes a slice with FlashMLA's kernels (named where they are missing).
SLICE_COMMAND = "python -m backends.vllm.source slice WHEEL -o DIR"
#: The file a slice keeps the release's version in (the wheel's METADATA, unchanged).
SLICE_METADATA = "vllm-slice.METADATA"
#: The slice's manifest: each file it was written with and the hash the wheel's RECORD gives it
#: (RECORD's own format), so that a slice whose files were edited or removed since says so.
SLICE_MANIFEST = "vllm-slice.RECORD"


#: The supported vLLM x FlashInfer matrix: each FlashInfer release with the vLLM releases judged on
#: it, in the order its runs take them (the project's own backend runs on every release). A pair
#: outside it either cannot work (:func:`incompatibility`) or is not judged; vLLM 0.34.0 pins
#: FlashInfer 0.7.3, which the package index reached lacks, and is judged on 0.7.4.
SUPPORTED_MATRIX: dict[str, tuple[str, ...]] = {
    "0.6.18.post1": ("0.30.0",),
    "0.7.0.post1": ("0.31.0", "0.32.0"),
    "0.7.2.post1": ("0.33.0",),
    "0.7.4": ("0.33.0", "0.34.0"),
}
#: The pair (vLLM, FlashInfer) whose run of the matrix also judges FlashMLA's kernels through the
#: release's FLASHMLA_SPARSE: FlashMLA does not run on FlashInfer, so the matrix judges it once.
FLASHMLA_PAIR = ("0.33.0", "0.7.4")


class VllmSourceError(ValueError):
    """``--vllm`` names nothing the suite can load vLLM's backend from (the message is one line)."""


@dataclass(frozen=True)
class VllmSource:
    root: Path  # the folder holding vllm/
    version: str  # the release, e.g. "0.33.0"
    origin: str  # what the user named, for reports
    installed: bool = False  # the importable vllm (its own imports, no stand-ins)
    #: the files of a slice that differ from the hash its manifest gives them (the release's)
    modified: tuple[str, ...] = ()

    def path_of(self, relative: str) -> Path:
        return self.root / relative

    def describe(self) -> str:
        changed = f", modified: {', '.join(self.modified)} not as the release ships" if self.modified else ""
        return f"vLLM {self.version} ({self.origin}){changed}"


def sm90_module_sha256(source: VllmSource) -> str:
    """The sha256 of the SM90 module ``source`` holds (what a release's facts name it by)."""
    return hashlib.sha256(source.path_of(MODULE_FILES[0]).read_bytes()).hexdigest()


def design_of(source: VllmSource) -> str:
    """``bounded`` (host upper bounds, a kept plan, the device clamp of the schedule: vLLM 0.31
    to 0.34) or ``exact`` (exact host lengths, a plan every step: 0.30), read from the
    backend's code: the bounded design's state has a clamp."""
    text = source.path_of(MODULE_FILES[0]).read_text()
    return "bounded" if "def _clamp_kv_end" in text else "exact"


def incompatibility(design: str, flashinfer_version: tuple[int, int, int]) -> str | None:
    """Why a vLLM design cannot run on a FlashInfer release, or None. The bounded design
    clamps the schedule in the planned backend's int workspace (``wrapper._planned_backend``,
    FlashInfer 0.7.0 and later); the exact design plans the strided layout, whose page counts
    0.7.0 and later refuse at plan."""
    text = ".".join(map(str, flashinfer_version))
    if design == "bounded" and flashinfer_version < (0, 7, 0):
        return (f"vLLM's bounded design writes into wrapper._planned_backend, which FlashInfer {text} lacks "
                "(0.7.0 and later have it)")
    if design == "exact" and flashinfer_version >= (0, 7, 0):
        return (f"vLLM's exact design plans the strided layout, which FlashInfer {text} refuses at plan "
                "(page counts must equal ceil(kv_len / page_size) from 0.7.0)")
    return None


def missing_flashmla_files(source: VllmSource) -> list[str]:
    """The files of :data:`FLASHMLA_MODULE_FILES` and :data:`OPTIONAL_FILES` that ``source``
    lacks (a ``--modules-only`` slice lacks the kernels; a slice written before FlashMLA was
    sliced lacks its modules too)."""
    return [f for f in FLASHMLA_MODULE_FILES + OPTIONAL_FILES if not source.path_of(f).is_file()]


def _version_from_metadata(text: str) -> str:
    version = email.parser.Parser().parsestr(text).get("Version")
    if not version:
        raise VllmSourceError("the METADATA file has no Version field")
    return version.strip()


def _metadata_text(source: VllmSource) -> str | None:
    """The release's METADATA: a slice's copy, a dist-info beside the package, or the installed
    distribution's; None where there is none (a source checkout)."""
    if source.installed:
        from importlib.metadata import PackageNotFoundError, distribution

        try:
            return distribution("vllm").read_text("METADATA")
        except PackageNotFoundError:
            return None
    slice_meta = source.root / SLICE_METADATA
    if slice_meta.is_file():
        return slice_meta.read_text()
    dist = sorted(source.root.glob("vllm-*.dist-info/METADATA"))
    return dist[-1].read_text() if dist else None


def flashinfer_pin(source: VllmSource) -> str | None:
    """The flashinfer-python release the vLLM release pins (``Requires-Dist:
    flashinfer-python==X`` of its METADATA, outside any extra), or None where it names none."""
    text = _metadata_text(source)
    if text is None:
        return None
    for requirement in email.parser.Parser().parsestr(text).get_all("Requires-Dist") or ():
        spec, _, marker = requirement.partition(";")
        match = re.fullmatch(r"\s*flashinfer[-_.]python\s*\(?\s*==\s*([^\s,)]+)\s*\)?\s*", spec, re.IGNORECASE)
        if match and "extra" not in marker:
            return match.group(1)
    return None


def _version_of_folder(root: Path) -> str:
    """The release of the vllm package under ``root``: a slice's METADATA, a dist-info beside
    the package, or ``vllm/_version.py``."""
    slice_meta = root / SLICE_METADATA
    if slice_meta.is_file():
        return _version_from_metadata(slice_meta.read_text())
    dist = sorted(root.glob("vllm-*.dist-info/METADATA"))
    if dist:
        return _version_from_metadata(dist[-1].read_text())
    version_py = root / "vllm" / "_version.py"
    if version_py.is_file():
        match = re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", version_py.read_text())
        if match:
            return match.group(1)
    raise VllmSourceError(f"{root}: cannot tell the vLLM release (no {SLICE_METADATA}, dist-info or vllm/_version.py)")


def _check_modules(root: Path, origin: str) -> None:
    listed = slice_manifest(root)
    damaged = [m for m in (listed or ()) if not (root / m).is_file()]
    if damaged:
        raise VllmSourceError(f"{origin}: damaged slice: {', '.join(Path(m).name for m in damaged)} missing "
                              f"({', '.join(damaged)}; its {SLICE_MANIFEST} lists them): write it again with "
                              f"`{SLICE_COMMAND}`")
    missing = [m for m in MODULE_FILES if not (root / m).is_file()]
    if missing:
        raise VllmSourceError(f"{origin}: lacks {missing}; a vLLM release without the SM90 sparse backend")


def slice_manifest(root: Path) -> dict[str, str] | None:
    """A slice's manifest (path -> ``algorithm=digest``, as the wheel's RECORD gave it), or None
    for a folder without one (a checkout, an unpacked wheel, a slice written before manifests)."""
    try:
        return _record_of((root / SLICE_MANIFEST).read_text())
    except (OSError, UnicodeDecodeError):
        return None


def _record_hash(algorithm: str, data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.new(algorithm, data).digest()).rstrip(b"=").decode()


def modified_files(root: Path) -> tuple[str, ...]:
    """The files of a slice (present ones) whose content is not what its manifest gives them."""
    changed = []
    for name, entry in (slice_manifest(root) or {}).items():
        algorithm, _, expected = entry.partition("=")
        path = root / name
        if path.is_file() and algorithm in hashlib.algorithms_guaranteed and \
                _record_hash(algorithm, path.read_bytes()) != expected:
            changed.append(name)
    return tuple(changed)


# --- reading a wheel against its RECORD ---------------------------------------------------------


@dataclass(frozen=True)
class WheelFiles:
    """What :func:`read_wheel` took from a vLLM wheel, every file checked against its RECORD."""

    version: str
    metadata: bytes  # the dist-info's METADATA, as the wheel holds it
    files: dict[str, bytes]  # path in the wheel -> content
    digest: str  # sha256 over the RECORD hashes of the files and the METADATA: the content's name
    hashes: dict[str, str]  # path in the wheel -> its RECORD entry (``algorithm=digest``)


def _read_member(archive: zipfile.ZipFile, name: str) -> bytes:
    """A member's bytes; a member the archive cannot give back intact (its compressed data or
    its CRC-32 broken) is a :class:`VllmSourceError` naming it."""
    try:
        return archive.read(name)
    except zipfile.BadZipFile as exc:
        why = "fails its CRC-32 check" if "CRC" in str(exc) else f"cannot be read ({exc})"
    except zlib.error:
        why = "cannot be decompressed"
    except (EOFError, OSError, NotImplementedError) as exc:
        why = f"cannot be read ({exc})"
    raise VllmSourceError(f"{name} {why}: the wheel is corrupt (download it again)")


def _record_of(text: str) -> dict[str, str]:
    """RECORD's rows: path -> ``algorithm=digest`` (urlsafe base64, no padding; empty for the
    RECORD itself)."""
    return {row[0]: row[1] for row in csv.reader(text.splitlines()) if len(row) >= 2}


def _checked(archive: zipfile.ZipFile, name: str, record: dict[str, str]) -> bytes:
    """A member's bytes, checked against the hash RECORD gives it."""
    data = _read_member(archive, name)
    algorithm, _, expected = record.get(name, "").partition("=")
    if not expected or algorithm not in hashlib.algorithms_guaranteed:
        raise VllmSourceError(f"its RECORD gives {name} no hash to check it against")
    found = _record_hash(algorithm, data)
    if found != expected:
        raise VllmSourceError(f"{name} does not match the wheel's RECORD ({algorithm} {found}, RECORD: {expected}): "
                              "the wheel was changed after it was built")
    return data


def _what_the_wheel_is(archive: zipfile.ZipFile, names: list[str]) -> str:
    """The distribution a wheel that is not vLLM's holds, as its METADATA names it."""
    others = [n for n in names if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
    if not others:
        return "it holds no *.dist-info/METADATA"
    try:
        meta = email.parser.Parser().parsestr(_read_member(archive, others[0]).decode("utf-8", "replace"))
    except VllmSourceError:
        return f"it holds {others[0]}"
    return f"it is {meta.get('Name', '?')} {meta.get('Version', '?')}"


def read_wheel(wheel: str | os.PathLike, names) -> WheelFiles:
    """The files ``names`` that a vLLM wheel holds (those it lacks are left out; the
    :data:`MODULE_FILES` must be there) and its METADATA, each checked against the wheel's own
    RECORD. Any problem is a :class:`VllmSourceError` of one line, the wheel not named."""
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile:
        raise VllmSourceError("not a wheel: not a zip archive") from None
    except OSError as exc:
        raise VllmSourceError(f"cannot be read ({exc.strerror or exc})") from None
    with archive:
        listed = archive.namelist()
        metas = [n for n in listed if re.fullmatch(r"vllm-[^/]+\.dist-info/METADATA", n)]
        if not metas:
            raise VllmSourceError(f"not a vLLM wheel: {_what_the_wheel_is(archive, listed)}")
        if len(metas) > 1:
            raise VllmSourceError(f"holds {len(metas)} vllm-*.dist-info/METADATA files, expected 1")
        record_name = metas[0].rsplit("/", 1)[0] + "/RECORD"
        if record_name not in listed:
            raise VllmSourceError(f"has no {record_name}: its files cannot be checked")
        record = _record_of(_read_member(archive, record_name).decode("utf-8", "replace"))
        metadata = _checked(archive, metas[0], record)
        version = _version_from_metadata(metadata.decode("utf-8", "replace"))
        present = set(listed)
        missing = [m for m in MODULE_FILES if m not in present]
        if missing:
            raise VllmSourceError(f"vLLM {version} lacks {missing}; a vLLM release without the SM90 sparse backend")
        files = {n: _checked(archive, n, record) for n in names if n in present}
    content = "\n".join(f"{n} {record[n]}" for n in [*sorted(files), metas[0]])
    return WheelFiles(version, metadata, files, hashlib.sha256(content.encode()).hexdigest(),
                      {n: record[n] for n in files})


# --- writing a slice: a new or empty folder, filled through a folder of its own ------------------


def _slice_release(folder: Path) -> str | None:
    try:
        return _version_from_metadata((folder / SLICE_METADATA).read_text())
    except (OSError, UnicodeDecodeError, VllmSourceError):
        return None


def output_problem(out: Path) -> str | None:
    """Why a slice cannot be written to ``out`` (None: a new or empty folder)."""
    if out.is_symlink() and not out.exists():
        return f"{out} is a broken link"
    if out.exists() and not out.is_dir():
        return f"{out} exists and is not a folder"
    if out.is_dir() and any(out.iterdir()):
        release = _slice_release(out)
        held = f"vLLM {release}'s slice" if release else "other files"
        return f"{out} is not empty (it holds {held}): a slice is written into a new or empty folder"
    return None


def _write_files(found: WheelFiles, folder: Path) -> None:
    for name, data in found.files.items():
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    (folder / SLICE_METADATA).write_bytes(found.metadata)
    (folder / SLICE_MANIFEST).write_bytes(_manifest_of(found))


def _manifest_of(found: WheelFiles) -> bytes:
    """The slice's manifest: a RECORD row (path, ``algorithm=digest``) per file written."""
    return "".join(f"{name},{entry}\n" for name, entry in sorted(found.hashes.items())).encode()


def _placed(found: WheelFiles, out: Path) -> bool:
    """Write ``found`` into a folder beside ``out`` and rename it to ``out``: True when it took
    ``out``'s place (a new or empty folder), False when ``out`` was taken meanwhile (by another
    process's rename); nothing of this call is left behind either way."""
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        _write_files(found, scratch)
        scratch.rename(out)  # replaces an empty folder; refused where out holds anything
        return True
    except OSError:
        if out.is_dir() and any(out.iterdir()):
            return False
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _written(found: WheelFiles, folder: Path) -> list[Path]:
    return [folder / n for n in found.files] + [folder / SLICE_METADATA, folder / SLICE_MANIFEST]


def write_slice(wheel: str | os.PathLike, out: str | os.PathLike, *, kernels: bool = True) -> list[Path]:
    """Extract :data:`SLICE_FILES` (FlashMLA's modules and kernels where present; without
    ``kernels`` the modules alone) and the METADATA of ``wheel`` into ``out``, a new or empty
    folder, each file checked against the wheel's RECORD; return the files written. Nothing is
    left in or beside ``out`` when it fails."""
    wheel, out = Path(wheel), Path(out)
    problem = output_problem(out)
    if problem:
        raise VllmSourceError(problem)
    try:
        found = read_wheel(wheel, SLICE_FILES if kernels else SLICE_MODULE_FILES)
    except VllmSourceError as exc:
        raise VllmSourceError(f"{wheel}: {exc}") from None
    try:
        placed = _placed(found, out)
    except OSError as exc:
        raise VllmSourceError(f"{out}: cannot write the slice ({exc.strerror or exc})") from None
    if not placed:
        raise VllmSourceError(output_problem(out) or f"{out} was written meanwhile by another process")
    return _written(found, out)


def _cache_root() -> Path:
    return Path(os.environ.get("SPARSE_MLA_VLLM_CACHE", Path(tempfile.gettempdir()) / "sparse-mla-vllm"))


def _slice_contents_key() -> str:
    """A short digest of :data:`SLICE_FILES`: a cached slice is reused only by code that slices
    the same files."""
    return hashlib.sha1("\n".join((*SLICE_FILES, SLICE_METADATA, SLICE_MANIFEST)).encode()).hexdigest()[:8]


def _slice_of_wheel(wheel: Path) -> Path:
    """The wheel's slice in the cache, named by the release and the RECORD hashes of its files
    (so a wheel of other content never meets this one's slice). The wheel's files are read and
    checked on every call (a corrupt wheel is refused whatever the cache holds), and a cached
    slice must hold them byte for byte. Workers racing to write it each write a folder of their
    own and the first rename wins."""
    found = read_wheel(wheel, SLICE_FILES)
    target = _cache_root() / f"vllm-{found.version}-{found.digest[:16]}-{_slice_contents_key()}"
    if not (target / SLICE_METADATA).is_file():
        try:
            _placed(found, target)
        except OSError as exc:
            raise VllmSourceError(f"cannot write the slice into the cache {target} ({exc.strerror or exc})") from None
    own = {SLICE_METADATA: found.metadata, SLICE_MANIFEST: _manifest_of(found)}
    for path in _written(found, target):
        expected = own[path.name] if path.name in own else found.files[path.relative_to(target).as_posix()]
        if not path.is_file() or path.read_bytes() != expected:
            raise VllmSourceError(f"the cached slice {target} differs from the wheel at {path.relative_to(target)} "
                                  f"(changed since it was written): remove {target}")
    return target


#: What ``--vllm`` takes, for the lines that say what it was given instead.
EXPECTED = "a vLLM wheel file, a folder holding the vllm package, or 'installed'"


def resolve(spec: str) -> VllmSource:
    """The :class:`VllmSource` that ``--vllm=spec`` names; anything else is a
    :class:`VllmSourceError` of one line saying what ``spec`` is."""
    if not spec.strip():
        raise VllmSourceError(f"--vllm is empty: give {EXPECTED}")
    if spec == "installed":
        found = importlib.util.find_spec("vllm")
        if found is None or not found.submodule_search_locations:
            raise VllmSourceError("--vllm=installed: no vllm package is importable here")
        root = Path(list(found.submodule_search_locations)[0]).parent
        _check_modules(root, "the installed vllm")
        from importlib.metadata import PackageNotFoundError, version

        try:
            release = version("vllm")
        except PackageNotFoundError:
            release = _version_of_folder(root)
        return VllmSource(root, release, "installed", installed=True)
    path = Path(spec).expanduser()
    where = f"--vllm={spec}"
    if not path.exists():
        raise VllmSourceError(f"{where}: no such file or folder (expected {EXPECTED})")
    if path.is_file():
        if path.suffix != ".whl":
            raise VllmSourceError(f"{where}: a file that is not a wheel (*.whl) (expected {EXPECTED})")
        try:
            root = _slice_of_wheel(path.resolve())
        except VllmSourceError as exc:
            raise VllmSourceError(f"{where}: {exc}") from None
        return VllmSource(root, _version_of_folder(root), str(path))
    if not path.is_dir():
        raise VllmSourceError(f"{where}: neither a file nor a folder (expected {EXPECTED})")
    root = path.resolve()
    if (root / "v1").is_dir():  # the vllm package folder itself (a slice's has no __init__.py)
        root = root.parent
    if not (root / "vllm").is_dir():
        raise VllmSourceError(f"{where}: a folder without a vllm package (no vllm/ in it; expected {EXPECTED})")
    _check_modules(root, where)
    return VllmSource(root, _version_of_folder(root), str(path), modified=modified_files(root))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m backends.vllm.source", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cut = sub.add_parser("slice", help="write the files a GPU runner needs from a vLLM wheel")
    cut.add_argument("wheel")
    cut.add_argument("-o", "--out", required=True, help="a new or empty folder")
    cut.add_argument("--modules-only", action="store_true",
                     help="leave out FlashMLA's compiled kernels (4 MB): the SM90 FlashInfer backend alone "
                          "(the flashmla backend then refuses to open, naming them)")
    args = parser.parse_args(argv)
    try:
        written = write_slice(args.wheel, args.out, kernels=not args.modules_only)
    except VllmSourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    total = sum(p.stat().st_size for p in written)
    version = _version_of_folder(Path(args.out))
    print(f"vLLM {version}: {len(written)} files, {total / 2**20:.1f} MiB in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
