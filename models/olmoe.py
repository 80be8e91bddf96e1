"""OLMoE (``OlmoeForCausalLM``): Llama's pre-norm layout with QK-norm over all heads, an
optional clamp of queries, keys and values (``clip_qkv``), and every MLP a top-k MoE of SwiGLU
experts with no shared expert."""

import dataclasses
from typing import Any, ClassVar

from eqxzoo.typed_config import refuse
from models.config import DecoderConfig, MoEConfig, QKNormOver
from models.decoder import DecoderLM
from models.family import Family, HFConfig, Tensor, llama_like_mapping
from models.hf_fields import common_fields, common_hf_fields
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

FIXED = {"qk_norm": True, "qk_norm_over": "all_heads"}
FREE = frozenset({"rope_scaling", "qkv_bias", "attention_out_bias", "clip_qkv"})


def config_from_hf(hf_config: HFConfig) -> OlmoeConfig:
    fields = common_fields(hf_config)
    moe = MoEConfig(
        n_experts=hf_config.get("num_experts"),
        top_k=hf_config.get("num_experts_per_tok"),
        expert_mlp_dim=fields["mlp_dim"],
        normalize_topk=bool(hf_config.get("norm_topk_prob")),
    )
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
        # OLMoE's intermediate_size is the experts' width (it has no dense MLP).
        "intermediate_size": moe.expert_mlp_dim,
        "num_experts": moe.n_experts,
        "num_experts_per_tok": moe.top_k,
        "norm_topk_prob": moe.normalize_topk,
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
        handled_keys=frozenset(
            {"attention_bias", "clip_qkv", "num_experts", "num_experts_per_tok", "norm_topk_prob"}
        ),
        # The router's auxiliary loss is the trainer's business ([loss] in the run config).
        ignored_keys=frozenset({"output_router_logits", "router_aux_loss_coef"}),
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=tensors,
    ),
)
