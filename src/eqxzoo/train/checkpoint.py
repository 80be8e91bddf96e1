"""Checkpoints: orbax `CheckpointManager`, async, keep-N, one Composite per step.

Every checkpoint holds three items:

- ``state``: the `TrainState` arrays (step, model in the pipeline layout, optimizer state),
  written with ``StandardSave`` and restored onto the *caller's* target shardings, so a
  run can resume on a different mesh;
- ``data``: the data iterator's ``get_state()`` dict as ``process_{i}-of-{n}.json`` files
  (grain's format), read back even when the number of processes changed;
- ``meta``: a JSON dict (run config, seed, counters such as skipped updates).

Restoring walks back from the newest checkpoint: one that cannot be read (a file truncated
or deleted, its metadata missing) is reported in one line and skipped for the one before.
orbax writes a step under a temporary name and renames it when complete, so a save killed
half-way is never listed as a checkpoint.

A save that cannot be written (no space left, a quota, an I/O error) is one
`CheckpointError` naming the step, the cause and the newest good checkpoint, raised once the
save's other writes have ended; its partial temporary directory is removed and the earlier
checkpoints are untouched. Before each save, a free space smaller than the last checkpoint's
size is warned about. orbax's own reports of a failed write (its threads' error logs) are
silenced: the failure reaches the caller as that one error.
"""

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import shutil
import signal
import sys
import textwrap
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from grain import DatasetIterator
from jax.experimental import multihost_utils
from jaxtyping import Array, PyTree
from orbax.checkpoint._src import asyncio_utils

from eqxzoo.errors import UserError
from eqxzoo.runtime import on_every_process

ITEMS = ("state", "data", "meta")
ASYNC_SAVE_GB = 96  # orbax's default
SYNC_SAVE_GB = 1
STEP_METADATA_FILE = "_CHECKPOINT_METADATA"
TMP_SUFFIX = ".orbax-checkpoint-tmp"
SETTLE_SECONDS = 60  # the longest a failed save waits for its other writes to end
CHECKSUMS = "checksums"  # the key of the arrays' checksums in the meta item
_DATA_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be written or read; the message is one line naming the cause."""


class CheckpointWarning(UserWarning):
    """An unusable checkpoint was skipped in favour of an older one."""


# --- the data iterator item --------------------------------------------------------------


def process_index_and_count() -> tuple[int, int]:
    """``(process index, process count)`` of this JAX process: names its data state file."""
    return jax.process_index(), jax.process_count()


def data_state_file(index: int, count: int) -> str:
    """grain's file name for one process's iterator state."""
    return f"process_{index}-of-{count}.json"


class DataStateHandler(ocp.CheckpointHandler):
    """Saves an iterator state dict as ``process_{i}-of-{n}.json``, the file grain writes.

    The state is the global position in the example order, identical on every process, so
    when a checkpoint written by ``m`` processes is restored by ``n != m`` processes each of
    them reads process 0's file. With the same count, each process reads its own file and
    a missing one is an error (the checkpoint is incomplete).
    """

    def save(self, directory: epath.Path, args: ocp.args.CheckpointArgs) -> None:
        index, count = process_index_and_count()
        (directory / data_state_file(index, count)).write_text(json.dumps(args.state, indent=4))

    def restore(self, directory: epath.Path, args: ocp.args.CheckpointArgs | None = None) -> dict:
        index, count = process_index_and_count()
        own = directory / data_state_file(index, count)
        if own.exists():
            return _read_data_state(own)
        counts = {
            int(match.group(2))
            for path in directory.iterdir()
            if (match := _DATA_FILE.fullmatch(path.name))
        }
        if not counts:
            raise CheckpointError("no data iterator state (process_*-of-*.json) in the checkpoint")
        if count in counts or len(counts) > 1:
            raise CheckpointError(f"data iterator state {own.name} is missing")
        (saved_count,) = counts
        first = directory / data_state_file(0, saved_count)
        if not first.exists():
            raise CheckpointError(f"data iterator state {first.name} is missing")
        return _read_data_state(first)

    def metadata(self, directory: epath.Path) -> None:
        return None

    def close(self) -> None:
        pass


def _read_data_state(path: epath.Path) -> dict:
    state = json.loads(path.read_text())
    if not isinstance(state, dict):
        raise CheckpointError("the iterator state is not a JSON object")
    return state


@ocp.args.register_with_handler(DataStateHandler, for_save=True)
@dataclasses.dataclass
class DataStateSave(ocp.args.CheckpointArgs):
    state: dict


@ocp.args.register_with_handler(DataStateHandler, for_restore=True)
@dataclasses.dataclass
class DataStateRestore(ocp.args.CheckpointArgs):
    pass


# --- checkpointer ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Unusable:
    """A checkpoint that was skipped on restore, and why."""

    step: int
    reason: str

    def __str__(self) -> str:
        return f"checkpoint at step {self.step} is unusable ({self.reason}); trying an older one"


@dataclasses.dataclass(frozen=True)
class Restored:
    """What `Checkpointer.restore_latest` read: the data iterator was restored in place."""

    step: int
    state: PyTree
    meta: dict
    skipped: tuple[Unusable, ...]


class Checkpointer:
    """Saves the steps that are due and keeps the newest ``keep`` checkpoints.

    A step is due every ``every`` steps or when forced (`is_due`, the only place that
    decides); the caller asks before preparing the state and `save` does not ask again.
    Saves are asynchronous by default: `save` returns once the arrays are copied off the
    devices (the caller may then donate them) and the files are written in the background.
    `wait` blocks until they are on disk; `close` also releases the manager, and is safe
    to call on every path (after a failed save it releases without waiting).

    Warnings (a skipped checkpoint, short free space) go to ``warn``; by default they are
    `CheckpointWarning` warnings.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        every: int,
        keep: int,
        async_save: bool = True,
        warn: Callable[[str], None] | None = None,
    ):
        assert every >= 1 and keep >= 1, (every, keep)  # `CheckpointConfig` refuses others
        _settle_failed_writes()
        _silence_orbax_write_failures()
        self.every = every
        self.directory = epath.Path(_absolute(directory))
        self._warn = warn or _warn_checkpoint
        self._writing_step: int | None = None  # an asynchronous save still being written
        self._failed = False
        # orbax's writes wait for an asynchronous creation of the item directories to signal
        # success: when it failed (a full disk), they waited 300 s and raised a TimeoutError.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
            cleanup_tmp_directories=True,
            create=True,
        )
        # Synchronous saves write at most SYNC_SAVE_GB at a time, not a host copy of everything.
        handlers = {
            "state": ocp.StandardCheckpointHandler(
                save_concurrent_gb=ASYNC_SAVE_GB if async_save else SYNC_SAVE_GB
            ),
            "data": DataStateHandler(),
            "meta": ocp.JsonCheckpointHandler(),
        }
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_handlers=handlers
        )
        self._stale_steps: tuple[int, ...] = ()

    def is_due(self, step: int, *, force: bool) -> bool:
        """Whether step ``step`` gets a checkpoint: a multiple of ``every``, or ``force``
        (end of run, a stop signal)."""
        return force or step % self.every == 0

    def save(
        self,
        step: int,
        state: PyTree,
        data_iterator: DatasetIterator,
        meta: dict[str, Any],
    ) -> bool:
        """Save ``state``, the iterator's position and ``meta`` as step ``step``.

        Whether the step is due is the caller's question (`is_due`). Returns whether a
        checkpoint was started; a step already saved is not saved again. Raises
        `CheckpointError` if a floating array of ``state`` holds NaN or Inf, if ``meta`` or
        the iterator state is not JSON-serialisable, or if this save (or the asynchronous
        one before it) cannot be written.
        """
        self.wait()
        self._drop_stale_steps()
        if step in self._manager.all_steps():
            return False
        inspection = inspect_arrays(state)
        bad = inspection.non_finite
        if bad:
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise CheckpointError(
                f"refusing to save step {step}: non-finite values in {bad[0]}{more}"
            )
        data_state = data_iterator.get_state()
        _check_json(data_state, f"step {step}: the data iterator state")
        _check_json(meta, f"step {step}: meta")
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=DataStateSave(data_state),
            meta=ocp.args.JsonSave({**meta, CHECKSUMS: inspection.checksums}),
        )
        self._warn_if_space_is_short(step)
        with self._writing(step):
            started = self._manager.save(step, args=args, force=True)
            self._writing_step = step
        return started

    def restore_latest(
        self,
        abstract_state: PyTree[jax.ShapeDtypeStruct],
        data_iterator: DatasetIterator | None,
    ) -> Restored | None:
        """Restore the newest usable checkpoint onto the shardings in ``abstract_state``.

        The data iterator (if any: generation needs none) is set to the saved position in
        place. Unusable checkpoints are
        skipped with a `CheckpointWarning` each (also listed in `Restored.skipped`); they are
        deleted when the next checkpoint is saved. Returns None when there is no
        checkpoint; raises `CheckpointError` when there are some but none is usable.
        """
        self.wait()
        self._manager.reload()
        skipped = []
        for step in sorted(self._manager.all_steps(), reverse=True):
            try:
                state, data_state, meta = self._restore_step(step, abstract_state)
                if data_iterator is not None:
                    data_iterator.set_state(data_state)
                failure = None
            except Exception as error:  # noqa: BLE001 - any read failure makes it unusable
                failure = _one_line(error)
            if not on_every_process(failure is None):
                unusable = Unusable(step, failure or "unreadable on another process")
                self._warn(str(unusable))
                skipped.append(unusable)
                continue
            if data_iterator is not None:
                data_iterator.start_prefetch()
            self._stale_steps = tuple(unusable.step for unusable in skipped)
            return Restored(step=step, state=state, meta=meta, skipped=tuple(skipped))
        if skipped:
            reasons = "; ".join(f"step {u.step}: {u.reason}" for u in skipped)
            raise CheckpointError(f"no usable checkpoint in {self.directory}: {reasons}")
        return None

    def latest_step(self) -> int | None:
        """The newest step saved or being saved, None if there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Every step with a checkpoint (or one being saved), oldest first."""
        return sorted(self._manager.all_steps())

    def wait(self) -> None:
        """Block until every started save is on disk; `CheckpointError` if one failed."""
        if self._writing_step is None:
            return
        with self._writing(self._writing_step):
            self._manager.wait_until_finished()
        self._writing_step = None

    def close(self) -> None:
        """Finish pending saves and release the manager; after a failed save, only release."""
        try:
            if not self._failed:
                self.wait()
        finally:
            with contextlib.suppress(Exception):
                self._manager.close()

    @contextlib.contextmanager
    def _writing(self, step: int) -> Iterator[None]:
        """Turn a failure of the filesystem to write step ``step`` (no space, a quota, an I/O
        error) into one `CheckpointError`, once the save's other writes have ended and the
        step's partial directory is removed. Other failures (a bug) propagate as they are."""
        try:
            yield
        except Exception as error:
            cause = _write_failure(error)
            if cause is None:
                raise
            self._failed = True
            self._writing_step = None
            # orbax leaves the failed save's other write coroutines un-awaited.
            warnings.filterwarnings("ignore", r"coroutine '.*' was never awaited", RuntimeWarning)
            _wait_for_orbax_writers()
            if jax.process_count() == 1:  # else the others may still write there
                self._remove_partial(step)
            older = [good for good in finished_steps(self.directory) if good != step]
            newest = (
                f"the newest good checkpoint is step {older[-1]}"
                if older
                else "there is no earlier checkpoint"
            )
            raise CheckpointError(
                f"checkpoint of step {step} not written: {cause} at {self.directory}; {newest}"
            ) from error

    def _remove_partial(self, step: int) -> None:
        """Remove the temporary directory of the failed save of ``step``."""
        for partial in self.directory.glob(f"{step}{TMP_SUFFIX}*"):
            shutil.rmtree(partial, ignore_errors=True)

    def _warn_if_space_is_short(self, step: int) -> None:
        """Warn when the free space is smaller than the newest checkpoint's size."""
        steps = finished_steps(self.directory)
        if not steps or "://" in str(self.directory):
            return
        newest = self.directory / str(steps[-1])
        size = sum(
            os.path.getsize(os.path.join(root, name))
            for root, _, names in os.walk(newest)
            for name in names
        )
        free = shutil.disk_usage(self.directory).free
        if free < size:
            self._warn(
                f"{free / 2**20:.1f} MiB free at {self.directory}, less than the last checkpoint "
                f"(step {steps[-1]}, {size / 2**20:.1f} MiB): the checkpoint of step {step} "
                "may not fit"
            )

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _restore_step(self, step: int, abstract_state: PyTree) -> tuple[PyTree, dict, dict]:
        """Read one step item by item, so that a failure names the item."""
        check_complete(self.directory / str(step))
        targets = {
            "meta": ocp.args.JsonRestore(),
            "data": DataStateRestore(),
            "state": ocp.args.StandardRestore(abstract_state),
        }
        restored = {}
        for item, target in targets.items():
            try:
                restored[item] = self._manager.restore(
                    step, args=ocp.args.Composite(**{item: target})
                )[item]
            except Exception as error:
                raise CheckpointError(f"{item}: {_one_line(error)}") from error
        meta = restored["meta"]
        verify_arrays(
            restored["state"], meta.pop(CHECKSUMS, None) if isinstance(meta, dict) else None
        )
        return restored["state"], restored["data"], meta

    def _drop_stale_steps(self) -> None:
        """Delete the unusable checkpoints newer than the one this run resumed from.

        They are kept until the run writes its next checkpoint, so that a restore alone
        never deletes anything; from then on the run's history replaces them.
        """
        for step in self._stale_steps:
            if step in self._manager.all_steps():
                self._manager.delete(step)
        self._stale_steps = ()


def finished_steps(directory: epath.Path | os.PathLike) -> list[int]:
    """The steps under ``directory`` whose save finished: renamed from its temporary name, with
    its metadata file written (whether they are readable is `restore_latest`'s question)."""
    directory = epath.Path(directory)
    return sorted(
        int(path.name)
        for path in directory.iterdir()
        if path.name.isdigit() and (path / STEP_METADATA_FILE).exists()
    )


def saves_asynchronously(requested: bool, platform: str) -> bool:
    """Whether a run's checkpoints are written in the background: as ``requested``, except on
    CPU devices, which already live in host memory (an asynchronous save would first copy
    the whole state there again)."""
    return requested and platform != "cpu"


def verify_arrays(state: PyTree, checksums: dict[str, list[int]] | None) -> None:
    """Raise `CheckpointError` if a restored array is not what was saved (its checksum differs;
    checkpoints written before checksums existed have none to compare) or holds NaN/Inf."""
    inspection = inspect_arrays(state)
    if checksums is not None:
        damaged = [
            path for path, sums in inspection.checksums.items() if checksums.get(path) != sums
        ]
        if damaged:
            more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
            raise CheckpointError(
                f"state: {damaged[0]}{more} does not match its checksum: the files were "
                "damaged after they were written"
            )
    if inspection.non_finite:
        raise CheckpointError(f"state: non-finite values in {inspection.non_finite[0]}")


def check_complete(step_directory: epath.Path) -> None:
    """Raise `CheckpointError` if the step's metadata or one of its items is missing.

    orbax restores some checkpoints whose metadata file was lost; we do not trust them.
    """
    metadata_file = step_directory / STEP_METADATA_FILE
    if not metadata_file.exists():
        raise CheckpointError(f"its metadata file {STEP_METADATA_FILE} is missing")
    try:
        json.loads(metadata_file.read_text())
    except ValueError as error:
        raise CheckpointError(f"its metadata file {STEP_METADATA_FILE} is corrupt") from error
    for item in ITEMS:
        if not (step_directory / item).is_dir():
            raise CheckpointError(f"item {item!r} is missing")


@dataclasses.dataclass(frozen=True)
class Inspection:
    """What `inspect_arrays` found in a state: per array path (``.model.embedding.weight``),
    whether its values are all finite (integer arrays are) and its checksum."""

    finite: dict[str, bool]
    checksums: dict[str, list[int]]

    @property
    def non_finite(self) -> list[str]:
        return [path for path, ok in self.finite.items() if not ok]


def inspect_arrays(state: PyTree) -> Inspection:
    """Check every array of ``state`` for NaN/Inf and checksum it, in one compiled pass.

    The checksum of an array is two sums (mod 2^32) over its values' bits, as unsigned
    words: their plain sum, which any single flipped bit changes, and a sum weighted by each
    word's position, which catches words moved around. Both are sums of integers, so they do
    not depend on how the array is sharded: a checkpoint restored onto another mesh gives
    the same checksums.
    """
    leaves_with_paths, _ = jax.tree_util.tree_flatten_with_path(state)
    arrays = [
        (jax.tree_util.keystr(path), leaf)
        for path, leaf in leaves_with_paths
        if isinstance(leaf, jax.Array | np.ndarray)
        and (jnp.issubdtype(leaf.dtype, jnp.number) or leaf.dtype == jnp.bool_)
        and leaf.dtype.itemsize in (1, 2, 4)
    ]
    if not arrays:
        return Inspection({}, {})
    finite, sums = jax.device_get(_inspect(tuple(leaf for _, leaf in arrays)))
    paths = [path for path, _ in arrays]
    return Inspection(
        finite=dict(zip(paths, map(bool, finite), strict=True)),
        checksums={path: [int(a), int(b)] for path, (a, b) in zip(paths, sums, strict=True)},
    )


@jax.jit
def _inspect(leaves):
    finite, sums = [], []
    for leaf in leaves:
        finite.append(
            jnp.all(jnp.isfinite(leaf)) if jnp.issubdtype(leaf.dtype, jnp.inexact) else True
        )
        unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[leaf.dtype.itemsize]
        bits = leaf.astype(jnp.uint8) if leaf.dtype == jnp.bool_ else leaf
        words = jax.lax.bitcast_convert_type(bits, unsigned).astype(jnp.uint32)
        sums.append(jnp.stack([jnp.sum(words), jnp.sum(words * _positions(words.shape))]))
    return jnp.stack(finite), jnp.stack(sums)


def _positions(shape: tuple[int, ...]) -> Array:
    """``1 +`` each element's row-major position (mod 2^32), built in the array's own shape:
    flattening a sharded array to number its words made XLA gather it whole onto every
    device (a 1 GB embedding on 8 CPU devices ran the host out of memory at a save)."""
    position = jnp.ones(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        index = jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
        position = position + index * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    return position


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


# --- helpers -----------------------------------------------------------------------------

_OS_ERROR_CODE = re.compile(r"os_error_code='(\d+)'")  # how TensorStore reports errno


def _write_failure(error: BaseException) -> str | None:
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


def _warn_checkpoint(message: str) -> None:
    warnings.warn(message, CheckpointWarning, stacklevel=3)


@functools.cache
def _settle_failed_writes() -> None:
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


def _wait_for_orbax_writers() -> None:
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
def _silence_orbax_write_failures() -> None:
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


def _absolute(directory: str | os.PathLike) -> str:
    """Local paths made absolute (orbax needs it); URLs such as ``gs://...`` unchanged."""
    directory = os.fspath(directory)
    return directory if "://" in directory else os.path.abspath(directory)


def _check_json(value: Any, what: str) -> None:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{what} is not JSON-serialisable: {error}") from error


def _one_line(error: BaseException) -> str:
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
