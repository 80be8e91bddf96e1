"""What a model family is, and the pieces its Hugging Face mapping is written with.

A family module (``models/llama.py``, ``models/mixtral.py``, ...) holds everything about one
family and nothing else: its config class (a `DecoderConfig` subclass with the family's
defaults and checks), and its `HFMapping`: the Hugging Face architecture, the config
conversion both ways, the tensor-name table, and which ``config.json`` keys it handles,
ignores or accepts only at Hugging Face's default. It ends with a module-level ``FAMILY``;
`models.registry` collects those, so adding a family is adding one file.

The helpers below are shared by the families: `HFConfig` reads a ``config.json`` with a
family's defaults and one-line errors; `common_fields` / `common_hf_fields` map the fields
every Llama-like config shares; the `Tensor` constructors describe how one zoo array is
stored in a Hugging Face checkpoint.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

from models.config import ConfigError, DecoderConfig
from models.tensor_files import Sliceable, stack

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

# Keys `common_fields` reads (and `read_rope_theta` checks).
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

    ``where`` (the file's path) starts every error message.
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
        return ConfigError(f"{self.where}: {key}: {problem}")


@runtime_checkable
class LayerTensors(Protocol):
    """Reads one layer's (or the model's top-level) tensors by name, checking shapes; what it
    returns is read lazily (`models.tensor_files.LazyArray`)."""

    def has(self, name: str) -> bool: ...

    def __call__(self, name: str, shape: tuple[int, ...] | None = None) -> Sliceable: ...


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One zoo array and how it is stored in a Hugging Face checkpoint.

    ``where`` picks the array from a model (for ``layered`` arrays, the array stacked over
    layers). ``to_hf`` maps one layer's array to ``{name: tensor}`` (names relative to
    ``model.layers.{i}.`` for layered arrays); ``from_hf`` rebuilds it, given a reader of
    those names and the array's per-layer shape. ``to_hf`` only uses ``.T``, ``.reshape`` and
    indexing, so it runs on numpy arrays and abstract JAX values alike; ``from_hf`` only the
    views of a lazy array (``.T``, ``.transpose``, ``.reshape`` splitting axes, ``.window``,
    `models.tensor_files.stack`), so that nothing is read until the result is sliced.
    """

    where: Callable[[Any], Any]
    layered: bool
    to_hf: Callable[[Any], dict[str, Any]]
    from_hf: Callable[[LayerTensors, tuple[int, ...]], Sliceable]


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
    zoo does not have and requires to be zero.
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
    no Hugging Face counterpart)."""

    name: str
    config_class: type[DecoderConfig]
    model_class: type
    hf: HFMapping | None


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


# ----------------------------------------------------------------------------- configs


def common_fields(hf_config: HFConfig) -> dict[str, Any]:
    """The `DecoderConfig` fields every Llama-like ``config.json`` gives the same way."""
    if hf_config.get("hidden_act", "silu") != "silu":
        raise hf_config.error(
            "hidden_act",
            f"{hf_config.values['hidden_act']!r} is not supported: the zoo's SwiGLU uses 'silu'",
        )
    n_heads = hf_config.get("num_attention_heads")
    d_model = hf_config.get("hidden_size")
    head_dim = hf_config.get("head_dim", d_model // n_heads)
    n_kv_heads = hf_config.get("num_key_value_heads", n_heads)
    return dict(
        vocab_size=hf_config.get("vocab_size"),
        d_model=d_model,
        n_layers=hf_config.get("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=None if n_kv_heads == n_heads else n_kv_heads,
        head_dim=None if head_dim * n_heads == d_model else head_dim,
        mlp_dim=hf_config.get("intermediate_size"),
        activation="swiglu",
        norm="rms",
        norm_eps=float(hf_config.get("rms_norm_eps")),
        rope_theta=read_rope_theta(hf_config),
        qk_norm=False,
        tie_embeddings=bool(hf_config.values.get("tie_word_embeddings", False)),
        init_std=float(hf_config.get("initializer_range", 0.02)),
    )


def read_rope_theta(hf_config: HFConfig) -> float:
    """``rope_theta`` from ``rope_parameters`` (transformers 5) or the top level (older).

    Only unscaled ("default") rotary embeddings over the whole head exist in the zoo.
    """
    values = hf_config.values
    for field in ("rope_parameters", "rope_scaling"):
        table = values.get(field) or {}
        if not isinstance(table, Mapping) or any(isinstance(v, Mapping) for v in table.values()):
            raise hf_config.error(field, f"{table!r}: per-layer rotary settings are not supported")
        rope_type = table.get("rope_type", table.get("type", "default"))
        if rope_type != "default":
            raise hf_config.error(
                f"{field}.rope_type",
                f"{rope_type!r}: only unscaled ('default') rotary embeddings are supported",
            )
        if table.get("partial_rotary_factor", 1.0) != 1.0:
            raise hf_config.error(
                f"{field}.partial_rotary_factor", "partial rotary embeddings are not supported"
            )
    if values.get("partial_rotary_factor", 1.0) != 1.0:
        raise hf_config.error(
            "partial_rotary_factor", "partial rotary embeddings are not supported"
        )
    parameters = values.get("rope_parameters") or {}
    theta = parameters.get("rope_theta", values.get("rope_theta"))
    return float(hf_config.defaults["rope_theta"] if theta is None else theta)


def common_hf_fields(config: DecoderConfig, architecture: str) -> dict[str, Any]:
    """The ``config.json`` fields `common_fields` reads, for ``config``; `ConfigError` naming
    the field where ``config`` uses a builder option ``architecture`` does not have."""
    if config.norm != "rms":
        raise ConfigError(f"norm: {config.norm!r} has no {architecture} counterpart; use 'rms'")
    if config.activation != "swiglu":
        raise ConfigError(
            f"activation: {config.activation!r} has no {architecture} counterpart; use 'swiglu'"
        )
    if config.qk_norm:
        raise ConfigError(f"qk_norm: {architecture} has no QK-norm; set qk_norm=False")
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.attention_head_dim,
        "intermediate_size": config.mlp_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": config.init_std,
    }


# ----------------------------------------------------------------------------- tensors


def copied(where: Callable, name: str, *, layered: bool = True) -> Tensor:
    """Norm weights and the embedding table: same layout on both sides."""
    return Tensor(where, layered, lambda a: {name: a}, lambda read, shape: read(name))


def linear(where: Callable, name: str, *, layered: bool = True) -> Tensor:
    """A `Linear` weight ``(in, out)`` <-> a torch ``nn.Linear`` weight ``(out, in)``."""
    return Tensor(where, layered, lambda a: {name: a.T}, lambda read, shape: read(name).T)


def heads_in(where: Callable, name: str) -> Tensor:
    """``wq/wk/wv (embed, heads, head_dim)`` <-> ``q/k/v_proj.weight (heads * head_dim, embed)``."""
    return Tensor(
        where,
        True,
        lambda a: {name: a.reshape(a.shape[0], -1).T},
        lambda read, shape: read(name).T.reshape(shape),
    )


def heads_out(where: Callable, name: str) -> Tensor:
    """``wo (heads, head_dim, embed)`` <-> ``o_proj.weight (embed, heads * head_dim)``."""
    return Tensor(
        where,
        True,
        lambda a: {name: a.reshape(-1, a.shape[-1]).T},
        lambda read, shape: read(name).T.reshape(shape),
    )


def heads_bias(where: Callable, name: str) -> Tensor:
    """``bq/bk/bv (heads, head_dim)`` <-> ``q/k/v_proj.bias (heads * head_dim,)``."""
    return Tensor(
        where, True, lambda a: {name: a.reshape(-1)}, lambda read, shape: read(name).reshape(shape)
    )


def experts(where: Callable, prefix: str, expert_name: str, fused: str) -> Tensor:
    """Stacked expert weights ``(experts, in, out)`` <-> one ``(out, in)`` tensor per expert.

    Also reads transformers 5's fused layout: ``fused`` is ``"gate"`` or ``"up"`` (a half of
    ``experts.gate_up_proj (experts, 2 * mlp, embed)``) or ``"down"`` (``experts.down_proj
    (experts, embed, mlp)``).
    """

    def name(expert: int) -> str:
        return f"{prefix}experts.{expert}.{expert_name}.weight"

    def to_hf(a) -> dict[str, Any]:
        return {name(expert): a[expert].T for expert in range(a.shape[0])}

    def from_hf(read: LayerTensors, shape: tuple[int, ...]) -> Sliceable:
        n_experts, rows, columns = shape
        if fused == "down" and read.has(f"{prefix}experts.down_proj"):
            return read(f"{prefix}experts.down_proj", (n_experts, columns, rows)).transpose(0, 2, 1)
        if fused in ("gate", "up") and read.has(f"{prefix}experts.gate_up_proj"):
            gate_up = read(f"{prefix}experts.gate_up_proj", (n_experts, 2 * columns, rows))
            start = 0 if fused == "gate" else columns
            return gate_up.window(1, start, start + columns).transpose(0, 2, 1)
        return stack([read(name(expert)).T for expert in range(n_experts)])

    return Tensor(where, True, to_hf, from_hf)


def llama_like_tensors(config: DecoderConfig) -> list[Tensor]:
    """Embedding, final norm, head and every layer's norms and attention, named as in
    ``LlamaForCausalLM`` (and the families that copied its layout)."""
    tensors = [
        copied(lambda m: m.embedding.weight, "model.embed_tokens.weight", layered=False),
        copied(lambda m: m.final_norm.weight, "model.norm.weight", layered=False),
        copied(lambda m: m.blocks.layers.attention_norm.weight, "input_layernorm.weight"),
        copied(lambda m: m.blocks.layers.mlp_norm.weight, "post_attention_layernorm.weight"),
        heads_in(lambda m: m.blocks.layers.attention.wq, "self_attn.q_proj.weight"),
        heads_in(lambda m: m.blocks.layers.attention.wk, "self_attn.k_proj.weight"),
        heads_in(lambda m: m.blocks.layers.attention.wv, "self_attn.v_proj.weight"),
        heads_out(lambda m: m.blocks.layers.attention.wo, "self_attn.o_proj.weight"),
    ]
    if not config.tie_embeddings:
        tensors.append(linear(lambda m: m.unembedding.weight, "lm_head.weight", layered=False))
    if config.qkv_bias:
        tensors += [
            heads_bias(lambda m: m.blocks.layers.attention.bq, "self_attn.q_proj.bias"),
            heads_bias(lambda m: m.blocks.layers.attention.bk, "self_attn.k_proj.bias"),
            heads_bias(lambda m: m.blocks.layers.attention.bv, "self_attn.v_proj.bias"),
        ]
    return tensors


def routed_experts_tensors(prefix: str, names: tuple[str, str, str]) -> list[Tensor]:
    """The router and the routed experts' ``(gate, up, down)`` weights, stored per expert as
    ``{prefix}experts.{e}.{name}.weight`` with the router at ``{prefix}gate.weight``."""
    return [
        linear(lambda m: m.blocks.layers.mlp.router.weight, f"{prefix}gate.weight"),
        experts(lambda m: m.blocks.layers.mlp.experts.gate, prefix, names[0], "gate"),
        experts(lambda m: m.blocks.layers.mlp.experts.up, prefix, names[1], "up"),
        experts(lambda m: m.blocks.layers.mlp.experts.down, prefix, names[2], "down"),
    ]


def layer_prefix(layer: int) -> str:
    """The name prefix of layer ``layer``'s tensors."""
    return f"model.layers.{layer}."
