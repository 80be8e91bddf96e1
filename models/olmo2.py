"""OLMo 2 (``Olmo2ForCausalLM``): RMSNorms after each sublayer (before the residual sum) instead
of before it, and QK-norm over all heads at once."""

import dataclasses
from typing import Any, ClassVar

from eqxzoo.typed_config import refuse
from models.config import DecoderConfig, NormPosition, QKNormOver
from models.decoder import DecoderLM
from models.family import Family, HFConfig, Tensor, llama_like_mapping
from models.hf_fields import common_fields, common_hf_fields
from models.hf_tensors import attention_tensors, mlp_tensors, model_tensors, norm_tensors


@dataclasses.dataclass(frozen=True)
class Olmo2Config(DecoderConfig):
    """Dense OLMo 2: post-sublayer norms, QK-norm over all heads."""

    family: ClassVar[str] = "olmo2"
    norm_eps: float = 1e-5
    norm_position: NormPosition = "post"
    qk_norm: bool = True
    qk_norm_over: QKNormOver = "all_heads"

    def __post_init__(self):
        super().__post_init__()
        if self.moe is not None:
            refuse("moe", "olmo2 is dense: use family 'olmoe' for experts")


ARCHITECTURE = "Olmo2ForCausalLM"

FIXED = {"norm_position": "post", "qk_norm": True, "qk_norm_over": "all_heads"}
FREE = frozenset({"rope_scaling", "qkv_bias", "attention_out_bias"})


def attention_bias(hf_config: HFConfig) -> dict[str, bool]:
    """``attention_bias`` (q/k/v and output), as OLMo 2 and OLMoE read it."""
    bias = bool(hf_config.values.get("attention_bias", False))
    return dict(qkv_bias=bias, attention_out_bias=bias)


def attention_bias_to_hf(config: DecoderConfig, architecture: str) -> dict[str, bool]:
    if config.attention_out_bias != config.qkv_bias:
        refuse("attention_out_bias", f"{architecture} has q/k/v and output biases or neither")
    return {"attention_bias": config.qkv_bias}


def config_from_hf(hf_config: HFConfig) -> Olmo2Config:
    return Olmo2Config(**common_fields(hf_config), **attention_bias(hf_config), **FIXED)


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    fields = common_hf_fields(config, ARCHITECTURE, fixed=FIXED, free=FREE)
    return {**fields, **attention_bias_to_hf(config, ARCHITECTURE)}


NORMS = {
    "attention_post_norm": "post_attention_layernorm",
    "mlp_post_norm": "post_feedforward_layernorm",
}


def tensors(config: DecoderConfig) -> list[Tensor]:
    return model_tensors(config) + norm_tensors(NORMS) + attention_tensors(config) + mlp_tensors()


FAMILY = Family(
    name="olmo2",
    config_class=Olmo2Config,
    model_class=DecoderLM,
    hf=llama_like_mapping(
        architecture=ARCHITECTURE,
        model_type="olmo2",
        defaults={"rms_norm_eps": 1e-5, "rope_theta": 10000.0},
        handled_keys=frozenset({"attention_bias"}),
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=tensors,
    ),
)
