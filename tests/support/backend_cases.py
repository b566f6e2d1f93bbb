"""Backend cases (``recording.backend_case``) as the tests write them by hand."""

from __future__ import annotations

from harness.plan_history import histories


def port_case(mode: str | None) -> dict:
    """The case ``harness.case_runner.run_sequence`` notes for the fresh history on the port, in ``mode``
    (None: a case noted before the mode was recorded)."""
    spec, seed = histories()["fresh"][0]
    case = {"kind": "sequence", "backend": {"name": "port-fa3", "kernel": "fa3", "release": None,
                                            "module_digest": None, "layout": "compacted", "reuse_plan": False},
            "max_tokens": 3, "twin": False, "compare": True, "with_inputs": True, "adaptive_verification": False,
            "rejected_drafts": 0, "kv_block_stride": None, "steps": [{"spec": spec, "seed": seed, "holes": None}],
            "flashinfer": "none"}
    return case if mode is None else {**case, "layer_mode": mode}


def vllm_case(release: str, module_digest: str | None) -> dict:
    """:func:`port_case` as a case of vLLM ``release`` that ran the SM90 module of sha256 ``module_digest``."""
    return {**port_case(None), "backend": {"name": f"vllm-{release}", "kernel": "fa3", "release": release,
                                           "module_digest": module_digest}}
