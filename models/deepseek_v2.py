"""DeepSeek-V2 (``DeepseekV2ForCausalLM``, V2-Lite included): DeepSeek-V3's layout (latent
attention, dense first layers as the prefix, MoE layers with shared experts) with
softmax-scored experts, chosen greedily or within the best groups (``topk_method``), never
renormalised, and no balancing bias. V2 always stores the rotary columns interleaved."""

import dataclasses
from typing import Any, ClassVar

from eqxzoo.typed_config import refuse
from models.config import DecoderConfig, LatentAttentionConfig, MoEConfig
from models.decoder import DecoderLM
from models.deepseek_v3 import (
    DEEPSEEK_IGNORED,
    DEEPSEEK_PINNED,
    LATENT_KEYS,
    LATENT_MOE_KEYS,
    TINY_LATENT,
    TINY_MOE,
    deepseek_tensors,
    latent_fields,
    latent_to_hf,
)
from models.family import Family, HFConfig, Tensor, llama_like_mapping
from models.hf_fields import moe_fields

ARCHITECTURE = "DeepseekV2ForCausalLM"

TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclasses.dataclass(frozen=True)
class DeepseekV2Config(DecoderConfig):
    """DeepSeek-V2: latent attention, dense first layers, then softmax-routed MoE layers
    with shared experts (V2-Lite: no query compression)."""

    family: ClassVar[str] = "deepseek_v2"
    moe: MoEConfig | None = MoEConfig(
        n_experts=16, top_k=4, expert_mlp_dim=256, shared_mlp_dim=512, normalize_topk=False
    )
    first_dense_layers: int = 1
    latent_attention: LatentAttentionConfig | None = LatentAttentionConfig(
        kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64
    )

    def __post_init__(self):
        super().__post_init__()
        if self.latent_attention is None:
            refuse("latent_attention", "DeepSeek-V2 attends with a [latent_attention] table")
        if self.moe is None:
            refuse("moe", "DeepSeek-V2 needs a [moe] table")
        if self.moe.scoring != "softmax" or self.moe.selection_bias or self.moe.normalize_topk:
            refuse(
                "moe.scoring",
                "DeepSeek-V2 routes by softmax scores, without a balancing bias or "
                "renormalisation: set scoring = 'softmax', selection_bias = false and "
                "normalize_topk = false",
            )


def config_from_hf(hf_config: HFConfig) -> DeepseekV2Config:
    fields = latent_fields(hf_config)
    method = hf_config.get("topk_method", "greedy")
    if method not in TOPK_METHODS:
        raise hf_config.error(
            "topk_method", f"{method!r} is not supported; supported: {', '.join(TOPK_METHODS)}"
        )
    grouped = method == "group_limited_greedy"
    moe_config = moe_fields(hf_config, LATENT_MOE_KEYS)
    moe = MoEConfig(
        **moe_config,
        shared_mlp_dim=hf_config.get("n_shared_experts") * moe_config["expert_mlp_dim"],
        normalize_topk=False,
        n_groups=hf_config.get("n_group") if grouped else 1,
        topk_groups=hf_config.get("topk_group") if grouped else 1,
        routed_scaling=float(hf_config.get("routed_scaling_factor")),
    )
    return DeepseekV2Config(**fields, moe=moe)


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    fields = latent_to_hf(config, ARCHITECTURE)
    moe = config.moe
    if moe.normalize_topk:
        refuse("moe.normalize_topk", f"{ARCHITECTURE} never renormalises; set False")
    grouped = moe.n_groups > 1
    return {
        **fields,
        "topk_method": "group_limited_greedy" if grouped else "greedy",
        "n_group": moe.n_groups if grouped else None,
        "topk_group": moe.topk_groups if grouped else None,
        "norm_topk_prob": False,
    }


def tensors(config: DecoderConfig) -> list[Tensor]:
    return deepseek_tensors(config, interleaved=True, selection_bias=False)


FAMILY = Family(
    name="deepseek_v2",
    config_class=DeepseekV2Config,
    model_class=DecoderLM,
    # V3's shape with softmax routing (no balancing bias, no renormalisation, its own routed
    # scale) and no low-rank query.
    tiny=dict(
        first_dense_layers=1,
        n_kv_heads=None,
        moe=dataclasses.replace(
            TINY_MOE,
            scoring="softmax",
            selection_bias=False,
            normalize_topk=False,
            routed_scaling=1.5,
        ),
        latent_attention=dataclasses.replace(TINY_LATENT, q_lora_rank=None),
    ),
    hf=llama_like_mapping(
        architecture=ARCHITECTURE,
        model_type="deepseek_v2",
        defaults={
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "n_shared_experts": 2,
            "routed_scaling_factor": 1.0,
            "first_k_dense_replace": 0,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "moe_intermediate_size": 1407,
        },
        handled_keys=LATENT_KEYS | {"topk_method"},
        # transformers' V2 router never renormalises, whatever norm_topk_prob says.
        ignored_keys=DEEPSEEK_IGNORED | {"norm_topk_prob"},
        pinned_keys={**DEEPSEEK_PINNED, "mlp_bias": False, "scoring_func": "softmax"},
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=tensors,
    ),
)
