"""The benchmark's own bookkeeping, on the CPU: rotated input sets keep each output paired
with the inputs that made it, a kernel output far from the reference is reported, the CPU
smoke run writes its JSON and markdown, and FlashMLA beside FA3 (``--vllm``): its side-by-side
table, its absence with the reason, its byte counts and its replayed kernel calls, and (with
``--vllm``) the whole FlashMLA path on the stand-in kernels."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from backends.vllm.flashmla import FlashMLABackend
from bench import report, run, selection
from bench.context import Context
from bench.counting import attention_bytes, attention_flops
from bench.flashmla import NO_VLLM, KernelCall, replay_of, run_flashmla_alone, step_counts
from bench.report import disagreement_lines
from bench.scenarios import Sets
from fast.impl import default_impl
from harness.timing import Timer
from reference.flashmla_layout import TOKEN_BYTES
from tests import flashmla_stand_in


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


# --- FlashMLA beside FA3 (--vllm) ---------------------------------------------------------------

def fa3_record(heads: int, median_s: float, **extra) -> dict:
    return {"variant": "fp8-rope64", "kind": "decode", "rows": 64, "heads": heads, "median_s": median_s,
            "flops_per_s": 2e12, "bytes_per_s": 3e12, "fraction_of_matmul": 0.25, "fraction_of_copy": 0.75, **extra}


def prefill_args(q, kv) -> tuple:
    """``sparse_prefill_fwd``'s arguments as vLLM's interface passes them (q, kv, indices,
    sm_scale, d_v, attn_sink, topk_length)."""
    return (q, kv, None, 0.1, 512, None, None)


def decode_args(q, kv) -> tuple:
    """``sparse_decode_fwd``'s (q, kv, indices, topk_length, attn_sink, tile_scheduler_metadata,
    num_splits, extra_kv, extra_indices, extra_topk_length, d_v, sm_scale), with no schedule."""
    return (q, kv, None, None, None, None, None, None, None, None, 512, 0.1)


def test_cpu_smoke_without_vllm_says_flashmla_was_not_run_and_why(tmp_path):
    assert run.main(["--out", str(tmp_path), "--cpu-smoke"]) == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["flashmla_backend"] == {"status": "not run", "reason": NO_VLLM} and data["flashmla"] == []
    text = (tmp_path / "bench.md").read_text()
    assert f"FlashMLA not run: {NO_VLLM}" in text.splitlines(), text


def test_a_vllm_path_that_names_nothing_is_reported_with_its_reason(tmp_path):
    nowhere = tmp_path / "no-such-vllm"
    assert run.main(["--out", str(tmp_path), "--cpu-smoke", "--sections", "kernel", "--vllm", str(nowhere)]) == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    status = data["flashmla_backend"]
    assert status["status"] == "not run" and str(nowhere) in status["reason"], status
    assert "expected a vLLM wheel file, a folder holding the vllm package, or 'installed'" in status["reason"]
    line = next(x for x in (tmp_path / "bench.md").read_text().splitlines() if x.startswith("FlashMLA not run: "))
    assert "no-such-vllm" in line


def test_the_side_by_side_table_pairs_each_flashmla_shape_with_fa3s():
    flashmla = {**fa3_record(64, 1e-5), "flops_per_s": 4e12, "bytes_per_s": 5.5e12, "fraction_of_matmul": 0.5,
                "fraction_of_copy": 0.9, "rel_l2_vs_reference": 1.7e-3, "fa3_rel_l2_vs_reference": 2.2e-3}
    wrong = {**fa3_record(128, 5e-5), "rel_l2_vs_reference": 0.3, "fa3_rel_l2_vs_reference": 2.1e-3}
    unsupported = {"variant": "bf16-nope", "kind": "decode", "rows": 64, "heads": 16,
                   "unsupported": "vLLM 0.30.0's FLASHMLA_SPARSE serves head sizes [576], not 512 (rope 0)"}
    data = {"flashmla_backend": {"status": "run", "source": "vLLM 0.33.0 (slice)"},
            "kernel": [fa3_record(16, 9e-5), fa3_record(64, 2e-5), fa3_record(128, 4e-5, finite=False)],
            "flashmla": [wrong, unsupported, flashmla]}
    text = report.markdown(data)
    section = text[text.index("## FA3 vs FlashMLA (vLLM 0.33.0 (slice))"):text.index("## Problems")]
    rows = [line for line in section.splitlines() if line.startswith(("| fp8-rope64 |", "| bf16-nope |"))]
    assert rows == [
        "| fp8-rope64 | decode | 64 | 64 | 20.0 | 10.0 | 2.00 | 2.0 | 4.0 | 3.00 | 5.50 | 25/75 | 50/90 | 2.2e-03 "
        "| 1.7e-03 |",
        "| fp8-rope64 | decode | 128 | 64 | 40.0 NaN! | 50.0 | 0.80 | 2.0 | 2.0 | 3.00 | 3.00 | 25/75 | 25/75 "
        "| 2.1e-03 | 3.0e-01 ! |",
        "| bf16-nope | decode | 16 | 64 | - | unsupported | - | - | - | - | - | - | - | - | - |",
    ], text
    assert "FlashMLA faster on 1 of 2 shapes timed on both; FA3 t / FlashMLA t from 0.80 to 2.00." in text
    assert f"- unsupported: {unsupported['unsupported']}" in text
    problems = text[text.index("## Problems"):]
    assert "- FlashMLA output disagrees with the float32 reference (fp8-rope64 decode rows 64 H 128): rel L2 0.3" \
        in problems and "FA3 output disagrees" not in problems, problems


def test_flashmla_bytes_count_each_calls_kv_rows_as_the_kernel_is_handed_them():
    """An fp8 step of vLLM's separate paths: decode rows on FlashMLA's 656-byte layout, prefill
    rows on the bf16 workspace they were upconverted into; FLOPs over the layer's 16 heads,
    not the 64 the kernels run."""
    heads, rope = 16, 64
    decode = KernelCall("sparse_decode_fwd", None, decode_args(torch.zeros(2, 1, 64, 576, dtype=torch.bfloat16),
                                                               torch.zeros(8, 64, 1, TOKEN_BYTES, dtype=torch.uint8)),
                        {}, ())
    prefill = KernelCall("sparse_prefill_fwd", None, prefill_args(torch.zeros(3, 64, 576, dtype=torch.bfloat16),
                                                                  torch.zeros(100, 1, 576, dtype=torch.bfloat16)),
                         {}, ())
    lengths = torch.tensor([128, 100, 7, 7, 6])
    slots = torch.tensor([[1, 2, 3], [3, 4, 5], [9, 9, 9], [9, 8, 9], [7, 8, 9]])
    mask = torch.ones_like(slots, dtype=torch.bool)
    outcome = SimpleNamespace(executed_lengths=lengths, executed_slots=(slots, mask), out=torch.zeros(1))
    counts = step_counts([decode, prefill], outcome, heads, rope, "float8_e4m3fn")

    def fixed(rows, total):  # q, slot ids, out, LSE of the layer's heads
        return rows * heads * 576 * 2 + total * 4 + rows * heads * 512 * 2 + rows * heads * 4

    assert counts["total_len"] == 248 and counts["flops"] == attention_flops(heads, 248, rope)
    assert counts["moved"]["gathered"] == fixed(2, 228) + 228 * 656 + fixed(3, 20) + 20 * 1152
    assert counts["moved"]["unique"] == fixed(2, 228) + 5 * 656 + fixed(3, 20) + 3 * 1152
    fa3 = attention_bytes(2, heads, 228, rope, "float8_e4m3fn")["gathered"]
    assert fixed(2, 228) + 228 * 656 - fa3 == 228 * (656 - 576), "FA3's fp8 row is 576 bytes, FlashMLA's 656"


def test_the_replay_rotates_caches_and_q_and_hands_the_decode_kernel_its_schedule():
    seen = []

    def op(*args):
        seen.append(args)

    project_caches = [torch.full((2, 64, 3), float(c)) for c in range(3)]
    in_layout = lambda cache: cache * 10  # noqa: E731  (as pack() turns a cache into FlashMLA's layout)
    step_cache = in_layout(project_caches[0])
    q = torch.randn(1, 4, 64, 3)
    workspace = torch.randn(50, 1, 3)
    schedule, splits = torch.ones(1, 8, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    nothing = torch.empty(0)  # the outputs' bytes do not matter here
    decode = KernelCall("sparse_decode_fwd", op, decode_args(q, step_cache.unsqueeze(-2)), {},
                        (nothing, None, schedule, splits))
    prefill = KernelCall("sparse_prefill_fwd", op, prefill_args(q[0], workspace), {}, (nothing,))
    per_set = 2 * q.numel() * q.element_size()
    replay = replay_of([decode, prefill], step_cache, in_layout, project_caches, l2_bytes=per_set)
    assert replay.count == 4 and replay.cache_sets == 3  # 4 x L2 over one set's q; 3 caches
    for i in range(2 * replay.count):
        replay(i)
    for i in range(2 * replay.count):
        (dq, dkv, *rest), (pq, pkv, *_) = seen[2 * i], seen[2 * i + 1]
        j = i % replay.count
        assert torch.equal(dkv, in_layout(project_caches[j % 3]).unsqueeze(-2)), f"set {j}: not cache {j % 3}"
        assert dkv.shape == (2, 64, 1, 3) and dkv.stride() == step_cache.unsqueeze(-2).stride()
        assert (dq.data_ptr() == q.data_ptr()) == (j == 0) and torch.equal(dq, q), f"set {j}: q"
        assert rest[3] is schedule and rest[4] is splits, "the decode kernel rebuilt its schedule"
        assert pkv is workspace and torch.equal(pq, q[0])


@pytest.fixture
def flashmla_on_the_stand_in(flashmla_source, monkeypatch):
    """The release's FLASHMLA_SPARSE with the stand-in kernels of tests/flashmla_stand_in.py in
    place of FlashMLA's, on a platform that says SM90 (as in tests/cpu/test_flashmla_backend.py)."""
    flashmla_stand_in.register(flashmla_source)
    flashmla_stand_in.hopper(monkeypatch)
    backend = FlashMLABackend(flashmla_source)
    flashmla_stand_in.interpreter_bool_masks(monkeypatch)
    flashmla_stand_in.in_place_of_the_kernels(monkeypatch)
    return backend


def expected_bytes(record: dict, kv_row: int) -> int:
    rows, heads, total = record["rows"], record["heads"], record["total_len"]
    return rows * heads * 576 * 2 + total * 4 + rows * heads * 512 * 2 + rows * heads * 4 + total * kv_row


@pytest.mark.vllm
@pytest.mark.flashmla
@pytest.mark.interpreter  # the stand-in's Triton kernels and vLLM's convert take CPU tensors
def test_cpu_smoke_with_vllm_times_flashmla_on_the_stand_in(flashmla_on_the_stand_in, flashmla_source, tmp_path):
    assert run.main(["--out", str(tmp_path), "--cpu-smoke", "--vllm", str(flashmla_source.root)]) == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["flashmla_backend"]["status"] == "run", data["flashmla_backend"]
    sel = selection.CPU_SMOKE
    shapes = {(r["variant"], r["rows"], r["heads"]) for r in data["flashmla"] if "median_s" in r}
    assert len(shapes) == len(data["flashmla"]) == len(sel.variants) * len(sel.heads) * len(sel.decode_rows), \
        [r.get("error") for r in data["flashmla"]]
    for r in data["flashmla"]:
        fp8 = r["kv_dtype"] == "float8_e4m3fn"
        assert [(c["op"], c["kernel_heads"], c["kv_row_bytes"]) for c in r["calls"]] == [
            ("sparse_decode_fwd" if fp8 else "sparse_prefill_fwd", 64, TOKEN_BYTES if fp8 else 1152)], r["calls"]
        assert r["total_len"] == r["rows"] * sel.topk and r["bytes"] == expected_bytes(r, r["calls"][0]["kv_row_bytes"])
        assert r["rel_l2_vs_reference"] < report.KERNEL_REL_L2_ALARM and r["finite"] and not r["problems"], r
        assert "fa3_rel_l2_vs_reference" not in r  # no FA3 on the CPU
    lines = (tmp_path / "bench.md").read_text().splitlines()
    table = [line for line in lines if line.startswith(("| bf16-rope64 | decode", "| fp8-rope64 | decode"))]
    assert len(table) == len(data["flashmla"]) and all(line.split(" | ")[4] == "-" for line in table), table


@pytest.mark.vllm
@pytest.mark.flashmla
@pytest.mark.interpreter
def test_fp8_prefill_rows_from_32_heads_are_timed_on_the_bf16_workspace(flashmla_on_the_stand_in):
    sel = dataclasses.replace(selection.CPU_SMOKE, variants=(("float8_e4m3fn", True, 0.5),), heads=(64,),
                              decode_rows=(2,), prefill_rows=(8,), reference_rows=(), reference_heads=())
    ctx = Context(impl=default_impl(), device=torch.device("cpu"), timer=Timer(torch.device("cpu")), sel=sel,
                  deadline=float("inf"), l2_bytes=1 << 20, flashmla=flashmla_on_the_stand_in)
    run_flashmla_alone(ctx)
    decode, prefill = ctx.results["flashmla"]
    assert [(c["op"], c["kv"], c["kv_row_bytes"]) for c in decode["calls"]] == [
        ("sparse_decode_fwd", "cache", TOKEN_BYTES)], decode.get("error")
    assert [(c["op"], c["kv"].split()[0], c["kv_row_bytes"]) for c in prefill["calls"]] == [
        ("sparse_prefill_fwd", "workspace", 1152)], prefill.get("error")
    assert prefill["rotation"]["caches"] == 1 and decode["rotation"]["caches"] == 1
    assert prefill["bytes"] == expected_bytes(prefill, 1152) and decode["bytes"] == expected_bytes(decode, TOKEN_BYTES)
    for r in (decode, prefill):
        assert r["rel_l2_vs_reference"] < report.KERNEL_REL_L2_ALARM and "median_s" in r, r
