"""Finding and reading the inputs of a preparation: files and directories -> documents.

An input is a UTF-8 text file (one document) or a JSONL file (one document per line), either
possibly gzipped; directories are walked recursively in sorted order, and files found by a
walk that are not text are skipped rather than fatal. Each document gets a score from its
content alone, which decides its split (train or validation) whatever the input order.
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
from jaxtyping import Bool, Float64

from eqxzoo.data.manifest import DataError, InputFileInfo

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
