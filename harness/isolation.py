"""The implementation under test called in a process of its own, for tests that call its host
stages directly rather than through :func:`harness.pipeline.prepare_step` (whose stages run
apart in :func:`harness.pipeline.run_step_in_child`): code under test that kills its process (a
segfault in a convert kernel, say) fails the one call with :class:`ImplementationCrashed`,
naming the stage and the signal, and the session goes on; the next call starts a new process.

:class:`IsolatedImpl` has the seam's host methods (:data:`HOST_STAGES`). Each call is sent to a
worker process started once (spawned: a fork of a process whose torch thread pool has run
hangs), which loads the implementation from its spec and runs the method. CPU tensors travel
through torch's shared memory, so a method that writes into a buffer it is handed (``out=``,
the layout's kv_indices) writes into the caller's buffer, and a buffer handed back is the
caller's own. :func:`crashes_noted` notes a crash on inputs built from a scenario as that
step's crash, for ``--dump-failures``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal

from .case_log import note_crash

#: The seam's methods a test calls directly (fast.impl.SparseMLAImpl), as the stages they are.
HOST_STAGES = ("request_ids", "convert", "kv_lens", "planned_lens", "kv_indptr", "write_kv_indices")
#: Seconds a worker that lost its implementation is given to exit before it is killed.
EXIT_WAIT_S = 10.0


class ImplementationCrashed(RuntimeError):
    """The implementation under test killed the process it ran in."""

    def __init__(self, stage: str, how: str):
        self.stage, self.how = stage, how
        super().__init__(f"the implementation under test killed its process ({how}) at stage {stage}")


def exit_description(code: int | None) -> str:
    """How a process ended, from its exit code (negative: the signal that killed it)."""
    if code is None:
        return "no exit status"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def serve(conn, impl_spec: str) -> None:
    """The worker: load ``impl_spec``, then answer ``(method, args, kwargs)`` requests with
    ``("ok", result)`` or ``("raised", exception)`` until the connection closes."""
    from fast.impl import load_impl

    impl = load_impl(impl_spec)
    while True:
        try:
            method, args, kwargs = conn.recv()
        except EOFError:
            return
        try:
            answer = ("ok", getattr(impl, method)(*args, **kwargs))
        except Exception as exc:  # the code under test raising is an outcome, handed back
            answer = ("raised", exc)
        try:
            conn.send(answer)
        except Exception as exc:  # an exception or result that does not pickle, named
            conn.send(("raised", RuntimeError(f"{method} returned what cannot be handed back: {exc!r}")))


def callers_buffers(result, args: tuple, kwargs: dict):
    """``result`` with the buffer the caller handed as ``out=`` in place of the worker's view of
    it (the same shared memory; the caller compares data pointers)."""
    out = kwargs.get("out")
    if out is None:
        return result
    if isinstance(result, tuple) and result:
        return (out, *result[1:])
    return out


class IsolatedImpl:
    """The host stages of the implementation ``impl_spec`` names, each call run in a worker
    process of its own (see the module docstring)."""

    def __init__(self, impl_spec: str):
        self.impl_spec = impl_spec
        self._worker = None
        self._conn = None

    def __getattr__(self, name):
        if name not in HOST_STAGES:
            raise AttributeError(name)
        return lambda *args, **kwargs: self.call(name, args, kwargs)

    def _started(self):
        if self._worker is None or not self._worker.is_alive():
            context = multiprocessing.get_context("spawn")
            self._conn, child = context.Pipe()
            self._worker = context.Process(target=serve, args=(child, self.impl_spec), daemon=True)
            self._worker.start()
            child.close()
        return self._conn

    def call(self, stage: str, args: tuple, kwargs: dict):
        conn = self._started()
        conn.send((stage, args, kwargs))
        try:
            status, value = conn.recv()
        except EOFError:
            raise ImplementationCrashed(stage, self._ended()) from None
        if status == "raised":
            raise value
        return callers_buffers(value, args, kwargs)

    def _ended(self) -> str:
        """Wait for the worker that lost its connection; how it ended."""
        worker, self._worker = self._worker, None
        worker.join(EXIT_WAIT_S)
        if worker.is_alive():
            worker.kill()
            worker.join()
        return exit_description(worker.exitcode)

    def close(self) -> None:
        if self._worker is not None:
            self._conn.close()
            self._worker.join(EXIT_WAIT_S)
            if self._worker.is_alive():
                self._worker.kill()
            self._worker = None


@contextlib.contextmanager
def crashes_noted(scenario, layout: str):
    """Inside the block, a crash of the implementation under test on inputs built from
    ``scenario`` is noted as that step's crash (:func:`harness.case_log.note_crash`), so that
    ``--dump-failures`` writes its recipe, and raised on."""
    try:
        yield
    except ImplementationCrashed as exc:
        note_crash(scenario, layout, exc.stage, str(exc))
        raise
