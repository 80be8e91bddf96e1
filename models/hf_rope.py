"""The rotary settings of a Hugging Face ``config.json``, both ways: ``rope_theta`` and
``rope_scaling`` (linear, llama3, yarn; per layer type for Gemma 3) to the zoo's
`RopeScaling`, and back."""

from collections.abc import Mapping
from typing import Any

from models.config import ConfigError, DecoderConfig, RopeScaling
from models.family import HFConfig

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
