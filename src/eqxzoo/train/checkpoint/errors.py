"""Errors of saving and restoring checkpoints."""

from eqxzoo.errors import UserError


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be written or read; the message is one line naming the cause."""


class CheckpointWarning(UserWarning):
    """An unusable checkpoint was skipped in favour of an older one."""
