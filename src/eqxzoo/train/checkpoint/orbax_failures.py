"""What orbax and TensorStore do when a write fails, and how a save is made to fail in one
line: wait for the other writes, silence the echoes, name the operating system's reason."""

import asyncio
import functools
import logging
import os
import re
import sys
import textwrap
import threading
import time
import traceback
from collections.abc import Coroutine
from typing import Any

from orbax.checkpoint._src import asyncio_utils

from eqxzoo.train.checkpoint.errors import CheckpointError

SETTLE_SECONDS = 60  # the longest a failed save waits for its other writes to end


_OS_ERROR_CODE = re.compile(r"os_error_code='(\d+)'")  # how TensorStore reports errno


def write_failure(error: BaseException) -> str | None:
    """The operating system's reason (``no space left on device``) when ``error`` or one in its
    chain is a failed file operation, else None."""
    while error is not None:
        code = getattr(error, "errno", None) if isinstance(error, OSError) else None
        if code is None and (match := _OS_ERROR_CODE.search(str(error))):
            code = int(match.group(1))
        if code:
            return os.strerror(code).lower()
        error = error.__cause__ or error.__context__
    return None


@functools.cache
def settle_failed_writes() -> None:
    """Make orbax's event loops, when their coroutine fails, wait for the tasks it started
    before they close (installed once per process).

    orbax runs each part of a save (an item's array writes, its metadata) with
    `asyncio_utils.run_sync` on a new event loop, closed as soon as the coroutine returns or
    raises. When one of TensorStore's writes of a ``gather`` fails, the others are still in
    flight: the loop was closed under them, and TensorStore ended them afterwards, writing
    their files into the partial directory once it had been removed, and delivering their
    failures into a loop that no longer ran them. Those failures were reported when they were
    collected, at exit, after the run's error line ("Future exception was never retrieved" and
    TensorStore's raw error, which carries no traceback to recognise it by). An orbax without
    that function is left as it is.
    """
    run_on_new_loop = getattr(asyncio_utils, "_run_sync_via_new_loop", None)
    if run_on_new_loop is not None:
        asyncio_utils._run_sync_via_new_loop = lambda coroutine: run_on_new_loop(
            _settled(coroutine)
        )


async def _settled(coroutine: Coroutine) -> Any:
    """Await ``coroutine``; if it fails, first wait (at most `SETTLE_SECONDS`) for the other
    tasks of the event loop, and retrieve their failures."""
    try:
        return await coroutine
    except Exception:
        deadline = time.monotonic() + SETTLE_SECONDS
        this = asyncio.current_task()
        while (others := asyncio.all_tasks() - {this}) and time.monotonic() < deadline:
            ended, _ = await asyncio.wait(others, timeout=deadline - time.monotonic())
            for task in ended:
                if not task.cancelled():
                    task.exception()
        raise


def wait_for_orbax_writers() -> None:
    """Wait (at most `SETTLE_SECONDS`) for the threads orbax started to write a save: orbax
    raises the failure of one while the others may still be writing into the partial
    directory. (`threading.Thread.join`: orbax's own ``join`` re-raises their failures.)"""
    deadline = time.monotonic() + SETTLE_SECONDS
    for thread in threading.enumerate():
        if (
            type(thread).__module__.startswith("orbax.")
            and thread is not threading.current_thread()
        ):
            threading.Thread.join(thread, max(0.0, deadline - time.monotonic()))


@functools.cache
def silence_orbax_write_failures() -> None:
    """Silence orbax's own reports of a failed write (installed once per process).

    orbax's threads log the failure with its traceback; when a loop's tasks outlive a
    `SETTLE_SECONDS` wait, their completions call back into the closed loop ("RuntimeError:
    Event loop is closed", printed as an unraisable exception) and the pending write
    coroutines are collected (at exit, "sys.meta_path is None"). The failure itself reaches
    the caller of the save (or of the wait for it): these echoes are dropped.
    """
    previous_hook = sys.unraisablehook

    def unraisable_hook(unraisable) -> None:
        error = unraisable.exc_value
        closed_loop = isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
        code = getattr(unraisable.object, "cr_code", None)
        orbax_coroutine = code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename
        if not (closed_loop or orbax_coroutine):
            previous_hook(unraisable)

    sys.unraisablehook = unraisable_hook
    for logger in ("absl", "asyncio"):
        logging.getLogger(logger).addFilter(lambda record: not _echoes_orbax_failure(record))


def _echoes_orbax_failure(record: logging.LogRecord) -> bool:
    """Whether a log record reports an exception raised in orbax's code."""
    if not record.exc_info or record.exc_info[2] is None:
        return False
    frames = traceback.extract_tb(record.exc_info[2])
    return any(f"{os.sep}orbax{os.sep}" in frame.filename for frame in frames)


def short_reason(error: BaseException) -> str:
    """A short one-line reason, without TensorStore's spec dumps.

    orbax wraps TensorStore's errors ("error while reading array index ...") around the
    informative one ("Error reading "w/0.0" ...: byte range ... not valid"): take the root
    cause, unless the error is already ours.
    """
    while not isinstance(error, CheckpointError) and error.__cause__ is not None:
        error = error.__cause__
    text = str(error) or type(error).__name__
    for cut in (" [tensorstore_spec", " See full TensorStore details", "\n"):
        text = text.split(cut)[0]
    return textwrap.shorten(text, 240, placeholder=" ...")
