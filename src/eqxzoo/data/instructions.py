"""Instruction and chat records (TRL's formats) -> token ids marked target or not.

Two kinds of JSONL record are read, as TRL's ``SFTTrainer`` reads them:

* chat: ``{"messages": [{"role": "user", "content": "..."}, ...]}``, rendered with the
  tokenizer's own chat template (``tokenizer_config.json``'s ``chat_template``, rendered by
  ``transformers``); roles are system, user and assistant, and tool when the template names
  it;
* prompt-completion: ``{"prompt": "...", "completion": "..."}``, the prompt's text followed by
  the completion's, tokenized by the tokenizer as it is (a post-processor's BOS included), and
  the checkpoint's ``eos_token`` after the completion when its config names one (as TRL adds
  it), so the model learns to end its answer.

With ``train_on = "completion"`` only the assistant turns (each with its end-of-turn marker)
and the completion (with its EOS) are targets; with ``"all"`` every token is. The assistant
turns are found for any template by rendering: the conversation up to an assistant message
with the generation prompt, then with that message; the characters in between are the turn.
The whole conversation is tokenized once, with character offsets, and a token is a target
when its characters overlap a turn's. A template that renders a shorter conversation as
anything but a prefix of the longer one cannot be read this way: such a record is refused
(``--train-on all`` needs no turns).

A record that cannot be used raises `RecordError` naming its reason; the caller reports it with
its file and line and goes on.
"""

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
from jaxtyping import Bool, UInt32

from eqxzoo.data.manifest import NOT_TARGET, mark_targets
from eqxzoo.data.tokenizer import TOKENIZER_CONFIG_FILE, TokenizerSource

TrainOn = Literal["completion", "all"]
Overlong = Literal["drop", "truncate"]
TRAIN_ON: tuple[TrainOn, ...] = ("completion", "all")
OVERLONG: tuple[Overlong, ...] = ("drop", "truncate")
CHAT, PROMPT_COMPLETION = "chat", "prompt_completion"
ROLES = ("system", "user", "assistant")
TOOL_ROLE = "tool"

# The reasons a record is skipped, counted in the report at the end.
MALFORMED = "malformed JSON"
BAD_FIELD = "missing or ill-typed field"
UNKNOWN_ROLE = "unknown role"
TEMPLATE_FAILED = "chat template failed"
OVERLONG_DROPPED = "longer than --max-tokens"
NO_TARGET = "no target token"


class RecordError(Exception):
    """One record cannot be used; ``reason`` is the count key, the message says why."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class Fit:
    """What to do with a record longer than ``max_tokens`` (None: no limit)."""

    max_tokens: int | None = None
    overlong: Overlong = "drop"


def overlaps(
    offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
) -> Bool[np.ndarray, " tokens"]:
    """Which tokens (character ``offsets`` ``[start, end)``) overlap one of ``spans``."""
    starts = np.asarray([start for start, _ in offsets], dtype=np.int64)
    ends = np.asarray([end for _, end in offsets], dtype=np.int64)
    hit = np.zeros(len(offsets), dtype=bool)
    for lo, hi in spans:
        hit |= (starts < hi) & (ends > lo)
    return hit


def fit_length(marked: UInt32[np.ndarray, " tokens"], fit: Fit) -> UInt32[np.ndarray, " kept"]:
    """``marked`` within ``fit.max_tokens``: dropped (`RecordError`) or cut. A cut record's
    last token is made no target, so the end-of-document the loader appends after it is none
    either (`eqxzoo.data.loader`): the model is not taught to stop where a record was cut."""
    if fit.max_tokens is None or len(marked) <= fit.max_tokens:
        return marked
    if fit.overlong == "drop":
        raise RecordError(
            OVERLONG_DROPPED,
            f"{len(marked)} tokens, more than --max-tokens {fit.max_tokens} "
            "(--overlong truncate keeps the first ones)",
        )
    cut = marked[: fit.max_tokens].copy()
    cut[-1] |= np.uint32(NOT_TARGET)
    return cut


def require_targets(marked: UInt32[np.ndarray, " tokens"], what: str) -> None:
    if not ((marked & np.uint32(NOT_TARGET)) == 0).any():
        raise RecordError(NO_TARGET, f"no target token ({what})")


def string_field(record: Mapping[str, Any], name: str) -> str:
    if name not in record:
        raise RecordError(BAD_FIELD, f"no field {name!r}")
    value = record[name]
    if not isinstance(value, str):
        raise RecordError(BAD_FIELD, f"field {name!r} is {type(value).__name__}, not a string")
    return value


def chat_messages(record: Mapping[str, Any], roles: Sequence[str]) -> list[dict[str, str]]:
    """The ``messages`` of a chat record, each a ``{"role", "content"}`` of strings."""
    if "messages" not in record:
        raise RecordError(BAD_FIELD, "no field 'messages'")
    messages = record["messages"]
    if not isinstance(messages, list):
        kind = type(messages).__name__
        raise RecordError(BAD_FIELD, f"field 'messages' is {kind}, not a list of messages")
    if not messages:
        raise RecordError(BAD_FIELD, "field 'messages' is an empty list")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            kind = type(message).__name__
            raise RecordError(BAD_FIELD, f"messages[{index}] is {kind}, not a role and content")
        try:
            role, content = string_field(message, "role"), string_field(message, "content")
        except RecordError as error:
            raise RecordError(error.reason, f"messages[{index}]: {error}") from None
        if role not in roles:
            raise RecordError(
                UNKNOWN_ROLE,
                f"messages[{index}]: unknown role {role!r} (this template takes "
                f"{', '.join(roles[:-1])} or {roles[-1]})",
            )
        checked.append({"role": role, "content": content})
    return checked


class InstructionEncoder:
    """Turns chat and prompt-completion records into marked token ids (`mark_targets`)
    with the tokenizer of ``source``; ``transformers`` is imported on the first chat record."""

    def __init__(self, source: TokenizerSource, train_on: TrainOn, fit: Fit):
        self.source = source
        self.train_on = train_on
        self.fit = fit
        template = source.chat_template or ""
        self.roles = (*ROLES, TOOL_ROLE) if TOOL_ROLE in template else ROLES
        eos = source.special_token("eos_token")
        self.eos_id = None if eos is None else source.tokenizer.token_to_id(eos)

    def encode(self, record: object, document_format: str) -> UInt32[np.ndarray, " tokens"]:
        """The marked tokens of one parsed JSONL ``record``; `RecordError` if unusable."""
        if not isinstance(record, dict):
            raise RecordError(BAD_FIELD, f"a {type(record).__name__}, not a JSON object")
        if document_format == CHAT:
            return self.encode_chat(chat_messages(record, self.roles))
        prompt, completion = string_field(record, "prompt"), string_field(record, "completion")
        return self.encode_prompt_completion(prompt, completion)

    def encode_prompt_completion(
        self, prompt: str, completion: str
    ) -> UInt32[np.ndarray, " tokens"]:
        encoding = self.source.tokenizer.encode(prompt + completion)
        ids = list(encoding.ids)
        targets = overlaps(encoding.offsets, [(len(prompt), len(prompt) + len(completion))])
        if self.eos_id is not None:
            ids.append(self.eos_id)
            targets = np.append(targets, True)
        return self.finish(ids, targets, "the completion is empty")

    def encode_chat(self, messages: list[dict[str, str]]) -> UInt32[np.ndarray, " tokens"]:
        text = self.render(messages, generation_prompt=False)
        encoding = self.source.tokenizer.encode(text, add_special_tokens=False)
        spans = [] if self.train_on == "all" else self.assistant_spans(messages, text)
        return self.finish(encoding.ids, overlaps(encoding.offsets, spans), "no assistant turn")

    def finish(
        self, ids: Sequence[int], targets: Bool[np.ndarray, " tokens"], why: str
    ) -> UInt32[np.ndarray, " kept"]:
        if self.train_on == "all":
            targets = np.ones(len(ids), dtype=bool)
        marked = mark_targets(ids, targets)
        kept = fit_length(marked, self.fit)
        require_targets(kept, why if len(kept) == len(marked) else "none left after the cut")
        return kept

    def assistant_spans(self, messages: list[dict[str, str]], text: str) -> list[tuple[int, int]]:
        """The character spans of ``text`` (the whole conversation rendered) that are
        assistant turns: each between the conversation before it rendered with the
        generation prompt and the conversation up to it rendered without."""
        spans = []
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:index], generation_prompt=True)
            through = self.render(messages[: index + 1], generation_prompt=False)
            if not (text.startswith(through) and through.startswith(before)):
                raise RecordError(
                    TEMPLATE_FAILED,
                    f"the chat template renders messages[{index}] differently once later "
                    "messages follow, so its tokens cannot be told apart (--train-on all "
                    "trains on every token)",
                )
            spans.append((len(before), len(through)))
        return spans

    def render(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
        try:
            return self.chat_renderer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as error:  # noqa: BLE001 (a template raises whatever it likes)
            message = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise RecordError(TEMPLATE_FAILED, f"the chat template failed: {message}") from None

    @functools.cached_property
    def chat_renderer(self) -> Any:
        """A ``transformers`` fast tokenizer carrying the template and the special tokens a
        template reads (``bos_token``, ``eos_token``, ...); built on a copy, since it sets
        options on the tokenizer it wraps."""
        import transformers
        from tokenizers import Tokenizer

        template = self.source.chat_template
        assert template is not None, "the caller checks that there is a template"
        specials = {
            name: token
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (token := self.source.special_token(name)) is not None
        }
        copy = Tokenizer.from_str(self.source.tokenizer.to_str())
        return transformers.PreTrainedTokenizerFast(
            tokenizer_object=copy, chat_template=template, **specials
        )


def missing_template_message(source: TokenizerSource | None, where: str) -> str:
    """The error for chat records with a tokenizer that has no chat template: the fix."""
    if source is None:
        return (
            f"{where}: chat records are rendered with the model's chat template: give "
            "--tokenizer the Hugging Face checkpoint directory whose tokenizer_config.json "
            "has a chat_template"
        )
    if source.directory is None:
        return (
            f"{where}: chat records need a chat template, and --tokenizer {source.file} is a "
            "bare tokenizer.json: give --tokenizer the checkpoint directory whose "
            f"{TOKENIZER_CONFIG_FILE} has a chat_template"
        )
    return (
        f"{where}: chat records need a chat template, and {source.directory} has none: add "
        f"a chat_template to its {TOKENIZER_CONFIG_FILE} (or prepare the records as "
        "prompt-completion)"
    )
