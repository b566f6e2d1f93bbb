"""Where vLLM's code under test comes from: ``--vllm=PATH``.

PATH is one of

- a vLLM wheel file (``vllm-0.33.0-cp38-abi3-....whl``): the files the suite needs
  (:data:`SLICE_FILES`) are extracted once into a cache folder keyed by the wheel's name and
  size, and loaded from there;
- a folder holding the ``vllm`` package (an unpacked wheel, a source checkout, or a slice this
  module wrote), or the ``vllm`` package folder itself;
- ``installed``: the ``vllm`` package the interpreter would import.

A wheel is 240-340 MB and a GPU runner may receive only a few tens of MB, so
``python3 -m backends.vllm_source slice WHEEL -o DIR`` writes the slice: the modules the SM90
backend's code under test is read from (:data:`MODULE_FILES`), those of the FLASHMLA_SPARSE
backend and FlashMLA's Python interface (:data:`FLASHMLA_MODULE_FILES`), FlashMLA's compiled
kernels when the wheel has them (:data:`OPTIONAL_FILES`, left out by ``--modules-only``), and the
wheel's METADATA (the release's version). ``--vllm=DIR`` then loads from the slice.
"""

from __future__ import annotations

import argparse
import email.parser
import hashlib
import importlib.util
import os
import re
import shutil
import sys
import tempfile
import zipfile
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
#: the ``flashmla`` backend (``backends.flashmla``); ``backends/utils.py`` lends the backend its
#: batch-reshaping and prefill-chunking functions (``backends.vllm_shims.release_functions``).
FLASHMLA_MODULE_FILES = (
    "vllm/v1/attention/backends/mla/flashmla_sparse.py",
    "vllm/v1/attention/ops/flashmla.py",
    "vllm/third_party/flashmla/__init__.py",
    "vllm/third_party/flashmla/flash_mla_interface.py",
    "vllm/v1/attention/backends/utils.py",
)
#: Compiled kernels a slice carries when the wheel has them (FlashMLA's sparse kernels).
OPTIONAL_FILES = ("vllm/_flashmla_C.abi3.so", "vllm/_flashmla_extension_C.abi3.so")
SLICE_MODULE_FILES = MODULE_FILES + FLASHMLA_MODULE_FILES
SLICE_FILES = SLICE_MODULE_FILES + OPTIONAL_FILES
#: The command that writes a slice with FlashMLA's kernels (named where they are missing).
SLICE_COMMAND = "python -m backends.vllm_source slice WHEEL -o DIR"
#: The file a slice keeps the release's version in (the wheel's METADATA, unchanged).
SLICE_METADATA = "vllm-slice.METADATA"


class VllmSourceError(ValueError):
    """``--vllm`` names nothing the suite can load vLLM's backend from."""


@dataclass(frozen=True)
class VllmSource:
    root: Path  # the folder holding vllm/
    version: str  # the release, e.g. "0.33.0"
    origin: str  # what the user named, for reports
    installed: bool = False  # the importable vllm (its own imports, no stand-ins)

    def path_of(self, relative: str) -> Path:
        return self.root / relative

    def describe(self) -> str:
        return f"vLLM {self.version} ({self.origin})"


def design_of(source: VllmSource) -> str:
    """``bounded`` (host upper bounds, a kept plan, the device clamp of the schedule: vLLM 0.32
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


def _wheel_metadata_name(names: list[str]) -> str:
    found = [n for n in names if re.fullmatch(r"vllm-[^/]+\.dist-info/METADATA", n)]
    if len(found) != 1:
        raise VllmSourceError(f"the wheel holds {len(found)} vllm-*.dist-info/METADATA files, expected 1")
    return found[0]


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
    missing = [m for m in MODULE_FILES if not (root / m).is_file()]
    if missing:
        raise VllmSourceError(f"{origin}: lacks {missing}; a vLLM release without the SM90 sparse backend")


def write_slice(wheel: str | os.PathLike, out: str | os.PathLike, *, kernels: bool = True) -> list[Path]:
    """Extract :data:`SLICE_FILES` (FlashMLA's modules and kernels where present; without
    ``kernels`` the modules alone) and the METADATA of ``wheel`` into ``out``; return the files
    written."""
    wheel, out = Path(wheel), Path(out)
    try:
        archive = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as exc:
        raise VllmSourceError(f"{wheel}: not a readable wheel ({exc})") from exc
    with archive:
        names = archive.namelist()
        meta = _wheel_metadata_name(names)
        missing = [m for m in MODULE_FILES if m not in names]
        if missing:
            raise VllmSourceError(f"{wheel}: lacks {missing}; a vLLM release without the SM90 sparse backend")
        written = []
        for name in [n for n in (SLICE_FILES if kernels else SLICE_MODULE_FILES) if n in names]:
            target = out / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(name) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            written.append(target)
        (out / SLICE_METADATA).write_bytes(archive.read(meta))
        written.append(out / SLICE_METADATA)
    return written


def _cache_root() -> Path:
    return Path(os.environ.get("SPARSE_MLA_VLLM_CACHE", Path(tempfile.gettempdir()) / "sparse-mla-vllm"))


def _slice_contents_key() -> str:
    """A short digest of :data:`SLICE_FILES`: a cached slice is reused only by code that slices
    the same files."""
    return hashlib.sha1("\n".join(SLICE_FILES).encode()).hexdigest()[:8]


def _slice_of_wheel(wheel: Path) -> Path:
    """The wheel's slice in the cache, written once; workers racing to write it each write a
    folder of their own and the first rename wins."""
    key = f"{wheel.name}-{wheel.stat().st_size}-{_slice_contents_key()}"
    target = _cache_root() / key
    if (target / SLICE_METADATA).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=key + ".", dir=target.parent))
    write_slice(wheel, scratch)
    try:
        scratch.rename(target)
    except OSError:  # another process renamed its copy first
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def resolve(spec: str) -> VllmSource:
    """The :class:`VllmSource` that ``--vllm=spec`` names."""
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
    if path.is_file() and path.suffix == ".whl":
        root = _slice_of_wheel(path.resolve())
        return VllmSource(root, _version_of_folder(root), str(path))
    if path.is_dir():
        root = path.resolve()
        if (root / "v1").is_dir():  # the vllm package folder itself (a slice's has no __init__.py)
            root = root.parent
        _check_modules(root, str(path))
        return VllmSource(root, _version_of_folder(root), str(path))
    raise VllmSourceError(
        f"--vllm={spec!r}: expected a vLLM wheel file, a folder holding the vllm package, or 'installed'"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m backends.vllm_source", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cut = sub.add_parser("slice", help="write the files a GPU runner needs from a vLLM wheel")
    cut.add_argument("wheel")
    cut.add_argument("-o", "--out", required=True)
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
