"""Telling a damaged checkpoint from one that could not be read.

A restore fails for one of two kinds of reasons, and the run must answer them oppositely:

- *damage*: the bytes on disk are not what was saved (an array or the data state that does
  not match its checksum, non-finite values, a file truncated or deleted, metadata that does
  not decode). Reading again gives the same answer; the checkpoint is moved aside and the one
  before it is used.
- *failure to read*: anything else (an I/O error, a permission, memory, a bug of ours). The
  checkpoint may be perfectly good: the run stops, moving and deleting nothing, and a rerun
  once the cause is gone resumes from it.

Anything not recognised as damage is a failure to read: when in doubt, nothing is touched.
"""

import json
import os

from etils import epath

from eqxzoo.train.checkpoint.errors import CheckpointDamaged, CheckpointUnreadable

# TensorStore reports a status code at the start of its messages. These mean that the bytes
# it found are not a valid encoding of what was written (OUT_OF_RANGE: a file shorter than
# its index says; FAILED_PRECONDITION: a compressed chunk cut short or gone; DATA_LOSS: a
# checksum of its own). PERMISSION_DENIED, UNAVAILABLE, UNKNOWN (EIO) and the rest are not.
DAMAGE_STATUSES = ("OUT_OF_RANGE", "FAILED_PRECONDITION", "DATA_LOSS")


def is_damage(error: BaseException) -> bool:
    """Whether ``error``, raised while restoring a checkpoint whose files are all readable
    (`check_readable`), says the checkpoint's bytes are damaged (see the module docstring)."""
    for cause in _chain(error):
        if isinstance(cause, CheckpointDamaged | json.JSONDecodeError | UnicodeDecodeError):
            return True
        if isinstance(cause, FileNotFoundError):  # every file that exists could be opened
            return True
        if type(cause) is ValueError and str(cause).startswith(DAMAGE_STATUSES):
            return True
    return False


def check_readable(step_directory: epath.Path) -> None:
    """Open every directory and file of a checkpoint for reading; `CheckpointUnreadable`
    naming the first that cannot be (a permission, an I/O error).

    Libraries reading the checkpoint see an unreadable directory as a missing one and would
    report a readable checkpoint as damaged; after this check, a missing file is missing.
    """
    if "://" in str(step_directory):
        return
    for root, _, names in os.walk(step_directory, onerror=_raise):
        for name in names:
            path = os.path.join(root, name)
            try:
                with open(path, "rb") as file:
                    file.read(1)
            except OSError as error:
                _raise(error)


def _raise(error: OSError) -> None:
    raise CheckpointUnreadable(f"{error.filename}: {error.strerror or error}") from error


def _chain(error: BaseException):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__
