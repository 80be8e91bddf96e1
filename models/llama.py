"""Llama 2 and 3.x (``LlamaForCausalLM``): RMSNorm, RoPE (with Llama 3's ``llama3`` scaling,
``linear`` or ``dynamic``), GQA, SwiGLU, a ``head_dim`` free of ``d_model / n_heads``,
optional tied embeddings and attention biases."""

import dataclasses
from typing import Any, ClassVar

from eqxzoo.typed_config import refuse
from models.config import DecoderConfig
from models.decoder import DecoderLM
from models.family import Family, HFConfig, Tensor, llama_like_mapping
from models.hf_fields import common_fields, common_hf_fields
from models.hf_tensors import llama_like_tensors, mlp_tensors


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
    bias = bool(hf_config.values.get("attention_bias", False))
    return LlamaConfig(**common_fields(hf_config), qkv_bias=bias, attention_out_bias=bias)


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    fields = common_hf_fields(
        config, ARCHITECTURE, free=frozenset({"rope_scaling", "qkv_bias", "attention_out_bias"})
    )
    if config.attention_out_bias and not config.qkv_bias:
        refuse(
            "attention_out_bias",
            f"{ARCHITECTURE} has an output bias only with q/k/v biases; set qkv_bias=True",
        )
    return {**fields, "attention_bias": config.qkv_bias, "mlp_bias": False}


def tensors(config: DecoderConfig) -> list[Tensor]:
    return llama_like_tensors(config) + mlp_tensors()


def zero_output_biases(config: DecoderConfig) -> list[str]:
    """Llama's ``attention_bias`` gives ``o_proj`` a bias too: a zoo config with q/k/v biases
    and none on the output is saved with zeros there."""
    if not config.qkv_bias or config.attention_out_bias:
        return []
    return [f"model.layers.{layer}.self_attn.o_proj.bias" for layer in range(config.n_layers)]


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
