"""The differential case a running test is checking, kept so that ``--dump-failures`` can write
it as a fixture when the test fails, whatever the test and whatever ``--impl``.

The shared helpers note what they are handed: :func:`harness.pipeline.prepare_step` every step
it prepares, the compare helpers of :mod:`harness.launch` the step they judge and the kernel's
outputs, :func:`recording.replay.replay` the fixture it judges. The case of a failing test is
the last one noted. Nothing is kept unless the plugin opened a log for the running test
(:func:`logging_cases`), so noting costs nothing otherwise.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class CaseLog:
    step: object | None = None  # harness.pipeline.Step
    inputs: object | None = None  # harness.scenario.AttentionInputs of the step, when a compare saw them
    outputs: dict = field(default_factory=dict)  # version -> (out, lse) of the step, rows as planned
    fixture: object | None = None  # a recording.fixture.Fixture judged by replay()
    crash: dict | None = None  # a step whose stages killed a child process: scenario, layout, stage, detail

    def note_step(self, step, inputs=None, outputs: dict | None = None) -> None:
        if step is not self.step:
            self.step, self.inputs, self.outputs = step, None, {}
        self.fixture = None
        if inputs is not None:
            self.inputs = inputs
        if outputs:
            self.outputs.update(outputs)

    def note_fixture(self, fixture) -> None:
        self.fixture = fixture

    def note_crash(self, scenario, layout: str, stage: str | None, detail: str) -> None:
        self.step, self.inputs, self.outputs, self.fixture = None, None, {}, None
        self.crash = {"scenario": scenario, "layout": layout, "stage": stage, "detail": detail}

    @property
    def empty(self) -> bool:
        return self.step is None and self.fixture is None and self.crash is None

    def build(self, **meta):
        """The fixture of the last noted case (inputs rebuilt on the host when no compare saw
        them), with ``meta`` added; None when nothing was noted."""
        if self.fixture is not None:
            fx = self.fixture
            fx.meta.update({k: v for k, v in meta.items() if k not in fx.meta})
            return fx
        if self.step is None:
            return None  # a crash is written as a recipe (recording.dump.write_crash)
        from harness.pipeline import fixture_from_step
        from harness.scenario import build_attention_inputs

        step = self.step
        inputs = self.inputs if self.inputs is not None else build_attention_inputs(step.scenario)
        from .environment import flashinfer_version

        n = step.num_planned
        installed = flashinfer_version() or "kernel"
        outputs = {installed if v == "kernel" else v: (out[:n].detach().cpu(), lse[:n].detach().float().cpu())
                   for v, (out, lse) in self.outputs.items()}
        return fixture_from_step(step, inputs, outputs=outputs, **meta)


_ACTIVE: list[CaseLog] = []


@contextmanager
def logging_cases():
    """Keep the cases noted inside the block in the yielded :class:`CaseLog`."""
    log = CaseLog()
    _ACTIVE.append(log)
    try:
        yield log
    finally:
        _ACTIVE.remove(log)


def note_step(step, inputs=None, out=None, lse=None, version: str | None = None) -> None:
    """Note the step under check (and the kernel's ``out``/``lse`` for it, under ``version``)."""
    if _ACTIVE:
        outputs = {version or "kernel": (out, lse)} if out is not None and lse is not None else None
        _ACTIVE[-1].note_step(step, inputs, outputs)


def note_fixture(fixture) -> None:
    """Note a fixture under check (a failing replay dumps the fixture itself)."""
    if _ACTIVE:
        _ACTIVE[-1].note_fixture(fixture)


def note_crash(scenario, layout: str, stage: str | None, detail: str) -> None:
    """Note a step whose stages killed the child process they ran in (harness.pipeline.run_step_in_child)."""
    if _ACTIVE:
        _ACTIVE[-1].note_crash(scenario, layout, stage, detail)
