"""One child of the plan-limit search (``python3 -m harness.port.plan_limits_child``): plan attempts
served one per input line, or one rows attempt (plan, run, every row judged), its size given on
the command line or, after the child has started, on stdin. A crash, an abort or a hang stays
in the child; a refusal is a result (the exception's type and message)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from mla_constants import DEEPSEEK_V32_SM_SCALE

from ..plan_limits.search import PLAN_WIDTH


def _exception_text(exc: BaseException, limit: int = 600) -> str:
    return f"{type(exc).__name__}: {str(exc)[:limit]}"


#: Exceptions a refusal may raise and leave the process healthy (host-side checks).
HEALTHY_REFUSALS = (ValueError, TypeError, NotImplementedError)


def _refusal(exc: BaseException) -> dict:
    """A refusal as a result: the exception's text, its class and base classes, and whether it
    leaves the process healthy (:data:`HEALTHY_REFUSALS`)."""
    types = [c.__name__ for c in type(exc).__mro__ if c not in (BaseException, object)]
    return {"outcome": "refused", "detail": _exception_text(exc), "exception_types": types,
            "healthy": isinstance(exc, HEALTHY_REFUSALS)}


def _limit_plan(n: int, heads: int, width: int, device, features=None):
    """A wrapper with reserved buffers for ``n`` rows and the host arrays of its plan (each row
    its own request reading ``width`` slots); returns ``(wrapper, plan_kwargs, kv_indices)``."""
    import torch

    from backends.flashinfer.port import open_wrapper
    from mla_constants import KV_LORA_RANK, ROPE_DIM

    i32 = dict(dtype=torch.int32)
    kv_indices = torch.zeros(n * width, device=device, **i32)
    wrapper = open_wrapper(
        device,
        qo_indptr=torch.zeros(n + 1, device=device, **i32), kv_indptr=torch.zeros(n + 1, device=device, **i32),
        kv_indices=kv_indices, kv_len_arr=torch.zeros(n, device=device, **i32), features=features,
    )
    plan = dict(
        qo_indptr=torch.arange(n + 1, **i32), kv_indptr=torch.arange(n + 1, **i32) * width, kv_indices=kv_indices,
        kv_len_arr=torch.full((n,), width, **i32), num_heads=heads, head_dim_ckv=KV_LORA_RANK, head_dim_kpe=ROPE_DIM,
        sm_scale=DEEPSEEK_V32_SM_SCALE, kv_dtype=torch.bfloat16,
    )
    return wrapper, plan, kv_indices


def plan_attempt(n: int, heads: int, width: int = PLAN_WIDTH, device: str = "cuda") -> dict:
    """In the child: plan ``n`` rows (nothing launched); accepted, or refused with the exception."""
    import torch

    start = time.perf_counter()
    result = {"kind": "plan", "rows": n, "heads": heads, "outcome": "accepted", "detail": ""}
    on_cuda = torch.device(device).type == "cuda"
    try:
        wrapper, plan, _ = _limit_plan(n, heads, width, device)
        wrapper.plan(**plan)
        if on_cuda:
            torch.cuda.synchronize()
        del wrapper, plan
    except Exception as exc:
        result.update(_refusal(exc))
    if on_cuda:
        torch.cuda.empty_cache()
    result["seconds"] = time.perf_counter() - start
    return result


def rows_bytes(n: int, heads: int, width: int = PLAN_WIDTH) -> int:
    """Device bytes a rows attempt holds besides the references' chunk: q, out, lse, the slots
    (the kernel's int32 indices and the judge's copy) and the selection mask."""
    return n * (heads * (576 * 2 + 512 * 2 + 4) + width * (4 + 4 + 1))


POOL_SLOTS = 1 << 16  # KV slots the rows of a rows attempt draw from


def rows_attempt(n: int, heads: int, width: int = PLAN_WIDTH, device: str = "cuda", seed: int = 0,
                 emit=print, pool_slots: int = POOL_SLOTS) -> dict:
    """In the child: plan ``n`` rows, run them, and judge every row against the float64 truth
    and the yardstick (:func:`harness.row_check.judge_rows`); the rows read slots drawn from
    ``pool_slots``. ``emit`` gets a JSON line per stage reached, so a parent knows where a child
    that died was."""
    import torch

    from harness.port.launch import nan_buffers
    from harness.row_check import judge_rows
    from harness.scenario import component_seed, query_rows, slot_values_on

    result = {"kind": "rows", "rows": n, "heads": heads, "outcome": "", "detail": "", "stage": "start"}
    start = time.perf_counter()

    def reached(stage: str) -> None:
        result["stage"] = stage
        emit("STAGE " + json.dumps({"stage": stage, "seconds": round(time.perf_counter() - start, 3)}))

    on_cuda = torch.device(device).type == "cuda"
    free = torch.cuda.mem_get_info()[0] if on_cuda else float("inf")
    needed = rows_bytes(n, heads, width) + (6 << 30)
    if needed > 0.9 * free:
        result.update(outcome="not-run", detail=f"needs about {needed / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
        return result
    reached("inputs")
    gen = torch.Generator(device=device).manual_seed(component_seed(seed, f"limit-slots-{n}") & 0x7FFFFFFF)
    wrapper, plan, kv_indices = _limit_plan(n, heads, width, device)
    kv_indices.copy_(torch.randint(0, pool_slots, (n * width,), generator=gen, device=device, dtype=torch.int32))
    q = query_rows(component_seed(seed, "limit-q"), torch.arange(n), heads, 576, device)
    pool = slot_values_on(component_seed(seed, "limit-kv"), torch.arange(pool_slots, device=device), 576,
                          torch.bfloat16)
    ckv, kpe = pool.view(-1, 1, 576)[..., :512], pool.view(-1, 1, 576)[..., 512:]  # the kernel's [N, 1, D] views
    out, lse = nan_buffers(n, heads, device)
    try:
        reached("plan")
        wrapper.plan(**plan)
    except Exception as exc:
        result.update(_refusal(exc))
        return result
    try:
        reached("run")
        wrapper.run(q[..., :512], q[..., 512:], ckv, kpe, out=out, lse=lse)
        if on_cuda:
            torch.cuda.synchronize()
    except Exception as exc:
        result.update(outcome="run-error", detail=_exception_text(exc))
        return result
    reached("judge")
    slots = kv_indices.view(n, width)
    mask = torch.ones((n, width), dtype=torch.bool, device=device)
    report = judge_rows(out, lse, q[..., :512], q[..., 512:], pool[:, :512], pool[:, 512:], slots, mask,
                        sm_scale=DEEPSEEK_V32_SM_SCALE)
    summary = report.summary()
    nonfinite = int((~torch.isfinite(out.float()).flatten(1).all(dim=1) | ~torch.isfinite(lse).all(dim=1)).sum())
    result.update(summary=summary, nonfinite_rows=nonfinite, seconds=time.perf_counter() - start)
    if report.ok:
        result.update(outcome="right", detail=f"every row within budget (worst {summary['worst_ratio']:.2f}x)")
    else:
        result.update(outcome="wrong", detail=f"{summary['bad_rows']} of {n} rows beyond the budget, no error; "
                                              f"first {summary['first_bad']}; {nonfinite} rows not finite")
    reached("done")
    return result


def serve_plans(lines, emit=print) -> None:
    """In the child: one plan attempt per input line ``N H`` (width on the command line), one
    ``RESULT`` line each."""
    for line in lines:
        if not line.strip():
            continue
        n, heads, width = (int(x) for x in line.split())
        emit("RESULT " + json.dumps(plan_attempt(n, heads, width)))


def warm_up(device: str = "cuda") -> None:
    """In a rows child before its size is known: what every rows attempt imports (FlashInfer
    too, where it imports) and CUDA."""
    import torch

    from backends.flashinfer.port import signature_features
    from harness import row_check  # noqa: F401
    from harness.port import launch  # noqa: F401

    try:
        signature_features()
    except ImportError:
        pass  # the attempt reports it, as a child started for it would
    if torch.device(device).type == "cuda":
        torch.zeros(1, device=device)


def rows_from_line(line: str, emit=print, device: str = "cuda", **options) -> dict:
    """In a warm rows child: the rows attempt of one input line ``N H W SEED``."""
    n, heads, width, seed = (int(x) for x in line.split())
    return rows_attempt(n, heads, width, device=device, seed=seed, emit=emit, **options)


def environment() -> dict:
    """In the child: the FlashInfer version and the GPU, or ``unavailable``: why the SM90
    FlashInfer path cannot run here."""
    import torch

    from harness.availability import sm90_flashinfer_unavailable_reason

    reason = sm90_flashinfer_unavailable_reason()
    if reason:
        return {"unavailable": reason}
    from backends.registry import installed_flashinfer_version

    p = torch.cuda.get_device_properties(0)
    return {"flashinfer": installed_flashinfer_version(), "torch": torch.__version__, "device": p.name,
            "num_sm": p.multi_processor_count}


def child_main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="one child of the plan-limit search (see harness.plan_limits)")
    parser.add_argument("--environment", action="store_true", help="the FlashInfer version and the GPU, as JSON")
    parser.add_argument("--serve-plans", action="store_true", help="plan attempts read from stdin, 'N H W' per line")
    parser.add_argument("--rows", type=int, help="a rows attempt of this many rows")
    parser.add_argument("--rows-from-stdin", action="store_true",
                        help="start, then make the rows attempt of one line 'N H W SEED' read from stdin")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--width", type=int, default=PLAN_WIDTH)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    emit = lambda text: print(text, flush=True)  # noqa: E731
    if args.environment:
        emit("RESULT " + json.dumps(environment()))
        return 0
    if args.serve_plans:
        serve_plans(sys.stdin, emit)
        return 0
    if args.rows_from_stdin:
        warm_up()
        emit("RESULT " + json.dumps(rows_from_line(sys.stdin.readline(), emit)))
        return 0
    if args.rows is None:
        parser.error("give --environment, --serve-plans, --rows N or --rows-from-stdin")
    emit("RESULT " + json.dumps(rows_attempt(args.rows, args.heads, args.width, seed=args.seed, emit=emit)))
    return 0


if __name__ == "__main__":
    sys.exit(child_main())
