"""How a family's config maps to a Hugging Face ``config.json``: which zoo fields every
config states or a family may fix (`check_expressible`), and the fields most configs share
(`common_fields`, `common_hf_fields`), both ways."""

import dataclasses
from collections.abc import Mapping
from typing import Any

from eqxzoo.typed_config import refuse
from models.config import RUNTIME_KEYS, DecoderConfig, MoEConfig
from models.family import HFConfig
from models.hf_rope import read_rope, rope_to_hf

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


@dataclasses.dataclass(frozen=True)
class MoEKeys:
    """Where a family's ``config.json`` keeps the fields every MoE states: the number of
    routed experts (``n_experts``: the first of these keys that is present), their width
    (``expert_mlp_dim``), the experts per token (``top_k``) and whether the chosen weights are
    renormalised (``normalize_topk``; None where the architecture fixes it)."""

    n_experts: tuple[str, ...]
    expert_mlp_dim: str
    normalize_topk: str | None = "norm_topk_prob"
    top_k: str = "num_experts_per_tok"

    @property
    def handled(self) -> frozenset[str]:
        """The keys, for `HFMapping.handled_keys`."""
        keys = {*self.n_experts, self.expert_mlp_dim, self.top_k, self.normalize_topk}
        return frozenset(keys - {None})


def moe_fields(hf_config: HFConfig, keys: MoEKeys) -> dict[str, Any]:
    """The `MoEConfig` fields ``keys`` name, read from ``hf_config``."""
    present = [key for key in keys.n_experts if hf_config.values.get(key) is not None]
    fields = {
        "n_experts": hf_config.get(present[0] if present else keys.n_experts[0]),
        "top_k": hf_config.get(keys.top_k),
        "expert_mlp_dim": hf_config.get(keys.expert_mlp_dim),
    }
    if keys.normalize_topk is not None:
        fields["normalize_topk"] = bool(hf_config.get(keys.normalize_topk))
    return fields


def moe_hf_fields(moe: MoEConfig, keys: MoEKeys) -> dict[str, Any]:
    """The ``config.json`` entries ``keys`` name, written from ``moe`` (the inverse of
    `moe_fields`)."""
    fields = {
        keys.n_experts[0]: moe.n_experts,
        keys.top_k: moe.top_k,
        keys.expert_mlp_dim: moe.expert_mlp_dim,
    }
    if keys.normalize_topk is not None:
        fields[keys.normalize_topk] = moe.normalize_topk
    return fields
