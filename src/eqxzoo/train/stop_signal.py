"""SIGTERM (a preemption notice) and SIGINT (Ctrl-C): before the first step, a stop at once
with nothing to save; from the first step on, a flag the training loop polls.

This module imports no JAX at module level: a command installs `stopping_before_first_step`
before it imports anything heavy, so that a signal while JAX loads is answered too.
"""

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StoppedBeforeFirstStep(BaseException):
    """SIGTERM or SIGINT arrived before the run's first step (while JAX loaded, the data
    opened, the step compiled or the state initialised): nothing was trained, so there is
    nothing to save, and the command ends with `MESSAGE` and exit code 0, as a stop after a
    step does.

    A `BaseException`, like `KeyboardInterrupt`: code that handles failures (``except
    Exception``, a restore telling damage from a failure to read) must not take a stop for
    one of them.
    """

    MESSAGE = "stopped by a signal before the first step: nothing to save"

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def stopped_by_signal(error: BaseException) -> bool:
    """Whether ``error`` is a `StoppedBeforeFirstStep` or was raised while one was handled
    (its ``__cause__`` / ``__context__`` chain holds one): a signal that lands inside JAX's
    tracing can break the cleanup around it, and the error that cleanup raises must not
    hide the stop."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, StoppedBeforeFirstStep):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


_received: list[int] = []


def _stop_now(signum: int, frame: Any) -> None:
    if signum == signal.SIGINT and _preemption_service():
        os.kill(os.getpid(), signal.SIGTERM)  # as `StopSignal` passes it on: see below
        return
    _received.append(signum)
    raise StoppedBeforeFirstStep(signum)


def raise_a_stop_received() -> None:
    """Raise the `StoppedBeforeFirstStep` of a signal received since
    `stopping_before_first_step` began, if any.

    A handler's exception is raised wherever the main thread is, and some places drop it: a
    finaliser (``__del__``, a weakref callback) or a callback from C++ reports it as
    "Exception ignored" and carries on, and the run would train as if no signal had come.
    The run calls this before it writes anything; `StopSignal` calls it as it takes over.
    """
    if _received:
        raise StoppedBeforeFirstStep(_received[0])


def _unraisable(previous: Any) -> Any:
    """A `sys.unraisablehook` that keeps a dropped stop quiet (`raise_a_stop_received`
    raises it again) and passes anything else to ``previous``."""

    def hook(unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, StoppedBeforeFirstStep):
            previous(unraisable)

    return hook


@contextlib.contextmanager
def stopping_before_first_step() -> Iterator[None]:
    """Within, SIGTERM and SIGINT raise `StoppedBeforeFirstStep` wherever the main thread is,
    until a `StopSignal` takes them over for the training loop; the handlers found are put
    back on the way out.

    In a multi-process run, once ``jax.distributed.initialize`` has started JAX's preemption
    service, a stop is that service's: it owns SIGTERM, SIGINT is passed on to it as a
    SIGTERM, and it stops every process at one step, the first, saved. A process that left
    on its own before the others would take their coordination service down with it (or
    leave them waiting in a collective).
    """
    _received.clear()
    previous = {signum: signal.signal(signum, _stop_now) for signum in SIGNALS}
    previous_unraisable, sys.unraisablehook = sys.unraisablehook, _unraisable(sys.unraisablehook)
    try:
        yield
    finally:
        _received.clear()
        sys.unraisablehook = previous_unraisable
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _default_handler(signum: int) -> Any:
    return signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL


class StopSignal:
    """SIGTERM (a preemption notice) or SIGINT (Ctrl-C) as a flag the training loop polls
    between steps.

    Use as a context manager; the loop force-saves and stops when `should_stop(step)`.
    With one process a handler sets the flag. With several, JAX's preemption service
    (started by ``jax.distributed.initialize``) owns SIGTERM and picks one step at which
    every process stops, so they all save the same step; SIGINT is passed on to it as a
    SIGTERM.

    It ends `stopping_before_first_step`: the handlers put back on exit are those found,
    except that a stop at once becomes the interpreter's default (after the loop a stop is
    no longer "before the first step").
    """

    def __init__(self):
        self.received = False
        self._previous: dict[int, Any] = {}

    def __enter__(self):
        import jax

        raise_a_stop_received()
        if jax.process_count() == 1:
            for signum in SIGNALS:
                self._take_over(signum, self._on_signal)
        else:
            self._take_over(signal.SIGINT, self._as_sigterm)
            if signal.getsignal(signal.SIGTERM) is _stop_now and not _preemption_service():
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}

    def _take_over(self, signum: int, handler: Any) -> None:
        previous = signal.signal(signum, handler)
        self._previous[signum] = _default_handler(signum) if previous is _stop_now else previous

    def should_stop(self, step: int) -> bool:
        """Whether to save and stop after ``step``."""
        import jax
        from jax.experimental import multihost_utils

        if jax.process_count() == 1:
            return self.received
        try:
            return multihost_utils.reached_preemption_sync_point(step)
        except RuntimeError:  # preemption service disabled
            return False

    def _on_signal(self, signum, frame) -> None:
        self.received = True

    def _as_sigterm(self, signum, frame) -> None:
        """Ctrl-C in a multi-process run: a SIGTERM to this process, which the preemption
        service turns into a stop at a step every process agrees on."""
        os.kill(os.getpid(), signal.SIGTERM)


def _preemption_service() -> bool:
    """Whether JAX's preemption service runs (its own SIGTERM handler replaced Python's);
    never imports JAX (a signal may arrive while it loads)."""
    distributed = sys.modules.get("jax._src.distributed")
    global_state = getattr(distributed, "global_state", None)
    return getattr(global_state, "preemption_sync_manager", None) is not None
