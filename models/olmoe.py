"""OLMoE (``OlmoeForCausalLM``): Llama's pre-norm layout with QK-norm over all heads, an
optional clamp of queries, keys and values (``clip_qkv``), and every MLP a top-k MoE of SwiGLU
experts with no shared expert."""

import dataclasses
from typing import Any, ClassVar

from eqxzoo.typed_config import refuse
from models.config import DecoderConfig, MoEConfig, QKNormOver
from models.decoder import DecoderLM
from models.family import Family, HFConfig, Tensor, llama_like_mapping
from models.hf_fields import MoEKeys, common_fields, common_hf_fields, moe_fields, moe_hf_fields
from models.hf_tensors import llama_like_tensors, routed_experts_tensors
from models.olmo2 import attention_bias, attention_bias_to_hf


@dataclasses.dataclass(frozen=True)
class OlmoeConfig(DecoderConfig):
    """OLMoE: QK-norm over all heads, every layer's MLP ``top_k`` of ``n_experts`` experts."""

    family: ClassVar[str] = "olmoe"
    norm_eps: float = 1e-5
    qk_norm: bool = True
    qk_norm_over: QKNormOver = "all_heads"
    moe: MoEConfig | None = MoEConfig(
        n_experts=64, top_k=8, expert_mlp_dim=1024, normalize_topk=False
    )

    def __post_init__(self):
        super().__post_init__()
        if self.moe is None:
            refuse("moe", "olmoe needs a [moe] table (a dense OLMo is family 'olmo2')")
        if self.moe.shared_mlp_dim:
            refuse("moe.shared_mlp_dim", "OLMoE has no shared experts")


ARCHITECTURE = "OlmoeForCausalLM"
# OLMoE's intermediate_size is the experts' width (it has no dense MLP).
MOE_KEYS = MoEKeys(("num_experts",), "intermediate_size")

FIXED = {"qk_norm": True, "qk_norm_over": "all_heads"}
FREE = frozenset({"rope_scaling", "qkv_bias", "attention_out_bias", "clip_qkv"})


def config_from_hf(hf_config: HFConfig) -> OlmoeConfig:
    fields = common_fields(hf_config)
    moe = MoEConfig(**moe_fields(hf_config, MOE_KEYS))
    clip = hf_config.values.get("clip_qkv")
    return OlmoeConfig(
        **fields,
        **attention_bias(hf_config),
        **FIXED,
        clip_qkv=None if clip is None else float(clip),
        moe=moe,
    )


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    fields = common_hf_fields(config, ARCHITECTURE, fixed=FIXED, free=FREE)
    moe = config.moe
    return {
        **fields,
        **attention_bias_to_hf(config, ARCHITECTURE),
        **moe_hf_fields(moe, MOE_KEYS),
        "clip_qkv": config.clip_qkv,
    }


def tensors(config: DecoderConfig) -> list[Tensor]:
    return llama_like_tensors(config) + routed_experts_tensors(
        "mlp.", ("gate_proj", "up_proj", "down_proj")
    )


FAMILY = Family(
    name="olmoe",
    config_class=OlmoeConfig,
    model_class=DecoderLM,
    # Queries and keys are RMS-normed before the clip: a bound of 1 would sit in the bulk of
    # their values, where the clip's derivative (1 inside, 0 outside) turns rounding
    # differences between two equal programs into different gradients (1F1B vs sequential).
    tiny=dict(moe=MoEConfig(n_experts=4, top_k=2, expert_mlp_dim=16), clip_qkv=3.0),
    hf=llama_like_mapping(
        architecture=ARCHITECTURE,
        model_type="olmoe",
        defaults={
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "num_experts_per_tok": 8,
            "num_experts": 64,
            "norm_topk_prob": False,
        },
        handled_keys=MOE_KEYS.handled | frozenset({"attention_bias", "clip_qkv"}),
        # The router's auxiliary loss is the trainer's business ([loss] in the run config).
        ignored_keys=frozenset({"output_router_logits", "router_aux_loss_coef"}),
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=tensors,
    ),
)
