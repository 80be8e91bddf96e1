"""What a prepared directory holds and how to read and check it: the manifest, its checksums
and the record format of the shards.

This is all the loader needs from preparation: `read_manifest` parses ``manifest.json``,
`verify_shards` checks every file against its sha256, `decode_record` turns one shard record
back into token ids. Writing the shards lives in `eqxzoo.data.shards`, the run that produces
a directory in `eqxzoo.data.prepare`.
"""

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from jaxtyping import UInt32

from eqxzoo.errors import UserError

FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "val")
TOKEN_DTYPE = "<u4"  # little-endian uint32, one per token


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


def encode_record(token_ids: Sequence[int]) -> bytes:
    """One document's record: its token ids as little-endian uint32 bytes."""
    return np.asarray(token_ids, dtype=TOKEN_DTYPE).tobytes()


def decode_record(record: bytes) -> UInt32[np.ndarray, " tokens"]:
    """The token ids of one record (the inverse of `encode_record`)."""
    return np.frombuffer(record, dtype=TOKEN_DTYPE).astype(np.uint32)


def shard_file_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.array_record"
