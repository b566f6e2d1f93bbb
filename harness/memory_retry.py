"""Child processes that ran out of GPU memory because other processes held it.

Under ``pytest -n auto`` every worker shares the GPU, and the largest cases (the plan-limit
search's rows children, the 32768-row scale children) need tens of GiB for seconds. A child
that dies of torch's CUDA out-of-memory error while the others hold the memory says nothing
about the code under test: it is made again, in a fresh child, after a pause. One that runs out
every time is reported as it ended, its retries named.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

#: How often an attempt that ran out of GPU memory is made again, and the pause before each.
OOM_RETRIES = 2
OOM_PAUSE_S = 5.0

T = TypeVar("T")


#: What a child's stderr says when the GPU had no memory for it.
OUT_OF_MEMORY_SIGNS = ("OutOfMemoryError", "CUDA out of memory", "CUDA error: out of memory",
                       "cudaErrorMemoryAllocation")


def out_of_gpu_memory(stderr: str) -> bool:
    """Whether a child's stderr ends in a CUDA out-of-memory error: torch's allocator's, or the
    runtime's where a context or a library's workspace could not be made."""
    return any(sign in stderr for sign in OUT_OF_MEMORY_SIGNS)


def retried_when_out_of_gpu_memory(
    run: Callable[[], T],
    ran_out: Callable[[T], bool],
    retries: int | None = None,
    pause: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[T, int]:
    """``run()`` (one attempt in a fresh child), made again while ``ran_out`` says its result
    ran out of GPU memory, at most ``retries`` more times (default :data:`OOM_RETRIES`), after
    ``pause`` seconds each (default :data:`OOM_PAUSE_S`): the last result and how many times
    it was made again."""
    retries = OOM_RETRIES if retries is None else retries
    pause = OOM_PAUSE_S if pause is None else pause
    result, made_again = run(), 0
    while ran_out(result) and made_again < retries:
        sleep(pause)
        result, made_again = run(), made_again + 1
    return result, made_again


def retries_note(made_again: int) -> str:
    """What an attempt's detail says of its retries ("" where it was made once)."""
    if not made_again:
        return ""
    return f" (made {made_again + 1} times: out of GPU memory, other processes holding it, before)"
