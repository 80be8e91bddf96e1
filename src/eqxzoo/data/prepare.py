"""Corpus preparation: raw text -> a tokenizer and ArrayRecord shards of tokenised documents.

An output directory holds

    tokenizer.json                  the byte-level BPE (trained here or copied from --tokenizer)
    train-00000.array_record ...    one record per document: its token ids as little-endian
    val-00000.array_record ...      uint32 bytes, *without* the end-of-document token (the
                                    loader appends it), at most ``records_per_shard`` per shard
    manifest.json                   written last: counts, checksums, inputs and options

Documents are split into train and validation by a hash of their content, so the split
does not depend on input order and duplicates never straddle it. Everything is written into
a hidden staging directory beside the output and renamed into place at the end, so a run
killed at any moment leaves no valid manifest; a later run with the same inputs and options
finds the manifest and does nothing.

Shards stay small because ArrayRecord random reads cost O(records per file).
"""

import contextlib
import dataclasses
import fcntl
import gzip
import hashlib
import io
import json
import os
import shutil
import sys
import sysconfig
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter
from jaxtyping import Bool, Float64, UInt32
from tokenizers import Tokenizer

from eqxzoo.data.tokenizer import (
    EOD_TOKEN,
    MIN_VOCAB_SIZE,
    encode_documents,
    ensure_eod_token,
    train_byte_level_bpe,
)

FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "val")
TOKEN_DTYPE = "<u4"  # little-endian uint32, one per token
DEFAULT_VOCAB_SIZE = 4096
# group_size:1 compresses each record on its own, so one random read decompresses one record.
SHARD_WRITER_OPTIONS = "group_size:1"
ENCODE_BATCH_DOCUMENTS = 256

STDLIB_EXCLUDED_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idlelib",
        "lib2to3",
        "__pycache__",
    }
)
STDLIB_MAX_FILE_BYTES = 1 << 20


class DataError(ValueError):
    """Bad data input a user can fix: the message names the file (and line) and the problem."""


class _NotTextError(DataError):
    """A file that is not UTF-8 text (or not valid gzip): fatal if named, skipped in a walk."""


# ----------------------------------------------------------------------------- options


@dataclasses.dataclass(frozen=True)
class PrepareOptions:
    """How to turn inputs into shards; ``tokenizer_file`` set means load it instead of training."""

    vocab_size: int = DEFAULT_VOCAB_SIZE
    tokenizer_file: Path | None = None
    text_field: str = "text"
    val_fraction: float = 0.01
    records_per_shard: int = 4096

    def __post_init__(self):
        if self.tokenizer_file is None and self.vocab_size < MIN_VOCAB_SIZE:
            raise DataError(
                f"--vocab-size must be >= {MIN_VOCAB_SIZE} (256 bytes + {EOD_TOKEN}), "
                f"got {self.vocab_size}"
            )
        if not 0.0 <= self.val_fraction < 1.0:
            raise DataError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.records_per_shard < 1:
            raise DataError(f"--records-per-shard must be >= 1, got {self.records_per_shard}")
        if not self.text_field:
            raise DataError("--text-field must not be empty")


# ----------------------------------------------------------------------------- manifest


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    file: str
    records: int
    tokens: int
    bytes: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class SplitInfo:
    documents: int
    tokens: int
    shards: tuple[ShardInfo, ...]


@dataclasses.dataclass(frozen=True)
class TokenizerInfo:
    file: str
    vocab_size: int
    eod_token: str
    eod_token_id: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class InputFileInfo:
    """One input file as it was when prepared: a change in size or mtime means re-prepare."""

    path: str
    bytes: int
    mtime_ns: int


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What a prepared directory holds; ``splits`` has the keys ``"train"`` and ``"val"``.

    Token counts exclude end-of-document tokens; ``token_dtype`` is the NumPy dtype of the
    records' bytes.
    """

    format_version: int
    token_dtype: str
    tokenizer: TokenizerInfo
    splits: dict[str, SplitInfo]
    inputs_fingerprint: str
    inputs: tuple[InputFileInfo, ...]
    options: dict[str, object]


def manifest_to_json(manifest: Manifest) -> str:
    return json.dumps(dataclasses.asdict(manifest), indent=2, sort_keys=True) + "\n"


def manifest_from_json(text: str, source: str) -> Manifest:
    """Parse manifest JSON; ``source`` names it in the error of a damaged or foreign file."""
    try:
        raw = json.loads(text)
        if raw["format_version"] != FORMAT_VERSION:
            raise DataError(
                f"{source}: manifest format {raw['format_version']} is not {FORMAT_VERSION}; "
                "re-run python -m pipelines.prepare"
            )
        splits = {
            name: SplitInfo(
                documents=split["documents"],
                tokens=split["tokens"],
                shards=tuple(ShardInfo(**shard) for shard in split["shards"]),
            )
            for name, split in raw["splits"].items()
        }
        return Manifest(
            format_version=raw["format_version"],
            token_dtype=raw["token_dtype"],
            tokenizer=TokenizerInfo(**raw["tokenizer"]),
            splits=splits,
            inputs_fingerprint=raw["inputs_fingerprint"],
            inputs=tuple(InputFileInfo(**info) for info in raw["inputs"]),
            options=raw["options"],
        )
    except DataError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise DataError(
            f"{source}: not a valid manifest ({type(error).__name__}: {error})"
        ) from None


def read_manifest(directory: Path | str) -> Manifest:
    """The manifest of a prepared directory; `DataError` if there is none or it is damaged."""
    path = Path(directory) / MANIFEST_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(
            f"{directory}: no {MANIFEST_FILE}, not a prepared corpus "
            "(run python -m pipelines.prepare)"
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"{path}: cannot read ({error})") from None
    return manifest_from_json(text, str(path))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _check_file(path: Path, expected_sha256: str, what: str) -> None:
    if not path.is_file():
        raise DataError(f"{what} {path} is missing; re-run python -m pipelines.prepare")
    actual = file_sha256(path)
    if actual != expected_sha256:
        raise DataError(
            f"{what} {path} is corrupt: sha256 {actual[:16]}... differs from the manifest's "
            f"{expected_sha256[:16]}...; re-run python -m pipelines.prepare"
        )


def verify_shards(directory: Path | str) -> Manifest:
    """Check tokenizer.json and every shard against the manifest's sha256; return the manifest.

    Raises `DataError` naming the first missing or corrupt file.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    _check_file(directory / manifest.tokenizer.file, manifest.tokenizer.sha256, "tokenizer")
    for split in manifest.splits.values():
        for shard in split.shards:
            _check_file(directory / shard.file, shard.sha256, "shard")
    return manifest


# ----------------------------------------------------------------------------- inputs


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """An input file; ``walked`` files (found in a directory) are skipped if not UTF-8 text."""

    path: Path
    walked: bool


def is_jsonl(path: Path) -> bool:
    return path.name.endswith((".jsonl", ".jsonl.gz"))


def stdlib_source_files() -> list[Path]:
    """The standard library's own ``*.py`` files: the built-in corpus, in sorted order.

    Tests, IDLE, lib2to3, installed packages and files over 1 MiB are left out: the rest is
    ordinary, varied Python a small model can learn from.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in _walk_files(root, skip_dir=lambda d: d.name in STDLIB_EXCLUDED_DIRS):
        if path.suffix == ".py" and path.stat().st_size <= STDLIB_MAX_FILE_BYTES:
            files.append(path)
    return files


def _walk_files(root: Path, skip_dir: Callable[[Path], bool]) -> list[Path]:
    """Regular files under ``root``, recursively, sorted by path; hidden entries skipped."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [
            name for name in dirnames if not name.startswith(".") and not skip_dir(here / name)
        ]
        files.extend(
            here / name
            for name in filenames
            if not name.startswith(".") and (here / name).is_file()
        )
    return sorted(files, key=lambda path: path.relative_to(root).parts)


def collect_source_files(
    inputs: Sequence[Path], *, exclude: Path | None = None
) -> list[SourceFile]:
    """Expand input paths (files, or directories walked recursively) into files, in order.

    ``exclude`` is a directory never walked into: the output, when it lies inside an input.
    """
    excluded = exclude.resolve() if exclude is not None else None
    sources = []
    for path in inputs:
        path = Path(path)
        if path.is_dir():
            walked = _walk_files(path, skip_dir=lambda d: d.resolve() == excluded)
            sources.extend(SourceFile(file, walked=True) for file in walked)
        elif path.is_file():
            sources.append(SourceFile(path, walked=False))
        else:
            raise DataError(f"input {path} does not exist")
    return sources


def inputs_record(sources: Sequence[SourceFile]) -> tuple[InputFileInfo, ...]:
    """Path, size and mtime of every input: enough to tell a re-run from changed inputs."""
    infos = []
    for source in sources:
        stat = source.path.stat()
        infos.append(InputFileInfo(str(source.path.resolve()), stat.st_size, stat.st_mtime_ns))
    return tuple(infos)


def fingerprint(record: object) -> str:
    """sha256 of a JSON-able value, keys sorted: equal values give equal fingerprints."""
    text = json.dumps(record, sort_keys=True, default=dataclasses.asdict)
    return hashlib.sha256(text.encode()).hexdigest()


# ----------------------------------------------------------------------------- documents


def _open_binary(path: Path) -> io.BufferedIOBase:
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def _read_bytes(path: Path) -> bytes:
    """The file's bytes, gunzipped if its name ends in ``.gz``."""
    try:
        with _open_binary(path) as file:
            return file.read()
    except (gzip.BadGzipFile, EOFError, zlib.error) as error:
        raise _NotTextError(f"{path}: not a valid gzip file ({error})") from None
    except OSError as error:
        raise DataError(f"{path}: cannot read ({error.strerror or error})") from None


def _read_lines(path: Path) -> Iterator[bytes]:
    """The file's lines, gunzipped if its name ends in ``.gz``, streamed."""
    try:
        with _open_binary(path) as file:
            yield from file
    except (gzip.BadGzipFile, EOFError, zlib.error) as error:
        raise _NotTextError(f"{path}: not a valid gzip file ({error})") from None
    except OSError as error:
        raise DataError(f"{path}: cannot read ({error.strerror or error})") from None


def _decode_utf8(data: bytes, where: str) -> str:
    if b"\x00" in data:
        raise _NotTextError(f"{where}: not UTF-8 text (contains NUL bytes)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise _NotTextError(f"{where}: not UTF-8 text (bad byte at offset {error.start})") from None


def _jsonl_documents(path: Path, text_field: str) -> Iterator[str]:
    for line_number, line in enumerate(_read_lines(path), start=1):
        if not line.strip():
            continue
        where = f"{path}:{line_number}"
        try:
            value = json.loads(_decode_utf8(line, where))
        except json.JSONDecodeError as error:
            raise DataError(f"{where}: not valid JSON ({error.msg})") from None
        if not isinstance(value, dict) or text_field not in value:
            raise DataError(f"{where}: no field {text_field!r} (set --text-field)")
        text = value[text_field]
        if not isinstance(text, str):
            raise DataError(f"{where}: field {text_field!r} is {type(text).__name__}, not a string")
        if text:
            yield text


def read_documents(path: Path, text_field: str) -> Iterator[str]:
    """The non-empty documents of one file: the whole file, or one per JSONL line."""
    if is_jsonl(path):
        yield from _jsonl_documents(path, text_field)
    else:
        text = _decode_utf8(_read_bytes(path), str(path))
        if text:
            yield text


def iter_documents(files: Sequence[Path], text_field: str) -> Iterator[str]:
    """All documents of ``files`` in order; the same files always give the same sequence."""
    for path in files:
        yield from read_documents(path, text_field)


# ----------------------------------------------------------------------------- split


def document_score(text: str) -> float:
    """A uniform number in [0, 1) from the document's content (sha256), for the split."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def assign_validation(
    scores: Float64[np.ndarray, " documents"], val_fraction: float
) -> Bool[np.ndarray, " documents"]:
    """Which documents go to validation: those scoring below ``val_fraction``.

    With a positive fraction and at least two documents, validation gets at least one (the
    lowest score) and training keeps at least one (the highest).
    """
    is_val = scores < val_fraction
    if val_fraction > 0 and len(scores) >= 2 and not is_val.any():
        is_val[np.argmin(scores)] = True
    if len(scores) >= 1 and is_val.all():
        is_val[np.argmax(scores)] = False
    return is_val


@dataclasses.dataclass(frozen=True)
class CorpusScan:
    """The files that hold text and one split score per document, in document order."""

    files: tuple[Path, ...]
    skipped: tuple[Path, ...]
    scores: Float64[np.ndarray, " documents"]


def scan_corpus(sources: Sequence[SourceFile], text_field: str) -> CorpusScan:
    """Read every input once: check it parses, skip walked files that are not text, score."""
    files, skipped, scores = [], [], []
    for source in sources:
        try:
            file_scores = [document_score(text) for text in read_documents(source.path, text_field)]
        except _NotTextError:
            if not source.walked:
                raise
            skipped.append(source.path)
            continue
        files.append(source.path)
        scores.extend(file_scores)
    return CorpusScan(tuple(files), tuple(skipped), np.asarray(scores, dtype=np.float64))


# ----------------------------------------------------------------------------- shards


def encode_record(token_ids: Sequence[int]) -> bytes:
    """One document's record: its token ids as little-endian uint32 bytes."""
    return np.asarray(token_ids, dtype=TOKEN_DTYPE).tobytes()


def decode_record(record: bytes) -> UInt32[np.ndarray, " tokens"]:
    """The token ids of one record (the inverse of `encode_record`)."""
    return np.frombuffer(record, dtype=TOKEN_DTYPE).astype(np.uint32)


def shard_file_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.array_record"


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as file:
        os.fsync(file.fileno())


class ShardWriter:
    """Writes one split's records into numbered shards of at most ``records_per_shard``."""

    def __init__(self, directory: Path, split: str, records_per_shard: int):
        self.directory = directory
        self.split = split
        self.records_per_shard = records_per_shard
        self.shards: list[ShardInfo] = []
        self._writer: ArrayRecordWriter | None = None
        self._records = 0
        self._tokens = 0

    def write(self, token_ids: Sequence[int]) -> None:
        if self._writer is None:
            path = self.directory / shard_file_name(self.split, len(self.shards))
            self._writer = ArrayRecordWriter(str(path), SHARD_WRITER_OPTIONS)
        self._writer.write(encode_record(token_ids))
        self._records += 1
        self._tokens += len(token_ids)
        if self._records == self.records_per_shard:
            self._finish_shard()

    def _finish_shard(self) -> None:
        assert self._writer is not None
        self._writer.close()
        self._writer = None
        name = shard_file_name(self.split, len(self.shards))
        path = self.directory / name
        _fsync_file(path)
        self.shards.append(
            ShardInfo(
                name,
                self._records,
                self._tokens,
                path.stat().st_size,
                file_sha256(path),
            )
        )
        self._records = self._tokens = 0

    def close(self) -> SplitInfo:
        if self._writer is not None:
            self._finish_shard()
        return SplitInfo(
            documents=sum(shard.records for shard in self.shards),
            tokens=sum(shard.tokens for shard in self.shards),
            shards=tuple(self.shards),
        )


def _batched(items: Iterable[str], size: int) -> Iterator[list[str]]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def write_shards(
    directory: Path,
    tokenizer: Tokenizer,
    documents: Iterable[str],
    is_val: Bool[np.ndarray, " documents"],
    records_per_shard: int,
) -> dict[str, SplitInfo]:
    """Tokenise ``documents`` and write each to its split's shards; the splits' summaries."""
    writers = {split: ShardWriter(directory, split, records_per_shard) for split in SPLITS}
    index = 0
    for batch in _batched(documents, ENCODE_BATCH_DOCUMENTS):
        for token_ids in encode_documents(tokenizer, batch):
            if index >= len(is_val):
                raise DataError("the inputs changed while being prepared; run again")
            writers["val" if is_val[index] else "train"].write(token_ids)
            index += 1
    if index != len(is_val):
        raise DataError("the inputs changed while being prepared; run again")
    return {split: writer.close() for split, writer in writers.items()}


# ----------------------------------------------------------------------------- tokenizer


def load_tokenizer(path: Path | str) -> Tokenizer:
    """A tokenizer from a Hugging Face ``tokenizer.json``; `DataError` if it cannot be loaded."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"tokenizer {path} does not exist")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # noqa: BLE001 (tokenizers raises bare Exceptions)
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise DataError(f"cannot load tokenizer {path}: {message}") from None


# ----------------------------------------------------------------------------- publishing


def options_record(options: PrepareOptions) -> dict[str, object]:
    """The options as recorded in the manifest: a changed one means the output is stale."""
    if options.tokenizer_file is None:
        tokenizer: dict[str, object] = {"train_vocab_size": options.vocab_size}
    else:
        path = Path(options.tokenizer_file)
        tokenizer = {"file": str(path.resolve()), "sha256": file_sha256(path)}
    record = {
        "tokenizer": tokenizer,
        "text_field": options.text_field,
        "val_fraction": options.val_fraction,
        "records_per_shard": options.records_per_shard,
    }
    return json.loads(json.dumps(record))


def is_up_to_date(out_dir: Path, inputs_fingerprint: str, options: dict[str, object]) -> bool:
    """True when ``out_dir`` was prepared from these inputs with these options and is whole.

    Files are checked by presence and size, not checksum: `verify_shards` is the full check.
    """
    try:
        manifest = read_manifest(out_dir)
    except DataError:
        return False
    if manifest.inputs_fingerprint != inputs_fingerprint or manifest.options != options:
        return False
    shards = [shard for split in manifest.splits.values() for shard in split.shards]
    tokenizer_path = out_dir / manifest.tokenizer.file
    return tokenizer_path.is_file() and all(
        (out_dir / shard.file).is_file() and (out_dir / shard.file).stat().st_size == shard.bytes
        for shard in shards
    )


def _check_replaceable(out_dir: Path) -> None:
    """Refuse to replace a path that is not an earlier output (or an empty directory)."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise DataError(f"--out {out_dir} exists and is not a directory")
    if any(out_dir.iterdir()) and not (out_dir / MANIFEST_FILE).is_file():
        raise DataError(
            f"--out {out_dir} is not empty and holds no {MANIFEST_FILE}; "
            "choose a new or empty directory"
        )


def _staging_prefix(out_dir: Path) -> str:
    return f".{out_dir.name}.partial-"


@contextlib.contextmanager
def _exclusive_lock(out_dir: Path) -> Iterator[None]:
    """Hold a lock beside ``out_dir`` so concurrent runs (several trainer processes) take turns."""
    with open(out_dir.parent / f".{out_dir.name}.lock", "a") as lock_file:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


def _remove_stale_staging(out_dir: Path) -> None:
    """Delete staging directories of killed runs (safe: we hold the lock, so none is live)."""
    for stale in out_dir.parent.glob(_staging_prefix(out_dir) + "*"):
        shutil.rmtree(stale, ignore_errors=True)


def _publish(staging: Path, out_dir: Path) -> None:
    """Move the finished ``staging`` directory to ``out_dir``, replacing an earlier output."""
    directory_fd = os.open(staging, os.O_RDONLY)
    try:
        os.fsync(directory_fd)
    finally:
        os.close(directory_fd)
    if out_dir.exists():
        retired = staging.with_name(staging.name + "-retired")
        os.replace(out_dir, retired)
        os.replace(staging, out_dir)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(staging, out_dir)


# ----------------------------------------------------------------------------- prepare


@dataclasses.dataclass(frozen=True)
class PrepareResult:
    out_dir: Path
    manifest: Manifest
    up_to_date: bool
    skipped_files: tuple[Path, ...]
    tokenizer_seconds: float
    total_seconds: float


def _no_progress(message: str) -> None:
    del message


def prepare_corpus(
    inputs: Sequence[Path],
    out_dir: Path,
    options: PrepareOptions,
    *,
    include_stdlib: bool = False,
    progress: Callable[[str], None] = _no_progress,
) -> PrepareResult:
    """Prepare ``inputs`` (and the stdlib corpus if asked) into ``out_dir``; see the module doc.

    A no-op returning ``up_to_date=True`` when ``out_dir`` already holds this preparation.
    Raises `DataError` for bad inputs, options or output paths.
    """
    start = time.perf_counter()
    out_dir = Path(out_dir).resolve()
    stdlib = stdlib_source_files() if include_stdlib else []
    sources = [SourceFile(path, walked=True) for path in stdlib]
    sources += collect_source_files(inputs, exclude=out_dir)
    if not sources:
        raise DataError("no usable documents: the inputs hold no files")
    tokenizer = None if options.tokenizer_file is None else load_tokenizer(options.tokenizer_file)
    inputs_info = inputs_record(sources)
    inputs_fingerprint = fingerprint(inputs_info)
    options_info = options_record(options)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive_lock(out_dir):
            if is_up_to_date(out_dir, inputs_fingerprint, options_info):
                manifest = read_manifest(out_dir)
                return PrepareResult(out_dir, manifest, True, (), 0.0, time.perf_counter() - start)
            _check_replaceable(out_dir)
            _remove_stale_staging(out_dir)

            progress(f"reading {len(sources)} input files")
            scan = scan_corpus(sources, options.text_field)
            if len(scan.scores) == 0:
                raise DataError("no usable documents: the inputs hold no non-empty UTF-8 text")
            is_val = assign_validation(scan.scores, options.val_fraction)

            tokenizer_start = time.perf_counter()
            if tokenizer is None:
                progress(f"training a byte-level BPE of {options.vocab_size} tokens")
                documents = iter_documents(scan.files, options.text_field)
                tokenizer = train_byte_level_bpe(documents, options.vocab_size)
            tokenizer_seconds = time.perf_counter() - tokenizer_start

            progress(f"tokenising {len(scan.scores)} documents")
            manifest = _write_output(
                out_dir,
                tokenizer,
                iter_documents(scan.files, options.text_field),
                is_val,
                options.records_per_shard,
                inputs_fingerprint=inputs_fingerprint,
                inputs=inputs_info,
                options=options_info,
            )
    except OSError as error:
        raise DataError(f"cannot write --out {out_dir}: {error.strerror or error}") from None
    return PrepareResult(
        out_dir,
        manifest,
        False,
        scan.skipped,
        tokenizer_seconds,
        time.perf_counter() - start,
    )


def _write_output(
    out_dir: Path,
    tokenizer: Tokenizer,
    documents: Iterable[str],
    is_val: Bool[np.ndarray, " documents"],
    records_per_shard: int,
    *,
    inputs_fingerprint: str,
    inputs: tuple[InputFileInfo, ...],
    options: dict[str, object],
) -> Manifest:
    """Write shards, tokenizer.json and (last) manifest.json into a staging directory beside
    ``out_dir``, then rename it into place; nothing is left behind if this fails."""
    eod_token_id = ensure_eod_token(tokenizer)
    staging = out_dir.parent / f"{_staging_prefix(out_dir)}{uuid.uuid4().hex[:12]}"
    staging.mkdir()
    try:
        splits = write_shards(staging, tokenizer, documents, is_val, records_per_shard)
        tokenizer.save(str(staging / TOKENIZER_FILE))
        _fsync_file(staging / TOKENIZER_FILE)
        tokenizer_info = TokenizerInfo(
            file=TOKENIZER_FILE,
            vocab_size=tokenizer.get_vocab_size(),
            eod_token=EOD_TOKEN,
            eod_token_id=eod_token_id,
            sha256=file_sha256(staging / TOKENIZER_FILE),
        )
        manifest = Manifest(
            format_version=FORMAT_VERSION,
            token_dtype=TOKEN_DTYPE,
            tokenizer=tokenizer_info,
            splits=splits,
            inputs_fingerprint=inputs_fingerprint,
            inputs=inputs,
            options=options,
        )
        with open(staging / MANIFEST_FILE, "w", encoding="utf-8") as file:
            file.write(manifest_to_json(manifest))
            file.flush()
            os.fsync(file.fileno())
        _publish(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def default_stdlib_cache_dir(vocab_size: int) -> Path:
    """``$XDG_CACHE_HOME/eqxzoo/stdlib-<python>-v<vocab>`` (``~/.cache`` when unset)."""
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    return cache_home / "eqxzoo" / f"stdlib-{python}-v{vocab_size}"


def prepare_stdlib_corpus(
    cache_dir: Path | str | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> Path:
    """The built-in corpus (this Python's stdlib sources), prepared on first use; its directory.

    Later calls find the manifest and return at once; a changed stdlib is re-prepared.
    """
    out_dir = Path(cache_dir) if cache_dir is not None else default_stdlib_cache_dir(vocab_size)
    options = PrepareOptions(vocab_size=vocab_size)
    return prepare_corpus([], out_dir, options, include_stdlib=True).out_dir
