"""A run directory holds one run: an OS lock keeps a second run out, and a resume must be
the same run.

**The lock.** `RunDirLock` takes an exclusive ``flock`` on ``RUN_DIR/run.lock`` and writes
its holder (pid, host, start time) into the file. The kernel releases the lock when the
process ends, however it ends (SIGKILL, OOM kill, a crash), so a dead run never leaves a
stale lock behind; the file itself stays and is reused. A second run on the directory is
refused at once with one line naming the holder. In a multi-process run only process 0
locks, and the others follow its verdict. Readers (``--dry-run``, ``pipelines.generate``)
take no lock.

**The same run.** A directory with checkpoints is resumed only by a config that differs
from the run's own in `RESUMABLE_KEYS` alone (the fields declared `runtime_field`):
what changes how the same run is carried out (steps, mesh and schedule, batch shape, logging, checkpoint cadence, the learning-rate
schedule, ...), never what it is (the architecture, its parameters' dtype, the optimizer's
state, the data and its order, the seeds). Any other change, or turning gradient clipping or
weight decay on or off (which adds or removes optimizer state), is refused in one line naming
every changed key with both values.

**The checkpoint is the truth.** The run's own config is the one saved in its newest
checkpoint (`checkpoint_config`), whatever ``config.toml`` says or whether it exists: a
resume, ``pipelines.generate`` and ``pipelines.export`` compare against it. ``config.toml``
is a copy for people, written by a run only once every check has passed and its state is
open (`write_run_config`); one that was edited or deleted is rewritten from the checkpoint
by ``python -m pipelines.run --run-dir RUN --repair-config`` (`repair_run_config`), and the
commands that only read a run use the checkpoint's config when ``config.toml`` is missing.
"""

import dataclasses
import datetime
import fcntl
import json
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from eqxzoo.errors import ConfigError, UserError
from eqxzoo.run.config import (
    RESUMABLE_KEYS,
    SWITCHED_OFF_BY_ZERO,
    RunConfig,
    config_from_dict,
    config_to_dict,
    config_to_toml,
    load_config,
)
from eqxzoo.train.checkpoint import finished_steps
from eqxzoo.train.report import replace_text
from eqxzoo.typed_config import flatten, read_toml

CONFIG_FILE = "config.toml"
CHECKPOINT_DIR = "checkpoints"
META_FILE = Path("meta") / "metadata"  # a checkpoint's meta item, which holds its config
LOCK_FILE = "run.lock"


class RunDirBusy(UserError, RuntimeError):
    """Another run holds the run directory's lock."""


class NotTheSameRun(UserError, ValueError):
    """A resume whose config changes what the run is."""


@dataclasses.dataclass(frozen=True)
class Change:
    key: str
    saved: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.key} = {_show(self.saved)} in the run, {_show(self.new)} now"


class RunDirLock:
    """An exclusive OS lock on ``run_dir/run.lock``, held until `release` or the process ends.

    `acquire` raises `RunDirBusy` naming the holder when another process holds it. On a
    filesystem without locks (``flock`` unsupported) it warns through ``warn`` and runs
    unlocked rather than refusing every run there.
    """

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self, warn=print) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunDirBusy(
                f"--run-dir {self.path.parent} is in use by another run ({holder}); wait for "
                "it to end or stop it, or give this run another --run-dir"
            ) from None
        except OSError as error:
            os.close(fd)
            warn(
                f"warning: cannot lock {self.path} ({error.strerror}): nothing keeps a "
                "second run out of this directory"
            )
            return
        self._fd = fd
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        }
        text = (json.dumps(holder) + "\n").encode()
        try:
            os.pwrite(fd, text, 0)
            os.ftruncate(fd, len(text))
        except OSError:
            self.release()
            raise

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _read_holder(fd: int) -> str:
    """``pid 123 on host, started 2026-...``: who holds the lock, as its holder wrote it."""
    text = os.pread(fd, 4096, 0).decode(errors="replace")
    try:
        holder = json.loads(text)
        return f"pid {holder['pid']} on {holder['host']}, started {holder['started']}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown: the lock file names none yet"


def has_checkpoints(run_dir: Path) -> bool:
    """Whether ``run_dir/checkpoints`` holds a finished checkpoint."""
    directory = run_dir / CHECKPOINT_DIR
    return directory.is_dir() and bool(finished_steps(directory))


def changed_keys(saved: Mapping[str, Any], new: Mapping[str, Any]) -> list[Change]:
    """Every dotted key whose value differs between two config documents, in key order
    (a key missing on one side is `None` there)."""
    saved_flat, new_flat = flatten(saved), flatten(new)
    return [
        Change(key, saved_flat.get(key), new_flat.get(key))
        for key in sorted(saved_flat.keys() | new_flat.keys())
        if saved_flat.get(key) != new_flat.get(key)
    ]


def is_resumable(key: str) -> bool:
    """Whether a resume may change the dotted ``key`` (or the leaf it is part of)."""
    parts = key.split(".")
    return any(".".join(parts[:n]) in RESUMABLE_KEYS for n in range(1, len(parts) + 1))


def refused_changes(saved: Mapping[str, Any], new: Mapping[str, Any]) -> list[Change]:
    """The changes from the ``saved`` config document to the ``new`` one that a resume may
    not make: to a key `RESUMABLE_KEYS` does not list, or one of `SWITCHED_OFF_BY_ZERO` to or from
    0."""
    return [
        change
        for change in changed_keys(saved, new)
        if not is_resumable(change.key)
        or (change.key in SWITCHED_OFF_BY_ZERO and (change.saved == 0) != (change.new == 0))
    ]


def checkpoint_config(run_dir: Path, step: int | None = None) -> tuple[int, dict] | None:
    """``(step, config document)`` saved in the checkpoint of ``step``, by default the newest
    whose meta item can be read; None when there is none (a damaged one is the restore's to
    report)."""
    directory = run_dir / CHECKPOINT_DIR
    if not directory.is_dir():
        return None
    steps = [step] if step is not None else sorted(finished_steps(directory), reverse=True)
    for candidate in steps:
        try:
            meta = json.loads((directory / str(candidate) / META_FILE).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and isinstance(meta.get("config"), dict):
            return candidate, meta["config"]
    return None


def _the_runs_config(run_dir: Path) -> tuple[str, dict] | None:
    """Where the run's own config comes from and its document with defaults filled in:
    its newest checkpoint, or (a checkpoint written before configs were saved in them)
    its ``config.toml``; None for a directory without checkpoints."""
    if not has_checkpoints(run_dir):
        return None
    stored = checkpoint_config(run_dir)
    if stored is not None:
        where, saved = f"its checkpoint of step {stored[0]}", stored[1]
    elif (run_dir / CONFIG_FILE).is_file():
        where, saved = str(run_dir / CONFIG_FILE), read_toml(run_dir / CONFIG_FILE)
    else:
        return None
    return where, _with_defaults(saved)


def _with_defaults(document: dict) -> dict:
    """A saved config document with the defaults filled in, as `config_to_dict` gives a new
    one (one written by another version is compared as written)."""
    try:
        return config_to_dict(config_from_dict(document))
    except ConfigError:
        return document


def check_same_run(run_dir: Path, config: RunConfig) -> None:
    """Raise `NotTheSameRun` if ``run_dir`` has checkpoints and ``config`` changes a key of
    the run's own config (`checkpoint_config`) that `RESUMABLE_KEYS` does not list."""
    own = _the_runs_config(run_dir)
    if own is None:
        return
    where, saved = own
    refused = refused_changes(saved, config_to_dict(config))
    if refused:
        raise NotTheSameRun(
            f"--run-dir {run_dir} holds another run ({where}): "
            f"{'; '.join(map(str, refused))}. Resume it with its own config "
            f"({run_dir / CONFIG_FILE}; if that was edited or lost, rewrite it with python -m "
            f"pipelines.run --run-dir {run_dir} --repair-config), or start this one in a new "
            "--run-dir"
        )


def prepare_run_dir(run_dir: Path, config: RunConfig, *, lock: bool, warn=print) -> RunDirLock:
    """Create ``run_dir``, lock it (if ``lock``) and check that ``config`` may resume what it
    holds. Returns the lock (held or not). The config is written later (`write_run_config`)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--run-dir {run_dir}: exists and is not a directory")
    if (run_dir / CHECKPOINT_DIR).exists() and not (run_dir / CHECKPOINT_DIR).is_dir():
        raise UserError(f"--run-dir {run_dir}: {CHECKPOINT_DIR} exists and is not a directory")
    run_dir.mkdir(parents=True, exist_ok=True)
    run_lock = RunDirLock(run_dir)
    if lock:
        run_lock.acquire(warn)
    try:
        check_same_run(run_dir, config)
    except BaseException:
        run_lock.release()
        raise
    return run_lock


def write_run_config(run_dir: Path, config: RunConfig) -> None:
    """Write ``config`` as the run's ``config.toml`` (atomically)."""
    replace_text(run_dir / CONFIG_FILE, config_to_toml(config))


def repair_run_config(run_dir: Path) -> int:
    """Rewrite ``run_dir``'s ``config.toml`` from its newest checkpoint's config, under the
    run directory's lock; returns the checkpoint's step."""
    stored = checkpoint_config(run_dir)
    if stored is None:
        raise UserError(f"--run-dir {run_dir}: no checkpoint holds a config to repair from")
    run_lock = RunDirLock(run_dir)
    run_lock.acquire()
    try:
        write_run_config(run_dir, config_from_dict(stored[1]))
    finally:
        run_lock.release()
    return stored[0]


def _show(value: Any) -> str:
    return "(unset)" if value is None else json.dumps(value)


def read_run_config(run_dir: Path, step: int | None = None) -> RunConfig:
    """The config of the ``pipelines.run`` directory ``run_dir`` for the commands that open a
    run (export, generate): its ``config.toml``, checked against the config saved in the
    checkpoint of ``step`` (default: the newest) that they will read, or that one when
    ``config.toml`` is missing. The run's own config holds its whole architecture, so the
    Hugging Face directory it may have started from is not needed (``init_from_hf`` is
    cleared). A `UserError` names what is missing or differs."""
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run directory")
    config_file = run_dir / CONFIG_FILE
    stored = checkpoint_config(run_dir, step)
    if not config_file.is_file():
        if stored is None:
            raise UserError(f"{run_dir} has no {CONFIG_FILE}: not a pipelines.run directory")
        return dataclasses.replace(config_from_dict(stored[1]), init_from_hf="")
    try:
        config = load_config(config_file, ["model.init_from_hf="])
    except ConfigError as error:
        raise ConfigError(f"{config_file}: {error}") from None
    if stored is not None:
        refused = refused_changes(_with_defaults(stored[1]), config_to_dict(config))
        if refused:
            raise NotTheSameRun(
                f"{config_file} is not the config of the checkpoint of step {stored[0]}: "
                f"{'; '.join(map(str, refused))}. Rewrite it from the checkpoint with python -m "
                f"pipelines.run --run-dir {run_dir} --repair-config"
            )
    return config
