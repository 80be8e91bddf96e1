"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (QK-norm per head) with every MLP a
top-k MoE of many SwiGLU experts, optionally renormalised, and no shared expert."""

import dataclasses
from typing import Any, ClassVar

from eqxzoo.typed_config import refuse
from models.config import DecoderConfig, MoEConfig
from models.decoder import DecoderLM
from models.family import Family, HFConfig, Tensor, llama_like_mapping
from models.hf_fields import MoEKeys, common_fields, common_hf_fields, moe_fields, moe_hf_fields
from models.hf_tensors import llama_like_tensors, routed_experts_tensors
from models.qwen3 import ATTENTION_KEYS, FIXED, FREE, attention_fields, attention_to_hf


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(DecoderConfig):
    """Qwen3-MoE: Qwen3's attention, every layer's MLP ``top_k`` of ``n_experts`` experts."""

    family: ClassVar[str] = "qwen3_moe"
    norm_eps: float = 1e-6
    rope_theta: float = 1e6
    qk_norm: bool = True
    moe: MoEConfig | None = MoEConfig(n_experts=128, top_k=8, expert_mlp_dim=768)

    def __post_init__(self):
        super().__post_init__()
        if self.moe is None:
            refuse("moe", "qwen3_moe needs a [moe] table (a dense Qwen3 is family 'qwen3')")
        if self.moe.shared_mlp_dim:
            refuse("moe.shared_mlp_dim", "Qwen3-MoE has no shared experts")


ARCHITECTURE = "Qwen3MoeForCausalLM"
# transformers reads num_experts, or num_local_experts when it is absent.
MOE_KEYS = MoEKeys(("num_experts", "num_local_experts"), "moe_intermediate_size")


def _check_every_layer_is_moe(hf_config: HFConfig, n_layers: int, n_experts: int) -> None:
    """Qwen3-MoE makes layer ``i`` dense when it is in ``mlp_only_layers`` or
    ``(i + 1) % decoder_sparse_step != 0``; the zoo's blocks are one stack of equal layers,
    so every layer must be a MoE layer."""
    values = hf_config.values
    dense_layers = set(values.get("mlp_only_layers") or [])
    step = values.get("decoder_sparse_step", 1)
    if step < 1:
        raise hf_config.error("decoder_sparse_step", f"must be >= 1, got {step}")
    dense_layers |= {layer for layer in range(n_layers) if (layer + 1) % step != 0}
    if n_experts < 1:
        raise hf_config.error("num_experts", "0: a Qwen3-MoE without experts; load it as Qwen3")
    if dense_layers:
        key = "mlp_only_layers" if values.get("mlp_only_layers") else "decoder_sparse_step"
        raise hf_config.error(
            key,
            f"{values.get(key)!r} makes layers {sorted(dense_layers)} dense: the zoo stacks "
            "equal layers, so every Qwen3-MoE layer must be a MoE layer",
        )


def config_from_hf(hf_config: HFConfig) -> Qwen3MoeConfig:
    fields = {**common_fields(hf_config), **attention_fields(hf_config)}
    moe_config = moe_fields(hf_config, MOE_KEYS)
    _check_every_layer_is_moe(hf_config, fields["n_layers"], moe_config["n_experts"])
    moe = MoEConfig(**moe_config)
    return Qwen3MoeConfig(**fields, moe=moe)


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    fields = common_hf_fields(config, ARCHITECTURE, fixed=FIXED, free=FREE)
    moe = config.moe
    return {
        **fields,
        **attention_to_hf(config),
        **moe_hf_fields(moe, MOE_KEYS),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def tensors(config: DecoderConfig) -> list[Tensor]:
    return llama_like_tensors(config) + routed_experts_tensors(
        "mlp.", ("gate_proj", "up_proj", "down_proj")
    )


FAMILY = Family(
    name="qwen3_moe",
    config_class=Qwen3MoeConfig,
    model_class=DecoderLM,
    tiny=dict(
        head_dim=16,
        moe=MoEConfig(n_experts=6, top_k=2, expert_mlp_dim=16, normalize_topk=True),
    ),
    hf=llama_like_mapping(
        architecture=ARCHITECTURE,
        model_type="qwen3_moe",
        defaults={
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 768,
            "norm_topk_prob": False,
        },
        handled_keys=ATTENTION_KEYS
        | MOE_KEYS.handled
        | {
            "decoder_sparse_step",
            "mlp_only_layers",
        },
        # max_window_layers is not read by transformers' Qwen3-MoE (its window, when on, is
        # in every layer); the router's auxiliary loss is the trainer's business ([loss]).
        ignored_keys=frozenset(
            {"max_window_layers", "output_router_logits", "router_aux_loss_coef"}
        ),
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=tensors,
    ),
)
