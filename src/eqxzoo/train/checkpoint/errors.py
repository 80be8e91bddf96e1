"""Errors of saving and restoring checkpoints."""

from eqxzoo.errors import UserError


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be written or read; the message is one line naming the cause."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint's bytes are not what was saved (`eqxzoo.train.checkpoint.damage`)."""


class CheckpointUnreadable(CheckpointError):
    """A checkpoint could not be read for a reason that may pass (an I/O error, a permission,
    memory, a bug): it may be good, so nothing is moved or deleted."""


class CheckpointWarning(UserWarning):
    """A damaged checkpoint was moved aside in favour of an older one."""
