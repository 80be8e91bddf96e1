"""Qwen3 (``Qwen3ForCausalLM``): Llama's layout with a per-head RMSNorm of queries and keys
(QK-norm), a ``head_dim`` free of ``d_model / n_heads``, tied or untied embeddings, and
optional sliding-window layers (``use_sliding_window``)."""

import dataclasses
from typing import Any, ClassVar

from eqxzoo.typed_config import refuse
from models.config import DecoderConfig
from models.decoder import DecoderLM
from models.family import Family, HFConfig, Tensor, llama_like_mapping
from models.hf_fields import common_fields, common_hf_fields, read_layer_types
from models.hf_tensors import llama_like_tensors, mlp_tensors


@dataclasses.dataclass(frozen=True)
class Qwen3Config(DecoderConfig):
    """Dense Qwen3: Llama with QK-norm over each head's ``head_dim``."""

    family: ClassVar[str] = "qwen3"
    norm_eps: float = 1e-6
    rope_theta: float = 1e6
    qk_norm: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.moe is not None:
            refuse("moe", "qwen3 is dense: use family 'qwen3_moe' for experts")


ARCHITECTURE = "Qwen3ForCausalLM"

# What Qwen3 and Qwen3-MoE read of their attention beyond `common_fields`.
ATTENTION_KEYS = frozenset({"attention_bias", "use_sliding_window", "sliding_window"})
# Fixed by both architectures.
FIXED = {"qk_norm": True}
# Free in both: the rest of what `attention_fields` reads.
FREE = frozenset({"rope_scaling", "qkv_bias", "attention_out_bias", "sliding_window"})


def attention_fields(hf_config: HFConfig) -> dict[str, Any]:
    """Biases (``attention_bias``: q/k/v and output) and the sliding window
    (``sliding_window``, only with ``use_sliding_window``)."""
    values = hf_config.values
    bias = bool(values.get("attention_bias", False))
    window = values.get("sliding_window") if values.get("use_sliding_window") else None
    return dict(qkv_bias=bias, attention_out_bias=bias, sliding_window=window, qk_norm=True)


def attention_to_hf(config: DecoderConfig) -> dict[str, Any]:
    if config.attention_out_bias != config.qkv_bias:
        refuse("attention_out_bias", "Qwen3 has q/k/v and output biases together or neither")
    return {
        "attention_bias": config.qkv_bias,
        "use_sliding_window": config.sliding_window is not None,
        "sliding_window": config.sliding_window,
    }


def config_from_hf(hf_config: HFConfig) -> Qwen3Config:
    fields = {**common_fields(hf_config), **attention_fields(hf_config)}
    layer_types = read_layer_types(hf_config, fields["n_layers"])
    if fields["sliding_window"] is None:
        if layer_types is not None and "sliding_attention" in layer_types:
            raise hf_config.error(
                "layer_types",
                "sliding_attention layers need use_sliding_window = true and a sliding_window",
            )
        layer_types = None
    elif layer_types is None:
        first_sliding = hf_config.get("max_window_layers", 28)
        layer_types = tuple(
            "sliding_attention" if layer >= first_sliding else "full_attention"
            for layer in range(fields["n_layers"])
        )
    return Qwen3Config(**fields, layer_types=layer_types)


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    fields = common_hf_fields(config, ARCHITECTURE, fixed=FIXED, free=FREE | {"layer_types"})
    layer_types = config.attention_layer_types
    full_first = next((i for i, kind in enumerate(layer_types) if kind != "full_attention"), None)
    return {
        **fields,
        **attention_to_hf(config),
        "layer_types": list(layer_types),
        "max_window_layers": config.n_layers if full_first is None else full_first,
    }


def tensors(config: DecoderConfig) -> list[Tensor]:
    return llama_like_tensors(config) + mlp_tensors()


FAMILY = Family(
    name="qwen3",
    config_class=Qwen3Config,
    model_class=DecoderLM,
    tiny=dict(head_dim=16),
    hf=llama_like_mapping(
        architecture=ARCHITECTURE,
        model_type="qwen3",
        defaults={"rms_norm_eps": 1e-6, "rope_theta": 10000.0},
        handled_keys=ATTENTION_KEYS | {"layer_types", "max_window_layers"},
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=tensors,
    ),
)
