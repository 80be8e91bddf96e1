"""What a prepared directory holds and how to read and check it: the manifest, its checksums
and the record format of the shards.

This is all the loader needs from preparation: `read_manifest` parses ``manifest.json``,
`verify_shards` checks every file against its sha256, `decode_record` turns one shard record
back into token ids (`decode_marked_record` keeps its target marks). Writing the shards lives
in `eqxzoo.data.shards`, the run that produces a directory in `eqxzoo.data.prepare`.

A record is one document's tokens as little-endian uint32. Token ids are below 2^31, so bit 31
(`NOT_TARGET`) is free to say "this token is no target": the prompt and user turns of chat and
prompt-completion records. Plain text never sets it, and its manifests keep format version 1;
a manifest of data that may set it has version 2, which older readers refuse rather than
reading marked tokens as ids.
"""

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from jaxtyping import Bool, UInt32

from eqxzoo.errors import UserError

FORMAT_VERSION = 1  # plain text: every token is a target
MARKED_FORMAT_VERSION = 2  # chat or prompt-completion records: tokens may carry NOT_TARGET
READABLE_FORMAT_VERSIONS = (FORMAT_VERSION, MARKED_FORMAT_VERSION)
MANIFEST_FILE = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "val")
TOKEN_DTYPE = "<u4"  # little-endian uint32, one per token
NOT_TARGET = 1 << 31  # set on a token the loss must not predict; token ids stay below it
TEXT_FORMAT = "text"
DOCUMENT_FORMATS = (TEXT_FORMAT, "chat", "prompt_completion")


class DataError(UserError, ValueError):
    """Bad data input a user can fix: the message names the file (and line) and the problem."""


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
    records' bytes. ``document_formats`` are the formats of the documents present, sorted
    (`DOCUMENT_FORMATS`; a manifest written before there were others means ``("text",)``).
    """

    format_version: int
    token_dtype: str
    tokenizer: TokenizerInfo
    splits: dict[str, SplitInfo]
    inputs_fingerprint: str
    inputs: tuple[InputFileInfo, ...]
    options: dict[str, object]
    document_formats: tuple[str, ...] = (TEXT_FORMAT,)

    @property
    def has_instructions(self) -> bool:
        """True when some documents are chat or prompt-completion records, not plain text."""
        return any(name != TEXT_FORMAT for name in self.document_formats)

    def document_mask(self, setting: bool | None) -> bool:
        """`masks_documents` of this data."""
        return masks_documents(setting, self.document_formats)


def masks_documents(setting: bool | None, document_formats: tuple[str, ...]) -> bool:
    """Whether batches keep documents apart: ``setting`` (``data.document_mask``), or when
    None, for chat and prompt-completion data only (each record is one example; plain text
    keeps the usual pretraining packing, where a window reads across document boundaries)."""
    if setting is not None:
        return setting
    return any(name != TEXT_FORMAT for name in document_formats)


def manifest_to_json(manifest: Manifest) -> str:
    return json.dumps(dataclasses.asdict(manifest), indent=2, sort_keys=True) + "\n"


def manifest_from_json(text: str, source: str) -> Manifest:
    """Parse manifest JSON; ``source`` names it in the error of a damaged or foreign file."""
    try:
        raw = json.loads(text)
        if raw["format_version"] not in READABLE_FORMAT_VERSIONS:
            raise DataError(
                f"{source}: manifest format {raw['format_version']} is not one of "
                f"{', '.join(map(str, READABLE_FORMAT_VERSIONS))}; re-run python -m pipelines.prepare"
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
            document_formats=tuple(raw.get("document_formats", [TEXT_FORMAT])),
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


# ----------------------------------------------------------------------------- checksums


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


# ----------------------------------------------------------------------------- records


def encode_record(token_ids: Sequence[int] | UInt32[np.ndarray, " tokens"]) -> bytes:
    """One document's record: its token ids (with their `NOT_TARGET` marks, if any) as
    little-endian uint32 bytes."""
    return np.asarray(token_ids, dtype=TOKEN_DTYPE).tobytes()


def decode_marked_record(record: bytes) -> UInt32[np.ndarray, " tokens"]:
    """The tokens of one record as written, `NOT_TARGET` marks kept (inverse of `encode_record`)."""
    return np.frombuffer(record, dtype=TOKEN_DTYPE).astype(np.uint32)


def decode_record(record: bytes) -> UInt32[np.ndarray, " tokens"]:
    """The token ids of one record, target marks cleared."""
    return token_ids(decode_marked_record(record))


def token_ids(marked: UInt32[np.ndarray, "*shape"]) -> UInt32[np.ndarray, "*shape"]:
    """The ids of marked tokens: bit 31 (`NOT_TARGET`) cleared."""
    return marked & np.uint32(NOT_TARGET - 1)


def is_target(marked: UInt32[np.ndarray, "*shape"]) -> Bool[np.ndarray, "*shape"]:
    """Which marked tokens are targets: those without `NOT_TARGET`."""
    return (marked & np.uint32(NOT_TARGET)) == 0


def mark_targets(
    ids: Sequence[int] | UInt32[np.ndarray, " tokens"], targets: Bool[np.ndarray, " tokens"]
) -> UInt32[np.ndarray, " tokens"]:
    """Token ids with `NOT_TARGET` set where ``targets`` is false."""
    ids = np.asarray(ids, dtype=np.uint32)
    assert ids.shape == targets.shape and (ids < NOT_TARGET).all()
    return np.where(targets, ids, ids | np.uint32(NOT_TARGET)).astype(np.uint32)


def shard_file_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.array_record"
