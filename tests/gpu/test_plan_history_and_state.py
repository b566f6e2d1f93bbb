"""Plan history, poisoned workspaces and graph against eager on every backend the run has
(docs/input-space.md#plan-history, #poisoned-workspaces, #graph-against-eager): the port on
FlashInfer's fa3 kernel, vLLM's SM90 backend (``--vllm``) and FlashMLA (``--vllm`` naming a
release with its kernels), each step judged by ``harness.judge`` with the comparison of its
layer mode (``harness.layer_modes``); the histories and checks are ``harness.plan_history``'s.

- plan history: one step after a fresh plan, a kept plan and a replan, each step against a fresh
  layer's run of it: bit for bit within one history and where the planned lengths are the same,
  within ``PLAN_HISTORY_ULPS`` bf16 ULPs where they differ (their KV split points differ; the
  bound is to be measured here on an H200);
- poisoned workspaces: every byte of the layer's float workspaces (``float_workspaces()``) set
  to 0xFF (NaN) after the plan, before the kernel, beside a clean layer: no output may change;
- graph against eager: the forward (``launch``) captured in a CUDA graph and replayed against the
  same step run eagerly, output and LSE bit for bit; a layer that cannot be captured is skipped
  with its reason (``unsupported: ...``).
The CPU twin (``tests/cpu/test_plan_history_and_state.py``) runs the same checks on the stand-ins
and shows each fails on its bug.
"""

from __future__ import annotations

import pytest

from harness.plan_history import check_graph_against_eager, check_plan_history, check_poisoned_workspaces
from harness.port.launch import DEVICE
from pytest_sparse_mla.backend import open_run_backend

pytestmark = pytest.mark.gpu

BACKENDS = ["port-fa3", pytest.param("vllm", marks=pytest.mark.vllm),
            pytest.param("flashmla", marks=[pytest.mark.vllm, pytest.mark.flashmla])]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Each backend the run has: the port always (on the run's ``--impl``), vLLM's and FlashMLA's
    with ``--vllm``."""
    if request.param == "port-fa3":
        return open_run_backend(request.config, "port-fa3")
    return request.getfixturevalue("vllm_on_gpu" if request.param == "vllm" else "flashmla_on_gpu")


def test_plan_history(backend, judge):
    check_plan_history(judge, backend, DEVICE)


def test_poisoned_workspaces(backend, judge):
    check_poisoned_workspaces(judge, backend, DEVICE)


def test_graph_against_eager(backend, judge):
    check_graph_against_eager(judge, backend, DEVICE)
