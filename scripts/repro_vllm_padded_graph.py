"""Standalone reproducer of docs/findings.md#vllm-padded-graph-rows-unplanned: needs torch (with
Triton), FlashInfer and a vLLM release's files (a wheel unpacked, a slice of
``python3 -m backends.vllm.source slice``, or a source checkout); nothing of this project.

    python3 scripts/repro_vllm_padded_graph.py VLLM_ROOT

VLLM_ROOT holds ``vllm/v1/attention/backends/mla/flashinfer_mla_sparse_sm90.py``. The script
takes from that file, unchanged, vLLM's plan state (``_SM90State``: its plan, its pack kernel)
and its builder's row rule (``_kv_lens_host``, ``_row_contexts``), and runs the step vLLM's
runner hands the backend under a FULL CUDA graph: three decode requests padded to the captured
size of four tokens. The runner fills ``query_start_loc`` flat past the live requests and sets
``num_actual_tokens`` to the padded count, so the builder plans ``query_start_loc_cpu[-1]`` = 3
rows while ``forward_mqa`` hands ``run()`` the 4 padded rows. It prints what vLLM planned, what
it ran, and what the installed FlashInfer did: FlashInfer 0.7.4 refuses at run ("q_nope rows
and heads must match the planned query shape."); releases without that check run the live rows
(checked here against a float64 softmax over each row's slots) and leave the padded row unplanned.
Exit status: 0 where FlashInfer ran the step and the live rows are right, 1 where it refused.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

MODULE = "vllm/v1/attention/backends/mla/flashinfer_mla_sparse_sm90.py"
#: Module-level definitions of vLLM's file the state needs (its constants are taken too).
TAKEN = {"_pack_topk_indices", "_clamp_work_kv_end", "_SM90State"}
BUILDER_METHODS = {"_kv_lens_host", "_row_contexts"}
TOPK, KPOOL, HEADS, D_CKV, D_PE = 2048, 4, 16, 512, 64
SM_SCALE = 0.1352


def load_vllm_parts(root: Path) -> tuple[type, object, object]:
    """vLLM's ``_SM90State`` class and its builder's ``_kv_lens_host`` and ``_row_contexts``,
    compiled from the release's own file (its imports of the rest of vLLM left out)."""
    path = root / MODULE
    tree = ast.parse(path.read_text(), str(path))
    body = [n for n in tree.body if isinstance(n, ast.Assign) or getattr(n, "name", None) in TAKEN]
    builder = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("SM90Builder"))
    methods = [n for n in builder.body if getattr(n, "name", None) in BUILDER_METHODS]
    for method in methods:
        method.decorator_list = [d for d in method.decorator_list if getattr(d, "id", "") != "staticmethod"]
    namespace = {"torch": torch, "triton": triton, "tl": tl, "Any": object, "ClassVar": object,
                 "CommonAttentionMetadata": object, "__name__": "vllm_sm90_parts"}
    exec(compile(ast.Module(body=body + methods, type_ignores=[]), str(path), "exec"), namespace)
    missing = sorted((TAKEN | BUILDER_METHODS) - set(namespace))
    if missing:
        raise SystemExit(f"{path}: no {', '.join(missing)}: this reproducer covers the bounded design "
                         "(vLLM 0.31.0 and later); vLLM 0.30.0's strided plan is refused by FlashInfer 0.7")
    return namespace["_SM90State"], namespace["_kv_lens_host"], namespace["_row_contexts"]


def padded_step_metadata(seq_lens: list[int], capture_size: int):
    """What vLLM's runner hands the builder for ``seq_lens`` decodes in the FULL graph of
    ``capture_size`` tokens: padded requests with q_len 0 (query_start_loc flat past the live
    ones), seq_len 0, and ``num_actual_tokens`` the padded token count."""
    live = len(seq_lens)
    qsl = list(range(live + 1)) + [live] * (capture_size - live)
    return SimpleNamespace(num_reqs=capture_size, num_actual_tokens=capture_size,
                           query_start_loc_cpu=torch.tensor(qsl, dtype=torch.int32),
                           seq_lens=torch.tensor(seq_lens + [0] * (capture_size - live), dtype=torch.int32),
                           seq_lens_cpu_upper_bound=None)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not (Path(argv[0]) / MODULE).is_file():
        print(__doc__)
        return 2
    root = Path(argv[0])
    state_cls, kv_lens_host, row_contexts = load_vllm_parts(root)
    import flashinfer

    device = torch.device("cuda")
    seq_lens, capture = [TOPK - 1, TOPK + 6, 300], 4
    cam = padded_step_metadata(seq_lens, capture)
    state = state_cls(device, HEADS, torch.bfloat16, capture, TOPK + 128, D_CKV, D_PE, SM_SCALE, TOPK, KPOOL)
    builder = SimpleNamespace(state=state, _adaptive_verification=False,
                              _row_contexts=lambda qsl, sl: row_contexts(qsl, sl))
    num_rows, kv_lens, exact = kv_lens_host(builder, cam)
    state.plan(num_rows, kv_lens, None, None)  # build(): exact lengths, no clamp
    gen = torch.Generator().manual_seed(0)
    slots_total = 8192
    cache = torch.randn(slots_total, 1, D_CKV + D_PE, generator=gen).to(torch.bfloat16).to(device)
    topk_slots = torch.full((capture, TOPK + 128), -1, dtype=torch.int32)
    for r, n in enumerate(kv_lens.tolist()):
        topk_slots[r, :n] = torch.randperm(slots_total, generator=gen)[:n].to(torch.int32)
    topk_slots = topk_slots.to(device)
    state.pack_indices(topk_slots)  # forward_mqa: every token row, the padded one included
    q = torch.randn(capture, HEADS, D_CKV + D_PE, generator=gen).to(torch.bfloat16).to(device)
    q_nope, q_pe = q[..., :D_CKV], q[..., D_CKV:]
    print(f"vLLM release files: {root}; FlashInfer {flashinfer.__version__}")
    print(f"vLLM's build() planned {num_rows} rows (query_start_loc_cpu[-1]; exact lengths {exact}: "
          f"{kv_lens.tolist()}); forward_mqa hands run() {q_nope.shape[0]} rows (num_actual_tokens, padded)")
    try:
        out = state.wrapper.run(q_nope, q_pe, cache[..., :D_CKV], cache[..., D_CKV:])
    except ValueError as exc:
        print(f"FlashInfer {flashinfer.__version__}: run() raised ValueError: {exc}")
        return 1
    torch.cuda.synchronize()
    worst = 0.0
    for r, n in enumerate(kv_lens.tolist()):
        sel = topk_slots[r, :n].long()
        kv = cache[sel, 0].double()
        scores = (q[r].double() @ kv.T) * SM_SCALE
        ref = torch.softmax(scores, dim=-1) @ kv[:, :D_CKV]
        worst = max(worst, float((out[r].double() - ref).abs().max()))
    print(f"FlashInfer {flashinfer.__version__}: run() ran; the {num_rows} planned rows' max |out - float64| "
          f"{worst:.3g}; the padded row {capture - 1} is not planned (its output is undefined)")
    return 0 if worst < 0.05 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
