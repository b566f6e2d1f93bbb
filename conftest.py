"""Wires the suite's command-line options; the hooks live in ``tests/plugin.py``."""

import os

from harness.gpu_env import count_gpus_without_cuda

# The convert kernel is Triton: without a GPU it runs in Triton's interpreter, which has to be
# chosen before the kernel is defined (on import of fast.convert).
if "TRITON_INTERPRET" not in os.environ and count_gpus_without_cuda() == 0:
    os.environ["TRITON_INTERPRET"] = "1"

from fast.impl import DEFAULT_IMPL_SPEC  # noqa: E402

pytest_plugins = ("tests.plugin", "pytester")


def pytest_addoption(parser):
    group = parser.getgroup("sparse-mla", "sparse MLA differential tester")
    group.addoption(
        "--impl",
        default=DEFAULT_IMPL_SPEC,
        metavar="MODULE:FACTORY",
        help="implementation under test: a factory returning an object with the fast.impl.SparseMLAImpl "
        f"methods (default: {DEFAULT_IMPL_SPEC})",
    )
    group.addoption(
        "--replay",
        action="append",
        default=[],
        metavar="PATH",
        help="replay recorded fixtures (files or folders; repeatable) instead of running the suite",
    )
    group.addoption(
        "--dump-failures",
        default=None,
        metavar="DIR",
        help="write a fixture for every failing differential case into DIR",
    )
    group.addoption(
        "--record-baseline",
        default=None,
        metavar="DIR",
        help="record every GPU-tier case's outputs, error ratios, times and FlashInfer warnings into DIR",
    )
    group.addoption(
        "--compare-baseline",
        default=None,
        metavar="DIR",
        help="compare the installed FlashInfer against a recorded baseline; report into --baseline-out",
    )
    group.addoption(
        "--baseline-out",
        default="baseline-compare",
        metavar="DIR",
        help="where --compare-baseline records this run and writes report.md / report.json (default: baseline-compare)",
    )
