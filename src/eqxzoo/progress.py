"""Whether progress is drawn live or printed as plain lines: one decision for every command.

A terminal gets rich's live displays (the training bar redrawn in place, a spinner per phase of
corpus preparation); anything else (a log file, CI, a pipe, pytest's capture) gets plain lines,
whose text tests and log readers rely on.
"""

import io

from rich.console import Console


def terminal_console(stream: io.TextIOBase) -> Console | None:
    """A rich console drawing on ``stream`` if it is an interactive terminal, else None.

    None means: print plain lines. Rich's own opt-outs (``TERM=dumb``, ``TTY_COMPATIBLE=0``)
    are honoured, while ``FORCE_COLOR`` never turns a log file into a live display. The
    console prints text as given (no markup, emoji or highlighting), like ``print`` would.
    """
    if not stream.isatty():
        return None
    console = Console(file=stream, markup=False, emoji=False, highlight=False)
    if not console.is_terminal or console.is_dumb_terminal:
        return None
    return console
