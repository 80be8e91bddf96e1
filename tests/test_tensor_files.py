"""Unit tests for `models.tensor_files`: lazy views, safetensors reading and sharded writing.

Loading a Hugging Face checkpoint reads, on each process, only the slices its devices hold,
through views (transpose, split-axis reshape, window, stack) of tensors read from disk by
``np.memmap``. A view that maps an index wrongly loads wrong weights silently, and one that
reads more than it must defeats the point, so these tests check, against numpy on the same
arrays in memory:

- every view, for many random slice tuples, gives bitwise the numpy result;
- bfloat16 and float16 tensors keep their dtype and bits;
- ``bytes_read`` counts exactly the stored bytes a slice covers (whole rows of a split axis),
  and opening a checkpoint reads no tensor data;
- `write_safetensors` shards as Hugging Face names and indexes them, each process writing
  its own shards and producing one shard at a time, and reads back bitwise;
- malformed checkpoints are refused with an `HFCheckpointError` that says what is wrong.
"""

import gc
import json
import re
import struct
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from models.tensor_files import (
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    HFCheckpointError,
    SafetensorsFiles,
    plan_shards,
    shard_file_names,
    stack,
    write_safetensors,
)

HEADS, HEAD_DIM, EMBED = 3, 4, 10  # the attention layout: (HEADS * HEAD_DIM, EMBED)
EXPERTS, LAYERS, COLUMNS = 3, 2, 5  # experts' (out, in) weights; gate_up (n, 2 * COLUMNS, r)


def assert_bitwise(actual, expected: np.ndarray) -> None:
    """``actual`` is an ndarray of ``expected``'s shape, dtype and bytes (NaNs included)."""
    assert isinstance(actual, np.ndarray), type(actual)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.tobytes() == expected.tobytes()


def random_index(rng: np.random.Generator, shape: Sequence[int]) -> tuple[slice, ...]:
    """A tuple of unit-step slices for at most ``len(shape)`` axes: each whole, empty, or a
    random range with ends left out, negative, reversed (empty) or past the end."""
    parts = []
    for size in shape[: rng.integers(0, len(shape) + 1)]:
        kind = rng.integers(0, 4)
        if kind == 0:
            parts.append(slice(None))
        elif kind == 1:
            at = int(rng.integers(0, size + 1))
            parts.append(slice(at, at))
        else:
            ends = [int(end) for end in rng.integers(-size - 2, size + 3, size=2)]
            start, stop = (None if rng.random() < 0.2 else end for end in ends)
            parts.append(slice(start, stop))
    return tuple(parts)


def check_view(view, expected: np.ndarray, seed: int, count: int = 50) -> None:
    """``view`` has ``expected``'s shape and dtype, and agrees with it bitwise read whole
    (``[()]`` and ``np.asarray``) and at ``count`` random indices."""
    assert tuple(view.shape) == expected.shape
    assert np.dtype(view.dtype) == expected.dtype
    assert_bitwise(view[()], expected)
    assert_bitwise(np.asarray(view), expected)
    rng = np.random.default_rng(seed)
    for _ in range(count):
        index = random_index(rng, expected.shape)
        assert_bitwise(view[index], expected[index])


def save(directory: Path, tensors: dict[str, np.ndarray]) -> SafetensorsFiles:
    """``tensors`` saved as ``directory/model.safetensors``, opened lazily."""
    safetensors.numpy.save_file(tensors, str(directory / WEIGHTS_NAME))
    return SafetensorsFiles(directory)


def expert_name(layer: int, expert: int) -> str:
    """The stored name of one layer's one expert's ``(out, in)`` weight."""
    return f"layers.{layer}.experts.{expert}.weight"


def make_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 tensors in the layouts the Hugging Face loaders view."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32)

    arrays = {
        "cube": normal(4, 6, 5),
        "matrix": normal(7, 9),
        "q_proj": normal(HEADS * HEAD_DIM, EMBED),
        "q_bias": normal(HEADS * HEAD_DIM),
        "gate_up": normal(EXPERTS, 2 * COLUMNS, 6),
        "empty": normal(0, 3),
    }
    for layer in range(LAYERS):
        for expert in range(EXPERTS):
            arrays[expert_name(layer, expert)] = normal(6, 5)
    return arrays


def experts_of(get: Callable, layer: int) -> list:
    """One layer's experts' weights, ``(in, out)`` each, as ``get(name).T``."""
    return [get(expert_name(layer, expert)).T for expert in range(EXPERTS)]


# Each view: (lazy view of the stored tensors, the same expression on the numpy arrays).
VIEWS: dict[str, tuple[Callable, Callable]] = {
    "stored": (lambda f: f.tensor("cube"), lambda a: a["cube"]),
    "stored_empty": (lambda f: f.tensor("empty"), lambda a: a["empty"]),
    "T_2d": (lambda f: f.tensor("matrix").T, lambda a: a["matrix"].T),
    "T_3d": (lambda f: f.tensor("cube").T, lambda a: a["cube"].T),
    "transpose_021": (
        lambda f: f.tensor("cube").transpose(0, 2, 1),
        lambda a: a["cube"].transpose(0, 2, 1),
    ),
    "transpose_120": (  # not its own inverse, unlike .T and (0, 2, 1)
        lambda f: f.tensor("cube").transpose(1, 2, 0),
        lambda a: a["cube"].transpose(1, 2, 0),
    ),
    "heads": (
        lambda f: f.tensor("q_proj").T.reshape(EMBED, HEADS, HEAD_DIM),
        lambda a: a["q_proj"].T.reshape(EMBED, HEADS, HEAD_DIM),
    ),
    "bias_heads": (
        lambda f: f.tensor("q_bias").reshape((HEADS, HEAD_DIM)),
        lambda a: a["q_bias"].reshape(HEADS, HEAD_DIM),
    ),
    "gate_half": (
        lambda f: f.tensor("gate_up").window(1, 0, COLUMNS).transpose(0, 2, 1),
        lambda a: a["gate_up"][:, :COLUMNS].transpose(0, 2, 1),
    ),
    "up_half": (
        lambda f: f.tensor("gate_up").window(1, COLUMNS, 2 * COLUMNS).transpose(0, 2, 1),
        lambda a: a["gate_up"][:, COLUMNS:].transpose(0, 2, 1),
    ),
    "gate_interleaved": (
        lambda f: f.tensor("gate_up").transpose(0, 2, 1).strided(2, 0, 2),
        lambda a: a["gate_up"].transpose(0, 2, 1)[..., 0::2],
    ),
    "up_interleaved": (
        lambda f: f.tensor("gate_up").strided(-2, 1, 2),
        lambda a: a["gate_up"][:, 1::2],
    ),
    "strided_by_3": (
        lambda f: f.tensor("matrix").strided(0, 1, 3),
        lambda a: a["matrix"][1::3],
    ),
    "cast": (
        lambda f: f.tensor("matrix").T.astype(ml_dtypes.bfloat16),
        lambda a: a["matrix"].T.astype(ml_dtypes.bfloat16),
    ),
    "experts": (
        lambda f: stack(experts_of(f.tensor, 0)),
        lambda a: np.stack(experts_of(a.__getitem__, 0)),
    ),
    "layers_of_experts": (
        lambda f: stack([stack(experts_of(f.tensor, layer)) for layer in range(LAYERS)]),
        lambda a: np.stack([np.stack(experts_of(a.__getitem__, layer)) for layer in range(LAYERS)]),
    ),
}


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> tuple[SafetensorsFiles, dict[str, np.ndarray]]:
    """`make_arrays` saved as one safetensors file and opened, with the arrays."""
    arrays = make_arrays()
    return save(tmp_path_factory.mktemp("stored"), arrays), arrays


@pytest.mark.parametrize("view_name", list(VIEWS))
def test_views_agree_with_numpy(stored, view_name):
    files, arrays = stored
    lazy, eager = VIEWS[view_name]
    check_view(lazy(files), eager(arrays), seed=sum(map(ord, view_name)))


def test_half_precision_dtypes_read_back_bitwise(tmp_path):
    rng = np.random.default_rng(1)
    values = rng.standard_normal((5, 7), dtype=np.float32)
    values[0, :4] = [np.inf, -np.inf, -0.0, np.nan]
    arrays = {
        "bf16": values.astype(ml_dtypes.bfloat16),
        "f16": values.astype(np.float16),
    }
    files = save(tmp_path, arrays)
    assert files.tensor("bf16").dtype == np.dtype(ml_dtypes.bfloat16)
    assert files.tensor("f16").dtype == np.dtype(np.float16)
    for name, array in arrays.items():
        check_view(files.tensor(name), array, seed=2)
        check_view(files.tensor(name).T, array.T, seed=3)


def test_bytes_read_counts_exactly_the_slices_read(tmp_path):
    rng = np.random.default_rng(4)
    matrix = rng.standard_normal((8, 16), dtype=np.float32)
    q_proj = rng.standard_normal((HEADS * HEAD_DIM, EMBED), dtype=np.float32)
    parts = {f"part{i}": rng.standard_normal((8, 16), dtype=np.float32) for i in range(3)}
    files = save(tmp_path, {"matrix": matrix, "q_proj": q_proj, **parts})
    assert files.bytes_read == 0

    def read(view, index, expected) -> int:
        """Bytes ``view[index]`` adds to ``bytes_read`` (checking its value)."""
        before = files.bytes_read
        assert_bitwise(view[index], expected)
        return files.bytes_read - before

    tensor = files.tensor("matrix")
    assert read(tensor, (slice(0, 2),), matrix[0:2]) == 2 * 16 * 4
    # The transpose's column slice is the stored row slice: the same bytes.
    assert read(tensor.T, (slice(None), slice(0, 2)), matrix.T[:, 0:2]) == 2 * 16 * 4
    assert read(tensor, (slice(3, 3),), matrix[3:3]) == 0
    assert read(tensor, (slice(1, 3), slice(4, 9)), matrix[1:3, 4:9]) == 2 * 5 * 4

    # A split axis is read in whole rows of the axes split from it: head 1's first 3 of
    # HEAD_DIM features read all of head 1's HEAD_DIM stored rows (of EMBED each), no more.
    heads = files.tensor("q_proj").T.reshape(EMBED, HEADS, HEAD_DIM)
    expected = q_proj.T.reshape(EMBED, HEADS, HEAD_DIM)[:, 1:2, 0:3]
    assert read(heads, (slice(None), slice(1, 2), slice(0, 3)), expected) == HEAD_DIM * EMBED * 4
    # Embedding columns 2:5 of heads 0 and 1: 2 * HEAD_DIM stored rows, 3 columns of each.
    expected = q_proj.T.reshape(EMBED, HEADS, HEAD_DIM)[2:5, 0:2]
    assert read(heads, (slice(2, 5), slice(0, 2)), expected) == 2 * HEAD_DIM * 3 * 4

    # A stack reads only the parts its first axis selects, each only where sliced.
    stacked = stack([files.tensor(name).T for name in parts])
    expected = np.stack([part.T for part in parts.values()])[1:3, 0:2]
    assert read(stacked, (slice(1, 3), slice(0, 2)), expected) == 2 * 2 * 8 * 4
    # A window reads only inside the window.
    window = tensor.window(1, 8, 16)
    assert read(window, (slice(0, 1),), matrix[0:1, 8:16]) == 8 * 4
    # A strided view counts only the elements it takes: the odd columns 3, 5, 7 of row 2,
    # and (under a transpose) every third row's columns 1:3.
    odd = tensor.strided(1, 1, 2)
    assert read(odd, (slice(2, 3), slice(1, 4)), matrix[2:3, 1::2][:, 1:4]) == 3 * 4
    every_third = tensor.T.strided(1, 0, 3)
    assert read(every_third, (slice(1, 3),), matrix.T[1:3, 0::3]) == 2 * 3 * 4


def test_opening_reads_no_tensor_data(tmp_path):
    arrays = make_arrays(seed=5)
    files = save(tmp_path, arrays)
    assert files.bytes_read == 0
    assert files.names() == sorted(arrays)
    assert all(name in files for name in arrays) and "nope" not in files
    assert files.total_bytes == sum(array.nbytes for array in arrays.values())
    views = [files.tensor(name).T for name in arrays]
    assert files.bytes_read == 0, "building views reads nothing either"
    views[0][()]
    assert files.bytes_read == arrays[next(iter(arrays))].nbytes


def test_plan_shards_and_file_names():
    assert plan_shards([("a", 100), ("b", 100), ("c", 100)], 200) == [["a", "b"], ["c"]]
    # A tensor over the limit gets a shard of its own; nothing is split or dropped.
    assert plan_shards([("a", 10), ("b", 300), ("c", 10)], 200) == [["a"], ["b"], ["c"]]
    assert plan_shards([], 200) == [[]]
    assert shard_file_names(1) == [WEIGHTS_NAME]
    assert shard_file_names(3) == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
    ]


def shard_arrays() -> dict[str, np.ndarray]:
    """Six 128-byte tensors (float32 and bfloat16): three shards of two at 256 bytes."""
    rng = np.random.default_rng(6)
    arrays = {}
    for i in range(6):
        values = rng.standard_normal((4, 8) if i % 2 else (4, 16), dtype=np.float32)
        arrays[f"w{i}"] = values if i % 2 else values.astype(ml_dtypes.bfloat16)
    return arrays


SHARDS = [["w0", "w1"], ["w2", "w3"], ["w4", "w5"]]
SHARD_FILES = shard_file_names(3)


class Recorder:
    """A `write_safetensors` ``produce`` that records the names it is asked for and checks
    that the tensors it produced for the shard before were released (one shard in memory)."""

    class Tensors(dict):
        """A dict that can be weakly referenced."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.arrays, self.calls, self.released = arrays, [], []
        self.previous: weakref.ref | None = None
        self.previous_arrays: list[weakref.ref] = []

    def __call__(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        gc.collect()
        self.released.append(
            (self.previous is None or self.previous() is None)
            and all(ref() is None for ref in self.previous_arrays)
        )
        self.calls.append(list(names))
        tensors = self.Tensors({name: self.arrays[name].copy() for name in names})
        self.previous = weakref.ref(tensors)
        self.previous_arrays = [weakref.ref(array) for array in tensors.values()]
        return tensors


def shapes_of(arrays: dict[str, np.ndarray]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """`write_safetensors`'s ``{name: (shape, dtype)}``."""
    return {name: (array.shape, array.dtype) for name, array in arrays.items()}


def check_sharded_directory(directory: Path, arrays: dict[str, np.ndarray]) -> None:
    """``directory`` holds `SHARDS` as `SHARD_FILES` with the Hugging Face index, and
    every tensor reads back bitwise, lazily and through safetensors itself."""
    assert sorted(path.name for path in directory.iterdir()) == sorted(
        [*SHARD_FILES, WEIGHTS_INDEX_NAME]
    )
    index = json.loads((directory / WEIGHTS_INDEX_NAME).read_text())
    assert index == {
        "metadata": {"total_size": sum(array.nbytes for array in arrays.values())},
        "weight_map": {name: file for names, file in zip(SHARDS, SHARD_FILES) for name in names},
    }
    # What a transformers-style loader does: load each file the weight map names.
    for file in sorted(set(index["weight_map"].values())):
        loaded = safetensors.numpy.load_file(str(directory / file))
        assert sorted(loaded) == sorted(n for n, f in index["weight_map"].items() if f == file)
        for name, array in loaded.items():
            assert_bitwise(array, arrays[name])
    files = SafetensorsFiles(directory)
    assert files.names() == sorted(arrays)
    assert files.total_bytes == index["metadata"]["total_size"]
    for name, array in arrays.items():
        assert files.tensor(name).dtype == array.dtype
        assert_bitwise(files.tensor(name)[()], array)
    assert files.bytes_read == files.total_bytes


def test_write_sharded(tmp_path):
    arrays = shard_arrays()
    produce = Recorder(arrays)
    written = write_safetensors(tmp_path, shapes_of(arrays), produce, max_shard_bytes=256)
    assert written == SHARD_FILES
    assert produce.calls == SHARDS
    check_sharded_directory(tmp_path, arrays)


def test_write_sharded_by_two_processes(tmp_path):
    arrays = shard_arrays()
    producers, written = {}, {}
    for process in (1, 0):  # process 1 first: the index must come from process 0 alone
        producers[process] = Recorder(arrays)
        written[process] = write_safetensors(
            tmp_path,
            shapes_of(arrays),
            producers[process],
            max_shard_bytes=256,
            process_index=process,
            process_count=2,
        )
        if process == 1:
            assert sorted(path.name for path in tmp_path.iterdir()) == [SHARD_FILES[1]]
    assert written == {0: [SHARD_FILES[0], SHARD_FILES[2]], 1: [SHARD_FILES[1]]}
    assert producers[0].calls == [SHARDS[0], SHARDS[2]]
    assert producers[1].calls == [SHARDS[1]]
    assert set(written[0]).isdisjoint(written[1])
    assert sorted(written[0] + written[1]) == SHARD_FILES
    check_sharded_directory(tmp_path, arrays)


def test_write_holds_one_shard_at_a_time(tmp_path):
    arrays = shard_arrays()
    produce = Recorder(arrays)
    write_safetensors(tmp_path, shapes_of(arrays), produce, max_shard_bytes=256)
    assert produce.released == [True] * len(SHARDS)


def test_write_single_file(tmp_path):
    arrays = shard_arrays()
    produce = Recorder(arrays)
    written = write_safetensors(tmp_path, shapes_of(arrays), produce)
    assert written == [WEIGHTS_NAME]
    assert produce.calls == [list(arrays)]
    assert sorted(path.name for path in tmp_path.iterdir()) == [WEIGHTS_NAME]
    files = SafetensorsFiles(tmp_path)
    for name, array in arrays.items():
        assert_bitwise(files.tensor(name)[()], array)
    # A second process has no shard of a single file to write, and writes nothing.
    other = tmp_path / "other"
    other.mkdir()
    produce = Recorder(arrays)
    written = write_safetensors(other, shapes_of(arrays), produce, process_index=1, process_count=2)
    assert written == [] and produce.calls == []
    assert list(other.iterdir()) == []


def safetensors_bytes(header: object, data: bytes) -> bytes:
    """A safetensors file: the header's length, the header as JSON, the data."""
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def valid_file_bytes() -> bytes:
    """A well-formed single-tensor safetensors file."""
    header = {"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}
    return safetensors_bytes(header, np.arange(6, dtype=np.float32).tobytes())


def test_valid_file_bytes_is_valid(tmp_path):
    (tmp_path / WEIGHTS_NAME).write_bytes(valid_file_bytes())
    assert_bitwise(
        SafetensorsFiles(tmp_path).tensor("w")[()], np.arange(6, dtype=np.float32).reshape(2, 3)
    )


def test_no_checkpoint_files(tmp_path):
    message = f"no {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME}"
    with pytest.raises(HFCheckpointError, match=re.escape(message)):
        SafetensorsFiles(tmp_path)


@pytest.mark.parametrize(
    "index, message",
    [
        (
            '{"weight_map": {"w": "model-00001-of-00002.safetensors"}}',
            "lists shard model-00001-of-00002.safetensors, which does not exist",
        ),
        ('{"weight_map": ', "not valid JSON"),
        ('{"metadata": {"total_size": 24}}', "no 'weight_map' table"),
        ('{"weight_map": ["model.safetensors"]}', "no 'weight_map' table"),
    ],
    ids=["missing_shard", "not_json", "no_weight_map", "weight_map_not_a_table"],
)
def test_bad_index(tmp_path, index, message):
    (tmp_path / WEIGHTS_INDEX_NAME).write_text(index)
    with pytest.raises(HFCheckpointError, match=re.escape(message)):
        SafetensorsFiles(tmp_path)


@pytest.mark.parametrize(
    "contents",
    [
        b"",
        b"garbage",
        struct.pack("<Q", 10**9) + b"{}",
        valid_file_bytes()[:20],
        struct.pack("<Q", 4) + b"\xff\xfe{}",
    ],
    ids=["empty", "shorter_than_length", "length_past_end", "truncated_header", "not_utf8"],
)
def test_not_a_safetensors_file(tmp_path, contents):
    (tmp_path / WEIGHTS_NAME).write_bytes(contents)
    with pytest.raises(HFCheckpointError, match="not a safetensors file"):
        SafetensorsFiles(tmp_path)


def test_bad_shard_in_index_is_named(tmp_path):
    shard = "model-00001-of-00001.safetensors"
    (tmp_path / WEIGHTS_INDEX_NAME).write_text(json.dumps({"weight_map": {"w": shard}}))
    (tmp_path / shard).write_bytes(b"garbage")
    with pytest.raises(HFCheckpointError, match=re.escape(shard) + ".*not a safetensors file"):
        SafetensorsFiles(tmp_path)


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}, "size does not match"),
        ({"dtype": "F16", "shape": [2, 3], "data_offsets": [0, 24]}, "size does not match"),
        ({"dtype": "Q99", "shape": [2, 3], "data_offsets": [0, 24]}, "unreadable header"),
        ({"dtype": "F32", "shape": [2, 3]}, "unreadable header"),
        ("F32", "unreadable header"),
    ],
    ids=["short_offsets", "wrong_dtype_size", "unknown_dtype", "no_offsets", "not_a_table"],
)
def test_bad_header_entry(tmp_path, entry, message):
    (tmp_path / WEIGHTS_NAME).write_bytes(safetensors_bytes({"w": entry}, bytes(24)))
    with pytest.raises(HFCheckpointError, match=f"tensor w.*{message}"):
        SafetensorsFiles(tmp_path)


def test_missing_tensor(tmp_path):
    files = save(tmp_path, {"w": np.zeros((2, 3), np.float32)})
    with pytest.raises(HFCheckpointError, match="tensor nope is missing from the checkpoint"):
        files.tensor("nope")


@pytest.mark.parametrize(
    "shape, new_shape",
    [
        ((6, 4), (4, 6)),
        ((6, 4), (24,)),
        ((6, 4), (2, 3, 2, 3)),
        ((6, 4), (6, 4, 5)),
        ((6, 4), (5, 4)),
        ((12,), (5, 2)),
    ],
    ids=["permuted", "merged", "wrong_split", "too_many", "wrong_size", "not_a_factor"],
)
def test_reshape_that_is_not_a_split(tmp_path, shape, new_shape):
    files = save(tmp_path, {"w": np.zeros(shape, np.float32)})
    with pytest.raises(ValueError, match="cannot view"):
        files.tensor("w").reshape(*new_shape)
    assert files.bytes_read == 0


# Damaged files and edge cases found by review.


def test_truncated_data_is_refused(tmp_path):
    (tmp_path / WEIGHTS_NAME).write_bytes(valid_file_bytes()[:-4])
    with pytest.raises(HFCheckpointError, match="lies past the end of the file"):
        SafetensorsFiles(tmp_path)


def test_header_not_an_object_is_refused(tmp_path):
    (tmp_path / WEIGHTS_NAME).write_bytes(safetensors_bytes([], b""))
    with pytest.raises(HFCheckpointError, match="not a safetensors file"):
        SafetensorsFiles(tmp_path)


def test_index_not_an_object_is_refused(tmp_path):
    (tmp_path / WEIGHTS_INDEX_NAME).write_text("[]")
    with pytest.raises(HFCheckpointError, match="weight_map"):
        SafetensorsFiles(tmp_path)


def test_window_on_a_negative_axis(stored):
    files, arrays = stored
    check_view(files.tensor("matrix").window(-1, 2, 5), arrays["matrix"][:, 2:5], seed=7)


def test_a_tensor_in_two_shards_is_refused(tmp_path):
    for file in ("a.safetensors", "b.safetensors"):
        safetensors.numpy.save_file({"w": np.zeros(2, np.float32)}, str(tmp_path / file))
    index = {"weight_map": {"w": "a.safetensors", "w2": "b.safetensors"}}
    (tmp_path / WEIGHTS_INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(HFCheckpointError, match=r"b\.safetensors: tensor w is also in a\.safet"):
        SafetensorsFiles(tmp_path)
