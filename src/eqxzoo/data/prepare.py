"""Corpus preparation: raw text -> a tokenizer and ArrayRecord shards of tokenised documents.

An output directory holds

    tokenizer.json                  the byte-level BPE (trained here or copied from --tokenizer)
    train-00000.array_record ...    one record per document: its token ids as little-endian
    val-00000.array_record ...      uint32 bytes, *without* the end-of-document token (the
                                    loader appends it), at most ``records_per_shard`` per shard;
                                    bit 31 set on a chat or prompt-completion record's tokens
                                    that are no targets (`eqxzoo.data.manifest.NOT_TARGET`)
    manifest.json                   written last: counts, checksums, inputs and options

Chat and prompt-completion records (`eqxzoo.data.instructions`) need the model's own tokenizer
(``--tokenizer``, a checkpoint directory for a chat template); a record that cannot be used is
reported and skipped (`eqxzoo.data.sources.RecordProblem`), the rest prepared. The options
that only such records use are recorded in the manifest once one differs from its default,
so a directory of plain text prepared before they existed is still up to date.

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
from jaxtyping import Bool, UInt32
from tokenizers import Tokenizer

from eqxzoo.data.instructions import (
    OVERLONG,
    TRAIN_ON,
    Fit,
    InstructionEncoder,
    Overlong,
    TrainOn,
)
from eqxzoo.data.manifest import (
    DOCUMENT_FORMATS,
    FORMAT_VERSION,
    MANIFEST_FILE,
    MARKED_FORMAT_VERSION,
    SPLITS,
    TEXT_FORMAT,
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
    RecordProblem,
    SourceFile,
    assign_validation,
    collect_source_files,
    inputs_record,
    iter_documents,
    iter_prepared_documents,
    scan_corpus,
    stdlib_source_files,
)
from eqxzoo.data.tokenizer import (
    DEFAULT_VOCAB_SIZE,
    EOD_TOKEN,
    MIN_VOCAB_SIZE,
    TOKENIZER_CONFIG_FILE,
    TokenizerSource,
    checkpoint_eod_token,
    ensure_eod_token,
    load_tokenizer,
    open_tokenizer,
    train_byte_level_bpe,
)

__all__ = [
    "DataError",
    "PrepareOptions",
    "PrepareResult",
    "default_stdlib_cache_dir",
    "load_tokenizer",
    "prepare_corpus",
    "prepare_stdlib_corpus",
]
AUTO_FORMAT = "auto"

# ----------------------------------------------------------------------------- options


@dataclasses.dataclass(frozen=True)
class PrepareOptions:
    """How to turn inputs into shards; ``tokenizer_file`` set (a ``tokenizer.json`` or a
    Hugging Face checkpoint directory holding one) means load it instead of training.

    ``document_format`` is the format of every JSONL file (``"auto"``: each file's own, see
    `eqxzoo.data.sources.detect_format`). For chat and prompt-completion records,
    ``train_on`` picks the targets (``"completion"``: the assistant turns and completions, as
    TRL's ``assistant_only_loss`` / ``completion_only_loss`` do; ``"all"``: every token), and
    a record of more than ``max_tokens`` tokens (None: no limit, records then span windows
    like text does) is dropped or cut as ``overlong`` says. The default is to drop: a cut
    record ends where its answer does not.
    """

    vocab_size: int = DEFAULT_VOCAB_SIZE
    tokenizer_file: Path | None = None
    text_field: str = "text"
    val_fraction: float = 0.01
    records_per_shard: int = 4096
    document_format: str = AUTO_FORMAT
    train_on: TrainOn = "completion"
    max_tokens: int | None = None
    overlong: Overlong = "drop"

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
        formats = (AUTO_FORMAT, *DOCUMENT_FORMATS)
        if self.document_format not in formats:
            raise DataError(
                f"--format must be one of {', '.join(formats)}, got {self.document_format!r}"
            )
        if self.train_on not in TRAIN_ON:
            raise DataError(
                f"--train-on must be one of {', '.join(TRAIN_ON)}, got {self.train_on!r}"
            )
        if self.overlong not in OVERLONG:
            raise DataError(
                f"--overlong must be one of {', '.join(OVERLONG)}, got {self.overlong!r}"
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise DataError(f"--max-tokens must be >= 1, got {self.max_tokens}")

    @property
    def instruction_options(self) -> dict[str, object]:
        """The options only chat and prompt-completion records use."""
        return {
            "format": self.document_format,
            "train_on": self.train_on,
            "max_tokens": self.max_tokens,
            "overlong": self.overlong,
        }


# ----------------------------------------------------------------------------- publishing


def tokenizer_record(options: PrepareOptions) -> dict[str, object]:
    """The tokenizer as recorded: the size to train, or the file's path and sha256 (and for a
    checkpoint directory, the sha256 of the config that holds its chat template)."""
    if options.tokenizer_file is None:
        return {"train_vocab_size": options.vocab_size}
    path = Path(options.tokenizer_file)
    if not path.is_dir():
        return {"file": str(path.resolve()), "sha256": file_sha256(path)}
    record: dict[str, object] = {
        "file": str((path / TOKENIZER_FILE).resolve()),
        "sha256": file_sha256(path / TOKENIZER_FILE),
    }
    for name in (TOKENIZER_CONFIG_FILE, "chat_template.jinja"):
        if (path / name).is_file():
            record[f"{name} sha256"] = file_sha256(path / name)
    return record


def options_record(options: PrepareOptions) -> dict[str, object]:
    """The options as recorded in the manifest: a changed one means the output is stale.
    The instruction options appear only once one differs from its default."""
    record = {
        "tokenizer": tokenizer_record(options),
        "text_field": options.text_field,
        "val_fraction": options.val_fraction,
        "records_per_shard": options.records_per_shard,
    }
    if options.instruction_options != PrepareOptions().instruction_options:
        record["instructions"] = options.instruction_options
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
    """What a run did; ``skipped_records`` counts the records skipped, by reason."""

    out_dir: Path
    manifest: Manifest
    up_to_date: bool
    skipped_files: tuple[Path, ...]
    tokenizer_seconds: float
    total_seconds: float
    skipped_records: dict[str, int] = dataclasses.field(default_factory=dict)


def _no_progress(message: str) -> None:
    del message


def _no_report(problem: RecordProblem) -> None:
    del problem


def skipped_counts(problems: Sequence[RecordProblem]) -> dict[str, int]:
    """How many records were skipped for each reason, most frequent first."""
    counts: dict[str, int] = {}
    for problem in problems:
        counts[problem.reason] = counts.get(problem.reason, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def describe_counts(counts: dict[str, int]) -> str:
    """``3 malformed JSON, 1 unknown role``."""
    return ", ".join(f"{count} {reason}" for reason, count in counts.items())


def _eod_token(source: TokenizerSource | None) -> str:
    """The end-of-document token, added to the tokenizer (`ensure_eod_token`) where it lacks
    it; only a bare file or a trained tokenizer lacks it (`checkpoint_eod_token`)."""
    if source is None:
        return EOD_TOKEN
    token = checkpoint_eod_token(source)
    ensure_eod_token(source.tokenizer, token)
    return token


def prepare_corpus(
    inputs: Sequence[Path],
    out_dir: Path,
    options: PrepareOptions,
    *,
    include_stdlib: bool = False,
    progress: Callable[[str], None] = _no_progress,
    report: Callable[[RecordProblem], None] = _no_report,
) -> PrepareResult:
    """Prepare ``inputs`` (and the stdlib corpus if asked) into ``out_dir``; see the module doc.

    A no-op returning ``up_to_date=True`` when ``out_dir`` already holds this preparation.
    Each record skipped is passed to ``report`` as it is found. Raises `DataError` for bad
    inputs, options or output paths, and when no document is usable.
    """
    start = time.perf_counter()
    out_dir = Path(out_dir).resolve()
    stdlib = stdlib_source_files() if include_stdlib else []
    sources = [SourceFile(path, walked=True) for path in stdlib]
    sources += collect_source_files(inputs, exclude=out_dir)
    if not sources:
        raise DataError("no usable documents: the inputs hold no files")
    source = None if options.tokenizer_file is None else open_tokenizer(options.tokenizer_file)
    tokenizer = None if source is None else source.tokenizer
    eod_token = _eod_token(source)
    encoder = None
    if source is not None:
        fit = Fit(options.max_tokens, options.overlong)
        encoder = InstructionEncoder(source, options.train_on, fit)
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
            scan = scan_corpus(
                sources, options.text_field, options.document_format, encoder, report
            )
            skipped = skipped_counts(scan.problems)
            if len(scan.scores) == 0 and skipped:
                raise DataError(
                    f"no usable documents: every record was skipped ({describe_counts(skipped)})"
                )
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
            documents = iter_prepared_documents(
                scan.files, scan.formats, options.text_field, encoder
            )
            manifest = _write_output(
                out_dir,
                tokenizer,
                documents,
                is_val,
                options.records_per_shard,
                inputs_fingerprint=inputs_fingerprint,
                inputs=inputs_info,
                options=options_info,
                eod_token=eod_token,
                document_formats=scan.document_formats,
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
        skipped,
    )


def _write_output(
    out_dir: Path,
    tokenizer: Tokenizer,
    documents: Iterable[str | UInt32[np.ndarray, " tokens"]],
    is_val: Bool[np.ndarray, " documents"],
    records_per_shard: int,
    *,
    inputs_fingerprint: str,
    inputs: tuple[InputFileInfo, ...],
    options: dict[str, object],
    eod_token: str,
    document_formats: tuple[str, ...],
) -> Manifest:
    """Write shards, tokenizer.json and (last) manifest.json into a staging directory beside
    ``out_dir``, then rename it into place; nothing is left behind if this fails."""
    eod_token_id = ensure_eod_token(tokenizer, eod_token)
    marked = any(name != TEXT_FORMAT for name in document_formats)
    staging = out_dir.parent / f"{_staging_prefix(out_dir)}{uuid.uuid4().hex[:12]}"
    staging.mkdir()
    try:
        splits = write_shards(staging, tokenizer, documents, is_val, records_per_shard)
        tokenizer.save(str(staging / TOKENIZER_FILE))
        fsync_file(staging / TOKENIZER_FILE)
        tokenizer_info = TokenizerInfo(
            file=TOKENIZER_FILE,
            vocab_size=tokenizer.get_vocab_size(),
            eod_token=eod_token,
            eod_token_id=eod_token_id,
            sha256=file_sha256(staging / TOKENIZER_FILE),
        )
        manifest = Manifest(
            format_version=MARKED_FORMAT_VERSION if marked else FORMAT_VERSION,
            token_dtype=TOKEN_DTYPE,
            tokenizer=tokenizer_info,
            splits=splits,
            inputs_fingerprint=inputs_fingerprint,
            inputs=inputs,
            options=options,
            document_formats=document_formats,
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
