"""Checkpoints: bitwise round trips, resharding onto other meshes, keep-N, damaged
checkpoints (moved aside) and ones that cannot be read (nothing touched), non-finite
refusal, data iterator state across process counts, SIGTERM, saves that cannot be
written."""

import contextlib
import errno
import functools
import gc
import json
import logging
import os
import re
import resource
import shutil
import signal
import tempfile
import types
import warnings
from collections.abc import Callable
from pathlib import Path

import equinox as eqx
import failing_writes
import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from damaging import array_files, delete_array_files, flip_a_byte, truncate_array_files
from jax.sharding import SingleDeviceSharding
from orbax.checkpoint._src.multihost import multihost
from orbax.checkpoint._src.path import async_path
from orbax.checkpoint._src.serialization import jax_array_handlers, serialization

import models
from eqxzoo.optim import OptimizerConfig
from eqxzoo.parallel import MeshConfig, Schedule, make_mesh
from eqxzoo.train import checkpoint
from eqxzoo.train.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointUnreadable,
    CheckpointWarning,
    checksums,
    data_state,
    inspect_arrays,
)
from eqxzoo.train.settings import StepConfig
from eqxzoo.train.state import (
    TrainState,
    abstract_state,
    init_train_state,
    state_shardings,
    train_state_axes,
)
from eqxzoo.train.stop_signal import StopSignal

MODEL = functools.partial(
    models.DecoderLM,
    models.LlamaConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, mlp_dim=16),
)
STEP_CONFIG = StepConfig(
    schedule=Schedule("gpipe", 2, 2, 1), optimizer=OptimizerConfig(freeze=(r"^\.embedding",))
)
META = {"config": {"model": "tiny", "lr": 3e-4}, "seed": 0, "skipped_updates": 2}
ONE_DEVICE = SingleDeviceSharding(jax.devices()[0])


def data_iterator(position: int = 0):
    iterator = grain.MapDataset.range(1000).to_iter_dataset().__iter__()
    for _ in range(position):
        next(iterator)
    return iterator


def small_state(seed: int = 0) -> dict:
    """A few arrays, one large enough (16 KiB) that its bytes live in their own file."""
    return {
        "step": jnp.asarray(seed, jnp.int32),
        "w": jax.random.normal(jax.random.key(seed), (64, 64)),
        "b": jnp.arange(8, dtype=jnp.bfloat16),
    }


def small_abstract() -> dict:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=ONE_DEVICE), small_state()
    )


def train_state_on(mesh_config: MeshConfig) -> tuple[TrainState, jax.sharding.Mesh]:
    mesh = make_mesh(mesh_config, jax.devices()[: mesh_config.size])
    return init_train_state(MODEL, jax.random.key(0), config=STEP_CONFIG, mesh=mesh), mesh


def train_state_shapes():
    return eqx.filter_eval_shape(
        lambda: init_train_state(
            MODEL,
            jax.random.key(0),
            config=STEP_CONFIG,
            mesh=make_mesh(MeshConfig(pp=2), jax.devices()[:2]),
        )
    )


@pytest.fixture(scope="module")
def mesh_state():
    """A TrainState on dp2 x pp2 x tp2, with an Adam step count moved off zero."""
    state, _ = train_state_on(MeshConfig(dp=2, pp=2, tp=2))
    return eqx.tree_at(lambda s: s.step, state, state.step + 5)


def assert_bitwise_equal(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert a.dtype == e.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def save_steps(directory, steps, *, keep=5):
    with Checkpointer(directory, every=1, keep=keep, async_save=False) as checkpointer:
        for step in steps:
            assert checkpointer.save(
                step, small_state(step), data_iterator(10 * step), {"step": step}
            )


def test_round_trip_is_bitwise_on_the_same_mesh(tmp_path, mesh_state):
    mesh = make_mesh(MeshConfig(dp=2, pp=2, tp=2))
    expected = jax.device_get(mesh_state)
    state = jax.tree.map(jnp.copy, mesh_state)
    iterator = data_iterator(5)
    with Checkpointer(tmp_path, every=3, keep=2) as checkpointer:
        assert checkpointer.save(3, state, iterator, META)
        for leaf in jax.tree.leaves(state):  # as a donating train step would
            leaf.delete()
        checkpointer.wait()
    saved_iterator_state = json.loads((tmp_path / "3" / "data" / "process_0-of-1.json").read_text())
    assert saved_iterator_state == iterator.get_state()

    target = abstract_state(mesh_state, jax.tree.map(lambda x: x.sharding, mesh_state))
    resumed_iterator = data_iterator()
    with Checkpointer(tmp_path, every=3, keep=2) as checkpointer:
        restored = checkpointer.restore_latest(target, resumed_iterator)
    assert (restored.step, restored.meta, restored.damaged) == (3, META, ())
    assert isinstance(restored.state, TrainState)
    assert_bitwise_equal(restored.state, expected)
    for leaf, sharding in zip(
        jax.tree.leaves(restored.state), jax.tree.leaves(target), strict=True
    ):
        assert leaf.sharding == sharding.sharding
    assert restored.state.model.blocks.layers.attention.wq.sharding.mesh == mesh
    assert next(resumed_iterator) == 5


@pytest.mark.parametrize("target", ["dp4-pp2", "one-device"])
def test_restore_onto_another_mesh(tmp_path, mesh_state, target):
    with Checkpointer(tmp_path, every=1, keep=1, async_save=False) as checkpointer:
        checkpointer.save(1, mesh_state, data_iterator(), META)

    shapes = train_state_shapes()
    if target == "dp4-pp2":
        shardings = state_shardings(
            shapes,
            train_state_axes(MODEL, config=STEP_CONFIG),
            config=STEP_CONFIG,
            mesh=make_mesh(MeshConfig(dp=4, pp=2)),
        )
    else:
        shardings = jax.tree.map(lambda _: ONE_DEVICE, shapes)
    with Checkpointer(tmp_path, every=1, keep=1) as checkpointer:
        restored = checkpointer.restore_latest(abstract_state(shapes, shardings), data_iterator())
    assert_bitwise_equal(restored.state, jax.device_get(mesh_state))
    for leaf, sharding in zip(
        jax.tree.leaves(restored.state), jax.tree.leaves(shardings), strict=True
    ):
        assert leaf.sharding == sharding
    if target == "dp4-pp2":
        assert dict(restored.state.model.blocks.layers.attention.wq.sharding.mesh.shape) == {
            "dp": 4,
            "pp": 2,
            "tp": 1,
            "ep": 1,
            "cp": 1,
        }


def test_saves_every_n_steps_and_keeps_the_last_n(tmp_path):
    with Checkpointer(tmp_path, every=2, keep=2) as checkpointer:
        saved = [
            step
            for step in range(1, 10)
            if checkpointer.is_due(step, force=step == 9)
            and checkpointer.save(step, small_state(step), data_iterator(step), {})
        ]
        assert not checkpointer.save(9, small_state(9), data_iterator(9), {})
        checkpointer.wait()
        assert saved == [2, 4, 6, 8, 9]
        assert checkpointer.all_steps() == [8, 9] and checkpointer.latest_step() == 9
    assert sorted(path.name for path in tmp_path.iterdir() if path.name.isdigit()) == ["8", "9"]


def _edit_data_state(step_dir):
    path = step_dir / "data" / "process_0-of-1.json"
    state = json.loads(path.read_text())
    state["next_index"] = state.get("next_index", 0) + 1
    path.write_text(json.dumps(state, indent=4))


DAMAGES = {
    "truncated-array": (truncate_array_files, r"state: OUT_OF_RANGE: Error reading \"w/0\.0\""),
    "deleted-array": (delete_array_files, r"state: FAILED_PRECONDITION: .*w/0\.0"),
    "missing-metadata": (
        lambda d: (d / "_CHECKPOINT_METADATA").unlink(),
        r"its metadata file _CHECKPOINT_METADATA is missing",
    ),
    "truncated-meta": (
        lambda d: (d / "meta" / "metadata").write_text('{"st'),
        r"meta: Unterminated string",
    ),
    "deleted-data-state": (
        lambda d: (d / "data" / "process_0-of-1.json").unlink(),
        r"data: no data iterator state",
    ),
    "flipped-bit": (
        flip_a_byte,
        r"state: \S+ does not match its checksum: the files were damaged after they were "
        r"written",
    ),
    "data-state-not-an-object": (
        lambda d: (d / "data" / "process_0-of-1.json").write_text("[]"),
        r"data: the iterator state is not a JSON object",
    ),
    "edited-data-state": (
        _edit_data_state,
        r"data: the iterator state does not match its checksum: the file was changed after it "
        r"was written",
    ),
}


def listing(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


# When one array cannot be read, orbax leaves the other reads' exceptions unretrieved.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", DAMAGES, ids=list(DAMAGES))
def test_a_damaged_latest_is_moved_aside_and_the_previous_restored(tmp_path, damage):
    damage_fn, reason = DAMAGES[damage]
    save_steps(tmp_path, [1, 2])
    damage_fn(tmp_path / "2")
    damaged_files = snapshot(tmp_path / "2")

    iterator = data_iterator()
    checkpointer = Checkpointer(tmp_path, every=1, keep=2)
    with pytest.warns(
        CheckpointWarning,
        match=rf"^checkpoint at step 2 is damaged \({reason}.*\); moved to "
        rf"{tmp_path}/damaged-2; trying an older one$",
    ):
        restored = checkpointer.restore_latest(small_abstract(), iterator)
    assert restored.step == 1 and [d.step for d in restored.damaged] == [2]
    assert_bitwise_equal(restored.state, small_state(1))
    assert restored.meta == {"step": 1} and next(iterator) == 10
    assert listing(tmp_path) == ["1", "damaged-2"]
    assert snapshot(tmp_path / "damaged-2") == damaged_files  # moved, not changed

    # The run goes on from step 1; keep=2 removes only the oldest, never what was moved aside.
    for step in (2, 3):
        assert checkpointer.save(step, small_state(step), data_iterator(10 * step), {"step": step})
    checkpointer.close()
    assert listing(tmp_path) == ["2", "3", "damaged-2"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        restored = Checkpointer(tmp_path, every=1, keep=2).restore_latest(
            small_abstract(), data_iterator()
        )
    assert restored.step == 3


def state_restore_raises(monkeypatch, error: BaseException) -> None:
    """Reading the ``state`` item raises ``error`` (until monkeypatch undoes it)."""
    restore = ocp.CheckpointManager.restore

    def failing(self, step, args=None, **kwargs):
        if args is not None and "state" in args:
            raise error
        return restore(self, step, args=args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "restore", failing)


@contextlib.contextmanager
def as_another_user():
    """Run the body without root's right to read every file (tests may run as root)."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(65534)  # nobody
    try:
        yield
    finally:
        os.seteuid(0)


def open_to_everyone(directory: Path) -> None:
    for path in [directory, *directory.rglob("*")]:
        path.chmod(0o777 if path.is_dir() else 0o666)


def unreadable_array_file(monkeypatch, directory: Path) -> None:
    """One array file of step 2 loses its read permission."""
    (path,) = array_files(directory / "2")[:1]
    path.chmod(0)


READ_FAILURES = {
    "io-error": (
        lambda monkeypatch, _: state_restore_raises(
            monkeypatch, OSError(errno.EIO, "Input/output error", "/nfs/ckpt/2/state/d/0")
        ),
        r"state: \[Errno 5\] Input/output error: '/nfs/ckpt/2/state/d/0'",
    ),
    "memory": (
        lambda monkeypatch, _: state_restore_raises(monkeypatch, MemoryError()),
        r"state: MemoryError",
    ),
    "our-bug": (
        lambda monkeypatch, _: state_restore_raises(monkeypatch, KeyError("a bug of ours")),
        r"state: 'a bug of ours'",
    ),
    "permission-denied": (
        unreadable_array_file,
        r"\S+/2/state/ocdbt\.process_0/d/\w+: Permission denied",
    ),
}


@pytest.mark.parametrize("failure", READ_FAILURES, ids=list(READ_FAILURES))
def test_a_checkpoint_that_cannot_be_read_stops_the_restore_and_nothing_is_touched(
    monkeypatch, failure
):
    """An I/O error, memory, a bug or a permission is not damage: the checkpoint may be good.
    The restore stops in one line naming the step, the file and the error; nothing is moved or
    deleted, and once the cause is gone the same newest checkpoint restores."""
    inject, reason = READ_FAILURES[failure]
    directory = Path(tempfile.mkdtemp(prefix="eqxzoo-unreadable-"))  # readable by another user
    try:
        save_steps(directory, [1, 2])
        open_to_everyone(directory)
        before = snapshot(directory)
        with monkeypatch.context() as patched:
            inject(patched, directory)
            with (
                as_another_user(),
                warnings.catch_warnings(),
                pytest.raises(CheckpointUnreadable) as stopped,
            ):
                warnings.simplefilter("error", CheckpointWarning)
                Checkpointer(directory, every=1, keep=5).restore_latest(
                    small_abstract(), data_iterator()
                )
        assert re.fullmatch(
            rf"cannot read the checkpoint of step 2: {reason}; nothing was moved or deleted: "
            r"rerun once the cause is fixed",
            str(stopped.value),
        ), str(stopped.value)
        open_to_everyone(directory)
        assert snapshot(directory) == before
        restored = Checkpointer(directory, every=1, keep=5).restore_latest(
            small_abstract(), data_iterator()
        )
        assert restored.step == 2 and restored.damaged == ()
        assert_bitwise_equal(restored.state, small_state(2))
    finally:
        shutil.rmtree(directory)


def test_no_usable_checkpoint_is_an_error(tmp_path):
    save_steps(tmp_path, [1, 2])
    (tmp_path / "2" / "_CHECKPOINT_METADATA").unlink()
    (tmp_path / "1" / "meta" / "metadata").write_text("")
    message = (
        rf"^no usable checkpoint in {tmp_path}: step 2: its metadata file _CHECKPOINT_METADATA is missing; "
        r"step 1: meta: Expecting value: line 1 column 1 \(char 0\) \(each moved aside to "
        r"damaged-STEP\)$"
    )
    with pytest.warns(CheckpointWarning), pytest.raises(CheckpointError, match=message):
        Checkpointer(tmp_path, every=1, keep=5).restore_latest(small_abstract(), data_iterator())
    assert listing(tmp_path) == ["damaged-1", "damaged-2"]


def test_no_checkpoint_restores_nothing(tmp_path):
    assert (
        Checkpointer(tmp_path / "new", every=1, keep=1).restore_latest(
            small_abstract(), data_iterator()
        )
        is None
    )


def test_half_written_checkpoint_is_never_picked(tmp_path):
    save_steps(tmp_path, [1])
    killed_save = tmp_path / "2.orbax-checkpoint-tmp-1700000000000000"
    shutil.copytree(tmp_path / "1", killed_save)
    truncate_array_files(killed_save)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        restored = Checkpointer(tmp_path, every=1, keep=5).restore_latest(
            small_abstract(), data_iterator()
        )
    assert restored.step == 1 and restored.damaged == ()


def test_refuses_to_save_non_finite_values(tmp_path):
    state = small_state()
    state["w"] = state["w"].at[3, 4].set(jnp.nan)
    state["b"] = state["b"].at[0].set(jnp.inf)
    with Checkpointer(tmp_path, every=1, keep=1) as checkpointer:
        with pytest.raises(
            CheckpointError,
            match=r"^refusing to save step 4: non-finite values in \['b'\] \(and 1 more\)$",
        ):
            checkpointer.save(4, state, data_iterator(), {})
        assert checkpointer.all_steps() == []


@pytest.mark.parametrize(
    ("saved_by", "restored_by"),
    [((0, 2), (0, 1)), ((0, 1), (1, 2)), ((1, 4), (0, 3))],
    ids=["2-to-1", "1-to-2", "4-to-3"],
)
def test_data_state_restores_with_another_process_count(
    tmp_path, monkeypatch, saved_by, restored_by
):
    monkeypatch.setattr(data_state, "process_index_and_count", lambda: saved_by)
    with Checkpointer(tmp_path, every=1, keep=1) as checkpointer:
        checkpointer.save(1, small_state(), data_iterator(7), {})
    index, count = saved_by
    data_dir = tmp_path / "1" / "data"
    for other in range(count):  # the files the other processes would have written
        if other != index:
            shutil.copy(
                data_dir / f"process_{index}-of-{count}.json",
                data_dir / f"process_{other}-of-{count}.json",
            )

    monkeypatch.setattr(data_state, "process_index_and_count", lambda: restored_by)
    iterator = data_iterator()
    assert (
        Checkpointer(tmp_path, every=1, keep=1).restore_latest(small_abstract(), iterator).step == 1
    )
    assert next(iterator) == 7


def test_data_state_of_this_process_missing_with_the_same_count(tmp_path, monkeypatch):
    monkeypatch.setattr(data_state, "process_index_and_count", lambda: (0, 2))
    save_steps(tmp_path, [1])
    monkeypatch.setattr(data_state, "process_index_and_count", lambda: (1, 2))
    with (
        pytest.warns(CheckpointWarning),
        pytest.raises(
            CheckpointError,
            match=r"step 1: data: data iterator state process_1-of-2\.json is missing \(each "
            r"moved aside to damaged-STEP\)$",
        ),
    ):
        Checkpointer(tmp_path, every=1, keep=1).restore_latest(small_abstract(), data_iterator())


def test_sigterm_forces_a_save(tmp_path):
    previous = signal.getsignal(signal.SIGTERM)
    with StopSignal() as stop, Checkpointer(tmp_path, every=100, keep=1) as checkpointer:
        assert not stop.should_stop(1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.should_stop(2)
        assert not checkpointer.is_due(2, force=False)
        assert checkpointer.is_due(2, force=stop.should_stop(2))
        assert checkpointer.save(2, small_state(), data_iterator(), {})
    assert signal.getsignal(signal.SIGTERM) is previous
    assert (tmp_path / "2" / "state").is_dir()


def test_meta_must_be_json(tmp_path):
    meta_error = r"^step 1: meta is not JSON-serialisable: .*ndarray"
    with (
        Checkpointer(tmp_path, every=1, keep=1) as checkpointer,
        pytest.raises(CheckpointError, match=meta_error),
    ):
        checkpointer.save(1, small_state(), data_iterator(), {"loss": np.zeros(2)})


def snapshot(directory) -> dict[str, bytes | None]:
    """Every file (its bytes) and directory (None) under ``directory``."""
    return {
        str(path.relative_to(directory)): path.read_bytes() if path.is_file() else None
        for path in sorted(Path(directory).rglob("*"))
    }


def array_write_fails(monkeypatch, code: int, step: int) -> Callable[[], None]:
    """The first array write of the state item fails; TensorStore ends the others later."""
    writes = failing_writes.FailingArrayWrites(code, step)
    monkeypatch.setattr(serialization, "async_serialize_from_host", writes)
    return writes.wait


def sharding_write_fails(monkeypatch, code: int, step: int) -> Callable[[], None]:
    """The state item's ``_sharding`` file fails while its arrays are still being written."""
    writes = failing_writes.SlowArrayWrites(step)
    monkeypatch.setattr(serialization, "async_serialize_from_host", writes)
    monkeypatch.setattr(
        jax_array_handlers,
        "_async_serialize_shardings",
        failing_writes.failing_sharding_write(code, step),
    )
    return writes.wait


def meta_write_fails(monkeypatch, code: int, step: int) -> Callable[[], None]:
    """The meta item's file fails while the state item's arrays are still being written
    (orbax waits for the items in name order: it raises the meta item's failure first)."""
    writes = failing_writes.SlowArrayWrites(step)
    monkeypatch.setattr(serialization, "async_serialize_from_host", writes)
    real = ocp.JsonCheckpointHandler._save_fn

    async def save(self, item, directory):
        if not failing_writes.in_step(directory, step):
            return await real(self, item, directory)
        raise failing_writes.refused(code, directory / "metadata")

    monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", save)
    return writes.wait


def data_write_fails(monkeypatch, code: int, step: int) -> Callable[[], None]:
    real = checkpoint.DataStateHandler.save

    def save(self, directory, args):
        if not failing_writes.in_step(directory, step):
            return real(self, directory, args)
        raise failing_writes.refused(code, directory / "process_0-of-1.json")

    monkeypatch.setattr(checkpoint.DataStateHandler, "save", save)
    return lambda: None


def item_directory_fails(monkeypatch, code: int, step: int) -> Callable[[], None]:
    """Creating the items' directories fails. (orbax's writes used to wait for them until its
    coordination timeout, 300 s: shortened here, so that a return of that fails quickly.)"""
    real = async_path.mkdir

    async def mkdir(path, *args, **kwargs):
        if Path(path).parent.name.startswith(f"{step}{checkpoint.TMP_SUFFIX}"):
            raise failing_writes.refused(code, path)
        return await real(path, *args, **kwargs)

    monkeypatch.setattr(async_path, "mkdir", mkdir)
    monkeypatch.setattr(multihost, "coordination_timeout", lambda: 5)
    return lambda: None


def failure(where, code, async_save, seen_at):
    return pytest.param(
        where, code, async_save, seen_at, id=f"{where.__name__}-{errno.errorcode[code]}-{seen_at}"
    )


@pytest.mark.parametrize(
    ("fails", "code", "async_save", "seen_at"),
    [
        failure(array_write_fails, errno.ENOSPC, False, "save"),
        failure(array_write_fails, errno.EDQUOT, True, "next save"),
        failure(array_write_fails, errno.ENOSPC, True, "close"),
        failure(sharding_write_fails, errno.ENOSPC, False, "save"),
        failure(sharding_write_fails, errno.EDQUOT, True, "next save"),
        failure(meta_write_fails, errno.EDQUOT, False, "save"),
        failure(meta_write_fails, errno.EIO, True, "close"),
        failure(data_write_fails, errno.EIO, False, "save"),
        failure(data_write_fails, errno.ENOSPC, True, "save"),
        failure(item_directory_fails, errno.EIO, False, "save"),
        failure(item_directory_fails, errno.ENOSPC, True, "save"),
    ],
)
def test_a_save_that_cannot_be_written_is_one_error_and_the_older_ones_stay(
    tmp_path, monkeypatch, caplog, capfd, fails, code, async_save, seen_at
):
    """Whichever write of the save of step 2 fails first, and wherever that is seen (at the
    save, or for an asynchronous save at the next save or at close): one `CheckpointError`,
    the partial directory removed once TensorStore is done, step 1 untouched and restorable,
    and nothing else reported, then or when the save's leftovers are collected."""
    save_steps(tmp_path, [1])
    before = snapshot(tmp_path)
    tensorstore_done = fails(monkeypatch, code, step=2)
    with (
        pytest.raises(CheckpointError) as failed,
        Checkpointer(tmp_path, every=1, keep=5, async_save=async_save) as checkpointer,
    ):
        checkpointer.save(2, small_state(2), data_iterator(20), {"step": 2})
        if seen_at == "next save":
            checkpointer.save(3, small_state(3), data_iterator(30), {"step": 3})
    tensorstore_done()
    monkeypatch.undo()
    gc.collect()
    assert str(failed.value) == (
        f"checkpoint of step 2 not written: {os.strerror(code).lower()} at {tmp_path}; "
        "the newest good checkpoint is step 1"
    )
    assert snapshot(tmp_path) == before, "the partial directory is removed, step 1 untouched"
    restored = Checkpointer(tmp_path, every=1, keep=5).restore_latest(small_abstract(), None)
    assert restored.step == 1
    assert_bitwise_equal(restored.state, small_state(1))
    assert [
        record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR
    ] == []
    errors = capfd.readouterr().err
    assert "os_error_code" not in errors and "Traceback" not in errors, errors


def test_a_save_warns_when_the_free_space_is_smaller_than_the_last_checkpoint(
    tmp_path, monkeypatch
):
    warned = []
    with Checkpointer(tmp_path, every=1, keep=5, async_save=False, warn=warned.append) as saver:
        saver.save(1, small_state(1), data_iterator(10), {"step": 1})
        assert warned == []
        monkeypatch.setattr(
            shutil, "disk_usage", lambda path: types.SimpleNamespace(total=1, used=1, free=0)
        )
        saver.save(2, small_state(2), data_iterator(20), {"step": 2})
    assert len(warned) == 1
    assert warned[0].startswith(
        f"0.0 MiB free at {tmp_path}, less than the last checkpoint (step 1, "
    )
    assert warned[0].endswith("MiB): the checkpoint of step 2 may not fit")


def test_an_asynchronous_save_that_fails_in_the_background_fails_the_next_save(tmp_path):
    """A 1 MiB array written under a 64 KiB file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored):
    the save returns, its background write fails, and the next save reports it by step."""
    state = {"weight": jnp.arange(2**18, dtype=jnp.float32)}
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    with Checkpointer(tmp_path, every=1, keep=5, async_save=True) as checkpointer:
        checkpointer.save(1, state, data_iterator(10), {"step": 1})
        checkpointer.wait()
        previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**16, hard))
        try:
            assert checkpointer.save(2, state, data_iterator(20), {"step": 2})
            with pytest.raises(CheckpointError) as failed:
                checkpointer.save(3, state, data_iterator(30), {"step": 3})
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, previous)
    assert str(failed.value) == (
        f"checkpoint of step 2 not written: file too large at {tmp_path}; "
        "the newest good checkpoint is step 1"
    )
    assert sorted(os.listdir(tmp_path)) == ["1"]


def test_a_save_that_fails_for_another_reason_keeps_its_traceback(tmp_path, monkeypatch):
    def bug(self, directory, args):
        raise TypeError("a bug in a handler")

    monkeypatch.setattr(checkpoint.DataStateHandler, "save", bug)
    with Checkpointer(tmp_path, every=1, keep=5, async_save=False) as checkpointer:
        with pytest.raises(TypeError, match="a bug in a handler"):
            checkpointer.save(1, small_state(1), data_iterator(10), {"step": 1})


def test_checksums_never_gather_a_sharded_array():
    """Each device sums its own shard: the compiled checksum pass holds a few shards' worth
    of temporaries, never the whole array (numbering the words of a flattened array made
    XLA gather it whole onto every device)."""
    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("y", "x"))
    array = jax.device_put(jnp.arange(512 * 256, dtype=jnp.float32).reshape(512, 256), sharding)
    compiled = checksums._inspect.lower((array,)).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < array.nbytes / 2
    assert (
        inspect_arrays({"a": array}).checksums == inspect_arrays({"a": np.asarray(array)}).checksums
    )
