"""Run a script that needs FlashInfer on a machine without it: the fa3 stand-in
(``tests.fa3_stand_in``) is installed as ``flashinfer.mla``, then every module of this project is
put out of reach and the script runs as ``__main__``.

    TRITON_INTERPRET=1 python3 -m tests.run_on_fa3_stand_in [--wrapper 0.7|0.6|module:Class] SCRIPT ARGS...

``--wrapper``: the stand-in that keeps its schedule as FlashInfer 0.7 does (the default) or as
0.6 does, or a class of the project's named as ``module:Class`` (a stand-in made wrong on purpose).

Out of reach: the project's modules the stand-in loaded are taken out of ``sys.modules`` (the
stand-in keeps the objects it holds), the project's root is taken off ``sys.path``, and an import
finder placed first refuses every project module. A script that imports one fails there; where
it caught the refusal, this launcher still exits with :data:`IMPORTED_THE_PROJECT` naming the
module. Otherwise the exit status is the script's.
"""

from __future__ import annotations

import argparse
import importlib.abc
import runpy
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The exit status of a script that imported (or tried to import) a module of the project.
IMPORTED_THE_PROJECT = 3


def project_names(root: Path = ROOT) -> set[str]:
    """The project's top-level packages and modules."""
    packages = {p.parent.name for p in root.glob("*/__init__.py")}
    return packages | {p.stem for p in root.glob("*.py")}


def is_project_module(name: str, names: set[str]) -> bool:
    return name.split(".")[0] in names


class ProjectGuard(importlib.abc.MetaPathFinder):
    """Refuses every module of the project, noting the names asked for."""

    def __init__(self, names: set[str]):
        self.names, self.refused = names, []

    def find_spec(self, fullname, path=None, target=None):
        if is_project_module(fullname, self.names):
            self.refused.append(fullname)
            raise ImportError(f"{fullname} is a module of the sparse-MLA tester, which a standalone script must not "
                              "import")
        return None


def install_stand_in(wrapper: str) -> None:
    """The stand-in ``wrapper`` (``0.7``, ``0.6`` or ``module:Class``) as ``flashinfer.mla`` for
    the rest of the process."""
    import importlib

    import pytest

    from tests import fa3_stand_in

    if ":" in wrapper:
        module, _, name = wrapper.partition(":")
        cls = getattr(importlib.import_module(module), name)
    else:
        cls = fa3_stand_in.StandInWrapper if wrapper == "0.7" else fa3_stand_in.StandIn06Wrapper
    fa3_stand_in.install(pytest.MonkeyPatch(), cls)


def out_of_reach(names: set[str]) -> ProjectGuard:
    """Take the project's modules out of ``sys.modules`` and its root off ``sys.path``; place a
    :class:`ProjectGuard` first."""
    for name in [n for n in sys.modules if is_project_module(n, names)]:
        del sys.modules[name]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
    guard = ProjectGuard(names)
    sys.meta_path.insert(0, guard)
    return guard


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wrapper", default="0.7",
                        help="0.7 or 0.6 (where the stand-in keeps its schedule), or module:Class")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    install_stand_in(args.wrapper)
    names = project_names()
    guard = out_of_reach(names)
    sys.argv = [args.script, *args.args]
    try:
        runpy.run_path(args.script, run_name="__main__")
        status = 0
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except Exception:  # the script's own failure: its traceback, then the import check
        traceback.print_exc()
        status = 1
    imported = sorted({*guard.refused, *(n for n in sys.modules if is_project_module(n, names))})
    if imported:
        print(f"{args.script} imported modules of the project: {imported}", file=sys.stderr)
        return IMPORTED_THE_PROJECT
    return status


if __name__ == "__main__":
    sys.exit(main())
