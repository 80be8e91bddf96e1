"""Byte-level BPE tokenizers (Hugging Face ``tokenizers``) with one end-of-document token.

Byte-level means every UTF-8 string encodes losslessly: the base alphabet is the 256 bytes,
merges are learnt on top, and ``decode(encode(text)) == text``. The end-of-document token
``<|endoftext|>`` is a special token the data loader appends between documents; the prepared
shards never contain it, and a document that happens to contain the literal string
``<|endoftext|>`` is encoded as ordinary text (see `encode_documents`).

A tokenizer to prepare with is a ``tokenizer.json`` file or a Hugging Face checkpoint
directory (`open_tokenizer`): the directory adds its ``tokenizer_config.json`` (special
tokens, the chat template) and fixes the end-of-document token to one the checkpoint's
embedding already has (`checkpoint_eod_token`).
"""

import dataclasses
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from eqxzoo.data.manifest import TOKENIZER_FILE, DataError

EOD_TOKEN = "<|endoftext|>"
# 256 byte symbols plus the end-of-document token: the smallest byte-level vocabulary.
MIN_VOCAB_SIZE = 257
# The byte-level BPE trained when nobody names a size (the built-in corpus, pipelines.prepare).
DEFAULT_VOCAB_SIZE = 4096
# The parts of a tokenizer.json that decide which ids a text becomes and which text ids are.
TOKENIZATION_PARTS = ("normalizer", "pre_tokenizer", "model", "decoder")
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where newer checkpoints keep the template


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


@dataclasses.dataclass(frozen=True)
class TokenizerSource:
    """A tokenizer given to prepare: ``file`` its ``tokenizer.json``; for a checkpoint
    directory also ``directory`` and its ``tokenizer_config.json`` as ``config`` (with the
    template of ``chat_template.jinja`` under ``chat_template`` where the config has none)."""

    tokenizer: Tokenizer
    file: Path
    directory: Path | None = None
    config: dict[str, Any] | None = None

    @property
    def chat_template(self) -> str | None:
        template = None if self.config is None else self.config.get("chat_template")
        if isinstance(template, list):  # the older form: named templates
            named = {entry.get("name"): entry.get("template") for entry in template}
            template = named.get("default")
        return template if isinstance(template, str) and template.strip() else None

    def special_token(self, name: str) -> str | None:
        """The config's ``name`` (``"eos_token"``, ...) as a string: written as one or as an
        added-token table ``{"content": ...}``."""
        value = None if self.config is None else self.config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        return value if isinstance(value, str) and value else None


def open_tokenizer(path: Path | str) -> TokenizerSource:
    """The tokenizer of a ``tokenizer.json`` file or of a checkpoint directory holding one
    (with its ``tokenizer_config.json``, when there is one). Raises `DataError`."""
    path = Path(path)
    if not path.is_dir():
        return TokenizerSource(load_tokenizer(path), path)
    file = path / TOKENIZER_FILE
    if not file.is_file():
        raise DataError(
            f"tokenizer directory {path} has no {TOKENIZER_FILE}: give a Hugging Face "
            "checkpoint directory with a fast tokenizer, or a tokenizer.json file"
        )
    config: dict[str, Any] = {}
    config_file = path / TOKENIZER_CONFIG_FILE
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except (ValueError, OSError) as error:
            raise DataError(f"cannot read {config_file}: {error}") from None
        if not isinstance(config, dict):
            raise DataError(f"{config_file}: not a JSON object")
    template_file = path / CHAT_TEMPLATE_FILE
    if "chat_template" not in config and template_file.is_file():
        config["chat_template"] = template_file.read_text(encoding="utf-8")
    return TokenizerSource(load_tokenizer(file), file, path, config)


def checkpoint_eod_token(source: TokenizerSource) -> str:
    """The end-of-document token for ``source``: ``<|endoftext|>`` where the tokenizer has it
    or is a bare file (it is then added, as for a trained one), else the checkpoint's
    ``eos_token``: a token added to a checkpoint's tokenizer would have an id beyond its
    embedding."""
    if source.directory is None or source.tokenizer.token_to_id(EOD_TOKEN) is not None:
        return EOD_TOKEN
    eos = source.special_token("eos_token")
    if eos is None or source.tokenizer.token_to_id(eos) is None:
        raise DataError(
            f"tokenizer {source.directory} has no {EOD_TOKEN} token and its "
            f"{TOKENIZER_CONFIG_FILE} names no eos_token it has: set eos_token there to the "
            "token that ends a document"
        )
    return eos


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Learn a byte-level BPE of at most ``vocab_size`` tokens (EOD included) from ``texts``.

    The vocabulary can end up smaller than asked when the texts have too few distinct
    pairs to merge; read the real size from ``tokenizer.get_vocab_size()``. Training is
    deterministic for the same texts in the same order.
    """
    assert vocab_size >= MIN_VOCAB_SIZE, vocab_size
    tokenizer = Tokenizer(models.BPE())
    # No prefix space: decoding gives back exactly the text that was encoded.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def ensure_eod_token(tokenizer: Tokenizer, token: str = EOD_TOKEN) -> int:
    """The id of ``token`` in ``tokenizer``, adding it as a special token if absent."""
    if tokenizer.token_to_id(token) is None:
        tokenizer.add_special_tokens([token])
    eod_id = tokenizer.token_to_id(token)
    assert eod_id is not None
    return eod_id


def encode_documents(tokenizer: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens added or recognised.

    Special-token strings inside a document (a web page quoting ``<|endoftext|>``) are
    encoded as the text they are, so the only end-of-document tokens in a training stream
    are the ones the loader puts between documents.
    """
    was_encoding_special_tokens = tokenizer.encode_special_tokens
    tokenizer.encode_special_tokens = True
    try:
        encodings = tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)
    finally:
        tokenizer.encode_special_tokens = was_encoding_special_tokens
    return [encoding.ids for encoding in encodings]


def decode_document(tokenizer: Tokenizer, token_ids: Sequence[int]) -> str:
    """The text of ``token_ids``, special tokens kept as their strings."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=False)


def tokenization_differences(tokenizer: Tokenizer, reference: Tokenizer) -> list[str]:
    """What makes ``tokenizer`` turn text into other ids, or ids into other text, than
    ``reference`` does: the parts of their serialised forms that differ (`TOKENIZATION_PARTS`:
    the model's vocabulary and merges among them), and ``reference``'s added tokens that
    ``tokenizer`` lacks or numbers differently. Empty when they tokenize alike; a token
    ``reference`` lacks is no difference (preparing a corpus adds the end-of-document one).
    Both are serialised by this ``tokenizers``, so a file written by another version compares
    by content, not by format."""
    ours, theirs = (json.loads(t.to_str()) for t in (tokenizer, reference))
    differences = [part for part in TOKENIZATION_PARTS if ours.get(part) != theirs.get(part)]
    numbered = {(token["content"], token["id"]) for token in ours.get("added_tokens", [])}
    missing = [
        token["content"]
        for token in theirs.get("added_tokens", [])
        if (token["content"], token["id"]) not in numbered
    ]
    if missing:
        differences.append("added tokens " + ", ".join(repr(token) for token in missing[:3]))
    return differences
