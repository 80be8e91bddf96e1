"""Arrays read by slices, and safetensors files read lazily and written shard by shard.

A checkpoint larger than one host's memory can only be loaded by reading, on each process,
the slices its devices hold. Everything here serves that: a `Sliceable` is anything with a
``shape``, a ``dtype`` and ``array[index] -> np.ndarray`` for a tuple of slices (a numpy
array is one). `LazyArray` is a sliceable that reads nothing until it is indexed; its views
(`LazyArray.T`, `LazyArray.transpose`, `LazyArray.reshape` splitting axes,
`LazyArray.window`, `LazyArray.strided`, `LazyArray.take`, `stack`) turn an index into the
index of what they view, so a slice of a
transposed, reshaped, stacked stored tensor reads only the stored bytes it covers (rows
whole where a split axis needs them).

`SafetensorsFiles` opens ``model.safetensors`` or ``model.safetensors.index.json`` and its
shards: the header only, each tensor a `StoredTensor` read through ``np.memmap``, counted
in ``bytes_read`` and, with ``refuse_non_finite``, checked for NaN and Inf.
`write_safetensors` writes ``{name: array}`` as one file or as shards of at most
``max_shard_bytes`` with the index Hugging Face reads, one shard in memory at a time, each
process writing its share.
"""

import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import ml_dtypes
import numpy as np

from eqxzoo.errors import UserError

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3

DTYPES: Mapping[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}

FLOAT_DTYPES = frozenset(DTYPES[name] for name in ("F64", "F32", "F16", "BF16"))

Index = tuple[slice, ...]
Bounds = tuple[tuple[int, int], ...]


class HFCheckpointError(UserError, ValueError):
    """A Hugging Face checkpoint's files or tensors do not match what its config describes."""


class NonFiniteTensor(HFCheckpointError):
    """A stored tensor holds NaN or Inf where it was read: a model trained from it would skip
    every step (its loss is not finite) and no checkpoint of it could be saved."""


@runtime_checkable
class Sliceable(Protocol):
    """An array-like read by slices: ``array[index]`` is an ``np.ndarray``."""

    shape: tuple[int, ...]
    dtype: Any

    def __getitem__(self, index: Index | slice) -> Any: ...


def bounds_of(index: Any, shape: Sequence[int]) -> Bounds:
    """``(start, stop)`` per axis for a tuple of unit-step slices (missing axes: whole)."""
    index = index if isinstance(index, tuple) else (index,)
    assert len(index) <= len(shape), (index, shape)
    bounds = []
    for axis, size in enumerate(shape):
        part = index[axis] if axis < len(index) else slice(None)
        assert isinstance(part, slice), f"only slices index a lazy array, got {part!r}"
        start, stop, step = part.indices(size)
        assert step == 1, f"only unit-step slices index a lazy array, got {part!r}"
        bounds.append((start, max(start, stop)))
    return tuple(bounds)


def _slices(bounds: Bounds) -> Index:
    return tuple(slice(start, stop) for start, stop in bounds)


class LazyArray:
    """An array that reads nothing until indexed; subclasses define `read` on bounds."""

    shape: tuple[int, ...]
    dtype: np.dtype

    def read(self, bounds: Bounds) -> np.ndarray:
        raise NotImplementedError

    def read_stepped(self, bounds: Bounds, axis: int, step: int) -> np.ndarray:
        """``read(bounds)`` taking every ``step``-th index along ``axis`` (`strided` views)."""
        return self.read(bounds)[(slice(None),) * axis + (slice(None, None, step),)]

    def __getitem__(self, index: Index | slice) -> np.ndarray:
        return self.read(bounds_of(index, self.shape))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        array = self[()]
        return array if dtype is None else array.astype(dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def T(self) -> "LazyArray":
        return self.transpose(*reversed(range(self.ndim)))

    def transpose(self, *axes: int) -> "LazyArray":
        return _Transposed(self, tuple(axes))

    def reshape(self, *shape: int | tuple[int, ...]) -> "LazyArray":
        """A view that splits axes (``(a * b, c) -> (a, b, c)``); merging is not supported."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        return _Split(self, tuple(shape))

    def window(self, axis: int, start: int, stop: int) -> "LazyArray":
        """The view ``[start:stop]`` along ``axis``."""
        return _Window(self, axis, start, stop)

    def strided(self, axis: int, start: int, step: int) -> "LazyArray":
        """The view ``[start::step]`` along ``axis`` (GPT-OSS interleaves its experts' gate
        and up projections: ``gate_up[..., 0::2]`` and ``[..., 1::2]``)."""
        return _Strided(self, axis, start, step)

    def astype(self, dtype) -> "LazyArray":
        return _Cast(self, np.dtype(dtype))

    def take(self, indices: Sequence[int] | np.ndarray, axis: int) -> "LazyArray":
        """The view ``np.take(self, indices, axis)``: entries of ``axis`` picked or reordered
        (a permutation, every other one). A read covers the picked entries' whole range on
        that axis."""
        return _Taken(self, np.asarray(indices, np.int64), axis)


class StoredTensor(LazyArray):
    """The tensor ``name`` of a safetensors file, read through ``np.memmap``; every read adds
    its bytes to ``files.bytes_read`` and, when ``files.refuse_non_finite``, is checked."""

    def __init__(self, files: "SafetensorsFiles", name: str, path: Path, offset: int, shape, dtype):
        self.files, self.name, self.path, self.offset = files, name, path, offset
        self.shape, self.dtype = tuple(shape), dtype

    def read(self, bounds: Bounds) -> np.ndarray:
        return self.read_stepped(bounds, 0, 1)

    def read_stepped(self, bounds: Bounds, axis: int, step: int) -> np.ndarray:
        """Only the elements taken are copied and counted (the pages of an element-wise
        interleave are read from disk once, by whichever view comes first)."""
        index = list(_slices(bounds))
        index[axis] = slice(bounds[axis][0], bounds[axis][1], step)
        if math.prod(self.shape) == 0:
            return np.zeros([len(range(*part.indices(10**18))) for part in index], self.dtype)
        stored = np.memmap(self.path, self.dtype, "r", self.offset, self.shape)
        array = np.array(stored[tuple(index)])
        self.files.bytes_read += array.nbytes
        if self.files.refuse_non_finite and self.dtype in FLOAT_DTYPES:
            self._check_finite(array, tuple(index))
        return array

    def _check_finite(self, array: np.ndarray, index: Index) -> None:
        """`NonFiniteTensor` naming this tensor and the first non-finite element of ``array``
        (read at ``index``) by its position in the stored tensor."""
        finite = np.isfinite(array)
        if finite.all():
            return
        where = tuple(int(i) for i in np.argwhere(~finite)[0])
        position = tuple(
            part.start + i * (part.step or 1) for part, i in zip(index, where, strict=True)
        )
        raise NonFiniteTensor(
            f"tensor {self.name} of {self.path} holds {float(array[where])} at {position}: "
            "the checkpoint's weights are damaged (or saved from a diverged model); replace "
            "the file or convert the weights again"
        )


class _Transposed(LazyArray):
    def __init__(self, base: LazyArray, axes: tuple[int, ...]):
        assert sorted(axes) == list(range(base.ndim)), axes
        self.base, self.axes = base, axes
        self.shape, self.dtype = tuple(base.shape[a] for a in axes), base.dtype

    def read(self, bounds: Bounds) -> np.ndarray:
        return self.read_stepped(bounds, 0, 1)

    def read_stepped(self, bounds: Bounds, axis: int, step: int) -> np.ndarray:
        base_bounds = [None] * self.base.ndim
        for position, base_axis in enumerate(self.axes):
            base_bounds[base_axis] = bounds[position]
        base = self.base.read_stepped(tuple(base_bounds), self.axes[axis], step)
        return base.transpose(self.axes)


class _Split(LazyArray):
    """``base`` with each axis split into one or more consecutive axes of ``shape``."""

    def __init__(self, base: LazyArray, shape: tuple[int, ...]):
        self.base, self.shape, self.dtype = base, shape, base.dtype
        self.groups: list[tuple[int, int]] = []  # per base axis: its new axes [first, last)
        new_axis = 0
        for size in base.shape:
            first, product = new_axis, 1
            while new_axis < len(shape) and (new_axis == first or product < size):
                product *= shape[new_axis]
                new_axis += 1
            if product != size or new_axis == first:
                raise ValueError(f"cannot view {base.shape} as {shape} by splitting axes")
            self.groups.append((first, new_axis))
        if new_axis != len(shape):
            raise ValueError(f"cannot view {base.shape} as {shape} by splitting axes")

    def read(self, bounds: Bounds) -> np.ndarray:
        """Whole rows of each split axis are read, then cut to the inner bounds."""
        base_bounds, covering, inner = [], [], []
        for first, last in self.groups:
            (start, stop), inner_sizes = bounds[first], self.shape[first + 1 : last]
            stride = math.prod(inner_sizes)
            base_bounds.append((start * stride, stop * stride))
            covering += [stop - start, *inner_sizes]
            inner += [slice(None), *_slices(bounds[first + 1 : last])]
        return self.base.read(tuple(base_bounds)).reshape(covering)[tuple(inner)]


class _Window(LazyArray):
    def __init__(self, base: LazyArray, axis: int, start: int, stop: int):
        axis = axis % base.ndim
        assert 0 <= start <= stop <= base.shape[axis], (base.shape, axis, start, stop)
        self.base, self.axis, self.start = base, axis, start
        self.shape = base.shape[:axis] + (stop - start,) + base.shape[axis + 1 :]
        self.dtype = base.dtype

    def read(self, bounds: Bounds) -> np.ndarray:
        first, last = bounds[self.axis]
        shifted = (first + self.start, last + self.start)
        return self.base.read(bounds[: self.axis] + (shifted,) + bounds[self.axis + 1 :])


class _Taken(LazyArray):
    def __init__(self, base: LazyArray, indices: np.ndarray, axis: int):
        axis = axis % base.ndim
        assert indices.ndim == 1 and np.all((0 <= indices) & (indices < base.shape[axis]))
        self.base, self.indices, self.axis = base, indices, axis
        self.shape = base.shape[:axis] + (len(indices),) + base.shape[axis + 1 :]
        self.dtype = base.dtype

    def read(self, bounds: Bounds) -> np.ndarray:
        first, last = bounds[self.axis]
        picked = self.indices[first:last]
        if picked.size == 0:
            return np.zeros([stop - start for start, stop in bounds], self.dtype)
        low, high = int(picked.min()), int(picked.max()) + 1
        covering = bounds[: self.axis] + ((low, high),) + bounds[self.axis + 1 :]
        return np.take(self.base.read(covering), picked - low, axis=self.axis)


class _Strided(LazyArray):
    """Reads the base from the first to the last selected index, every ``step``-th."""

    def __init__(self, base: LazyArray, axis: int, start: int, step: int):
        axis = axis % base.ndim
        assert step >= 1 and 0 <= start < max(base.shape[axis], 1), (base.shape, start, step)
        self.base, self.axis, self.start, self.step = base, axis, start, step
        size = len(range(start, base.shape[axis], step))
        self.shape = base.shape[:axis] + (size,) + base.shape[axis + 1 :]
        self.dtype = base.dtype

    def read(self, bounds: Bounds) -> np.ndarray:
        first, last = bounds[self.axis]
        base_first = self.start + first * self.step
        base_last = base_first if last == first else self.start + (last - 1) * self.step + 1
        base_bounds = bounds[: self.axis] + ((base_first, base_last),) + bounds[self.axis + 1 :]
        return self.base.read_stepped(base_bounds, self.axis, self.step)


class _Cast(LazyArray):
    def __init__(self, base: Sliceable, dtype: np.dtype):
        self.base, self.shape, self.dtype = base, tuple(base.shape), dtype

    def read(self, bounds: Bounds) -> np.ndarray:
        return np.asarray(self.base[_slices(bounds)]).astype(self.dtype)


class _Stacked(LazyArray):
    def __init__(self, parts: Sequence[Sliceable]):
        shapes = {tuple(part.shape) for part in parts}
        dtypes = {np.dtype(part.dtype) for part in parts}
        assert parts and len(shapes) == 1 and len(dtypes) == 1, (shapes, dtypes)
        self.parts = list(parts)
        self.shape = (len(parts), *shapes.pop())
        self.dtype = dtypes.pop()

    def read(self, bounds: Bounds) -> np.ndarray:
        (start, stop), rest = bounds[0], _slices(bounds[1:])
        if start == stop:
            return np.zeros([b - a for a, b in bounds], self.dtype)
        return np.stack([np.asarray(self.parts[i][rest]) for i in range(start, stop)])


def stack(parts: Sequence[Sliceable]) -> Sliceable:
    """``np.stack(parts)`` for numpy arrays; a lazy stack when any part is lazy."""
    if all(isinstance(part, np.ndarray) for part in parts):
        return np.stack(parts)
    return _Stacked(parts)


# ----------------------------------------------------------------------------- files


def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (``{name: {dtype, shape, data_offsets}}``) and where its
    data starts."""
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > os.path.getsize(path):
                raise ValueError("header longer than the file")
            header = json.loads(handle.read(length))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
    except (OSError, struct.error, ValueError) as error:
        raise HFCheckpointError(f"{path}: not a safetensors file ({error})") from None
    header.pop("__metadata__", None)
    return header, 8 + length


class SafetensorsFiles:
    """The tensors of a checkpoint directory's safetensors file or shards, by name, lazily.

    Only headers are read on opening; `tensor` gives a `StoredTensor`. ``bytes_read``
    counts the tensor bytes read so far, by every tensor of these files. With
    ``refuse_non_finite`` set, a read of a floating tensor that finds NaN or Inf raises
    `NonFiniteTensor` naming it: a trainer that reads each slice once checks every weight
    it loads at the cost of one vectorised `np.isfinite`, before any step. It is off by
    default: a reader of arbitrary tensors (a cached mask of ``-inf``) must see them.
    """

    def __init__(self, directory: str | os.PathLike):
        directory = Path(directory)
        single, index = directory / WEIGHTS_NAME, directory / WEIGHTS_INDEX_NAME
        if single.is_file():
            files = [single]
        elif index.is_file():
            try:
                table = json.loads(index.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise HFCheckpointError(f"{index}: not valid JSON ({error})") from None
            weight_map = table.get("weight_map") if isinstance(table, dict) else None
            if not isinstance(weight_map, dict):
                raise HFCheckpointError(f"{index}: no 'weight_map' table")
            files = [directory / name for name in sorted(set(weight_map.values()))]
            for file in files:
                if not file.is_file():
                    raise HFCheckpointError(
                        f"{index}: lists shard {file.name}, which does not exist"
                    )
        else:
            raise HFCheckpointError(
                f"{directory}: no {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME} "
                "(only safetensors checkpoints can be read; re-save with safe_serialization=True)"
            )
        self.bytes_read = 0
        self.refuse_non_finite = False
        self.entries: dict[str, StoredTensor] = {}
        for file in files:
            header, data_start = _read_header(file)
            for name, entry in header.items():
                if name in self.entries:
                    raise HFCheckpointError(
                        f"{file}: tensor {name} is also in {self.entries[name].path.name}"
                    )
                self.entries[name] = self._stored(file, name, entry, data_start)

    def _stored(self, file: Path, name: str, entry: Any, data_start: int) -> StoredTensor:
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(int(size) for size in entry["shape"])
            start, stop = (int(offset) for offset in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise HFCheckpointError(
                f"{file}: tensor {name} has an unreadable header entry {entry!r}"
            ) from None
        if stop - start != math.prod(shape) * dtype.itemsize:
            raise HFCheckpointError(f"{file}: tensor {name}'s size does not match its shape")
        if not 0 <= start <= stop <= file.stat().st_size - data_start:
            raise HFCheckpointError(
                f"{file}: tensor {name} lies past the end of the file (truncated?)"
            )
        return StoredTensor(self, name, file, data_start + start, shape, dtype)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        return sorted(self.entries)

    def tensor(self, name: str) -> StoredTensor:
        if name not in self.entries:
            raise HFCheckpointError(f"tensor {name} is missing from the checkpoint")
        return self.entries[name]

    @property
    def total_bytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.entries.values())


# ----------------------------------------------------------------------------- writing


def plan_shards(
    sizes: Iterable[tuple[str, int]], max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> list[list[str]]:
    """Groups of names in order, each (but a lone oversized tensor) at most
    ``max_shard_bytes``; ``sizes`` is ``(name, bytes)`` in the order to write."""
    shards: list[list[str]] = [[]]
    filled = 0
    for name, size in sizes:
        if shards[-1] and filled + size > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += size
    return shards


def shard_file_names(count: int) -> list[str]:
    """Hugging Face's shard names: one ``model.safetensors``, else ``model-0000i-of-0000n``."""
    if count == 1:
        return [WEIGHTS_NAME]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_safetensors(
    directory: Path,
    shapes: Mapping[str, tuple[tuple[int, ...], np.dtype]],
    produce: Callable[[Sequence[str]], Mapping[str, np.ndarray]],
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    process_index: int = 0,
    process_count: int = 1,
) -> list[str]:
    """Write the tensors ``shapes`` describes (``{name: (shape, dtype)}``, in order) into
    ``directory`` as Hugging Face names the files; returns the shard files written here.

    ``produce(names)`` returns those tensors; it is called once per shard, so one shard is
    in memory at a time. Shard ``i`` is written by process ``i % process_count``; process 0
    also writes the index when there are several shards.
    """
    import safetensors.numpy

    sizes = [
        (name, math.prod(shape) * np.dtype(dtype).itemsize)
        for name, (shape, dtype) in shapes.items()
    ]
    shards = plan_shards(sizes, max_shard_bytes)
    files = shard_file_names(len(shards))
    written = []
    for number, (names, file) in enumerate(zip(shards, files, strict=True)):
        if number % process_count != process_index:
            continue
        tensors = produce(names)
        for name in names:
            shape, dtype = shapes[name]
            array = tensors[name]
            assert array.shape == tuple(shape) and array.dtype == np.dtype(dtype), (
                name,
                array.shape,
                array.dtype,
            )
        contiguous = {name: np.ascontiguousarray(tensors[name]) for name in names}
        safetensors.numpy.save_file(contiguous, str(directory / file), metadata={"format": "pt"})
        written.append(file)
        del tensors, contiguous, array
    if len(files) > 1 and process_index == 0:
        index = {
            "metadata": {"total_size": sum(size for _, size in sizes)},
            "weight_map": {
                name: file for names, file in zip(shards, files, strict=True) for name in names
            },
        }
        (directory / WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return written
