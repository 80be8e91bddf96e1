"""What every command does with the paths it is given, at its edge: `absolute_path`."""

from pathlib import Path


def absolute_path(path: str | Path) -> Path:
    """``path`` as the command's user meant it: ``~`` expanded, relative to the working
    directory, through symlinks. Resolved once where a command reads its arguments, so that
    nothing below (orbax takes only absolute paths) ever sees a relative one. An empty
    ``path`` (an unset shell variable) is the caller's to refuse first: it is not ``.``."""
    assert str(path), "an empty path is refused by the command, not resolved to ."
    return Path(path).expanduser().resolve()
