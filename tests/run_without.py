"""Run a script as ``__main__`` on a machine that lacks some modules: each module named is made
unimportable (``sys.modules[name] = None``: importing it raises ImportError naming it), as on a
machine where it is not installed.

    python3 -m tests.run_without flashinfer,safetensors SCRIPT ARGS...

The exit status is the script's.
"""

from __future__ import annotations

import runpy
import sys


def main(argv: list[str]) -> None:
    missing, script, *args = argv
    for name in missing.split(","):
        sys.modules[name] = None
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
