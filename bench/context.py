"""What every benchmark section shares: the run's context (implementation, device, timer,
selection, deadline, results), guarded units that record a failure and go on, and logging."""

from __future__ import annotations

import gc
import time
import traceback
from dataclasses import dataclass, field

import torch

from harness.timing import Timer

from .selection import Selection


def log(text: str) -> None:
    print(f"[bench] {text}", flush=True)


def error_text(exc: BaseException, limit: int = 600) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass
class Context:
    impl: object
    device: torch.device
    timer: Timer
    sel: Selection
    deadline: float  # time.monotonic() after which no new unit starts
    l2_bytes: int
    ceilings: dict = field(default_factory=dict)
    sections: frozenset = frozenset({"ceilings", "plan", "kernel", "graph", "reference"})
    flashmla: object | None = None  # FlashMLA's backend (``--vllm``) where it opened
    results: dict = field(
        default_factory=lambda: {"kernel": [], "flashmla": [], "plan": [], "graph": [], "reference": [], "skipped": []}
    )

    def expired(self) -> bool:
        return time.monotonic() > self.deadline

    def skip(self, what: dict, reason: str) -> None:
        self.results["skipped"].append({**what, "reason": reason})

    def guarded(self, section: str, record: dict, fn, *, append: bool = True) -> dict | None:
        """Run ``fn()`` into ``record`` (appended to ``section``); a failure is recorded.
        None when the time budget is spent (the unit is listed as skipped)."""
        if self.expired():
            self.skip({"section": section, **record}, "time budget of the run spent")
            return None
        try:
            record.update(fn())
        except Exception as exc:  # one failing unit must not stop the others
            record["error"] = error_text(exc)
            record["traceback"] = traceback.format_exc(limit=6)[-1500:]
        if append:
            self.results[section].append(record)
        return record

    @property
    def matmul_rate(self) -> float | None:
        return self.ceilings.get("matmul", {}).get("flops_per_s")

    @property
    def copy_rate(self) -> float | None:
        return self.ceilings.get("copy", {}).get("bytes_per_s")


def gpu_unavailable_reason() -> str | None:
    from harness.availability import sm90_flashinfer_unavailable_reason

    return sm90_flashinfer_unavailable_reason()
