"""Writing ArrayRecord shards: tokenised documents -> numbered shard files of one split each.

Each record is one document's token ids (`eqxzoo.data.manifest.encode_record`, with their
target marks for chat and prompt-completion records), compressed on
its own so that one random read decompresses one record; a shard holds at most
``records_per_shard`` records because ArrayRecord random reads cost O(records per file).
Every finished shard is fsynced and summarised (records, tokens, bytes, sha256) for the
manifest.
"""

import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter
from jaxtyping import Bool, UInt32
from tokenizers import Tokenizer

from eqxzoo.data.manifest import (
    SPLITS,
    DataError,
    ShardInfo,
    SplitInfo,
    encode_record,
    file_sha256,
    shard_file_name,
)
from eqxzoo.data.tokenizer import encode_documents

# group_size:1 compresses each record on its own, so one random read decompresses one record.
SHARD_WRITER_OPTIONS = "group_size:1"
ENCODE_BATCH_DOCUMENTS = 256


def fsync_file(path: Path) -> None:
    """Flush a written file to disk, so a crash after publishing never finds it half-written."""
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

    def write(self, token_ids: Sequence[int] | UInt32[np.ndarray, " tokens"]) -> None:
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
        fsync_file(path)
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


def tokenized(
    tokenizer: Tokenizer, documents: Iterable[str | UInt32[np.ndarray, " tokens"]]
) -> Iterator[Sequence[int] | UInt32[np.ndarray, " tokens"]]:
    """Each document's tokens: texts encoded in batches (`encode_documents`), documents that
    are tokens already passed on, in order."""
    texts: list[str] = []
    for document in documents:
        if isinstance(document, str):
            texts.append(document)
            if len(texts) == ENCODE_BATCH_DOCUMENTS:
                yield from encode_documents(tokenizer, texts)
                texts = []
        else:
            yield from encode_documents(tokenizer, texts)
            texts = []
            yield document
    yield from encode_documents(tokenizer, texts)


def write_shards(
    directory: Path,
    tokenizer: Tokenizer,
    documents: Iterable[str | UInt32[np.ndarray, " tokens"]],
    is_val: Bool[np.ndarray, " documents"],
    records_per_shard: int,
) -> dict[str, SplitInfo]:
    """Write each document (a text to tokenise, or marked tokens) to its split's shards; the
    splits' summaries."""
    writers = {split: ShardWriter(directory, split, records_per_shard) for split in SPLITS}
    index = 0
    for token_ids in tokenized(tokenizer, documents):
        if index >= len(is_val):
            raise DataError("the inputs changed while being prepared; run again")
        writers["val" if is_val[index] else "train"].write(token_ids)
        index += 1
    if index != len(is_val):
        raise DataError("the inputs changed while being prepared; run again")
    return {split: writer.close() for split, writer in writers.items()}
