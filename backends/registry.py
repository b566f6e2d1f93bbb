"""The backends by name (``backends.seam`` says what a backend is)."""

from __future__ import annotations

from .seam import Backend

#: The names :func:`open_backend` takes; ``vllm`` and ``flashmla`` need a vLLM release.
BACKEND_NAMES = ("port-fa3", "port-fa2", "vllm", "flashmla")
NEEDS_VLLM = ("vllm", "flashmla")


def open_backend(name: str, vllm_source=None) -> Backend:
    """The backend ``name`` (one of :data:`BACKEND_NAMES`); ``vllm_source``: a
    ``backends.vllm_source.VllmSource`` for those that run a vLLM release's files."""
    if name in NEEDS_VLLM and vllm_source is None:
        raise ValueError(f"backend {name!r} runs a vLLM release's files: name one with --vllm")
    if name in ("port-fa3", "port-fa2"):
        from .port import PortBackend

        return PortBackend(kernel=name.split("-", 1)[1])
    if name == "vllm":
        from .vllm_sm90 import VllmSM90Backend

        return VllmSM90Backend(vllm_source)
    if name == "flashmla":
        from .flashmla import FlashMLABackend

        return FlashMLABackend(vllm_source)
    raise ValueError(f"unknown backend {name!r}; known: {', '.join(BACKEND_NAMES)}")
