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

Nothing a run did not write is deleted or overwritten. An existing output directory is
replaced only when it holds a manifest and otherwise only files named like those above
(checked before any work and again just before the swap); anything else is refused with
the names. Beside it a run writes a lock file ``.DIR.lock`` and staging directories
``.DIR.partial-*``, and deletes from those only files named like its outputs.

This module is the run itself (options, up-to-date check, lock, staging, publishing); reading
the inputs is `eqxzoo.data.sources`, writing shards `eqxzoo.data.shards`, and the manifest
and its checks (all the loader needs) `eqxzoo.data.manifest`.
"""

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
from jaxtyping import Bool
from tokenizers import Tokenizer

from eqxzoo.data.manifest import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    SPLITS,
    TOKEN_DTYPE,
    TOKENIZER_FILE,
    DataError,
    InputFileInfo,
    Manifest,
    TokenizerInfo,
    file_sha256,
    manifest_to_json,
    read_manifest,
)
from eqxzoo.data.shards import fsync_file, write_shards
from eqxzoo.data.sources import (
    SourceFile,
    assign_validation,
    collect_source_files,
    inputs_record,
    iter_documents,
    scan_corpus,
    stdlib_source_files,
)
from eqxzoo.data.tokenizer import (
    DEFAULT_VOCAB_SIZE,
    EOD_TOKEN,
    MIN_VOCAB_SIZE,
    ensure_eod_token,
    train_byte_level_bpe,
)

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


def fingerprint(record: object) -> str:
    """sha256 of a JSON-able value, keys sorted: equal values give equal fingerprints."""
    text = json.dumps(record, sort_keys=True, default=dataclasses.asdict)
    return hashlib.sha256(text.encode()).hexdigest()


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


SHARD_NAME = re.compile(rf"({'|'.join(SPLITS)})-\d{{5,}}\.array_record")
FOREIGN_NAMES_SHOWN = 5


def is_prepared_file(path: Path) -> bool:
    """True for a regular file named like one a run writes into its output: the manifest, the
    tokenizer or a shard (`eqxzoo.data.manifest.shard_file_name`). Never a link or a folder."""
    name = path.name
    if name not in (MANIFEST_FILE, TOKENIZER_FILE) and not SHARD_NAME.fullmatch(name):
        return False
    return path.is_file() and not path.is_symlink()


def foreign_entries(out_dir: Path) -> list[str]:
    """The sorted names in the directory ``out_dir`` that no run of prepare wrote there:
    all of them without a manifest (it is then no output of ours, whatever its files are
    called), else those that are not `is_prepared_file`; folders end in ``/``."""
    entries = sorted(out_dir.iterdir())
    if not is_prepared_file(out_dir / MANIFEST_FILE):
        foreign = entries
    else:
        foreign = [entry for entry in entries if not is_prepared_file(entry)]
    return [entry.name + ("/" if entry.is_dir() else "") for entry in foreign]


def listing(names: Sequence[str], shown: int = FOREIGN_NAMES_SHOWN) -> str:
    """``a, b, c and 4 more``: the first ``shown`` names, unprintable ones quoted, so the
    message stays one line."""
    quoted = [name if name.isprintable() else repr(name) for name in names[:shown]]
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(quoted) + more


def _check_replaceable(out_dir: Path) -> None:
    """Refuse an ``out_dir`` whose replacement would delete anything prepare did not write.

    Absent or empty is fine; a directory of earlier outputs only is replaced.
    """
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise DataError(f"--out {out_dir} exists and is not a directory")
    foreign = foreign_entries(out_dir)
    if foreign:
        raise DataError(
            f"--out {out_dir} holds entries pipelines.prepare did not write: {listing(foreign)}; "
            "choose another --out or move them out of it"
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


def _remove_prepared_files(directory: Path) -> None:
    """Delete the `is_prepared_file` files in ``directory``, then the directory if that
    emptied it; anything else (something put there meanwhile) stays, and so does the
    directory. Best effort: what cannot be deleted is left for the next run."""
    with contextlib.suppress(OSError):
        for entry in directory.iterdir():
            if is_prepared_file(entry):
                entry.unlink()
        directory.rmdir()


def _remove_stale_staging(out_dir: Path) -> None:
    """Clear staging directories of killed runs (safe: we hold the lock, so none is live)."""
    prefix = _staging_prefix(out_dir)
    for stale in out_dir.parent.iterdir():
        if stale.name.startswith(prefix) and stale.is_dir() and not stale.is_symlink():
            _remove_prepared_files(stale)


def _publish(staging: Path, out_dir: Path) -> None:
    """Move the finished ``staging`` directory to ``out_dir``, replacing an earlier output.

    ``out_dir`` is checked again first, as something may have been put there during the run.
    """
    directory_fd = os.open(staging, os.O_RDONLY)
    try:
        os.fsync(directory_fd)
    finally:
        os.close(directory_fd)
    _check_replaceable(out_dir)
    if out_dir.exists():
        retired = staging.with_name(staging.name + "-retired")
        os.replace(out_dir, retired)
        os.replace(staging, out_dir)
        _remove_prepared_files(retired)
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
        fsync_file(staging / TOKENIZER_FILE)
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
