"""The backends by name, or a user's own as ``module:factory`` (``backends.seam`` says what a
backend is).

A spec is one of:

- ``port-fa3`` / ``port-fa2``: the project's port (``backends.flashinfer.port``) on FlashInfer's fa3 or fa2
  kernel, its host stages those of the implementation under test (``--impl``) where one is given;
- ``vllm`` / ``vllm-RELEASE``: a vLLM release's own SM90 backend (``backends.vllm.sm90``), from the
  release ``--vllm`` names (``vllm-RELEASE`` must name the same release);
- ``flashmla`` / ``flashmla-RELEASE``: FlashMLA's sparse kernels as that release's
  FLASHMLA_SPARSE calls them (``backends.vllm.flashmla``);
- ``module:factory``: ``factory()`` from ``module``, returning an object with the members of
  :class:`backends.seam.Backend`.

A spec that cannot be opened is one :class:`BackendError` line. Names are checked without
importing torch (:func:`name_problem`), so a run's controller can check them before it starts
its workers; implementations are imported only when a backend is opened.

The registry is the plugin's one door to backends/: besides opening backends it answers what a
run asks of the vendor packages behind them (the vLLM release ``--vllm`` names and what it is
judged as, whether FlashMLA can be tested from it, the installed FlashInfer and its features),
so that the packages can change without the plugin changing.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .flashinfer.installed import PAGE_COUNT_REFUSAL as PAGE_COUNT_REFUSAL
from .flashinfer.installed import flashinfer_import_problem as flashinfer_import_problem
from .flashinfer.installed import flashinfer_jit_dir as flashinfer_jit_dir
from .flashinfer.installed import flashinfer_wrapper_class as flashinfer_wrapper_class
from .flashinfer.installed import installed_flashinfer_version as installed_flashinfer_version
from .vllm.facts import facts_for
from .vllm.source import SLICE_COMMAND, design_of, missing_flashmla_files, resolve
from .vllm.source import VllmSourceError as VllmSourceError
from .vllm.source import sm90_module_sha256 as sm90_module_sha256

if TYPE_CHECKING:
    from .seam import Backend


@dataclass(frozen=True)
class BackendFamily:
    """How a family of backends is opened: ``module.cls``, called with the FlashInfer ``kernel``
    and the host stages under test (the port), or with the vLLM release ``--vllm`` names
    (``needs_vllm``: the backends that run a release's files)."""

    module: str
    cls: str
    kernel: str | None = None
    needs_vllm: bool = False
    #: the module of the family's release facts (``digest_problem``), where it keeps any
    facts: str | None = None

    def open(self, vllm_source, impl) -> Backend:
        opener = getattr(importlib.import_module(self.module), self.cls)
        return opener(vllm_source) if self.needs_vllm else opener(kernel=self.kernel, impl=impl)


#: Every backend family by name (``vllm`` and ``flashmla`` also named ``NAME-RELEASE``).
FAMILIES = {
    "port-fa3": BackendFamily("backends.flashinfer.port", "PortBackend", kernel="fa3"),
    "port-fa2": BackendFamily("backends.flashinfer.port", "PortBackend", kernel="fa2"),
    "vllm": BackendFamily("backends.vllm.sm90", "VllmSM90Backend", needs_vllm=True, facts="backends.vllm.facts"),
    "flashmla": BackendFamily("backends.vllm.flashmla", "FlashMLABackend", needs_vllm=True),
}
#: The port's names and the FlashInfer kernel each runs on.
PORT_KERNELS = {name: family.kernel for name, family in FAMILIES.items() if not family.needs_vllm}
#: The backends that run a vLLM release's files (named with ``--vllm``).
NEEDS_VLLM = tuple(name for name, family in FAMILIES.items() if family.needs_vllm)
#: The names :func:`open_backend` takes (``vllm`` and ``flashmla`` also as ``NAME-RELEASE``).
BACKEND_NAMES = (*PORT_KERNELS, *NEEDS_VLLM)
KNOWN = "port-fa3, port-fa2, vllm[-RELEASE], flashmla[-RELEASE] or module:factory"


class BackendError(ValueError):
    """A backend spec that cannot be opened; the message is the one line the user sees."""


def is_factory_spec(spec: str) -> bool:
    """Whether ``spec`` names a user's factory (``module:factory``) rather than a backend."""
    return ":" in spec


def family_and_release(name: str) -> tuple[str, str | None]:
    """``("vllm", "0.33.0")`` for ``vllm-0.33.0``, ``("vllm", None)`` for ``vllm``; a port's name
    is its own family, with no release."""
    if name in PORT_KERNELS:
        return name, None
    family, sep, release = name.partition("-")
    return family, release if sep else None


def name_problem(name: str, vllm_release: str | None) -> str | None:
    """Why the backend ``name`` cannot be opened in a run whose ``--vllm`` names ``vllm_release``
    (None: no ``--vllm``), or None."""
    family, release = family_and_release(name)
    if family in PORT_KERNELS:
        return None
    if family not in NEEDS_VLLM or release == "":
        return f"unknown backend {name!r}; known: {KNOWN}"
    if vllm_release is None:
        return f"backend {name!r} runs a vLLM release's files: name one with --vllm"
    if release is not None and release != vllm_release:
        return f"backend {name!r} names vLLM {release}, but --vllm gives vLLM {vllm_release}"
    return None


def missing_backend_members(obj) -> list[str]:
    """The members of :class:`backends.seam.Backend` that ``obj`` lacks (a method must be callable)."""
    from .seam import Backend

    attributes = list(Backend.__annotations__)
    methods = [name for name, value in vars(Backend).items() if callable(value) and not name.startswith("_")]
    return ([name for name in attributes if not hasattr(obj, name)]
            + [name for name in methods if not callable(getattr(obj, name, None))])


def backend_from_factory(spec: str) -> Backend:
    """``factory()`` of ``module:factory``, checked against the seam: a spec without a module or a
    factory, a factory that cannot be loaded or raises, and an object without the seam's members
    are each one :class:`BackendError` naming the spec."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise BackendError(f"--backend expects a name or 'module:factory', got {spec!r}")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise BackendError(f"--backend {spec!r}: cannot load the factory: {exc}") from None
    try:
        backend = factory()
    except Exception as exc:  # whatever the user's factory raises is named
        raise BackendError(f"--backend {spec!r}: the factory raised {type(exc).__name__}: {exc}") from None
    missing = missing_backend_members(backend)
    if missing:
        raise BackendError(f"--backend {spec!r}: what the factory returned ({type(backend).__name__}) lacks "
                           f"{', '.join(missing)} (see backends.seam.Backend)")
    return backend


def release_digest_problem(name: str, release: str | None, digest: str | None) -> str | None:
    """Where what a case records of the backend ``name`` (its ``release`` and the sha256 of the
    module it ran) contradicts the facts its family keeps of its releases; None where they agree
    or the family keeps none."""
    family = FAMILIES.get(family_and_release(name)[0])
    if family is None or family.facts is None:
        return None
    return importlib.import_module(family.facts).digest_problem(release, digest)


def open_backend(spec: str, vllm_source=None, *, impl=None) -> Backend:
    """The backend ``spec`` names (module docstring). ``vllm_source``: a
    ``backends.vllm.source.VllmSource`` for those that run a vLLM release's files; ``impl``: the
    host stages the port runs (an object with ``fast.impl.SparseMLAImpl``'s methods; None: the
    project's own)."""
    if is_factory_spec(spec):
        return backend_from_factory(spec)
    problem = name_problem(spec, vllm_source.version if vllm_source is not None else None)
    if problem:
        raise BackendError(problem)
    family, _ = family_and_release(spec)
    return FAMILIES[family].open(vllm_source, impl)


def resolve_vllm_source(spec: str):
    """The vLLM release ``--vllm`` names (a wheel, a slice folder or ``installed``), as a
    ``backends.vllm.source.VllmSource``; :class:`VllmSourceError` where it cannot be read as one."""
    return resolve(spec)


def flashmla_absence(source) -> str | None:
    """Why FlashMLA's backend cannot be tested from the vLLM release ``source`` (None: its modules
    and kernels are there)."""
    missing = missing_flashmla_files(source)
    if not missing:
        return None
    return (f"FlashMLA not under test: {source.describe()} lacks {', '.join(missing)} (a slice written with "
            f"--modules-only; write it with `{SLICE_COMMAND}`)")


def vllm_judged_as(source) -> str:
    """What the vLLM release ``source`` is judged as: the facts kept of its version and design
    (``backends.vllm.facts``), in one line."""
    return facts_for(source.version, design_of(source)).summary()


def vllm_v2_runner(source):
    """The vLLM release ``source``'s V2 model runner, building a step's attention metadata from the
    release's own files (``backends.vllm.v2_runner.load_runner``); imports torch and Triton."""
    from .vllm.v2_runner import load_runner

    return load_runner(source)


def flashinfer_features(device=None):
    """The installed FlashInfer's features (``backends.flashinfer.compat.Features``), probed on
    ``device`` where it is a CUDA device; imports torch and FlashInfer."""
    from .flashinfer.compat import detect_features

    return detect_features(device)
