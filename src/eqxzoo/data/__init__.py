"""Data: tokenizers and corpus preparation (raw text -> ArrayRecord shards + manifest)."""

from eqxzoo.data.prepare import (
    DataError,
    InputFileInfo,
    Manifest,
    PrepareOptions,
    PrepareResult,
    ShardInfo,
    SplitInfo,
    TokenizerInfo,
    decode_record,
    default_stdlib_cache_dir,
    load_tokenizer,
    prepare_corpus,
    prepare_stdlib_corpus,
    read_manifest,
    stdlib_source_files,
    verify_shards,
)
from eqxzoo.data.tokenizer import EOD_TOKEN, decode_document, encode_documents

__all__ = [
    "EOD_TOKEN",
    "DataError",
    "InputFileInfo",
    "Manifest",
    "PrepareOptions",
    "PrepareResult",
    "ShardInfo",
    "SplitInfo",
    "TokenizerInfo",
    "decode_document",
    "decode_record",
    "default_stdlib_cache_dir",
    "encode_documents",
    "load_tokenizer",
    "prepare_corpus",
    "prepare_stdlib_corpus",
    "read_manifest",
    "stdlib_source_files",
    "verify_shards",
]
