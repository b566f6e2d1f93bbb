"""What is installed here: FlashInfer's version, why it cannot be imported, where it keeps its
JIT kernels, its MLA wrapper class. FlashInfer is imported only when asked, so that the registry,
which re-exports these, stays importable without it (and without torch).
"""

from __future__ import annotations

from pathlib import Path

#: The start of the ValueError with which a plan() that checks page counts
#: (``plan_checks_page_counts``) refuses a row whose kv_indptr span is not ceil(kv_len / page_size).
PAGE_COUNT_REFUSAL = "CSR metadata page counts in kv_indptr must equal ceil"


def installed_flashinfer_version() -> str | None:
    """The importable FlashInfer's version, or None when it is not importable."""
    try:
        import flashinfer
    except Exception:  # ImportError and broken installs alike
        return None
    return getattr(flashinfer, "__version__", "unknown")


def flashinfer_import_problem() -> str | None:
    """Why FlashInfer cannot be imported here, or None."""
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:
        return f"flashinfer is not importable: {exc!r}"
    return None


def flashinfer_jit_dir() -> Path:
    """Where the installed FlashInfer keeps the kernels it compiles."""
    from flashinfer.jit import env

    return Path(env.FLASHINFER_JIT_DIR)


def flashinfer_wrapper_class():
    """FlashInfer's ``BatchMLAPagedAttentionWrapper`` (what production plans and runs)."""
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    return BatchMLAPagedAttentionWrapper
