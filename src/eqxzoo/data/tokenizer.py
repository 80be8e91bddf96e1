"""Byte-level BPE tokenizers (Hugging Face ``tokenizers``) with one end-of-document token.

Byte-level means every UTF-8 string encodes losslessly: the base alphabet is the 256 bytes,
merges are learnt on top, and ``decode(encode(text)) == text``. The end-of-document token
``<|endoftext|>`` is a special token the data loader appends between documents; the prepared
shards never contain it, and a document that happens to contain the literal string
``<|endoftext|>`` is encoded as ordinary text (see `encode_documents`).
"""

import json
from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOD_TOKEN = "<|endoftext|>"
# 256 byte symbols plus the end-of-document token: the smallest byte-level vocabulary.
MIN_VOCAB_SIZE = 257
# The byte-level BPE trained when nobody names a size (the built-in corpus, pipelines.prepare).
DEFAULT_VOCAB_SIZE = 4096
# The parts of a tokenizer.json that decide which ids a text becomes and which text ids are.
TOKENIZATION_PARTS = ("normalizer", "pre_tokenizer", "model", "decoder")


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


def ensure_eod_token(tokenizer: Tokenizer) -> int:
    """The id of ``<|endoftext|>`` in ``tokenizer``, adding it as a special token if absent."""
    if tokenizer.token_to_id(EOD_TOKEN) is None:
        tokenizer.add_special_tokens([EOD_TOKEN])
    eod_id = tokenizer.token_to_id(EOD_TOKEN)
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
