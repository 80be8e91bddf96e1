"""The arrays of a saved checkpoint, read by slices without restoring the state.

`pipelines.export` reads a checkpoint one layer of one array at a time, so that a checkpoint
larger than the host's memory exports: `saved_arrays` opens the ``state`` item of one step
(orbax's own metadata names every array, its shape and dtype) and gives each array as a
`SavedArray`, read through TensorStore from the OCDBT/zarr files orbax wrote.

Nothing is trusted blindly: each `SavedArray` adds what it reads to the two checksums the
checkpoint recorded at save time (`eqxzoo.train.checkpoint.inspect_arrays`: sums over the
values' bits and over bits times position, both additive over slices), and `verify_reads`
compares them, summed over processes, once every value was read.
"""

import json
import math
import os
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath

from eqxzoo.runtime import counts_of_every_process
from eqxzoo.train.checkpoint import CHECKSUMS, CheckpointError, check_complete

STATE_ITEM = "state"
META_ITEM = "meta"
WORD = {1: np.uint8, 2: np.uint16, 4: np.uint32}


class SavedArray:
    """One array of a saved state, read by slices: ``saved[index]`` is an ``np.ndarray``.

    ``name`` is its dotted path in the state (``model.blocks.layers.attention.wq``).
    ``read_count`` and ``read_sums`` accumulate the values read and their two checksums
    (mod 2^64; the recorded ones are mod 2^32).
    """

    def __init__(self, metadata: Any, spec: dict[str, Any]):
        self.name: str = metadata.name
        self.shape = tuple(int(size) for size in metadata.shape)
        self.dtype = np.dtype(metadata.dtype)
        self.spec = spec
        self.store = None
        self.read_count = 0
        self.read_sums = np.zeros(2, np.uint64)

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(self.shape) - len(index))
        if self.store is None:
            self.store = ts.open(self.spec, read=True).result()
        values = np.asarray(self.store[index].read().result())
        self._add_to_checksums(values, index)
        return values

    def _add_to_checksums(self, values: np.ndarray, index: tuple[slice, ...]) -> None:
        """Add the checksums' terms of ``values``, the block ``index`` of the whole array:
        each value's bits as an unsigned word, and the word times its 1-based position in
        the whole array in C order."""
        if values.dtype.itemsize not in WORD:
            return
        words = values.view(WORD[values.dtype.itemsize]).astype(np.uint64)
        position = np.ones((), np.uint64)
        strides = np.cumprod((self.shape[1:] + (1,))[::-1])[::-1]
        for axis, (part, stride) in enumerate(zip(index, strides, strict=True)):
            start, stop, _ = part.indices(self.shape[axis])
            offsets = np.arange(start, stop, dtype=np.uint64) * np.uint64(stride)
            position = np.add.outer(position, offsets) if axis else position + offsets
        with np.errstate(over="ignore"):
            self.read_sums += np.array([words.sum(), (words * position).sum()], np.uint64)
        self.read_count += values.size


def saved_arrays(step_directory: epath.Path | os.PathLike) -> dict[str, SavedArray]:
    """``{name: SavedArray}`` for every array of the step's ``state`` item.

    Raises `CheckpointError` if the path names no directory (the path is the problem, not
    the checkpoint), the step is incomplete or its metadata unreadable. A relative path is
    taken from the working directory (orbax reads only absolute ones)."""
    step_directory = epath.Path(os.path.abspath(os.fspath(step_directory)))
    if not step_directory.is_dir():
        what = "is not a directory" if step_directory.exists() else "does not exist"
        raise CheckpointError(f"{step_directory} {what}: no checkpoint step there")
    check_complete(step_directory)
    item = step_directory / STATE_ITEM
    try:
        metadata = ocp.PyTreeCheckpointHandler().metadata(item)
    except Exception as error:  # noqa: BLE001 - any failure means the item is unreadable
        raise CheckpointError(f"{item}: unreadable metadata ({error})") from None
    driver = "zarr3" if metadata.use_zarr3 else "zarr"
    ocdbt = (item / "manifest.ocdbt").exists()
    arrays = {}
    for leaf in jax.tree.leaves(metadata.tree):
        if not hasattr(leaf, "shape") or not hasattr(leaf, "name"):
            continue
        if ocdbt:
            kvstore = {"driver": "ocdbt", "base": f"file://{item}", "path": f"{leaf.name}/"}
        else:
            kvstore = {"driver": "file", "path": f"{item / leaf.name}/"}
        arrays[leaf.name] = SavedArray(leaf, {"driver": driver, "kvstore": kvstore})
    return arrays


def recorded_checksums(step_directory: epath.Path | os.PathLike) -> dict[str, list[int]] | None:
    """The checksums the step's ``meta`` item recorded (None for checkpoints without any)."""
    for path in sorted((epath.Path(step_directory) / META_ITEM).glob("*")):
        try:
            meta = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(meta, dict) and CHECKSUMS in meta:
            return meta[CHECKSUMS]
    return None


def verify_reads(arrays: Iterable[SavedArray], checksums: dict[str, list[int]] | None) -> int:
    """Compare the checksums of what was read with the recorded ones; the arrays checked.

    Sums are added over processes (every process must call this), then each array read
    whole exactly once (counted over processes) is compared. Raises `CheckpointError`
    naming the first array whose values are not what was saved.
    """
    arrays = sorted(arrays, key=lambda array: array.name)
    partial = np.array(
        [[array.read_count, *(int(total) for total in array.read_sums)] for array in arrays],
        dtype=object,
    ).reshape(len(arrays), 3)
    totals = counts_of_every_process(partial).sum(axis=0).tolist()
    if checksums is None:
        return 0
    checked = 0
    for array, (count, plain, positional) in zip(arrays, totals, strict=True):
        recorded = checksums.get(f".{array.name}")
        if recorded is None or count != math.prod(array.shape):
            continue
        if [plain % 2**32, positional % 2**32] != list(recorded):
            raise CheckpointError(
                f"{array.name} does not match its checksum: the checkpoint's files were "
                "damaged after they were written"
            )
        checked += 1
    return checked
