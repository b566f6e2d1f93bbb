"""Record the checked-in fixtures on a GPU: each case through the SM90 path of the installed
FlashInfer, its output added to ``fixtures/<name>.safetensors`` under that version.

    python3 -m scripts.record_fixtures [--dir fixtures]

Run once per FlashInfer version (each installed as scripts/gpu_runner.py does): the first
run writes each file, later runs check that the case's inputs are bit-identical and add their
outputs. A case a version refuses (the strided layout on FlashInfer >= 0.7) is noted in the
file's metadata under ``refused``.

    python3 -m scripts.record_fixtures --migrate FILE...

rewrites fixtures of schema 1 (written before fixtures carried a content digest) with their
digest, and points a declared finding at docs/findings.md.

    python3 -m scripts.record_fixtures --compact FILE...

rewrites fixtures so that they store only what they cannot rebuild: q and the KV slots their
scenario rebuilds bit for bit, and outputs bitwise equal to another version's, are left out and
rebuilt at load (recording/derived.py). Each file is loaded back and must give every tensor, output
and metadata field it gave before, bit for bit, or it is left as it was. Recording writes compact
files too.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import torch

from backends.flashinfer.port import make_attention_state
from fast.impl import FastImpl
from harness import batch, build_attention_inputs, build_scenario
from harness.findings import REGIME_C_FINDING
from harness.port.launch import (
    DEVICE,
    assert_launchable,
    attention_config,
    eager_step,
    launch_inputs,
    nan_buffers,
    prepared,
    sync,
)
from mla_constants import GLM_NOPE_SM_SCALE
from recording.case_log import fixture_from_step
from recording.environment import runtime_environment
from recording.fixture import FixtureError, bitwise_equal, load_fixture, migrate_fixture, save_fixture

SMALL = dict(topk=256, block_size=16)
NOPE = dict(rope=False, sm_scale=GLM_NOPE_SM_SCALE)
FP8 = dict(kv_dtype="float8_e4m3fn", k_scale=0.5)


@dataclass
class FixtureCase:
    name: str
    spec: object
    layout: str = "compacted"
    focus: tuple[str, ...] = ()
    finding: str | None = None  # a known finding the fixture must keep showing
    graph_from: object | None = None  # capture a graph at this (larger) spec, replay this case
    seed: int = 7
    extra: dict = field(default_factory=dict)


CASES = [
    FixtureCase(
        "a-identity-fill-bf16", batch((1, 1), (5, 1), (255, 1), (256, 1), kpool=4, num_heads=16, **SMALL), focus=("A",)
    ),
    FixtureCase(
        "h-kpool1-decode-bf16",
        batch((5, 1), (255, 1), (256, 1), (257, 1), (3000, 1), kpool=1, num_heads=32, **SMALL),
        focus=("H",),
    ),
    FixtureCase(
        "bdefg-pooled-decode-bf16",
        batch((8, 1), (256, 1), (258, 1), (260, 1), (263, 1), (2000, 1), kpool=4, num_heads=16, **SMALL),
        focus=("B", "D", "E", "F", "G"),
    ),
    FixtureCase(
        "c-compacted-fp8",
        batch((9, 1), (255, 1), (130, 1), (1001, 1), kpool=4, num_heads=64, **SMALL, **FP8),
        focus=("C",),
    ),
    FixtureCase(
        "c-packed-finding-bf16",
        batch((9, 1), (255, 1), (130, 1), (1001, 1), kpool=4, num_heads=16, **SMALL),
        layout="packed",
        focus=("C",),
        finding=REGIME_C_FINDING.format(layout="packed"),
    ),
    FixtureCase(
        "nope-pooled-mixed-bf16",
        batch((3, 1), (256, 1), (261, 1), (900, 1), kpool=4, num_heads=32, **SMALL, **NOPE),
        focus=("C", "D", "E", "G"),
    ),
    FixtureCase(
        "nope-spec-decode-straddling-bf16",
        batch((259, 4), (254, 4), (4000, 4), kpool=4, decode_threshold=4, num_heads=16, **SMALL, **NOPE),
        focus=("C", "D", "E", "G"),
    ),
    FixtureCase("h-topk2048-long-fp8-h64", batch((5000, 1), (131_072, 1), kpool=1, num_heads=64, **FP8), focus=("H",)),
    FixtureCase(
        "strided-seed-layout-bf16",
        batch((40, 1), (3000, 1), (256, 1), kpool=1, num_heads=16, **SMALL),
        layout="strided",
        focus=("H",),
    ),
    FixtureCase(
        "decode-prefill-to-mha-bf16",
        batch((3000, 1), (258, 1), (200, 24), kpool=4, num_heads=16, **SMALL),
        focus=("F", "G", "E"),
    ),
    FixtureCase(
        "chunked-prefill-sparse-fp8",
        batch((12, 1), (700, 16), kpool=4, num_heads=32, **SMALL, **FP8),
        focus=("B", "C", "G"),
    ),
    FixtureCase(
        "async-spec-decode-fp8",
        batch(
            (259, 4),
            (255, 4),
            (2000, 4),
            kpool=4,
            decode_threshold=4,
            async_scheduling=True,
            host_bound_slack=3,
            num_heads=16,
            **SMALL,
            **FP8,
        ),
        focus=("C", "D", "E", "G"),
    ),
    FixtureCase(
        "graph-replay-smaller-bf16",
        batch((255, 1), (262, 1), (7, 1), kpool=4, num_heads=16, **SMALL),
        graph_from=batch((3000, 1), (259, 1), (40, 1), (266, 8), (100, 6), kpool=4, num_heads=16, **SMALL),
        focus=("C", "E", "G"),
    ),
    FixtureCase("empty-batch-bf16", batch(kpool=4, num_heads=16, **SMALL)),
]


def run_eager(impl, step, scenario):
    inputs = build_attention_inputs(scenario, DEVICE)
    state = make_attention_state(impl, attention_config(scenario, step.layout, step.max_rows), DEVICE)
    launch = launch_inputs(impl, scenario, inputs, step.max_rows)
    out, lse = nan_buffers(step.max_rows, scenario.spec.num_heads)
    eager_step(state, launch, step, out, lse)
    sync()
    return inputs, out[: step.num_planned].cpu(), lse[: step.num_planned].cpu()


def run_graph_replay(impl, case, scenario, step):
    """Capture the step at ``graph_from``'s size, replan for ``scenario`` and replay."""
    from harness.port.launch import StaticStep

    big = build_scenario(case.graph_from, case.seed + 1)
    static = StaticStep([big, scenario], impl)
    big_step = prepared(impl, big, case.layout, max_rows=static.max_rows)
    step = prepared(impl, scenario, case.layout, max_rows=static.max_rows)
    inputs_big, inputs = build_attention_inputs(big, DEVICE), build_attention_inputs(scenario, DEVICE)
    state = make_attention_state(impl, attention_config(big, case.layout, static.max_rows), DEVICE)
    static.load(big, inputs_big)
    state.plan(big_step.num_planned, big_step.planned_lens)
    state.step(*static.args())
    sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        state.step(*static.args())
    static.load(scenario, inputs)
    state.plan(step.num_planned, step.planned_lens)
    graph.replay()
    sync()
    n = step.num_planned
    return step, inputs, static.out[:n].cpu(), static.lse[:n].cpu()


def record(case: FixtureCase, directory: Path, impl) -> str:
    version = str(runtime_environment()["flashinfer"])
    scenario = build_scenario(case.spec, case.seed)
    step = prepared(impl, scenario, case.layout)
    if not case.finding:
        assert_launchable(step, version)
    refused = None
    try:
        if case.graph_from is not None:
            step, inputs, out, lse = run_graph_replay(impl, case, scenario, step)
        else:
            inputs, out, lse = run_eager(impl, step, scenario)
    except ValueError as exc:  # e.g. the strided layout on FlashInfer >= 0.7
        refused, inputs, out, lse = (
            f"{type(exc).__name__}: {exc}"[:400],
            build_attention_inputs(scenario, DEVICE),
            None,
            None,
        )
    fresh = fixture_from_step(
        step, inputs, outputs={version: (out, lse)} if out is not None else {}, name=case.name, focus=list(case.focus),
        graph_replay=case.graph_from is not None,
    )
    if case.finding:
        fresh.meta["expect_finding"] = case.finding
    path = directory / f"{case.name}.safetensors"
    if path.exists():
        try:
            old = load_fixture(path)
        except FixtureError:
            old = None
        if old is not None:
            for key, value in fresh.tensors.items():
                if not bitwise_equal(old[key], value):
                    raise SystemExit(
                        f"{path}: input tensor {key!r} differs from the recorded one; delete the file to re-record"
                    )
            fresh.outputs = {**old.outputs, **fresh.outputs}
            fresh.meta["environment"] = old.meta.get("environment", {})
            fresh.meta["refused"] = old.meta.get("refused", {})
    fresh.meta.setdefault("environment", {})[version] = runtime_environment()
    if refused:
        fresh.meta.setdefault("refused", {})[version] = refused
    save_fixture(path, fresh, compact=True)
    return f"{case.name}: rows {step.num_planned}, " + (f"refused on {version}" if refused else f"recorded {version}")


def migrate(paths) -> int:
    findings = {case.name: case.finding for case in CASES if case.finding}
    for path in map(Path, paths):
        updates = {"expect_finding": findings[path.stem]} if path.stem in findings else {}
        try:
            migrate_fixture(path, **updates)
        except (FixtureError, KeyError, OSError) as exc:
            print(f"{path}: not migrated: {exc}")
            return 1
        print(f"{path}: migrated")
    return 0


def same_fixture(a, b) -> str | None:
    """What differs between two loaded fixtures (None: every tensor, output and metadata field
    but how the file stores them)."""
    if sorted(a.tensors) != sorted(b.tensors) or sorted(a.outputs) != sorted(b.outputs):
        return (f"tensors {sorted(a.tensors)} / outputs {sorted(a.outputs)} against "
                f"{sorted(b.tensors)} / {sorted(b.outputs)}")
    for key in a.tensors:
        if not bitwise_equal(a[key], b[key]):
            return f"tensor {key!r}"
    for version, (out, lse) in a.outputs.items():
        if not (bitwise_equal(out, b.outputs[version][0]) and bitwise_equal(lse, b.outputs[version][1])):
            return f"output {version!r}"
    storage = ("digest", "derived", "schema_version")
    if {k: v for k, v in a.meta.items() if k not in storage} != {k: v for k, v in b.meta.items() if k not in storage}:
        return "metadata"
    return None


def compact(paths) -> int:
    """Rewrite each fixture compact; a file that would not load back the same is left as it was."""
    for path in map(Path, paths):
        try:
            before = load_fixture(path)
            size = path.stat().st_size
            tmp = save_fixture(path.with_name(path.name + ".compact"), before, compact=True)
            difference = same_fixture(before, load_fixture(tmp))
        except (FixtureError, OSError) as exc:
            print(f"{path}: not rewritten: {exc}")
            return 1
        if difference:
            tmp.unlink()
            print(f"{path}: not rewritten: the compact file gives another {difference}")
            return 1
        tmp.replace(path)
        derived = load_fixture(path).meta.get("derived") or {}
        print(f"{path}: {size / 1e6:.2f} MB -> {path.stat().st_size / 1e6:.2f} MB"
              + (f", rebuilt at load: {', '.join(sorted(derived))}" if derived else ""))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="fixtures")
    parser.add_argument("--only", nargs="*", help="case names")
    parser.add_argument(
        "--migrate", nargs="+", metavar="FILE", help="rewrite schema-1 fixtures with their content digest"
    )
    parser.add_argument(
        "--compact", nargs="+", metavar="FILE",
        help="rewrite fixtures leaving out the tensors they rebuild bit for bit at load",
    )
    args = parser.parse_args()
    if args.migrate:
        return migrate(args.migrate)
    if args.compact:
        return compact(args.compact)
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    impl = FastImpl()
    failures = 0
    for case in CASES:
        if args.only and case.name not in args.only:
            continue
        try:
            print(record(case, directory, impl), flush=True)
        except Exception as exc:  # one broken case must not lose the others
            failures += 1
            print(f"{case.name}: FAILED {type(exc).__name__}: {exc}", flush=True)
    total = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    print(f"fixtures: {len(list(directory.glob('*.safetensors')))} files, {total / 1e6:.1f} MB")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
