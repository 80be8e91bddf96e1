"""What a model family is, and the pieces its Hugging Face mapping is written with.

A family module (``models/llama.py``, ``models/mixtral.py``, ...) holds everything about one
family and nothing else: its config class (a `DecoderConfig` subclass with the family's
defaults and checks), and its `HFMapping`: the Hugging Face architecture, the config
conversion both ways, the tensor-name table, and which ``config.json`` keys it handles,
ignores or accepts only at Hugging Face's default. It ends with a module-level ``FAMILY``;
`models.registry` collects those, so adding a family is adding one file.

This module holds the types (`HFConfig` reads a ``config.json`` with a family's defaults
and one-line errors; `Tensor` says how one zoo array is stored in a checkpoint). The helpers
the families share live beside it: `models.hf_fields` (the fields most configs share, both
ways, and `check_expressible`, which refuses a zoo config an architecture cannot hold),
`models.hf_rope` (the rotary settings) and `models.hf_tensors` (the `Tensor` constructors).
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol, runtime_checkable

from models.config import ConfigError, DecoderConfig
from models.tensor_files import Sliceable

# Keys of every transformers config that say nothing about the computation.
COMMON_IGNORED_KEYS = frozenset(
    {
        "_name_or_path",
        "bos_token_id",
        "chunk_size_feed_forward",
        "dtype",
        "eos_token_id",
        "id2label",
        "is_encoder_decoder",
        "label2id",
        "max_position_embeddings",
        "output_attentions",
        "output_hidden_states",
        "pad_token_id",
        "problem_type",
        "return_dict",
        "torch_dtype",
        "transformers_version",
        "use_cache",
    }
)

# Keys `common_fields` reads (and `read_rope` checks).
COMMON_HANDLED_KEYS = frozenset(
    {
        "architectures",
        "model_type",
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "hidden_act",
        "rms_norm_eps",
        "rope_parameters",
        "rope_scaling",
        "rope_theta",
        "partial_rotary_factor",
        "tie_word_embeddings",
        "initializer_range",
    }
)

# Options the zoo does not model, accepted only at Hugging Face's default value.
COMMON_PINNED_KEYS: Mapping[str, Any] = {"attention_dropout": 0.0}


class HFConfig:
    """A parsed ``config.json``, read with the family's defaults for optional keys.

    ``where`` is the file's path, which `models.hf.config_from_hf` puts before every error.
    """

    def __init__(self, values: Mapping[str, Any], defaults: Mapping[str, Any], where: str):
        self.values = values
        self.defaults = defaults
        self.where = where

    def get(self, key: str, default: Any = None) -> Any:
        """``key``'s value; if missing or null, ``default``, else the family's default, else
        an error naming the key."""
        value = self.values.get(key)
        if value is not None:
            return value
        if default is not None:
            return default
        if key in self.defaults:
            return self.defaults[key]
        raise self.error(key, "missing: a Hugging Face config must set it")

    def error(self, key: str, problem: str) -> ConfigError:
        """The error about ``key`` of the ``config.json``; `models.hf.read_hf_config` prefixes
        the file's path (``where``) to every error it raises."""
        return ConfigError(problem, field=key)


@runtime_checkable
class LayerTensors(Protocol):
    """Reads one layer's (or the model's top-level) tensors by name, checking shapes; what it
    returns is read lazily (`models.tensor_files.LazyArray`)."""

    def has(self, name: str) -> bool: ...

    def __call__(self, name: str, shape: tuple[int, ...] | None = None) -> Sliceable: ...


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One zoo array (or a tuple of them) and how it is stored in a Hugging Face checkpoint.

    ``where`` picks the array from a model (for ``layered`` arrays, the array stacked over
    layers), or a tuple of arrays stored together (GPT-2 keeps q, k and v in one tensor).
    ``to_hf`` maps one layer's array(s) to ``{name: tensor}`` (names relative to the layer's
    prefix, `HFMapping.layer_prefix`, for layered arrays); ``from_hf`` rebuilds them, given a
    reader of those names and the per-layer shape (a tuple of shapes for a tuple). ``to_hf``
    only uses ``.T``, ``.reshape``, indexing and ``jnp.concatenate``, so it runs on numpy
    arrays and abstract JAX values alike; ``from_hf`` only the views of a lazy array
    (``.T``, ``.transpose``, ``.reshape`` splitting axes, ``.window``,
    `models.tensor_files.stack`), so that nothing is read until the result is sliced.
    """

    where: Callable[[Any], Any]
    layered: bool
    to_hf: Callable[[Any], dict[str, Any]]
    from_hf: Callable[[LayerTensors, tuple[int, ...]], Sliceable]
    stack: Literal["blocks", "prefix"] = "blocks"

    def layers(self, config: DecoderConfig) -> range:
        """The Hugging Face layer indices this layered tensor is stored at: the prefix's
        layers come first (``0 .. first_dense_layers - 1``), then the blocks'."""
        n_prefix = config.first_dense_layers
        return range(n_prefix) if self.stack == "prefix" else range(n_prefix, config.n_layers)


def tensor_parts(value: Any) -> list[Any]:
    """The arrays of a `Tensor`'s ``where`` (or ``from_hf``) result: one, or a tuple's."""
    return list(value) if isinstance(value, tuple) else [value]


@dataclasses.dataclass(frozen=True)
class HFMapping:
    """How a family is stored as a Hugging Face ``architecture`` of ``model_type``.

    ``config_from_hf`` builds the zoo config from an `HFConfig`; ``config_to_hf`` gives the
    ``config.json`` fields for a zoo config (raising `ConfigError` naming the field when the
    config has no exact counterpart). ``tensors`` lists every array with its names and
    layout. ``config.json`` keys are whitelisted: ``handled_keys`` are read,
    ``ignored_keys`` do not change what the model computes, ``pinned_keys`` (options the
    zoo does not model) are accepted only at Hugging Face's default; any other key with a
    value is refused, naming it. ``renames`` are substrings of stored tensor names read
    under another name (transformers' in-memory names); ``zero_tensors`` names tensors the
    zoo does not have and requires to be zero; ``ignored_tensor_suffixes`` end the names of
    stored tensors that are not parameters (GPT-2's cached attention masks).
    ``layer_format`` is layer ``i``'s name prefix with ``{}`` for ``i``.
    """

    architecture: str
    model_type: str
    defaults: Mapping[str, Any]
    handled_keys: frozenset[str]
    ignored_keys: frozenset[str]
    pinned_keys: Mapping[str, Any]
    config_from_hf: Callable[[HFConfig], DecoderConfig]
    config_to_hf: Callable[[DecoderConfig], dict[str, Any]]
    tensors: Callable[[DecoderConfig], list[Tensor]]
    renames: tuple[tuple[str, str], ...] = ()
    zero_tensors: Callable[[DecoderConfig], list[str]] = lambda config: []
    ignored_tensor_suffixes: tuple[str, ...] = ()
    layer_format: str = "model.layers.{}."

    def layer_prefix(self, layer: int) -> str:
        """The name prefix of layer ``layer``'s tensors."""
        return self.layer_format.format(layer)

    def check_keys(self, hf_config: HFConfig) -> None:
        """Refuse every key this mapping neither handles, ignores nor finds at its default."""
        for key, value in hf_config.values.items():
            if key in self.handled_keys or key in self.ignored_keys:
                continue
            if key in self.pinned_keys:
                default = self.pinned_keys[key]
                if value is not None and value != default:
                    raise hf_config.error(
                        key,
                        f"{value!r} is not supported: the zoo models {self.architecture} only "
                        f"with Hugging Face's default {default!r}",
                    )
            elif value is not None:
                raise hf_config.error(
                    key,
                    f"{value!r}: an option of {self.architecture} the zoo does not model "
                    "(its family file lists the keys it reads or ignores)",
                )


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: its TOML ``family`` name, config class, the model class built from
    a config (``model_class(config, key=key)``; the shared `models.decoder.DecoderLM` for
    every family so far) and Hugging Face mapping (``None`` for the bare builder, which has
    no Hugging Face counterpart).

    ``tiny``: the fields its tiny example sets beyond the small shapes every example shares
    (`models.registry.tiny_config`): what makes it this family at a size a test runs in
    seconds (experts, windows shorter than a test's sequence, soft-caps that bite, a dense
    prefix layer). The family tests are driven by these, so a new family needs no test edit.
    """

    name: str
    config_class: type[DecoderConfig]
    model_class: type
    hf: HFMapping | None
    tiny: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def llama_like_mapping(
    *,
    handled_keys: frozenset[str] = frozenset(),
    ignored_keys: frozenset[str] = frozenset(),
    pinned_keys: Mapping[str, Any] | None = None,
    **fields: Any,
) -> HFMapping:
    """An `HFMapping` for a ``config.json`` read with `common_fields`: the given keys on top
    of the ones every such config has (`COMMON_HANDLED_KEYS`, `COMMON_IGNORED_KEYS`,
    `COMMON_PINNED_KEYS`); ``fields`` are the rest of `HFMapping`'s fields."""
    return HFMapping(
        handled_keys=COMMON_HANDLED_KEYS | handled_keys,
        ignored_keys=COMMON_IGNORED_KEYS | ignored_keys,
        pinned_keys={**COMMON_PINNED_KEYS, **(pinned_keys or {})},
        **fields,
    )
