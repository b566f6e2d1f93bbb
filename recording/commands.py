"""The commands a written case prints and carries: how the project replays it, as the run that
wrote or replayed it ran (no torch here: the controlling pytest process imports it)."""

from __future__ import annotations

import shlex

from mla_constants import DEFAULT_IMPL_SPEC


def replay_command(path, impl_spec: str | None = None, vllm: str | None = None, backends=()) -> str:
    """The command that replays ``path`` (a fixture, a recipe, a case or a folder of them) through
    the implementation it ran with: ``--impl`` where that is not the project's own, ``--vllm``,
    and each user's own backend (``--backend module:factory``) the run named."""
    words = ["pytest", f"--replay={shlex.quote(str(path))}"]
    if impl_spec and impl_spec != DEFAULT_IMPL_SPEC:
        words += ["--impl", shlex.quote(impl_spec)]
    if vllm:
        words.append(f"--vllm={shlex.quote(vllm)}")
    words += [f"--backend={shlex.quote(spec)}" for spec in backends]
    return " ".join(words)
