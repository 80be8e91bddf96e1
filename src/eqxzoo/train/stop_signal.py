"""SIGTERM (a preemption notice) and SIGINT (Ctrl-C) as a flag the training loop polls."""

import os
import signal
from typing import Any

import jax
from jax.experimental import multihost_utils


class StopSignal:
    """SIGTERM (a preemption notice) or SIGINT (Ctrl-C) as a flag the training loop polls
    between steps.

    Use as a context manager; the loop force-saves and stops when `should_stop(step)`.
    With one process a handler sets the flag. With several, JAX's preemption service
    (started by ``jax.distributed.initialize``) owns SIGTERM and picks one step at which
    every process stops, so they all save the same step; SIGINT is passed on to it as a
    SIGTERM.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received = False
        self._previous: dict[int, Any] = {}

    def __enter__(self):
        if jax.process_count() == 1:
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._on_signal)
        else:
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._as_sigterm)
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}

    def should_stop(self, step: int) -> bool:
        """Whether to save and stop after ``step``."""
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
