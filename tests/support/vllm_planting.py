"""Bugs planted in vLLM's loaded module for a test alone, the judge such a test runs its steps
through, the fa3 stand-in each design plans on, and the selections of the vLLM tests that the
child sessions of the dump/replay journeys run."""

from __future__ import annotations

import inspect
import textwrap

import pytest

from harness.case_runner import Reporter
from harness.cases import KernelConfig
from tests import fa3_stand_in

#: Selections (``-k``) of ``tests/cpu/test_vllm_backend.py``: a sequence through one layer, and a single step.
SEQUENCE = "(sequence_keeps and 4)"
SINGLE_STEP = "(step_executes and decode-mixed-lengths-kpool4)"


BF16 = KernelConfig("bfloat16", True, 16)
BUILDER = "FlashInferMLASparseSM90Builder"


class UnreportedJudge(Reporter):
    """Each step judged, its failure raised, nothing reported to the run's summary (the planted
    bug's failures are what the test expects); a configuration the backend does not serve skips
    the test."""

    def admit(self, backend, config) -> None:
        reason = backend.unsupported(config)
        if reason:
            pytest.skip(f"{backend.name}: {reason}")


def planted(monkeypatch, module, class_name: str, method: str, edits) -> None:
    """Set ``class_name.method`` of vLLM's loaded ``module`` to its own source with each ``(line,
    bug)`` of ``edits`` replaced (each line must occur once: a release that changed it fails here)."""
    cls = getattr(module, class_name)
    source = textwrap.dedent(inspect.getsource(getattr(cls, method)))
    for line, bug in edits:
        assert source.count(line) == 1, f"{class_name}.{method} of {module.__file__} has {source.count(line)}x {line!r}"
        source = source.replace(line, bug)
    source = source.replace("super().", f"super({class_name}, self).")
    namespace = {}
    exec(compile(source, module.__file__, "exec"), module.__dict__, namespace)
    monkeypatch.setattr(cls, method, namespace[method])


def stand_in_for(backend):
    return fa3_stand_in.StandInWrapper if backend.design == "bounded" else fa3_stand_in.StandIn06Wrapper
