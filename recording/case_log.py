"""The fixture of the differential case a failing test was checking (``--dump-failures``).

The shared helpers note the case under check in :mod:`harness.case_log`; this module opens the
log for a running test (:func:`logging_cases`) and builds the fixture of the last noted case
(:meth:`CaseLog.build`), or of any prepared step (:func:`fixture_from_step`).
"""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager

from harness import case_log as notes
from harness.case_log import note_crash as note_crash  # re-exported: the helpers' noting API
from harness.case_log import note_fixture as note_fixture
from harness.case_log import note_step as note_step
from harness.pipeline import Step
from harness.scenario import build_attention_inputs

from .environment import flashinfer_version
from .fixture import Fixture, build_fixture


class CaseLog(notes.CaseLog):
    def build(self, **meta) -> Fixture | None:
        """The fixture of the last noted case (inputs rebuilt on the host when no compare saw
        them), with ``meta`` added; None when nothing was noted."""
        if self.fixture is not None:
            fx = self.fixture
            fx.meta.update({k: v for k, v in meta.items() if k not in fx.meta})
            return fx
        if self.step is None:
            return None  # a crash is written as a recipe (recording.dump.write_crash)
        step = self.step
        inputs = self.inputs if self.inputs is not None else build_attention_inputs(step.scenario)
        n = step.num_planned
        installed = flashinfer_version() or "kernel"
        outputs = {installed if v == "kernel" else v: (out[:n].detach().cpu(), lse[:n].detach().float().cpu())
                   for v, (out, lse) in self.outputs.items()}
        return fixture_from_step(step, inputs, outputs=outputs, **meta)


def logging_cases() -> AbstractContextManager[CaseLog]:
    """Keep the cases noted inside the block in the yielded :class:`CaseLog`."""
    return notes.logging_cases(CaseLog())


def fixture_from_step(step: Step, inputs, outputs=None, **meta) -> Fixture:
    """A replayable fixture of the step's planned rows (only the referenced KV slots kept)."""
    sc, spec = step.scenario, step.scenario.spec
    n = step.num_planned
    base = dict(
        name=meta.pop("name", None),
        spec=dataclasses.asdict(spec),
        seed=sc.seed,
        layout=step.layout,
        sm_scale=spec.sm_scale,
        k_scale=spec.k_scale,
        kv_dtype=spec.kv_dtype,
        page_size=1,
        causal=False,
        regimes=sc.row_regime[:n],
        row_ctx=sc.row_ctx[:n].tolist(),
        max_rows=step.max_rows,
    )
    base.update(meta)
    return build_fixture(
        meta=base,
        q_nope=inputs.q_nope[:n],
        q_pe=inputs.q_pe[:n],
        ckv=inputs.ckv,
        kpe=inputs.kpe,
        kv_indptr=step.kv_indptr[: n + 1],
        kv_indices=step.kv_indices,
        kv_len=step.planned_lens,
        intended=sc.intended_slots()[:n],
        outputs=outputs,
    )
