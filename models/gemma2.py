"""Gemma 2 (``Gemma2ForCausalLM``): sliding-window and global layers alternating, attention and
final logit soft-capping, RMSNorms before and after each sublayer scaled by ``1 + weight``,
embeddings scaled by ``sqrt(d_model)``, GeGLU, scores scaled by ``query_pre_attn_scalar``."""

import dataclasses
from typing import Any, ClassVar

from eqxzoo.nn import Activation
from eqxzoo.typed_config import refuse
from models.config import DecoderConfig, NormKind, NormPosition
from models.decoder import DecoderLM
from models.family import Family, HFConfig, Tensor, llama_like_mapping
from models.hf_fields import common_fields, common_hf_fields, read_layer_types
from models.hf_tensors import attention_tensors, mlp_tensors, model_tensors, norm_tensors


@dataclasses.dataclass(frozen=True)
class Gemma2Config(DecoderConfig):
    """Gemma 2: every second layer global, the others a ``sliding_window``; soft-capped."""

    family: ClassVar[str] = "gemma2"
    global_layer_every: ClassVar[int | None] = 2
    activation: Activation = "geglu"
    norm: NormKind = "rms_plus_one"
    norm_position: NormPosition = "both"
    scale_embeddings: bool = True
    tie_embeddings: bool = True
    sliding_window: int | None = 4096
    attention_softcap: float | None = 50.0
    final_softcap: float | None = 30.0

    def __post_init__(self):
        super().__post_init__()
        if self.moe is not None:
            refuse("moe", f"{self.family} is dense")


ARCHITECTURE = "Gemma2ForCausalLM"

# Gemma's norms: before and after each sublayer.
GEMMA_NORMS = {
    "attention_norm": "input_layernorm",
    "attention_post_norm": "post_attention_layernorm",
    "mlp_norm": "pre_feedforward_layernorm",
    "mlp_post_norm": "post_feedforward_layernorm",
}
# Fixed by Gemma 2 and 3.
GEMMA_FIXED = {
    "norm": "rms_plus_one",
    "norm_position": "both",
    "scale_embeddings": True,
}
# Free in both.
GEMMA_FREE = frozenset(
    {
        "qkv_bias",
        "attention_out_bias",
        "sliding_window",
        "layer_types",
        "attention_scale_dim",
        "attention_softcap",
        "final_softcap",
        "rope_scaling",
    }
)
# Read by `gemma_fields` (both families).
GEMMA_KEYS = frozenset(
    {
        "hidden_activation",
        "attention_bias",
        "sliding_window",
        "layer_types",
        "query_pre_attn_scalar",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "use_bidirectional_attention",
    }
)


def gemma_fields(hf_config: HFConfig, *, local_rope: bool = False) -> dict[str, Any]:
    """The `DecoderConfig` fields of a Gemma 2 or 3 ``config.json``."""
    values = hf_config.values
    if values.get("use_bidirectional_attention"):
        raise hf_config.error(
            "use_bidirectional_attention", "True: only causal attention is supported"
        )
    fields = common_fields(hf_config, activation_key="hidden_activation", local_rope=local_rope)
    head_dim = fields["head_dim"] or fields["d_model"] // fields["n_heads"]
    scale_dim = hf_config.get("query_pre_attn_scalar")
    bias = bool(values.get("attention_bias", False))
    return dict(
        **fields,
        **GEMMA_FIXED,
        qkv_bias=bias,
        attention_out_bias=bias,
        sliding_window=values.get("sliding_window"),
        layer_types=read_layer_types(hf_config, fields["n_layers"]),
        attention_scale_dim=None if scale_dim == head_dim else int(scale_dim),
        attention_softcap=values.get("attn_logit_softcapping"),
        final_softcap=values.get("final_logit_softcapping"),
    )


def gemma_to_hf(config: DecoderConfig, architecture: str, **family: Any) -> dict[str, Any]:
    """The ``config.json`` fields `gemma_fields` reads (``family``: fixed and free fields of
    the architecture beyond Gemma's)."""
    fixed = {**GEMMA_FIXED, **family.get("fixed", {})}
    free = (GEMMA_FREE | family.get("free", frozenset())) - set(fixed)
    fields = common_hf_fields(
        config, architecture, fixed=fixed, free=free, activation_key="hidden_activation"
    )
    if config.attention_out_bias != config.qkv_bias:
        refuse("attention_out_bias", "Gemma has q/k/v and output biases together or neither")
    scale_dim = config.attention_scale_dim or config.attention_head_dim
    return {
        **fields,
        "attention_bias": config.qkv_bias,
        "sliding_window": config.sliding_window,
        "layer_types": list(config.attention_layer_types),
        "query_pre_attn_scalar": scale_dim,
        "attn_logit_softcapping": config.attention_softcap,
        "final_logit_softcapping": config.final_softcap,
    }


def gemma_tensors(config: DecoderConfig) -> list[Tensor]:
    return (
        model_tensors(config)
        + norm_tensors(GEMMA_NORMS)
        + attention_tensors(config)
        + mlp_tensors()
    )


def config_from_hf(hf_config: HFConfig) -> Gemma2Config:
    return Gemma2Config(**gemma_fields(hf_config))


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    return gemma_to_hf(config, ARCHITECTURE)


FAMILY = Family(
    name="gemma2",
    config_class=Gemma2Config,
    model_class=DecoderLM,
    tiny=dict(sliding_window=3, attention_softcap=2.0, final_softcap=3.0),
    hf=llama_like_mapping(
        architecture=ARCHITECTURE,
        model_type="gemma2",
        defaults={
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": 256,
        },
        handled_keys=GEMMA_KEYS,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=gemma_tensors,
    ),
)
