"""The `Checkpointer`: saving, listing and restoring the steps of one run directory with an
orbax `CheckpointManager` (see the package's docstring for what a checkpoint holds)."""

import contextlib
import dataclasses
import json
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from grain import DatasetIterator
from jaxtyping import PyTree

from eqxzoo.runtime import counts_of_every_process, on_every_process
from eqxzoo.train.checkpoint.checksums import (
    CHECKSUMS,
    DATA_CHECKSUM,
    data_state_checksum,
    inspect_arrays,
    verify_arrays,
    verify_data_state,
)
from eqxzoo.train.checkpoint.damage import check_readable, is_damage
from eqxzoo.train.checkpoint.data_state import DataStateHandler, DataStateRestore, DataStateSave
from eqxzoo.train.checkpoint.errors import (
    CheckpointDamaged,
    CheckpointError,
    CheckpointMismatch,
    CheckpointUnreadable,
    CheckpointWarning,
)
from eqxzoo.train.checkpoint.orbax_failures import (
    settle_failed_writes,
    short_reason,
    silence_orbax_write_failures,
    wait_for_orbax_writers,
    write_failure,
)

ITEMS = ("state", "data", "meta")
# The files that say what an item holds; orbax reads some checkpoints without them and
# fails later with errors that do not say a file is missing.
ITEM_INDEX_FILES = (("state", "_METADATA"), ("meta", "metadata"))
ASYNC_SAVE_GB = 96  # orbax's default
SYNC_SAVE_GB = 1
STEP_METADATA_FILE = "_CHECKPOINT_METADATA"
# How reading a step went on one process, ordered: every process follows the worst.
READ, DAMAGED, UNREADABLE = 0, 1, 2
TMP_SUFFIX = ".orbax-checkpoint-tmp"


# --- checkpointer ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Damaged:
    """A damaged checkpoint found on restore: why, and where it was moved."""

    step: int
    reason: str
    moved_to: str

    def __str__(self) -> str:
        return (
            f"checkpoint at step {self.step} is damaged ({self.reason}); moved to "
            f"{self.moved_to}; trying an older one"
        )


@dataclasses.dataclass(frozen=True)
class Restored:
    """What `Checkpointer.restore_latest` read: the data iterator was restored in place."""

    step: int
    state: PyTree
    meta: dict
    damaged: tuple[Damaged, ...]


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
        settle_failed_writes()
        silence_orbax_write_failures()
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
            meta=ocp.args.JsonSave(
                {
                    **meta,
                    CHECKSUMS: inspection.checksums,
                    DATA_CHECKSUM: data_state_checksum(data_state),
                }
            ),
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
        """Restore the newest checkpoint that is not damaged onto the shardings in
        ``abstract_state``; the data iterator (if any: generation needs none) is set to the
        saved position in place.

        A damaged checkpoint (`eqxzoo.train.checkpoint.damage`) is moved aside to
        ``damaged-STEP`` with a `CheckpointWarning` (listed in `Restored.damaged`) and the one
        before it is tried. A checkpoint whose arrays are not those of ``abstract_state``
        (names or shapes) stops the restore with `CheckpointMismatch` naming an array and both
        shapes, and one that cannot be read for any other reason with `CheckpointUnreadable`
        naming the step, the file and the error; both move and delete nothing. Returns None
        when there is no checkpoint; raises `CheckpointError` when every one is damaged.
        """
        self.wait()
        self._manager.reload()
        damaged = []
        for step in sorted(self._manager.all_steps(), reverse=True):
            restored, failure = None, None
            try:
                restored = self._restore_step(step, abstract_state)
                if data_iterator is not None:
                    data_iterator.set_state(restored[1])
            except Exception as error:  # noqa: BLE001 - told apart just below
                failure = error
            outcome = READ if failure is None else DAMAGED if is_damage(failure) else UNREADABLE
            worst = max(counts_of_every_process(np.array([outcome]))[:, 0])
            if worst == UNREADABLE:
                if isinstance(failure, CheckpointMismatch):
                    raise failure
                if outcome == UNREADABLE:
                    raise _unreadable(step, failure) from failure
                raise _unreadable(step, RuntimeError("it could not be read on another process"))
            if worst == DAMAGED:
                reason = short_reason(failure) if failure else "damaged on another process"
                found = Damaged(step, reason, self._move_aside(step))
                self._warn(str(found))
                damaged.append(found)
                continue
            if data_iterator is not None:
                data_iterator.start_prefetch()
            state, _, meta = restored
            return Restored(step=step, state=state, meta=meta, damaged=tuple(damaged))
        if damaged:
            reasons = "; ".join(f"step {d.step}: {d.reason}" for d in damaged)
            raise CheckpointError(
                f"no usable checkpoint in {self.directory}: {reasons} (each moved aside to "
                "damaged-STEP)"
            )
        return None

    def _move_aside(self, step: int) -> str:
        """Rename a damaged step's directory to ``damaged-STEP`` (``damaged-STEP.N`` if that
        exists already), out of the run's list of checkpoints; return the new path."""
        source = self.directory / str(step)
        target = self.directory / f"damaged-{step}"
        count = 1
        while target.exists():
            count += 1
            target = self.directory / f"damaged-{step}.{count}"
        if jax.process_index() == 0:
            source.rename(target)
        on_every_process(True)  # every process waits for the rename
        self._manager.reload()
        return str(target)

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
            cause = write_failure(error)
            if cause is None:
                raise
            self._failed = True
            self._writing_step = None
            # orbax leaves the failed save's other write coroutines un-awaited.
            warnings.filterwarnings("ignore", r"coroutine '.*' was never awaited", RuntimeWarning)
            wait_for_orbax_writers()
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
        """Read one step item by item, so that a failure names the item, and verify the
        arrays and the data state against the checksums saved with them."""
        step_directory = self.directory / str(step)
        check_readable(step_directory)
        check_complete(step_directory)
        targets = {
            "meta": ocp.args.JsonRestore(),
            "data": DataStateRestore(),
            "state": ocp.args.StandardRestore(abstract_state),
        }
        restored = {}
        for item, target in targets.items():
            try:
                if item == "state":
                    check_shapes(step, step_directory / item, abstract_state)
                restored[item] = self._manager.restore(
                    step, args=ocp.args.Composite(**{item: target})
                )[item]
            except CheckpointMismatch:
                raise
            except Exception as error:
                kind = CheckpointDamaged if is_damage(error) else CheckpointError
                raise kind(f"{item}: {short_reason(error)}") from error
        meta = restored["meta"]
        if not isinstance(meta, dict):
            raise CheckpointDamaged("meta: not a JSON object")
        verify_data_state(restored["data"], meta.pop(DATA_CHECKSUM, None))
        verify_arrays(restored["state"], meta.pop(CHECKSUMS, None))
        return restored["state"], restored["data"], meta


def check_shapes(step: int, state_directory: epath.Path, abstract_state: PyTree) -> None:
    """Raise `CheckpointMismatch` unless the state item in ``state_directory`` (read from its
    metadata, no array data) holds exactly the arrays of ``abstract_state``, shape for shape.

    orbax would refuse such a restore too, in its own terms (``Requested shape ... is not
    compatible with the stored shape``, or tree structures that "do not match") and naming
    no array; here the message names the first array that differs, by its path in the
    state, with both shapes.
    """
    stored = _shapes(ocp.StandardCheckpointHandler().metadata(state_directory).tree)
    wanted = _shapes(abstract_state)
    differences = [
        f"it has no {'.'.join(key)}, which the state to restore has (shape {shape})"
        if key not in stored
        else f"it holds {'.'.join(key)} with shape {stored[key]}, where the state to restore "
        f"has {shape}"
        for key, shape in wanted.items()
        if stored.get(key) != shape
    ] + [
        f"it holds {'.'.join(key)} (shape {shape}), which the state to restore does not have"
        for key, shape in stored.items()
        if key not in wanted
    ]
    if differences:
        more = f" (and {len(differences) - 1} more)" if len(differences) > 1 else ""
        raise CheckpointMismatch(
            f"the checkpoint of step {step} does not fit this run's model: {differences[0]}"
            f"{more}. The config (or the code) builds another model than the one saved: use "
            "the run's own config or start a new --run-dir; nothing was moved or deleted"
        )


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


def check_complete(step_directory: epath.Path) -> None:
    """Raise `CheckpointDamaged` if the step's metadata or one of its items is missing.

    orbax restores some checkpoints whose metadata file was lost; we do not trust them.
    """
    metadata_file = step_directory / STEP_METADATA_FILE
    if not metadata_file.exists():
        raise CheckpointDamaged(f"its metadata file {STEP_METADATA_FILE} is missing")
    try:
        json.loads(metadata_file.read_text())
    except ValueError as error:
        raise CheckpointDamaged(f"its metadata file {STEP_METADATA_FILE} is corrupt") from error
    for item in ITEMS:
        if not (step_directory / item).is_dir():
            raise CheckpointDamaged(f"item {item!r} is missing")
    for item, name in ITEM_INDEX_FILES:
        if not (step_directory / item / name).is_file():
            raise CheckpointDamaged(f"{item}: its index file {name} is missing")


# --- helpers -----------------------------------------------------------------------------


def _shapes(tree: PyTree) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Each array's shape by its path, as orbax names the arrays of a saved tree (so that a
    state and the metadata of its checkpoint have the same keys)."""
    return {key: tuple(leaf.shape) for key, leaf in ocp.tree.to_flat_dict(tree).items()}


def _unreadable(step: int, error: BaseException) -> CheckpointUnreadable:
    """The one line that stops a restore which failed for a reason other than damage."""
    return CheckpointUnreadable(
        f"cannot read the checkpoint of step {step}: {short_reason(error)}; nothing was moved "
        "or deleted: rerun once the cause is fixed"
    )


def _warn_checkpoint(message: str) -> None:
    warnings.warn(message, CheckpointWarning, stacklevel=3)


def _absolute(directory: str | os.PathLike) -> str:
    """Local paths made absolute (orbax needs it); URLs such as ``gs://...`` unchanged."""
    directory = os.fspath(directory)
    return directory if "://" in directory else os.path.abspath(directory)


def _check_json(value: Any, what: str) -> None:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{what} is not JSON-serialisable: {error}") from error
