"""The benchmark's own bookkeeping, on the CPU: rotated input sets keep each output paired
with the inputs that made it, a kernel output far from the reference is reported, and the
CPU smoke run writes its JSON and markdown."""

from __future__ import annotations

import json

import torch

from bench import run
from bench.report import disagreement_lines
from bench.scenarios import Sets


def tagged_sets(num_caches: int, num_qs: int) -> Sets:
    caches = [torch.full((1, 1, 576), float(c)) for c in range(num_caches)]
    qs = [torch.full((1, 1, 576), float(q)) for q in range(num_qs)]
    count = max(num_caches, num_qs)
    outs = [(torch.full((1,), float(o)), torch.zeros(1)) for o in range(count)]
    return Sets(caches, qs, outs)


def test_each_output_set_always_comes_from_the_same_inputs():
    for num_caches, num_qs in [(2, 15), (3, 2), (1, 4), (4, 4)]:
        sets = tagged_sets(num_caches, num_qs)
        made_by = {}
        for i in range(5 * sets.count + 3):
            x = sets.inputs(i)
            pair = (int(x.q_nope[0, 0, 0]), int(x.kv_cache[0, 0, 0]))
            out_id = int(sets.out(i)[0][0])
            assert made_by.setdefault(out_id, pair) == pair, (
                f"{num_caches} caches, {num_qs} q sets: output {out_id} written from {pair} at i={i}, "
                f"earlier from {made_by[out_id]}")
        assert len(made_by) == sets.count


def test_a_kernel_output_far_from_the_reference_is_reported():
    data = {"reference": [
        {"variant": "bf16-rope64", "kind": "decode", "rows": 64, "heads": 128, "kernel_rel_l2_vs_float64": 1.4},
        {"variant": "bf16-rope64", "kind": "decode", "rows": 256, "heads": 128, "kernel_rel_l2_vs_float64": 1.8e-3},
        {"variant": "bf16-rope64", "kind": "decode", "rows": 1, "heads": 16, "mode": "float32"},
        {"variant": "bf16-rope64", "kind": "decode", "rows": 1, "heads": 16, "kernel_rel_l2_vs_float64": float("nan")},
    ]}
    lines = disagreement_lines(data)
    assert len(lines) == 2, lines
    assert "rows 64 H 128" in lines[0] and "1.4" in lines[0]
    assert "nan" in lines[1]


def test_cpu_smoke_run_writes_json_and_markdown(tmp_path):
    assert run.main(["--out", str(tmp_path), "--cpu-smoke"]) == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["mode"] == "cpu-smoke" and data["reference"], "no reference records"
    assert all("median_s" in r for r in data["reference"]), [r for r in data["reference"] if "median_s" not in r]
    assert set(data["not_run"]) == {"kernel", "plan", "graph"}
    text = (tmp_path / "bench.md").read_text()
    assert "## Reference oracle" in text and "not run: kernel" in text


def test_reference_profile_runs_at_a_tiny_shape(capsys):
    from bench import reference_profile

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the profile runs where torch sees a GPU
    assert reference_profile.main(["--rows", "3", "--heads", "2", "--topk", "32", "--reps", "2"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[0]
    assert line.startswith(f"{device}: rows 3 x H 2 x topk 32, float32") and "wall" in line and "host" in line
