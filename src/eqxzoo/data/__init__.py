"""Data: tokenizers, corpus preparation (raw text -> ArrayRecord shards + manifest) and the
grain loader (shards -> packed, sharded ``(G, M, B, T)`` batches)."""

from eqxzoo.data.loader import (
    Batches,
    BatchShape,
    SplitDocuments,
    TokenStream,
    check_vocab,
    open_split,
    process_columns,
    process_rows,
    train_batches,
    validation_batches,
)
from eqxzoo.data.manifest import (
    DataError,
    InputFileInfo,
    Manifest,
    ShardInfo,
    SplitInfo,
    TokenizerInfo,
    decode_record,
    read_manifest,
    verify_shards,
)
from eqxzoo.data.prepare import (
    PrepareOptions,
    PrepareResult,
    default_stdlib_cache_dir,
    load_tokenizer,
    prepare_corpus,
    prepare_stdlib_corpus,
)
from eqxzoo.data.sources import stdlib_source_files
from eqxzoo.data.tokenizer import EOD_TOKEN, decode_document, encode_documents

__all__ = [
    "EOD_TOKEN",
    "BatchShape",
    "Batches",
    "DataError",
    "InputFileInfo",
    "Manifest",
    "PrepareOptions",
    "PrepareResult",
    "ShardInfo",
    "SplitDocuments",
    "SplitInfo",
    "TokenStream",
    "TokenizerInfo",
    "check_vocab",
    "decode_document",
    "decode_record",
    "default_stdlib_cache_dir",
    "encode_documents",
    "load_tokenizer",
    "open_split",
    "prepare_corpus",
    "prepare_stdlib_corpus",
    "process_columns",
    "process_rows",
    "read_manifest",
    "stdlib_source_files",
    "train_batches",
    "validation_batches",
    "verify_shards",
]
