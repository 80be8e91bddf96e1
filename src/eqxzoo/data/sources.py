"""Finding and reading the inputs of a preparation: files and directories -> documents.

An input is a UTF-8 text file (one document) or a JSONL file (one document per line), either
possibly gzipped; directories are walked recursively in sorted order, and files found by a
walk that are not text are skipped rather than fatal. Each document gets a score from its
content alone, which decides its split (train or validation) whatever the input order.

A JSONL file holds one format of record (`detect_format`, or the one asked for): plain text
under the text field, chat (``messages``) or prompt-completion (``prompt`` and
``completion``), the latter two encoded by `eqxzoo.data.instructions`. A broken line of plain
text is fatal, as a damaged corpus file is; a chat or prompt-completion record that cannot be
used is a `RecordProblem`, reported with its file and line and skipped, and the rest of the
file is still read.
"""

import dataclasses
import gzip
import hashlib
import io
import json
import os
import sysconfig
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
from jaxtyping import Bool, Float64, UInt32

from eqxzoo.data.instructions import (
    CHAT,
    MALFORMED,
    PROMPT_COMPLETION,
    InstructionEncoder,
    RecordError,
    missing_template_message,
)
from eqxzoo.data.manifest import TEXT_FORMAT, DataError, InputFileInfo

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


class _NotTextError(DataError):
    """A file that is not UTF-8 text (or not valid gzip): fatal if named, skipped in a walk."""


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
            raise DataError(
                f"{where}: no field {text_field!r} (set --text-field; chat records have "
                "'messages', prompt-completion records 'prompt' and 'completion')"
            )
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


def detect_format(path: Path, text_field: str) -> str:
    """The format of a file's records, from its first JSON object: plain text when it has
    ``text_field`` (and for any file that is not JSONL), chat when it has ``messages``,
    prompt-completion when it has ``prompt`` or ``completion``, else plain text (whose
    reading then names the missing field)."""
    if not is_jsonl(path):
        return TEXT_FORMAT
    for line in _read_lines(path):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if not isinstance(value, dict):
            continue
        if text_field in value:
            return TEXT_FORMAT
        if "messages" in value:
            return CHAT
        if "prompt" in value or "completion" in value:
            return PROMPT_COMPLETION
        return TEXT_FORMAT
    return TEXT_FORMAT


@dataclasses.dataclass(frozen=True)
class RecordProblem:
    """A record skipped: where (``file.jsonl:17``), why (the count key) and the details."""

    where: str
    reason: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


def read_records(path: Path) -> Iterator[tuple[str, object]]:
    """``(where, value)`` for each non-blank line of a JSONL file: the parsed JSON, or a
    `RecordError` for a line that is not JSON."""
    for line_number, line in enumerate(_read_lines(path), start=1):
        if not line.strip():
            continue
        where = f"{path}:{line_number}"
        try:
            yield where, json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as error:
            yield where, RecordError(MALFORMED, f"not UTF-8 text (bad byte at {error.start})")
        except json.JSONDecodeError as error:
            yield where, RecordError(MALFORMED, f"not valid JSON ({error.msg})")


def encoded_records(
    path: Path, document_format: str, encoder: InstructionEncoder
) -> Iterator[tuple[str, object, UInt32[np.ndarray, " tokens"] | RecordError]]:
    """``(where, parsed record, its marked tokens or why it is unusable)`` for each record of a
    chat or prompt-completion file."""
    for where, value in read_records(path):
        if isinstance(value, RecordError):
            yield where, value, value
            continue
        try:
            yield where, value, encoder.encode(value, document_format)
        except RecordError as error:
            yield where, value, error


def iter_prepared_documents(
    files: Sequence[Path],
    formats: Sequence[str],
    text_field: str,
    encoder: InstructionEncoder | None,
) -> Iterator[str | UInt32[np.ndarray, " tokens"]]:
    """Every usable document of ``files`` in order: plain text as its string (to be
    tokenized), a chat or prompt-completion record as its marked tokens."""
    for path, document_format in zip(files, formats, strict=True):
        if document_format == TEXT_FORMAT:
            yield from read_documents(path, text_field)
            continue
        assert encoder is not None
        for _, _, encoded in encoded_records(path, document_format, encoder):
            if not isinstance(encoded, RecordError):
                yield encoded


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
    """The files that hold text, each one's format, one split score per usable document in
    document order, and the records skipped."""

    files: tuple[Path, ...]
    skipped: tuple[Path, ...]
    scores: Float64[np.ndarray, " documents"]
    formats: tuple[str, ...] = ()
    file_documents: tuple[int, ...] = ()
    problems: tuple[RecordProblem, ...] = ()

    @property
    def document_formats(self) -> tuple[str, ...]:
        """The formats of the usable documents, sorted."""
        used = zip(self.formats, self.file_documents, strict=True)
        return tuple(sorted({name for name, count in used if count}))


def _no_report(problem: RecordProblem) -> None:
    del problem


def _record_scores(
    path: Path,
    document_format: str,
    encoder: InstructionEncoder,
    problems: list[RecordProblem],
    report: Callable[[RecordProblem], None],
) -> list[float]:
    """Scores of a chat or prompt-completion file's usable records (from the record's JSON,
    keys sorted, so not from the options that encode it); unusable ones are reported."""
    scores = []
    for where, value, encoded in encoded_records(path, document_format, encoder):
        if isinstance(encoded, RecordError):
            problem = RecordProblem(where, encoded.reason, str(encoded))
            problems.append(problem)
            report(problem)
        else:
            scores.append(document_score(json.dumps(value, sort_keys=True, ensure_ascii=False)))
    return scores


def _check_can_encode(path: Path, document_format: str, encoder: InstructionEncoder | None):
    if document_format == CHAT and (encoder is None or encoder.source.chat_template is None):
        raise DataError(
            missing_template_message(None if encoder is None else encoder.source, str(path))
        )
    if encoder is None:
        raise DataError(
            f"{path}: prompt-completion records are tokenized by the model's own tokenizer: "
            "give --tokenizer its Hugging Face checkpoint directory (or tokenizer.json)"
        )


def scan_corpus(
    sources: Sequence[SourceFile],
    text_field: str,
    document_format: str = "auto",
    encoder: InstructionEncoder | None = None,
    report: Callable[[RecordProblem], None] = _no_report,
) -> CorpusScan:
    """Read every input once: find each JSONL file's format (``document_format``, or
    `detect_format` for ``"auto"``), check it parses, skip walked files that are not text,
    score every usable document, report the unusable records."""
    files, skipped, scores, formats, counts, problems = [], [], [], [], [], []
    for source in sources:
        path = source.path
        try:
            file_format = document_format
            if file_format == "auto" or not is_jsonl(path):
                file_format = detect_format(path, text_field)
            if file_format == TEXT_FORMAT:
                file_scores = [document_score(text) for text in read_documents(path, text_field)]
            else:
                _check_can_encode(path, file_format, encoder)
                assert encoder is not None
                file_scores = _record_scores(path, file_format, encoder, problems, report)
        except _NotTextError:
            if not source.walked:
                raise
            skipped.append(path)
            continue
        files.append(path)
        formats.append(file_format)
        counts.append(len(file_scores))
        scores.extend(file_scores)
    return CorpusScan(
        tuple(files),
        tuple(skipped),
        np.asarray(scores, dtype=np.float64),
        tuple(formats),
        tuple(counts),
        tuple(problems),
    )
