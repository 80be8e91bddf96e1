"""Errors of saving and restoring checkpoints."""

from eqxzoo.errors import UserError


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be written or read; the message is one line naming the cause."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint's bytes are not what was saved (`eqxzoo.train.checkpoint.damage`)."""


class CheckpointUnreadable(CheckpointError):
    """A checkpoint could not be read for a reason that may pass (an I/O error, a permission,
    memory, a bug): it may be good, so nothing is moved or deleted."""


class CheckpointMismatch(CheckpointError):
    """A checkpoint holds other arrays, or arrays of other shapes, than the state restored
    into it: the config (or the code) builds another model than the one saved. The
    checkpoint is not damaged, so nothing is moved or deleted."""


class CheckpointWarning(UserWarning):
    """A damaged checkpoint was moved aside in favour of an older one."""
