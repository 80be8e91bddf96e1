"""What a model family is, and the pieces its Hugging Face mapping is written with.

A family module (``models/llama.py``, ``models/mixtral.py``, ...) holds everything about one
family and nothing else: its config class (a `DecoderConfig` subclass with the family's
defaults and checks), and its `HFMapping`: the Hugging Face architecture, the config
conversion both ways, the tensor-name table, and which ``config.json`` keys it handles,
ignores or accepts only at Hugging Face's default. It ends with a module-level ``FAMILY``;
`models.registry` collects those, so adding a family is adding one file.

The helpers below are shared by the families: `HFConfig` reads a ``config.json`` with a
family's defaults and one-line errors; `common_fields` / `common_hf_fields` map the fields
most configs share (`read_rope` / `rope_to_hf` the rotary settings) and `check_expressible`
refuses a zoo config an architecture cannot hold; the `Tensor` constructors describe how one
zoo array is stored in a Hugging Face checkpoint.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol, runtime_checkable

from eqxzoo.typed_config import refuse
from models.config import RUNTIME_KEYS, ConfigError, DecoderConfig, MoEConfig, RopeScaling
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

# DecoderConfig fields every ``config.json`` states (shapes and numerics), and those that
# choose how the zoo runs (`RUNTIME_KEYS`, never saved): no family refuses them.
FREE_FIELDS = frozenset(
    {
        "vocab_size",
        "d_model",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "head_dim",
        "mlp_dim",
        "norm_eps",
        "rope_theta",
        "tie_embeddings",
        "init_std",
        "moe",
    }
) | {key for key in RUNTIME_KEYS if "." not in key}

# MoEConfig fields that change what the router and experts compute: like DecoderConfig's
# fields, each is free, fixed ("moe.<field>" in `check_expressible`'s ``fixed`` / ``free``)
# or at its default.
MOE_ARCHITECTURE_FIELDS = (
    "scoring",
    "n_groups",
    "topk_groups",
    "routed_scaling",
    "router_bias",
    "selection_bias",
    "expert_bias",
    "expert_activation",
)

# Hugging Face activation names for the zoo's MLPs: gated (the config's activation) or not.
GATED_ACTIVATIONS = {"silu": "swiglu", "gelu_pytorch_tanh": "geglu"}


def check_expressible(
    config: DecoderConfig,
    architecture: str,
    *,
    fixed: Mapping[str, Any] | None = None,
    free: frozenset[str] = frozenset(),
) -> None:
    """Refuse a config that uses a builder option ``architecture`` cannot express.

    Every field is either free (`FREE_FIELDS` and ``free``: the family's ``config.json``
    states it), fixed by the architecture (``fixed``: e.g. Gemma's ``norm``), or must keep
    `DecoderConfig`'s default; so must the router's and experts' `MOE_ARCHITECTURE_FIELDS` (named
    ``moe.<field>``). `ConfigError` names the first field that does not.
    """
    fixed = fixed or {}
    checked = [
        (field.name, field.default, getattr(config, field.name))
        for field in dataclasses.fields(DecoderConfig)
        if field.name not in FREE_FIELDS
    ]
    if config.moe is not None:
        defaults = {field.name: field.default for field in dataclasses.fields(MoEConfig)}
        checked += [
            (f"moe.{name}", defaults[name], getattr(config.moe, name))
            for name in MOE_ARCHITECTURE_FIELDS
        ]
    for name, default, value in checked:
        if name in free:
            continue
        expected = fixed.get(name, default)
        if value != expected:
            refuse(name, f"{value!r} has no {architecture} counterpart; use {expected!r}")


def common_fields(
    hf_config: HFConfig, *, activation_key: str = "hidden_act", local_rope: bool = False
) -> dict[str, Any]:
    """The `DecoderConfig` fields most ``config.json`` files give the same way: shapes, norm
    epsilon, the gated activation (under ``activation_key``), rotary settings
    (`read_rope`; ``local_rope``: per-layer-type settings allowed) and tied embeddings."""
    activation = hf_config.get(activation_key, "silu")
    if activation not in GATED_ACTIVATIONS:
        raise hf_config.error(
            activation_key,
            f"{activation!r} is not supported; supported: {', '.join(GATED_ACTIVATIONS)}",
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
        activation=GATED_ACTIVATIONS[activation],
        norm_eps=float(hf_config.get("rms_norm_eps")),
        **read_rope(hf_config, local=local_rope),
        tie_embeddings=bool(hf_config.values.get("tie_word_embeddings", False)),
        init_std=float(hf_config.get("initializer_range", 0.02)),
    )


# What a rope_parameters table may hold, by rope_type.
ROPE_KEYS = {
    "default": {"rope_type", "type", "rope_theta"},
    "linear": {"rope_type", "type", "rope_theta", "factor"},
    "dynamic": {"rope_type", "type", "rope_theta", "factor"},
    "llama3": {
        "rope_type",
        "type",
        "rope_theta",
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    },
    "yarn": {
        "rope_type",
        "type",
        "rope_theta",
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "truncate",
    },
}


def _rope_table(hf_config: HFConfig, field: str, table: Any) -> tuple[Any, RopeScaling | None]:
    """``(rope_theta or None, scaling)`` of one ``rope_parameters``-style table."""
    if not isinstance(table, Mapping):
        raise hf_config.error(field, f"{table!r}: expected a table of rotary settings")
    if table.get("partial_rotary_factor", 1.0) != 1.0:
        raise hf_config.error(
            f"{field}.partial_rotary_factor", "partial rotary embeddings are not supported"
        )
    rope_type = table.get("rope_type", table.get("type", "default"))
    if rope_type not in ROPE_KEYS:
        raise hf_config.error(
            f"{field}.rope_type",
            f"{rope_type!r} is not supported; supported: {', '.join(ROPE_KEYS)}",
        )
    unknown = sorted(set(table) - ROPE_KEYS[rope_type] - {"partial_rotary_factor"})
    if unknown:
        raise hf_config.error(
            f"{field}.{unknown[0]}", f"not supported with rope_type {rope_type!r}"
        )
    theta = table.get("rope_theta")
    if rope_type == "default":
        return theta, None
    if rope_type == "yarn":
        scaling = _yarn_scaling(hf_config, table)
    else:
        scaling = dict(kind=rope_type, factor=float(table["factor"]))
    if rope_type == "dynamic":
        scaling["original_max_positions"] = hf_config.get("max_position_embeddings")
    elif rope_type == "llama3":
        scaling.update(
            low_freq_factor=float(table["low_freq_factor"]),
            high_freq_factor=float(table["high_freq_factor"]),
            original_max_positions=table["original_max_position_embeddings"],
        )
    try:
        return theta, RopeScaling(**scaling)
    except ConfigError as error:
        raise hf_config.error(field, str(error)) from None


def _yarn_scaling(hf_config: HFConfig, table: Mapping[str, Any]) -> dict[str, Any]:
    """`RopeScaling` fields of a ``yarn`` table, with transformers' defaults: the original
    context is ``max_position_embeddings`` if unset, ``factor`` the ratio of the two if
    unset, and an unset or zero ``beta_fast`` / ``beta_slow`` is 32 / 1."""
    original = table.get("original_max_position_embeddings")
    if original is None:
        original = hf_config.get("max_position_embeddings")
    factor = table.get("factor")
    if factor is None:
        factor = hf_config.get("max_position_embeddings") / original

    def optional(key: str) -> float | None:
        return None if table.get(key) is None else float(table[key])

    return dict(
        kind="yarn",
        factor=float(factor),
        original_max_positions=original,
        beta_fast=float(table.get("beta_fast") or 32),
        beta_slow=float(table.get("beta_slow") or 1),
        mscale=optional("mscale"),
        mscale_all_dim=optional("mscale_all_dim"),
        attention_factor=optional("attention_factor"),
        truncate=table.get("truncate", True),
    )


def read_rope(hf_config: HFConfig, *, local: bool = False) -> dict[str, Any]:
    """``rope_theta`` and ``rope_scaling`` (and with ``local``, ``local_rope_theta``) from
    ``rope_parameters`` (transformers 5), or ``rope_scaling`` and a top-level ``rope_theta``
    (older files).

    With ``local``, ``rope_parameters`` may be one table per layer type (Gemma 3):
    ``full_attention``'s gives the global settings, ``sliding_attention``'s (unscaled) the
    local base. Partial rotary embeddings and scalings other than ``linear``, ``dynamic``,
    ``llama3`` and ``yarn`` are refused, naming the key.
    """
    values = hf_config.values
    field = "rope_parameters" if values.get("rope_parameters") else "rope_scaling"
    table = values.get(field) or {}
    if values.get("partial_rotary_factor", 1.0) != 1.0:
        raise hf_config.error(
            "partial_rotary_factor", "partial rotary embeddings are not supported"
        )
    local_theta = values.get("rope_local_base_freq") if local else None
    if isinstance(table, Mapping) and any(isinstance(v, Mapping) for v in table.values()):
        if not local:
            raise hf_config.error(field, f"{table!r}: per-layer rotary settings are not supported")
        unknown = sorted(set(table) - {"full_attention", "sliding_attention"})
        if unknown:
            raise hf_config.error(f"{field}.{unknown[0]}", "is not a layer type of this model")
        sliding_field = f"{field}.sliding_attention"
        local_theta, local_scaling = _rope_table(
            hf_config, sliding_field, table.get("sliding_attention", {})
        )
        if local_scaling is not None:
            raise hf_config.error(
                f"{sliding_field}.rope_type",
                f"{local_scaling.kind!r}: sliding-window layers' rotary embeddings must be "
                "unscaled ('default')",
            )
        field, table = f"{field}.full_attention", table.get("full_attention", {})
    theta, scaling = _rope_table(hf_config, field, table)
    theta = values.get("rope_theta") if theta is None else theta
    rope = dict(
        rope_theta=float(hf_config.defaults["rope_theta"] if theta is None else theta),
        rope_scaling=scaling,
    )
    if local:
        default = hf_config.defaults.get("local_rope_theta")
        rope["local_rope_theta"] = float(default if local_theta is None else local_theta)
    return rope


def rope_to_hf(config: DecoderConfig) -> dict[str, Any]:
    """``rope_parameters`` (one table, or one per layer type when sliding layers have their
    own base) and, for ``dynamic`` scaling, the ``max_position_embeddings`` it scales from."""
    table: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    fields: dict[str, Any] = {}
    scaling = config.rope_scaling
    if scaling is not None:
        table.update(rope_type=scaling.kind, factor=scaling.factor)
        if scaling.kind == "dynamic":
            fields["max_position_embeddings"] = scaling.original_max_positions
        elif scaling.kind == "llama3":
            table.update(
                low_freq_factor=scaling.low_freq_factor,
                high_freq_factor=scaling.high_freq_factor,
                original_max_position_embeddings=scaling.original_max_positions,
            )
        elif scaling.kind == "yarn":
            table.update(
                original_max_position_embeddings=scaling.original_max_positions,
                beta_fast=scaling.beta_fast,
                beta_slow=scaling.beta_slow,
                truncate=scaling.truncate,
            )
            for key in ("mscale", "mscale_all_dim", "attention_factor"):
                if getattr(scaling, key) is not None:
                    table[key] = getattr(scaling, key)
    if config.local_rope_theta is not None:
        local = {"rope_type": "default", "rope_theta": config.local_rope_theta}
        table = {"full_attention": table, "sliding_attention": local}
    return {"rope_parameters": table, **fields}


def read_layer_types(hf_config: HFConfig, n_layers: int) -> tuple[str, ...] | None:
    """``layer_types`` as given (each ``full_attention`` or ``sliding_attention``), or None."""
    layer_types = hf_config.values.get("layer_types")
    if layer_types is None:
        return None
    kinds = ("full_attention", "sliding_attention")
    if len(layer_types) != n_layers or any(kind not in kinds for kind in layer_types):
        raise hf_config.error(
            "layer_types",
            f"{layer_types}: expected {n_layers} entries, each one of {', '.join(kinds)}",
        )
    return tuple(layer_types)


def common_hf_fields(
    config: DecoderConfig,
    architecture: str,
    *,
    fixed: Mapping[str, Any] | None = None,
    free: frozenset[str] = frozenset(),
    activation_key: str = "hidden_act",
) -> dict[str, Any]:
    """The ``config.json`` fields `common_fields` reads, for ``config``, after
    `check_expressible` (``fixed``, ``free``: the family's own fields)."""
    check_expressible(config, architecture, fixed=fixed, free=free | {"activation"})
    activations = {zoo: hf for hf, zoo in GATED_ACTIVATIONS.items()}
    if config.activation not in activations:
        refuse(
            "activation",
            f"{config.activation!r} has no {architecture} counterpart; use "
            f"{' or '.join(repr(name) for name in activations)}",
        )
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.attention_head_dim,
        "intermediate_size": config.mlp_dim,
        activation_key: activations[config.activation],
        "rms_norm_eps": config.norm_eps,
        **rope_to_hf(config),
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


def flattened(where: Callable, name: str) -> Tensor:
    """A per-head array ``(heads, head_dim)`` (``bq/bk/bv``, an all-heads QK-norm weight) <->
    a flat ``(heads * head_dim,)`` tensor (``q_proj.bias``, OLMo 2's ``q_norm.weight``)."""
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


# Where the zoo's block norms sit in a Llama-layout checkpoint: before each sublayer.
LLAMA_NORMS = {"attention_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}


def model_tensors(config: DecoderConfig, prefix: str = "model.") -> list[Tensor]:
    """The token embedding, the final norm and (untied) the output head."""
    tensors = [
        copied(lambda m: m.embedding.weight, f"{prefix}embed_tokens.weight", layered=False),
        copied(lambda m: m.final_norm.weight, f"{prefix}norm.weight", layered=False),
    ]
    if not config.tie_embeddings:
        tensors.append(linear(lambda m: m.unembedding.weight, "lm_head.weight", layered=False))
    return tensors


def norm_tensors(names: Mapping[str, str]) -> list[Tensor]:
    """Each block norm ``{zoo field: Hugging Face module name}`` (``attention_norm``,
    ``attention_post_norm``, ``mlp_norm``, ``mlp_post_norm``)."""

    def norm_weight(field: str) -> Callable:
        return lambda m: getattr(m.blocks.layers, field).weight

    return [copied(norm_weight(field), f"{name}.weight") for field, name in names.items()]


def attention_tensors(config: DecoderConfig, prefix: str = "self_attn.") -> list[Tensor]:
    """q/k/v/o projections, their biases and QK-norm weights, as ``{prefix}q_proj.weight``,
    ``{prefix}q_norm.weight``, ... (Llama's layout, kept by the families derived from it)."""

    def attention(m):
        return m.blocks.layers.attention

    tensors = [
        heads_in(lambda m: attention(m).wq, f"{prefix}q_proj.weight"),
        heads_in(lambda m: attention(m).wk, f"{prefix}k_proj.weight"),
        heads_in(lambda m: attention(m).wv, f"{prefix}v_proj.weight"),
        heads_out(lambda m: attention(m).wo, f"{prefix}o_proj.weight"),
    ]
    if config.qkv_bias:
        tensors += [
            flattened(lambda m: attention(m).bq, f"{prefix}q_proj.bias"),
            flattened(lambda m: attention(m).bk, f"{prefix}k_proj.bias"),
            flattened(lambda m: attention(m).bv, f"{prefix}v_proj.bias"),
        ]
    if config.attention_out_bias:
        tensors.append(copied(lambda m: attention(m).bo, f"{prefix}o_proj.bias"))
    if config.qk_norm:
        norm = copied if config.qk_norm_over == "head" else flattened
        tensors += [
            norm(lambda m: attention(m).q_norm.weight, f"{prefix}q_norm.weight"),
            norm(lambda m: attention(m).k_norm.weight, f"{prefix}k_norm.weight"),
        ]
    return tensors


def mlp_tensors(prefix: str = "mlp.") -> list[Tensor]:
    """A gated MLP's ``{prefix}gate_proj``, ``up_proj`` and ``down_proj`` weights."""
    return [
        linear(lambda m: m.blocks.layers.mlp.gate.weight, f"{prefix}gate_proj.weight"),
        linear(lambda m: m.blocks.layers.mlp.up.weight, f"{prefix}up_proj.weight"),
        linear(lambda m: m.blocks.layers.mlp.down.weight, f"{prefix}down_proj.weight"),
    ]


def llama_like_tensors(config: DecoderConfig) -> list[Tensor]:
    """Embedding, final norm, head and every layer's norms and attention, named as in
    ``LlamaForCausalLM`` (and the families that copied its layout)."""
    return model_tensors(config) + norm_tensors(LLAMA_NORMS) + attention_tensors(config)


class _PrefixAsBlocks:
    """A model seen with its prefix in place of its blocks, so that a `Tensor` written for
    the blocks (``m.blocks.layers...``) picks the same array of the prefix's layers."""

    def __init__(self, model: Any):
        self.model = model

    @property
    def blocks(self) -> Any:
        return self.model.prefix


def on_prefix(tensors: list[Tensor]) -> list[Tensor]:
    """The layered ``tensors`` of the blocks, stored for the prefix's layers instead (the
    prefix's layers have the blocks' layout where they share a part: norms, attention)."""
    return [
        dataclasses.replace(t, where=lambda m, t=t: t.where(_PrefixAsBlocks(m)), stack="prefix")
        for t in tensors
        if t.layered
    ]


def routed_experts_tensors(prefix: str, names: tuple[str, str, str]) -> list[Tensor]:
    """The router and the routed experts' ``(gate, up, down)`` weights, stored per expert as
    ``{prefix}experts.{e}.{name}.weight`` with the router at ``{prefix}gate.weight``."""
    return [
        linear(lambda m: m.blocks.layers.mlp.router.weight, f"{prefix}gate.weight"),
        experts(lambda m: m.blocks.layers.mlp.experts.gate, prefix, names[0], "gate"),
        experts(lambda m: m.blocks.layers.mlp.experts.up, prefix, names[1], "up"),
        experts(lambda m: m.blocks.layers.mlp.experts.down, prefix, names[2], "down"),
    ]
