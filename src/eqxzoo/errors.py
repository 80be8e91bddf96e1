"""Errors a user can cause, and the one way every command reports them.

Everything a user can get wrong (a config value, a path, a corpus, a mesh that does not fit
the devices, a damaged checkpoint) raises a subclass of `UserError` whose message is one
line naming the cause and the fix. Each command's ``main`` runs its body through
`run_command`, which prints ``error: MESSAGE`` on stderr and returns the error's exit code:
no command shows a traceback for a user's mistake. Internal invariants use ``assert`` and
`equinox.error_if` instead, and do show one.

This module imports nothing heavy: the commands use it before JAX is started.
"""

import sys
from collections.abc import Callable

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_STOPPED = 3
EXIT_LOST_PEER = 4


class UserError(Exception):
    """A problem the user can fix; ``str(error)`` is the whole one-line message.

    ``field`` is the config key (or option) it is about, when it is about one: the message is
    then ``"field: problem"``. Code that relates an error to a key reads ``field`` (and
    `under` puts it in its section), never the message's text.
    """

    exit_code: int = EXIT_USAGE

    def __init__(self, problem: str, *, field: str | None = None):
        super().__init__(f"{field}: {problem}" if field else problem)
        self.problem = problem
        self.field = field

    def under(self, section: str) -> "UserError":
        """The same error about ``section.field`` (about ``section`` itself when it names no
        field)."""
        field = f"{section}.{self.field}" if self.field else section
        return type(self)(self.problem, field=field)


class ConfigError(UserError, ValueError):
    """A config value a user set is invalid; the message names the key and the fix."""


def fail(message: str, code: int = EXIT_USAGE) -> int:
    """Print ``error: message`` on stderr; return ``code`` for the command to exit with."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def run_command(body: Callable[[], int]) -> int:
    """``body()``, with a `UserError` or an operating-system error (a path that is a file, a
    disk that is full, a permission) reported as one ``error:`` line and its exit code."""
    try:
        return body()
    except UserError as error:
        return fail(str(error), error.exit_code)
    except OSError as error:
        where = f"{error.filename}: " if error.filename else ""
        return fail(f"{where}{error.strerror or error}")
