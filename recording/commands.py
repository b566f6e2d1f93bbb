"""The commands a written case prints and carries: how the project replays it, as the run that
wrote or replayed it ran, and how a vLLM case's standalone reproducer is written and run (no torch
here: the controlling pytest process imports it)."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from mla_constants import DEFAULT_IMPL_SPEC

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def found_through_pythonpath(specs, pythonpath: str | None = None) -> tuple[str, ...]:
    """The folders of ``PYTHONPATH`` (default: the environment's) outside the project that hold
    the modules of ``specs`` (``module:attr``): what a printed command must carry to find them
    again."""
    entries = [Path(p) for p in (os.environ.get("PYTHONPATH", "") if pythonpath is None else pythonpath).split(
        os.pathsep) if p]
    found = []
    for spec in specs:
        top = spec.partition(":")[0].split(".")[0]
        for entry in entries:
            if (entry / top).is_dir() or (entry / f"{top}.py").is_file():
                if entry.resolve() != PROJECT_ROOT:
                    found.append(str(entry.resolve()))
                break
    return tuple(dict.fromkeys(found))


def with_the_project_on_path(env: dict) -> dict:
    """``env`` with the project's folder first on ``PYTHONPATH``: a child pytest started from
    another folder then loads this plugin even where the project is a checkout, not installed."""
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != PROJECT_ROOT]
    return dict(env, PYTHONPATH=os.pathsep.join([str(PROJECT_ROOT), *rest]))


def replay_command(path, impl_spec: str | None = None, vllm: str | None = None, backends=(),
                   search_path=()) -> str:
    """The command that replays ``path`` (a fixture, a recipe, a case or a folder of them) through
    the implementation it ran with: ``--impl`` where that is not the project's own, ``--vllm``,
    and each user's own backend (``--backend module:factory``) the run named; ``PYTHONPATH`` set
    to ``search_path`` first where their modules were found there (:func:`found_through_pythonpath`)."""
    words = [f"PYTHONPATH={shlex.quote(os.pathsep.join(search_path))}"] if search_path else []
    words += ["pytest", f"--replay={shlex.quote(str(path))}"]
    if impl_spec and impl_spec != DEFAULT_IMPL_SPEC:
        words += ["--impl", shlex.quote(impl_spec)]
    if vllm:
        words.append(f"--vllm={shlex.quote(vllm)}")
    words += [f"--backend={shlex.quote(spec)}" for spec in backends]
    return " ".join(words)


def standalone_folder(case_path) -> str:
    """The folder of a vLLM case's standalone reproducer: ``NAME.standalone`` beside ``NAME.case.json``."""
    path = str(case_path)
    return path.removesuffix(".case.json") + ".standalone"


def standalone_command(case_path, vllm_root=None) -> str:
    """The commands that write the standalone reproducer of a vLLM case (``recording.vllm_repro``)
    and run it on ``vllm_root`` (a folder holding vllm/; VLLM_ROOT where none is known)."""
    folder = standalone_folder(case_path)
    root = shlex.quote(str(vllm_root)) if vllm_root else "VLLM_ROOT"
    return (f"python3 -m recording.vllm_repro {shlex.quote(str(case_path))} --out {shlex.quote(folder)} && "
            f"python3 {shlex.quote(folder + '/repro.py')} {root}")
