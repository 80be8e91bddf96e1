"""Loading: prepared shards -> packed token windows -> ``(G, M, B, T)`` global batches.

The example order is a pure function of the data (the prepared split), the seed and the
window length ``T + 1``:

* epoch ``e`` visits every document once, in the order ``permutation(seed, e)``;
* each document is followed by the end-of-document token; epochs follow one another, so the
  training data is one endless token stream;
* the stream is cut into consecutive windows of ``T + 1`` tokens (inputs are a window's first
  ``T`` tokens, targets its last ``T``), so every token of every epoch lands in exactly one
  window: nothing lost at epoch ends, nothing repeated;
* windows are consumed in blocks of one epoch's worth (``epoch tokens // (T + 1)`` windows),
  each block in the order ``permutation(seed, block)``: a batch mixes windows from all over
  the corpus instead of adjacent pieces of one long document, and every window is still
  consumed exactly once;
* optimizer step ``k`` takes the next ``G * M * B`` windows, laid out as ``(G, M, B)``.

Because a window is addressed by its number alone, any process can read any window: a
process reads only the rows of ``B`` that its devices hold, the mesh and the number of
processes never change what a global batch contains, and the iterator state is one integer
(the next window), saved with grain's orbax handler and identical on every process.

A batch is ``{"tokens", "targets"}``: a target is the next token, or `IGNORED` where that token
is no target (the prompt and user turns of chat and prompt-completion records, marked by
`eqxzoo.data.manifest.NOT_TARGET`); the end-of-document token after a document is a target
when the document's last token is, so the model learns to stop after an answer. With
document masks on, a batch also carries ``"segments"`` and ``"positions"``: a document's
segment is its tokens and its end-of-document token, numbered from the window's first
document (0) on, and positions count from 0 at each document's start (at the window's start
for the document it begins inside); the end-of-document token's target, the next document's
first token, which its segment cannot see, is then `IGNORED`. Both come from the documents'
boundaries in the stream, never from token values (an end-of-turn token may be the
end-of-document token), so every process computes the same for its part of a window.
"""

import dataclasses
import functools
import queue
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
from jax.sharding import Sharding
from jaxtyping import Array, Int, Int64, UInt32

from eqxzoo.data.manifest import (
    NOT_TARGET,
    TEXT_FORMAT,
    DataError,
    Manifest,
    decode_marked_record,
    is_target,
    masks_documents,
    read_manifest,
    token_ids,
    verify_shards,
)

# The trainer's "no target" id, eqxzoo.train.loss.IGNORED, restated so that the data package
# does not import the trainer; tests/test_data.py checks that they agree.
IGNORED = -1
BATCH_AXIS, SEQ_AXIS = 2, 3  # B and T in (G, M, B, T)
STATE_VERSION = 1
DOCUMENT_CACHE = 2048  # decoded documents kept per stream


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """One optimizer step's batch: G accumulation steps x M microbatches x B sequences x T."""

    grad_accum: int
    microbatches: int
    batch_size: int
    seq_len: int

    def __post_init__(self):
        for name in ("grad_accum", "microbatches", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise DataError(f"batch shape: {name} must be >= 1, got {getattr(self, name)}")

    @property
    def windows(self) -> int:
        """Windows (sequences) per global batch: ``G * M * B``."""
        return self.grad_accum * self.microbatches * self.batch_size

    @property
    def window_tokens(self) -> int:
        return self.seq_len + 1

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.grad_accum, self.microbatches, self.batch_size, self.seq_len)


# ----------------------------------------------------------------------------- documents


@dataclasses.dataclass(frozen=True)
class SplitDocuments:
    """The documents of one split: a grain source over its shards, every document's length,
    and the formats of the prepared documents (`eqxzoo.data.manifest.DOCUMENT_FORMATS`)."""

    name: str
    source: grain.sources.ArrayRecordDataSource
    lengths: Int64[np.ndarray, " documents"]
    eod_token_id: int
    vocab_size: int
    document_formats: tuple[str, ...] = (TEXT_FORMAT,)

    def document_mask(self, setting: bool | None) -> bool:
        """`eqxzoo.data.manifest.masks_documents` of this split's data."""
        return masks_documents(setting, self.document_formats)

    @property
    def stream_tokens(self) -> int:
        """Tokens in one epoch of the stream: every document plus its end-of-document token."""
        return int(self.lengths.sum()) + len(self.lengths)


def open_split(directory: Path | str, split: str, *, verify: bool = True) -> SplitDocuments:
    """Open a prepared split, checking the shards against the manifest.

    ``verify`` compares every file's sha256 with the manifest (a truncated or corrupted shard);
    record and token counts are always checked while reading the document lengths, so a
    manifest that does not describe the shards is caught either way. Raises `DataError`.
    """
    directory = Path(directory)
    manifest = verify_shards(directory) if verify else read_manifest(directory)
    if split not in manifest.splits:
        raise DataError(f"{directory}: the manifest has no {split!r} split")
    info = manifest.splits[split]
    if info.documents == 0:
        raise DataError(f"{directory}: the {split!r} split holds no documents")
    lengths = []
    paths = []
    for shard in info.shards:
        path = directory / shard.file
        if not path.is_file():
            raise DataError(f"shard {path} is missing; re-run python -m pipelines.prepare")
        shard_lengths = _record_lengths(path, manifest)
        if len(shard_lengths) != shard.records or int(shard_lengths.sum()) != shard.tokens:
            raise DataError(
                f"shard {path} does not match the manifest: it holds {len(shard_lengths)} "
                f"documents / {int(shard_lengths.sum())} tokens, the manifest says "
                f"{shard.records} / {shard.tokens}; re-run python -m pipelines.prepare"
            )
        lengths.append(shard_lengths)
        paths.append(str(path))
    all_lengths = np.concatenate(lengths)
    if len(all_lengths) != info.documents or int(all_lengths.sum()) != info.tokens:
        raise DataError(
            f"{directory}: the {split!r} shards hold {len(all_lengths)} documents / "
            f"{int(all_lengths.sum())} tokens, the manifest says {info.documents} / {info.tokens}"
        )
    return SplitDocuments(
        name=split,
        source=grain.sources.ArrayRecordDataSource(paths),
        lengths=all_lengths,
        eod_token_id=manifest.tokenizer.eod_token_id,
        vocab_size=manifest.tokenizer.vocab_size,
        document_formats=manifest.document_formats,
    )


def _record_lengths(path: Path, manifest: Manifest) -> Int64[np.ndarray, " documents"]:
    itemsize = np.dtype(manifest.token_dtype).itemsize
    try:
        source = grain.sources.ArrayRecordDataSource([str(path)])
        records = source.__getitems__(range(len(source)))
    except Exception as error:  # noqa: BLE001 (array_record's errors vary)
        raise DataError(
            f"shard {path} cannot be read ({error}); re-run python -m pipelines.prepare"
        ) from None
    return np.array([len(record) // itemsize for record in records], dtype=np.int64)


def check_vocab(documents: SplitDocuments, model_vocab_size: int) -> None:
    """A tokenizer larger than the model's embedding would index past it: refuse early."""
    if documents.vocab_size > model_vocab_size:
        raise DataError(
            f"the corpus tokenizer has {documents.vocab_size} tokens but model.vocab_size is "
            f"{model_vocab_size}; raise model.vocab_size or prepare with a smaller vocabulary"
        )


# ----------------------------------------------------------------------------- token stream


class TokenStream:
    """The endless stream of a split's documents, each followed by end-of-document, epoch after
    epoch; epoch ``e``'s document order is ``permutation(seed, e)`` (or file order if not
    ``shuffle``). Reads are thread-safe, so grain's reader threads can share one stream.

    Tokens are read as stored, `NOT_TARGET` marks kept (`eqxzoo.data.manifest.token_ids`
    clears them); an end-of-document token carries its document's last token's mark.
    `window` reads the windows of ``T + 1`` tokens that the stream is cut into, in the
    shuffled consumption order (see the module doc)."""

    def __init__(self, documents: SplitDocuments, *, seed: int, shuffle: bool):
        self.documents = documents
        self.seed = seed
        self.shuffle = shuffle
        self.epoch_tokens = documents.stream_tokens
        self._epoch = functools.lru_cache(maxsize=4)(self._order_and_ends)
        self._block_order = functools.lru_cache(maxsize=4)(self._window_permutation)
        # Shuffled windows revisit each document about length / (T + 1) times per epoch.
        self._document = functools.lru_cache(maxsize=DOCUMENT_CACHE)(self._read_document)

    def _read_document(self, index: int) -> UInt32[np.ndarray, " tokens"]:
        return decode_marked_record(self.documents.source[index])

    def _window_permutation(self, block: int, block_windows: int) -> Int64[np.ndarray, " windows"]:
        return np.random.default_rng([self.seed, block, 1]).permutation(block_windows)

    def window_start(self, index: int, width: int) -> int:
        """Where in the stream the ``index``-th window of ``width`` tokens in consumption
        order starts."""
        if self.shuffle:
            block_windows = max(1, self.epoch_tokens // width)
            block, offset = divmod(index, block_windows)
            index = block * block_windows + int(self._block_order(block, block_windows)[offset])
        return index * width

    def window(
        self, index: int, width: int, part: tuple[int, int] | None = None
    ) -> UInt32[np.ndarray, " width"]:
        """The ``index``-th window of ``width`` tokens in consumption order (its tokens
        ``[lo, hi)`` with ``part``, reading only those)."""
        start = self.window_start(index, width)
        lo, hi = (0, width) if part is None else part
        return self.read(start + lo, start + hi)

    def documents_at(
        self, start: int, stop: int
    ) -> tuple[Int64[np.ndarray, " tokens"], Int64[np.ndarray, " tokens"]]:
        """For each stream position in ``[start, stop)``: the number of its document in the
        stream (counted over all epochs) and the position where that document starts."""
        positions = np.arange(start, stop, dtype=np.int64)
        numbers = np.empty_like(positions)
        starts = np.empty_like(positions)
        epochs = positions // self.epoch_tokens
        for epoch in np.unique(epochs):
            here = epochs == epoch
            _, ends = self._epoch(int(epoch))
            offsets = positions[here] - epoch * self.epoch_tokens
            index = np.searchsorted(ends, offsets, side="right")
            numbers[here] = epoch * len(ends) + index
            begins = np.concatenate([[0], ends[:-1]])[index]
            starts[here] = epoch * self.epoch_tokens + begins
        return numbers, starts

    def _order_and_ends(
        self, epoch: int
    ) -> tuple[Int64[np.ndarray, " documents"], Int64[np.ndarray, " documents"]]:
        """Epoch ``epoch``'s document order and the stream offset at which each one ends
        (exclusive, counting its end-of-document token)."""
        n_documents = len(self.documents.lengths)
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(n_documents)
        else:
            order = np.arange(n_documents)
        return order, np.cumsum(self.documents.lengths[order] + 1)

    def read(self, start: int, stop: int) -> UInt32[np.ndarray, " tokens"]:
        """Tokens ``[start, stop)`` of the stream."""
        pieces = []
        position = start
        while position < stop:
            epoch, offset = divmod(position, self.epoch_tokens)
            end = min(stop, (epoch + 1) * self.epoch_tokens) - epoch * self.epoch_tokens
            pieces.append(self._read_in_epoch(epoch, offset, end))
            position = epoch * self.epoch_tokens + end
        return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]

    def _read_in_epoch(self, epoch: int, start: int, stop: int) -> UInt32[np.ndarray, " tokens"]:
        order, ends = self._epoch(epoch)
        first = int(np.searchsorted(ends, start, side="right"))
        last = int(np.searchsorted(ends, stop - 1, side="right"))
        eod = np.uint32(self.documents.eod_token_id)
        pieces = []
        for index in order[first : last + 1]:
            document = self._document(int(index))
            pieces.append(document)
            last_mark = document[-1] & np.uint32(NOT_TARGET) if len(document) else 0
            pieces.append(np.array([eod | last_mark], dtype=np.uint32))
        tokens = np.concatenate(pieces)
        begin = int(ends[first - 1]) if first > 0 else 0
        return tokens[start - begin : stop - begin]


# ----------------------------------------------------------------------------- batches


def process_rows(sharding: Sharding, shape: BatchShape) -> tuple[int, int]:
    """The rows ``[lo, hi)`` of ``B`` that this process's devices hold under ``sharding``."""
    indices = sharding.addressable_devices_indices_map(shape.shape).values()
    return held_range([index[BATCH_AXIS] for index in indices], shape.batch_size, "batch rows")


def process_columns(sharding: Sharding, shape: BatchShape) -> tuple[int, int]:
    """The tokens ``[lo, hi)`` of each sequence (``T``) that this process's devices hold:
    all of them unless ``sharding`` splits the sequences over ``cp`` across processes."""
    indices = sharding.addressable_devices_indices_map(shape.shape).values()
    return held_range([index[SEQ_AXIS] for index in indices], shape.seq_len, "sequence tokens")


def held_range(slices: list[slice], size: int, what: str) -> tuple[int, int]:
    """The one contiguous range ``[lo, hi)`` of an axis of ``size`` that ``slices`` (the
    devices' parts of it) cover together."""
    ranges = sorted({part.indices(size)[:2] for part in slices})
    lo, hi = ranges[0][0], ranges[-1][1]
    covered = sum(stop - start for start, stop in ranges)
    if covered != hi - lo:
        raise ValueError(f"this process's {what} {ranges} are not one contiguous range")
    return lo, hi


@dataclasses.dataclass(frozen=True)
class HostBatch:
    """One process's part of a global batch: rows ``[lo, hi)`` of B, as numpy arrays;
    ``segments`` and ``positions`` only with document masks."""

    inputs: Int[np.ndarray, "grad_accum microbatches rows seq"]
    targets: Int[np.ndarray, "grad_accum microbatches rows seq"]
    segments: Int[np.ndarray, "grad_accum microbatches rows seq"] | None = None
    positions: Int[np.ndarray, "grad_accum microbatches rows seq"] | None = None

    def arrays(self) -> dict[str, Int[np.ndarray, "grad_accum microbatches rows seq"]]:
        """The batch's arrays by the names the trainer reads."""
        named = {"tokens": self.inputs, "targets": self.targets}
        if self.segments is not None and self.positions is not None:
            named |= {"segments": self.segments, "positions": self.positions}
        return named


@dataclasses.dataclass(frozen=True)
class WindowPart:
    """Tokens ``[lo, hi)`` of one window with their targets, and with document masks their
    segments and positions (see the module doc)."""

    inputs: Int[np.ndarray, " tokens"]
    targets: Int[np.ndarray, " tokens"]
    segments: Int[np.ndarray, " tokens"] | None
    positions: Int[np.ndarray, " tokens"] | None


def read_window_part(
    stream: TokenStream, index: int, width: int, part: tuple[int, int], document_mask: bool
) -> WindowPart:
    """Inputs ``part`` of the ``index``-th window and their targets (read one token on)."""
    start = stream.window_start(index, width)
    lo, hi = part
    marked = stream.read(start + lo, start + hi + 1)
    ids = token_ids(marked).astype(np.int32)
    targets = np.where(is_target(marked[1:]), ids[1:], IGNORED).astype(np.int32)
    if not document_mask:
        return WindowPart(ids[:-1], targets, None, None)
    numbers, begins = stream.documents_at(start + lo, start + hi + 1)
    first_number, _ = stream.documents_at(start, start + 1)
    segments = (numbers - first_number[0]).astype(np.int32)
    targets = np.where(segments[1:] == segments[:-1], targets, IGNORED).astype(np.int32)
    offsets = np.arange(start + lo, start + hi, dtype=np.int64)
    positions = (offsets - np.maximum(begins[:-1], start)).astype(np.int32)
    return WindowPart(ids[:-1], targets, segments[:-1], positions)


class WindowReader:
    """Reads step ``k``'s rows ``rows`` of windows, starting at window ``first_window``: of
    each, the tokens ``columns`` of the sequence (all by default) and the targets after them,
    and with ``document_mask`` their segments and positions."""

    def __init__(
        self,
        stream: TokenStream,
        shape: BatchShape,
        rows: tuple[int, int],
        first_window: int,
        columns: tuple[int, int] | None = None,
        *,
        document_mask: bool = False,
    ):
        self.stream = stream
        self.shape = shape
        self.rows = rows
        self.columns = (0, shape.seq_len) if columns is None else columns
        self.first_window = first_window
        self.document_mask = document_mask

    def __call__(self, step: int) -> HostBatch:
        shape = self.shape
        lo, hi = self.rows
        first, last = self.columns
        names = ("inputs", "targets", "segments", "positions")
        if not self.document_mask:
            names = names[:2]
        local = (shape.grad_accum, shape.microbatches, hi - lo, last - first)
        arrays = {name: np.empty(local, np.int32) for name in names}
        base = self.first_window + step * shape.windows
        for g in range(shape.grad_accum):
            for m in range(shape.microbatches):
                start = base + (g * shape.microbatches + m) * shape.batch_size + lo
                for row in range(hi - lo):
                    part = read_window_part(
                        self.stream,
                        start + row,
                        shape.window_tokens,
                        self.columns,
                        self.document_mask,
                    )
                    for name, array in arrays.items():
                        array[g, m, row] = getattr(part, name)
        return HostBatch(**arrays)


class Batches(grain.DatasetIterator):
    """Global ``(G, M, B, T)`` training batches as sharded `jax.Array`s, prefetched.

    A grain dataset over step numbers reads this process's rows with ``num_threads`` reader
    threads; a background thread turns them into global arrays
    (`jax.make_array_from_process_local_data`) ``prefetch`` steps ahead of the consumer.
    ``get_state()`` is the position of the next batch *handed out* (not of the prefetched
    ones), the same on every process; `set_state` continues exactly there. With
    ``document_mask`` the batches also carry ``"segments"`` and ``"positions"``.
    """

    def __init__(
        self,
        stream: TokenStream,
        shape: BatchShape,
        sharding: Sharding,
        *,
        prefetch: int = 2,
        num_threads: int = 2,
        document_mask: bool = False,
    ):
        super().__init__()
        self.stream = stream
        self.shape = shape
        self.sharding = sharding
        self.document_mask = document_mask
        self.rows = process_rows(sharding, shape)
        self.columns = process_columns(sharding, shape)
        self.prefetch = max(prefetch, 1)
        self.num_threads = num_threads
        self._next_window = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=self.prefetch)

    def _host_batches(self, first_window: int):
        reader = WindowReader(
            self.stream,
            self.shape,
            self.rows,
            first_window,
            self.columns,
            document_mask=self.document_mask,
        )
        dataset = grain.MapDataset.range(0, 1 << 62).map(reader)
        options = grain.ReadOptions(
            num_threads=self.num_threads,
            prefetch_buffer_size=max(self.prefetch, self.num_threads),
        )
        return iter(dataset.to_iter_dataset(options))

    def _produce(self, first_window: int, stop: threading.Event, out: queue.Queue) -> None:
        try:
            host = self._host_batches(first_window)
            window = first_window
            while not stop.is_set():
                batch = next(host)
                arrays = {name: self._to_global(part) for name, part in batch.arrays().items()}
                window += self.shape.windows
                while not stop.is_set():
                    try:
                        out.put((window, arrays), timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except Exception as error:  # noqa: BLE001 (handed to the consumer, raised there)
            out.put(error)

    def _to_global(self, local: Int[np.ndarray, "g m rows t"]) -> Int[Array, "g m b t"]:
        return jax.make_array_from_process_local_data(self.sharding, local, self.shape.shape)

    def start_prefetch(self) -> None:
        if self._thread is None:
            self._stop = threading.Event()
            self._queue = queue.Queue(maxsize=self.prefetch)
            self._thread = threading.Thread(
                target=self._produce,
                args=(self._next_window, self._stop, self._queue),
                name="eqxzoo-batches",
                daemon=True,
            )
            self._thread.start()

    def close(self) -> None:
        """Stop the background thread; a later `next` or `start_prefetch` starts it again."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def __next__(self) -> dict[str, Int[Array, "grad_accum microbatches batch seq"]]:
        self.start_prefetch()
        item = self._queue.get()
        if isinstance(item, BaseException):
            self._thread = None
            raise item
        self._next_window, arrays = item
        return arrays

    def get_state(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "next_window": self._next_window,
            "window_tokens": self.shape.window_tokens,
            "seed": self.stream.seed,
            "epoch_tokens": self.stream.epoch_tokens,
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Continue at ``state``'s position; the stream must be the one that wrote it (same
        split, seed and window length). The batch size may differ: windows are numbered
        globally, so a run resumed with another batch size takes the next unseen windows."""
        expected = {k: v for k, v in self.get_state().items() if k != "next_window"}
        found = {k: state.get(k) for k in expected}
        if found != expected:
            raise DataError(
                f"the checkpoint's data position belongs to another stream ({found}); this run "
                f"reads {expected}: data.seed, data.seq_len and the corpus must match to resume"
            )
        self.close()
        self._next_window = int(state["next_window"])

    def __del__(self):
        self._stop.set()


def check_fits(documents: SplitDocuments, shape: BatchShape, *, batches: int = 1) -> None:
    """One epoch of the split must hold ``batches`` whole batches: otherwise a batch would
    repeat tokens (and the validation set would not be a fixed set of distinct windows)."""
    needed = batches * shape.windows * shape.window_tokens
    if needed > documents.stream_tokens:
        raise DataError(
            f"data.seq_len {shape.seq_len}: {batches} batch(es) of {shape.windows} sequences need "
            f"{needed} tokens but the {documents.name!r} split holds only "
            f"{documents.stream_tokens} (with end-of-document tokens); lower data.seq_len or the "
            "batch size, or prepare a larger corpus"
        )


def train_batches(
    documents: SplitDocuments,
    shape: BatchShape,
    sharding: Sharding,
    *,
    seed: int,
    prefetch: int = 2,
    num_threads: int = 2,
    document_mask: bool | None = None,
) -> Batches:
    """Shuffled, endless training batches (see the module doc for the order); document masks
    as `SplitDocuments.document_mask` decides from ``document_mask``."""
    check_fits(documents, shape)
    stream = TokenStream(documents, seed=seed, shuffle=True)
    return Batches(
        stream,
        shape,
        sharding,
        prefetch=prefetch,
        num_threads=num_threads,
        document_mask=documents.document_mask(document_mask),
    )


def validation_batches(
    documents: SplitDocuments,
    shape: BatchShape,
    sharding: Sharding,
    *,
    batches: int,
    document_mask: bool | None = None,
) -> list[dict[str, Int[Array, "grad_accum microbatches batch seq"]]]:
    """A fixed set of ``batches`` batches: the first of the split's stream shuffled with seed 0
    (distinct windows drawn from the whole split, the same whatever the run's seed), with the
    keys `train_batches` gives."""
    check_fits(documents, shape, batches=batches)
    stream = TokenStream(documents, seed=0, shuffle=True)
    reader = WindowReader(
        stream,
        shape,
        process_rows(sharding, shape),
        0,
        process_columns(sharding, shape),
        document_mask=documents.document_mask(document_mask),
    )
    return [
        {
            name: jax.make_array_from_process_local_data(sharding, part, shape.shape)
            for name, part in reader(step).arrays().items()
        }
        for step in range(batches)
    ]
