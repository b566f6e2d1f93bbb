"""A reproducer for one fixture that needs nothing of this project: ``NAME.repro.py`` beside
the fixture, importing only torch, flashinfer and safetensors (and the standard library). It
plans and runs the fixture's recorded plan on the installed FlashInfer (flat forms before 0.7,
canonical forms from 0.7, read from the wrapper's signatures), computes the float64 reference
of the intended slots inline, and applies the error budget written out in the script, with the
working-precision errors of the case measured here when the script is written. It is what a
user attaches to an upstream issue.

    python3 -m recording.repro fixtures/c-packed-finding-bf16.safetensors -o DIR
    python3 DIR/c-packed-finding-bf16.repro.py

``--dump-failures`` writes one beside every fixture it writes. A fixture that rebuilds some
tensors at load (``derived``: the checked-in ones) is written into ``-o DIR`` with every tensor
stored, so that the script reads it with safetensors alone.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

from reference.budget import ABS_FLOOR, FACTORS, LSE_ULPS, element_errors

from .commands import replay_command
from .fixture import Fixture, FixtureError, load_fixture, save_fixture
from .replay import as_planned_selection, reference_outputs

TEMPLATE = Path(__file__).with_name("repro_script.tmpl")
#: The only modules a reproducer may import (beyond the standard library).
ALLOWED_IMPORTS = ("torch", "flashinfer", "safetensors")


def repro_path(fixture_path: Path) -> Path:
    return fixture_path.with_name(fixture_path.name.removesuffix(".safetensors") + ".repro.py")


def rows_reading_invalid_entries(fx: Fixture) -> torch.Tensor:
    """Per row: whether its planned span holds an invalid entry (-1)."""
    slots, mask = as_planned_selection(fx)
    return ((slots < 0) & mask).any(dim=1)


def working_precision_errors(fx: Fixture) -> dict[str, list[float]]:
    """Per output: (max, mean) error of the working-precision reference against float64 over
    the planned selection (the slots FlashInfer is given; rows whose span holds an invalid
    entry left out, as the script leaves them out), and max |truth| (the LSE floor's scale)."""
    truth = reference_outputs(fx, "planned", "float64")
    lowp = reference_outputs(fx, "planned", "lowp")
    judged = ~rows_reading_invalid_entries(fx)
    result = {}
    for name, t, lo in (("out", truth[0][judged], lowp[0][judged]), ("lse", truth[1][judged], lowp[1][judged])):
        t = t.double()
        _, err_l, _ = element_errors(lo.double(), t, lo.double())  # |lowp - truth| where both are finite
        finite = t.isfinite() & lo.double().isfinite()
        count = max(int(finite.sum()), 1)
        max_abs = float(t[t.isfinite()].abs().max()) if bool(t.isfinite().any()) else 0.0
        result[name] = [float(err_l.max()) if err_l.numel() else 0.0, float(err_l.sum()) / count, max_abs]
    return result


def repro_source(fx: Fixture, fixture_name: str) -> str:
    """The reproducer script's text for ``fx`` stored as ``fixture_name``."""
    meta = fx.meta
    kv_dtype = str(meta.get("kv_dtype", "bfloat16"))
    case = {
        k: meta[k] for k in ("name", "layout", "impl", "nodeid", "regimes", "expect_finding") if meta.get(k) is not None
    }
    if isinstance(meta.get("shrunk"), dict):
        case["check"] = meta["shrunk"].get("check")
    factors = FACTORS["float8_e4m3fn" if "float8" in kv_dtype or kv_dtype == "uint8" else "bfloat16"]
    script_name = fixture_name.removesuffix(".safetensors") + ".repro.py"
    return TEMPLATE.read_text().format(
        case=repr(case), lowp=repr(working_precision_errors(fx)), factors=f"{factors[0]!r}, {factors[1]!r}",
        abs_floor=repr(ABS_FLOOR), lse_ulps=repr(LSE_ULPS), script_name=script_name, fixture_name=fixture_name,
        project_command=project_command_line(meta, fixture_name),
    )


def project_command_line(meta: dict, fixture_name: str) -> str:
    """The docstring's line on how the project replays the fixture, through the implementation
    (and vLLM) it was recorded with."""
    command = replay_command(fixture_name, meta.get("impl"), meta.get("vllm"))
    return f"\nIn the sparse-MLA tester that wrote it: {command}\n"


def write_repro(fx: Fixture, fixture_path: Path) -> Path:
    """Write the reproducer beside ``fixture_path`` (the fixture's file)."""
    path = repro_path(Path(fixture_path))
    path.write_text(repro_source(fx, Path(fixture_path).name))
    return path


def standalone_problem(src: Path) -> str | None:
    """Why ``src`` has no standalone reproducer (None: it is a fixture file)."""
    from .recipe import is_recipe
    from .sequence import is_sequence

    if is_recipe(src) or is_sequence(src):
        kind = "a recipe" if is_recipe(src) else "a sequence"
        return (f"{src} is {kind}: recipes and sequences have no standalone reproducer (they rebuild their case "
                f"through this project); replay it: pytest --replay={src}, or give a fixture "
                "(*.safetensors) of the case")
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="write a standalone reproducer (torch + flashinfer + safetensors) for a fixture"
    )
    parser.add_argument("fixture")
    parser.add_argument(
        "-o", "--out", help="folder for the script and a copy of the fixture (default: beside the fixture)"
    )
    args = parser.parse_args(argv)
    src = Path(args.fixture)
    problem = standalone_problem(src)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        fx = load_fixture(src)
    except FixtureError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    derived = sorted(fx.meta.get("derived") or {})
    target = Path(args.out) / src.name if args.out else src
    if derived and target.resolve() == src.resolve():
        print(f"error: {src} rebuilds {', '.join(derived)} at load and the reproducer reads every tensor from its "
              "file: give -o DIR for a copy that stores them, beside the script", file=sys.stderr)
        return 2
    if target.resolve() != src.resolve():
        target.parent.mkdir(parents=True, exist_ok=True)
        if derived:
            save_fixture(target, fx)  # every tensor stored: the script reads them with safetensors alone
        else:
            shutil.copyfile(src, target)
    path = write_repro(fx, target)
    print(f"wrote {path}\nrun: python3 {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
