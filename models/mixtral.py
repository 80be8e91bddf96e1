"""Mixtral (``MixtralForCausalLM``): Llama with every MLP a top-k MoE of SwiGLU experts
(renormalised top-k weights), no shared experts, no attention biases, optionally a sliding
window in every layer."""

import dataclasses
from typing import Any, ClassVar

from eqxzoo.typed_config import refuse
from models.config import DecoderConfig, MoEConfig
from models.decoder import DecoderLM
from models.family import Family, HFConfig, Tensor, llama_like_mapping
from models.hf_fields import MoEKeys, common_fields, common_hf_fields, moe_fields, moe_hf_fields
from models.hf_tensors import llama_like_tensors, routed_experts_tensors


@dataclasses.dataclass(frozen=True)
class MixtralConfig(DecoderConfig):
    """Mixtral: Llama with every MLP a top-k MoE of SwiGLU experts, no shared experts."""

    family: ClassVar[str] = "mixtral"
    moe: MoEConfig | None = MoEConfig()

    def __post_init__(self):
        super().__post_init__()
        if self.moe is None:
            refuse("moe", "mixtral needs a [moe] table")
        if self.moe.shared_mlp_dim:
            refuse("moe.shared_mlp_dim", "mixtral has no shared experts: use family 'qwen_moe'")


ARCHITECTURE = "MixtralForCausalLM"
MOE_KEYS = MoEKeys(("num_local_experts",), "intermediate_size", normalize_topk=None)


def config_from_hf(hf_config: HFConfig) -> MixtralConfig:
    moe = MoEConfig(**moe_fields(hf_config, MOE_KEYS), normalize_topk=True)
    return MixtralConfig(
        **common_fields(hf_config),
        sliding_window=hf_config.values.get("sliding_window"),
        moe=moe,
    )


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    fields = common_hf_fields(config, ARCHITECTURE, free=frozenset({"sliding_window"}))
    moe = config.moe
    if not moe.normalize_topk:
        refuse("moe.normalize_topk", f"{ARCHITECTURE} always renormalises; set it to True")
    return {
        **fields,
        **moe_hf_fields(moe, MOE_KEYS),
        "sliding_window": config.sliding_window,
    }


def tensors(config: DecoderConfig) -> list[Tensor]:
    return llama_like_tensors(config) + routed_experts_tensors(
        "block_sparse_moe.", ("w1", "w3", "w2")
    )


FAMILY = Family(
    name="mixtral",
    config_class=MixtralConfig,
    model_class=DecoderLM,
    tiny=dict(moe=MoEConfig(n_experts=4, top_k=2, expert_mlp_dim=16)),
    hf=llama_like_mapping(
        architecture=ARCHITECTURE,
        model_type="mixtral",
        defaults={"rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_experts_per_tok": 2},
        handled_keys=MOE_KEYS.handled | {"sliding_window"},
        # The router's auxiliary loss is the trainer's business ([loss] in the run config).
        ignored_keys=frozenset({"output_router_logits", "router_aux_loss_coef"}),
        pinned_keys={"router_jitter_noise": 0.0},
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=tensors,
        # transformers 5 names Mixtral's block_sparse_moe "mlp" in memory (fused layout).
        renames=((".mlp.", ".block_sparse_moe."),),
    ),
)
