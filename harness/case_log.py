"""The differential case a running test is checking, noted by the shared helpers so that
``--dump-failures`` can write it as a fixture when the test fails, whatever the test and
whatever ``--impl``.

A multi-step test notes its sequence instead (:func:`note_sequence`, then
:func:`note_sequence_step` for each step it runs): a failure is then the sequence of its steps so
far. The shared helpers note what they are handed: :func:`harness.pipeline.prepare_step` every step
it prepares, the compare helpers of :mod:`harness.port.launch` the step they judge and the kernel's
outputs, :func:`recording.replay.replay` the fixture it judges. The case of a failing test is
the last one noted. Nothing is kept unless a log is open for the running test
(:func:`logging_cases`; :mod:`recording.case_log` opens one that can build the fixture), so
noting costs nothing otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass(eq=False)  # a log is one test's: two with the same notes are still two logs
class CaseLog:
    step: object | None = None  # harness.pipeline.Step
    inputs: object | None = None  # harness.scenario.AttentionInputs of the step, when a compare saw them
    outputs: dict = field(default_factory=dict)  # version -> (out, lse) of the step, rows as planned
    fixture: object | None = None  # a recording.fixture.Fixture judged by replay()
    crash: dict | None = None  # a step whose stages killed a child process: scenario, layout, stage, detail
    sequence: dict | None = None  # a multi-step test's sequence so far: harness.port.sequence.Sequence fields, steps
    # a case run through a backend behind the seam (harness.case_runner.run_sequence): its backend, layer and
    # steps so far
    backend_case: dict | None = None

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

    def note_sequence(self, kind: str, layout: str, max_rows: int, **options) -> None:
        self.sequence = {"kind": kind, "layout": layout, "max_rows": max_rows, "steps": [], **options}

    def note_sequence_step(self, scenario) -> None:
        if self.sequence is not None:
            self.sequence["steps"].append((scenario.spec, scenario.seed))

    @property
    def empty(self) -> bool:
        return (self.step is None and self.fixture is None and self.crash is None and self.sequence is None
                and self.backend_case is None)


_ACTIVE: list[CaseLog] = []


@contextmanager
def logging_cases(log: CaseLog | None = None) -> Iterator[CaseLog]:
    """Keep the cases noted inside the block in ``log`` (a new :class:`CaseLog` by default),
    which is yielded."""
    log = CaseLog() if log is None else log
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


def note_sequence(kind: str, layout: str, max_rows: int, **options) -> None:
    """A multi-step test starts a sequence (``harness.port.sequence.Sequence``'s kind, layout, row
    capacity and options); a failure in it is written as the sequence of its steps so far."""
    if _ACTIVE:
        _ACTIVE[-1].note_sequence(kind, layout, max_rows, **options)


def note_sequence_step(scenario) -> None:
    """The open sequence's next step (its spec and seed rebuild it)."""
    if _ACTIVE:
        _ACTIVE[-1].note_sequence_step(scenario)


def note_crash(scenario, layout: str, stage: str | None, detail: str) -> None:
    """Note a step whose stages killed the child process they ran in (harness.pipeline.run_step_in_child)."""
    if _ACTIVE:
        _ACTIVE[-1].note_crash(scenario, layout, stage, detail)


def note_backend_case(case: dict | None) -> None:
    """Note the case a backend is running (``harness.case_runner.run_sequence``'s record: the backend,
    the layer, the steps so far as specs and seeds); None: the running case is none a written case
    rebuilds, so none is kept."""
    if _ACTIVE:
        _ACTIVE[-1].backend_case = case
