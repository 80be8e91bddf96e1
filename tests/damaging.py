"""Ways to damage a checkpoint on disk after it was written, shared by the checkpointer's
tests and the end-to-end recovery tests."""

import os
from pathlib import Path


def array_files(step_directory: Path) -> list[Path]:
    """The files of the step's ``state`` item that hold array data (over 4 KiB)."""
    files = (step_directory / "state").rglob("d/*")
    return [path for path in files if path.stat().st_size > 4096]


def flip_a_byte(step_directory: Path) -> None:
    """Flip one bit in the middle of the largest file of the step's ``state`` item (array
    data): the size and every file name stay as they were."""
    files = [path for path in (step_directory / "state").rglob("*") if path.is_file()]
    data = max(files, key=os.path.getsize)
    content = bytearray(data.read_bytes())
    content[len(content) // 2] ^= 0x10
    data.write_bytes(bytes(content))


def truncate_array_files(step_directory: Path) -> None:
    for path in array_files(step_directory):
        with open(path, "r+b") as file:
            file.truncate(path.stat().st_size // 2)


def delete_array_files(step_directory: Path) -> None:
    for path in array_files(step_directory):
        path.unlink()
