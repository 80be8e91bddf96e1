"""Llama (``LlamaForCausalLM``): RMSNorm, RoPE, GQA, SwiGLU, optional tied embeddings and
attention biases."""

import dataclasses
from typing import Any, ClassVar

from eqxzoo.typed_config import refuse
from models.config import DecoderConfig
from models.decoder import DecoderLM
from models.family import (
    Family,
    HFConfig,
    Tensor,
    common_fields,
    common_hf_fields,
    layer_prefix,
    linear,
    llama_like_mapping,
    llama_like_tensors,
)


@dataclasses.dataclass(frozen=True)
class LlamaConfig(DecoderConfig):
    """Dense Llama: RMSNorm, RoPE, GQA, SwiGLU, optional tied embeddings."""

    family: ClassVar[str] = "llama"

    def __post_init__(self):
        super().__post_init__()
        if self.moe is not None:
            refuse("moe", "llama is dense: use family 'mixtral' or 'qwen_moe' for experts")


ARCHITECTURE = "LlamaForCausalLM"


def config_from_hf(hf_config: HFConfig) -> LlamaConfig:
    return LlamaConfig(
        **common_fields(hf_config), qkv_bias=bool(hf_config.values.get("attention_bias", False))
    )


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    return {
        **common_hf_fields(config, ARCHITECTURE),
        "attention_bias": config.qkv_bias,
        "mlp_bias": False,
    }


def tensors(config: DecoderConfig) -> list[Tensor]:
    return llama_like_tensors(config) + [
        linear(lambda m: m.blocks.layers.mlp.gate.weight, "mlp.gate_proj.weight"),
        linear(lambda m: m.blocks.layers.mlp.up.weight, "mlp.up_proj.weight"),
        linear(lambda m: m.blocks.layers.mlp.down.weight, "mlp.down_proj.weight"),
    ]


def zero_output_biases(config: DecoderConfig) -> list[str]:
    """Llama's ``attention_bias`` gives ``o_proj`` a bias too; the zoo has none, i.e. zeros."""
    if not config.qkv_bias:
        return []
    return [layer_prefix(layer) + "self_attn.o_proj.bias" for layer in range(config.n_layers)]


FAMILY = Family(
    name="llama",
    config_class=LlamaConfig,
    model_class=DecoderLM,
    hf=llama_like_mapping(
        architecture=ARCHITECTURE,
        model_type="llama",
        defaults={"rms_norm_eps": 1e-6, "rope_theta": 10000.0},
        handled_keys=frozenset({"attention_bias"}),
        # pretraining_tp splits the same matmuls into slices: the same function.
        ignored_keys=frozenset({"pretraining_tp"}),
        pinned_keys={"mlp_bias": False},
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=tensors,
        zero_tensors=zero_output_biases,
    ),
)
