"""A standalone reproducer of a written case of vLLM's SM90 backend (``NAME.case.json``): a folder
holding ``repro.py`` and its data ``case.pt``, which need torch (with Triton), FlashInfer and the
vLLM release's files only, nothing of this project.

    python3 -m recording.vllm_repro CASE.case.json --out DIR [--vllm VLLM_ROOT]
    python3 DIR/repro.py VLLM_ROOT

The script is ``recording/vllm_repro_script.py`` with the case's name, the release and module it
was written on and the tolerance policy's numbers for its KV dtype (``reference.budget``) written
into it. It runs vLLM's own ``build()`` and ``forward_mqa()`` for each step in order through one
layer, reads FlashInfer's schedule back, and says whether vLLM's plan/clamp or FlashInfer's kernel
is off (its docstring says how).

The data (``torch.save``) holds every step's concrete tensors, rebuilt here from the case's specs
and seeds as the test built them: the step's common metadata (query split, sequence lengths, host
bounds, positions, the block table as the engine's buffer, the request id of each token row and
the dense-MHA routing the common builder derives), the indexer's top-k rows, q_nope and q_pe, the
intended selection of each planned row (the convert rule's slots, -1 invalid), and the KV cache
as writes: the rows of the layer's cache buffer that differ from a NaN-filled one (the first
step) or from the previous step's cache (later steps of a sequence share one cache, as the test's
do). Only the rows some step writes are stored.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
import sys
from pathlib import Path

import torch

from backends.registry import family_and_release
from backends.seam import BETWEEN_BLOCKS_BYTE
from fast.convert import request_ids
from fast.kvlen import prefills_use_dense_mha
from harness.backend_step import layer_config, step_input
from harness.case_runner import in_one_cache, scenario_of_step
from harness.device_inputs import build_attention_inputs, nan_kv_buffer, with_blocks_apart
from mla_constants import KV_LORA_RANK
from reference.budget import ABS_FLOOR, FACTORS

from .backend_case import load_backend_case, steps_of
from .commands import replay_command, standalone_folder
from .fixture import FixtureError

TEMPLATE = Path(__file__).with_name("vllm_repro_script.py")
SCRIPT_NAME = "repro.py"
DATA_NAME = "case.pt"
#: The only modules the script imports beyond the standard library (vLLM's own files and the
#: FlashInfer they import are loaded at run time from VLLM_ROOT and the installed packages).
ALLOWED_IMPORTS = ("torch", "triton")


def standalone_problem(record: dict) -> str | None:
    """Why a loaded case has no standalone reproducer (None: a case of vLLM's SM90 backend)."""
    name = record["backend"]["name"]
    family, _ = family_and_release(name)
    if family != "vllm" or record["backend"].get("kernel") != "fa3":
        return (f"the case was written on {name}: the standalone reproducer runs vLLM's SM90 backend on FlashInfer "
                "(cases of vllm-X.Y.Z)")
    return None


def step_metadata(scenario, rows_with_padding: int) -> dict:
    """The step's common metadata as vLLM's builder and the common builder read it (host tensors):
    the host's query split (``query_start_loc_cpu``) and the one the step runs on the device
    (``query_start_loc``: the metadata's own where it carries one, else the host's), the request
    ids of the token rows under the device's split."""
    meta = scenario.meta
    host_qsl = meta.query_start_loc_cpu.to(torch.int32)
    device_qsl = getattr(meta, "query_start_loc", None)
    qsl = host_qsl if device_qsl is None else device_qsl.to(torch.int32)
    table = scenario.block_table.to(torch.int32)
    engine_table = torch.zeros(table.shape[0] + 1, table.shape[1], dtype=torch.int32)  # one spare zero row
    engine_table[: table.shape[0]] = table
    bound = meta.seq_lens_cpu_upper_bound
    return {
        "num_reqs": int(meta.num_reqs), "num_actual_tokens": int(meta.num_actual_tokens),
        "num_decodes": int(meta.num_decodes), "num_decode_tokens": int(meta.num_decode_tokens),
        "num_prefills": int(meta.num_prefills), "req_id_rows": int(rows_with_padding),
        "query_start_loc_cpu": host_qsl, "query_start_loc": qsl, "seq_lens": meta.seq_lens.to(torch.int32),
        "seq_lens_cpu_upper_bound": None if bound is None else bound.clone(),
        "positions": None if meta.positions is None else meta.positions.clone(),
        "block_table": engine_table,
        "req_id_per_token": request_ids(qsl[: meta.num_reqs + 1], rows_with_padding),
        "prefill_use_dense_mha": bool(prefills_use_dense_mha(meta, scenario.spec.topk)),
    }


def cache_buffer(cache: torch.Tensor) -> torch.Tensor:
    """The buffer a cache ``[num_blocks, block_size, D]`` lies in, ``[num_blocks, block_stride, D]``
    (itself where its blocks are contiguous), every byte between blocks as the project lays it."""
    num_blocks, block_size, dim = cache.shape
    stride = cache.stride(0) // dim
    if stride == block_size:
        return cache.contiguous()
    base = torch.empty((num_blocks, stride, dim), dtype=cache.dtype)
    base.view(torch.uint8).fill_(BETWEEN_BLOCKS_BYTE)
    base[:, :block_size] = cache
    return base


def fresh_buffer(layout: dict) -> torch.Tensor:
    """What the script starts a cache from (``new_cache`` there): between blocks the byte the
    project lays there, in blocks the NaN row."""
    base = torch.empty((layout["num_blocks"], layout["block_stride"], layout["dim"]), dtype=layout["fill"].dtype)
    base.view(torch.uint8).fill_(layout["between_byte"])
    base[:, : layout["block_size"]] = layout["fill"]
    return base


def changed_rows(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """The rows (of the flat ``[rows, D]`` views) whose bytes differ."""
    a = before.reshape(-1, before.shape[-1]).view(torch.uint8)
    b = after.reshape(-1, after.shape[-1]).view(torch.uint8)
    return (a != b).any(dim=1).nonzero().flatten()


def cache_writes(previous: torch.Tensor | None, base: torch.Tensor, layout: dict) -> dict:
    """The step's cache as writes: the rows of ``base`` that differ from ``previous`` (the cache
    the step before left), or from a fresh buffer where there is none; those that become the NaN
    row ``fill`` as their row ids alone (``fill_rows``), the others with their values."""
    fresh = previous is None
    before = fresh_buffer(layout) if fresh else previous
    rows = changed_rows(before, base)
    values = base.reshape(-1, base.shape[-1])[rows]
    filled = (values.view(torch.uint8) == layout["fill"].view(torch.uint8)).all(dim=1)
    return {"fresh": fresh, "fill_rows": rows[filled], "rows": rows[~filled], "values": values[~filled].clone()}


def layer_dict(config) -> dict:
    fields = dataclasses.asdict(config)
    fields["kv_lora_rank"] = KV_LORA_RANK
    return fields


def standalone_data(record: dict) -> dict:
    """The script's data for a loaded case: the layer, the cache layout and every step's tensors,
    built as ``harness.case_runner.run_sequence`` builds them."""
    rejected = record.get("rejected_drafts", 0)
    scenarios = [scenario_of_step(*step, rejected_drafts=rejected, mtp_draft_step=record.get("mtp_draft_step", 0))
                 for step in steps_of(record)]
    spec0, stride = scenarios[0].spec, record.get("kv_block_stride")
    config = dataclasses.replace(layer_config(spec0, record["max_tokens"],
                                              adaptive_verification=record.get("adaptive_verification", False)),
                                 kv_block_stride=stride)
    shared = None
    if record["with_inputs"] and record["kind"] == "sequence":
        blocks = max(s.num_blocks for s in scenarios)
        shared = nan_kv_buffer((blocks, spec0.block_size, spec0.head_dim), spec0.kv_dtype, "cpu")
    layout, previous, written = None, None, []
    for scenario in scenarios:
        n = step_input(scenario, None).planned_rows
        rows = scenario.topk_indices.shape[0]
        step = {"rows": n, "meta": step_metadata(scenario, rows), "topk_indices": scenario.topk_indices.to(torch.int32),
                "intended": scenario.intended_slots()[:n].to(torch.int64),
                "row_ctx": [int(c) for c in scenario.row_ctx[:n]], "regimes": list(scenario.row_regime[:n]),
                "q_nope": None, "q_pe": None, "cache": None}
        if record["with_inputs"]:
            inputs = build_attention_inputs(scenario, "cpu")
            inputs = in_one_cache(inputs, shared) if shared is not None else inputs
            inputs = with_blocks_apart(inputs, stride) if stride is not None else inputs
            q_rows = scenario.meta.num_decode_tokens if scenario.prefills_to_mha else rows
            step["q_nope"], step["q_pe"] = inputs.q_nope[:q_rows].clone(), inputs.q_pe[:q_rows].clone()
            base = cache_buffer(inputs.kv_cache)
            if layout is None:
                layout = cache_layout(inputs.kv_cache, spec0.kv_dtype)
            elif base.shape != previous.shape:
                raise ValueError(f"the steps' caches differ in shape: {tuple(previous.shape)}, {tuple(base.shape)}")
            step["cache"] = cache_writes(previous, base, layout)
            previous = base.clone()
        written.append(step)
    return {"layer": layer_dict(config), "cache": layout, "steps": written}


def cache_layout(cache: torch.Tensor, kv_dtype: str) -> dict:
    """The shape of a step's cache buffer and what fills it before any write."""
    num_blocks, block_size, dim = cache.shape
    return {"num_blocks": num_blocks, "block_size": block_size, "block_stride": cache.stride(0) // dim, "dim": dim,
            "fill": nan_kv_buffer((dim,), kv_dtype, "cpu"), "between_byte": BETWEEN_BLOCKS_BYTE}


def with_constants(template: str, constants: dict[str, str]) -> str:
    """``template`` with each line ``NAME = ...`` of ``constants`` given the value written there
    (each such line must be there once)."""
    for name, value in constants.items():
        pattern = re.compile(rf"^{re.escape(name)} = .*$", re.MULTILINE)
        if len(pattern.findall(template)) != 1:
            raise ValueError(f"{TEMPLATE}: no single line '{name} = ...' to write")
        line = f"{name} = {value}"
        template = pattern.sub(lambda _, line=line: line, template)
    return template


def script_text(record: dict, case_name: str) -> str:
    """The script for a loaded case: the template with the case and the tolerance policy's
    numbers for its KV dtype written in."""
    kv_dtype = record["steps"][0]["spec"]["kv_dtype"]
    max_factor, mean_factor = FACTORS[kv_dtype]
    case = {"name": record["name"], "nodeid": record.get("nodeid"), "release": record["backend"].get("release"),
            "module_digest": record["backend"].get("module_digest"), "flashinfer": record.get("flashinfer"),
            "kv_dtype": kv_dtype,
            "replay": replay_command(case_name, record.get("impl"), record.get("vllm"))}
    return with_constants(TEMPLATE.read_text(), {
        "CASE": repr(case), "MAX_FACTOR, MEAN_FACTOR": f"{max_factor!r}, {mean_factor!r}",
        "ABS_FLOOR": repr(ABS_FLOOR)})


def write_standalone(case_path, out=None) -> Path:
    """Write the reproducer folder of the case file ``case_path`` (default: beside it,
    ``NAME.standalone``); returns the folder. A case of another backend is a ``FixtureError``."""
    case_path = Path(case_path)
    record = load_backend_case(case_path)
    problem = standalone_problem(record)
    if problem:
        raise FixtureError(f"{case_path}: {problem}")
    folder = Path(out) if out else Path(standalone_folder(case_path))
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(standalone_data(record), folder / DATA_NAME)
    (folder / SCRIPT_NAME).write_text(script_text(record, case_path.name))
    return folder


def run_command(folder: Path, vllm_root=None) -> str:
    """The command that runs the reproducer in ``folder`` on ``vllm_root`` (VLLM_ROOT where none)."""
    root = shlex.quote(str(vllm_root)) if vllm_root else "VLLM_ROOT"
    return f"python3 {shlex.quote(str(folder / SCRIPT_NAME))} {root}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="write a standalone reproducer (torch, FlashInfer and vLLM's files) "
                                                 "of a written case of vLLM's SM90 backend")
    parser.add_argument("case", help="a NAME.case.json written under --dump-failures")
    parser.add_argument("--out", help="the folder to write (default: NAME.standalone beside the case)")
    parser.add_argument("--vllm", help="the folder holding vllm/ to name in the printed command")
    args = parser.parse_args(argv)
    try:
        folder = write_standalone(args.case, args.out)
    except FixtureError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {folder} ({SCRIPT_NAME}, {DATA_NAME})\nrun: {run_command(folder, args.vllm)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
