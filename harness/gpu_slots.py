"""Machine-wide slots for the GPU cases that take a large share of a GPU's memory (the ``gpu_large``
cases: the scale batches, the plan-limit searches, the large batches), so that the processes
of every session on one machine together run only as many of them at once as the GPU holds.

Several sessions share one GPU when a runner runs them at once (``scripts/gpu_runner.py --jobs``),
each with its own xdist workers; without a bound across them, three sessions' large cases on an
80 GB H100 ran out of GPU memory together, and took smaller cases of other workers with them
(every one of those passed alone). A slot is an exclusive ``flock`` on one of ``slots`` files
per GPU in a folder every process on the machine sees; the lock goes with the process that
held it, also when it dies."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from pathlib import Path

#: The GPU memory one large case may take with its children: the largest allocations seen
#: failing on an H100 were 8 to 9.2 GiB, next to 14.8 GiB held by one case's process.
LARGE_CASE_GIB = 40
#: The folder of the slot files (every process of the machine).
SLOT_FOLDER = Path(tempfile.gettempdir()) / "sparse-mla-gpu-slots"
#: Overrides the number of slots per GPU.
SLOTS_ENV = "SPARSE_MLA_GPU_LARGE_AT_ONCE"


def slots_for(total_bytes: int, override: str | None = None) -> int:
    """How many large cases one GPU of ``total_bytes`` runs at once (at least one)."""
    if override:
        return max(1, int(override))
    return max(1, total_bytes // (LARGE_CASE_GIB * 2**30))


@contextlib.contextmanager
def gpu_slot(gpu_key: str, slots: int, folder: Path = SLOT_FOLDER, poll_s: float = 0.05):
    """Hold one of the ``slots`` slots of the GPU ``gpu_key`` while the block runs, waiting for
    one to be free; yields the seconds waited."""
    folder.mkdir(parents=True, exist_ok=True)
    key = "".join(c if c.isalnum() or c in "-_" else "_" for c in gpu_key)
    handles = [open(folder / f"{key}-{i}.lock", "a+") for i in range(slots)]  # closed below
    started = time.monotonic()
    held = None
    try:
        while held is None:
            for handle in handles:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                held = handle
                break
            else:
                time.sleep(poll_s)
        yield time.monotonic() - started
    finally:
        if held is not None:
            fcntl.flock(held, fcntl.LOCK_UN)
        for handle in handles:
            handle.close()


def current_gpu() -> tuple[str, int]:
    """The key of this process's current CUDA device (its UUID where torch reports it) and its
    memory in bytes."""
    import torch

    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    return (str(uuid) if uuid is not None else f"gpu{index}-{os.environ.get('CUDA_VISIBLE_DEVICES', 'all')}",
            int(props.total_memory))
