"""Qwen2-MoE (``Qwen2MoeForCausalLM``): q/k/v biases, top-k routed experts plus a
sigmoid-gated shared expert in every layer."""

import dataclasses
from typing import Any, ClassVar

from eqxzoo.typed_config import refuse
from models.config import DecoderConfig, MoEConfig
from models.decoder import DecoderLM
from models.family import Family, HFConfig, Tensor, llama_like_mapping
from models.hf_fields import MoEKeys, common_fields, common_hf_fields, moe_fields, moe_hf_fields
from models.hf_tensors import linear, llama_like_tensors, routed_experts_tensors


@dataclasses.dataclass(frozen=True)
class QwenMoeConfig(DecoderConfig):
    """Qwen2-MoE: q/k/v biases, top-k experts plus a sigmoid-gated shared expert."""

    family: ClassVar[str] = "qwen_moe"
    qkv_bias: bool = True
    moe: MoEConfig | None = MoEConfig(normalize_topk=False, shared_mlp_dim=1024, shared_gate=True)

    def __post_init__(self):
        super().__post_init__()
        if self.moe is None:
            refuse("moe", "qwen_moe needs a [moe] table")


ARCHITECTURE = "Qwen2MoeForCausalLM"
MOE_KEYS = MoEKeys(("num_experts",), "moe_intermediate_size")


def config_from_hf(hf_config: HFConfig) -> QwenMoeConfig:
    fields = common_fields(hf_config)
    _check_layers(hf_config, fields["n_layers"])
    moe = MoEConfig(
        **moe_fields(hf_config, MOE_KEYS),
        shared_mlp_dim=hf_config.get("shared_expert_intermediate_size"),
        shared_gate=True,
    )
    return QwenMoeConfig(**fields, qkv_bias=bool(hf_config.get("qkv_bias")), moe=moe)


def _check_layers(hf_config: HFConfig, n_layers: int) -> None:
    """Every Qwen2-MoE layer must be a full-attention MoE layer, as every zoo layer is."""
    values = hf_config.values
    if values.get("mlp_only_layers"):
        raise hf_config.error(
            "mlp_only_layers",
            f"{values['mlp_only_layers']}: dense layers between MoE layers are not supported",
        )
    if values.get("decoder_sparse_step", 1) != 1:
        raise hf_config.error(
            "decoder_sparse_step",
            f"{values['decoder_sparse_step']}: only 1 (every layer a MoE) is supported",
        )
    if values.get("use_sliding_window"):
        raise hf_config.error(
            "use_sliding_window", "sliding-window attention is not supported; set it to false"
        )
    layer_types = values.get("layer_types") or ["full_attention"] * n_layers
    if any(layer_type != "full_attention" for layer_type in layer_types):
        raise hf_config.error(
            "layer_types", f"{layer_types}: only 'full_attention' layers are supported"
        )


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    fields = common_hf_fields(config, ARCHITECTURE, free=frozenset({"qkv_bias"}))
    moe = config.moe
    if not (moe.shared_mlp_dim > 0 and moe.shared_gate):
        refuse(
            "moe.shared_mlp_dim",
            f"{ARCHITECTURE} always has a gated shared expert; "
            "set shared_mlp_dim > 0 and shared_gate=True",
        )
    return {
        **fields,
        **moe_hf_fields(moe, MOE_KEYS),
        "shared_expert_intermediate_size": moe.shared_mlp_dim,
        "qkv_bias": config.qkv_bias,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "use_sliding_window": False,
    }


def tensors(config: DecoderConfig) -> list[Tensor]:
    shared = "mlp.shared_expert."
    return (
        llama_like_tensors(config)
        + routed_experts_tensors("mlp.", ("gate_proj", "up_proj", "down_proj"))
        + [
            linear(lambda m: m.blocks.layers.mlp.shared.gate.weight, f"{shared}gate_proj.weight"),
            linear(lambda m: m.blocks.layers.mlp.shared.up.weight, f"{shared}up_proj.weight"),
            linear(lambda m: m.blocks.layers.mlp.shared.down.weight, f"{shared}down_proj.weight"),
            linear(
                lambda m: m.blocks.layers.mlp.shared_gate.weight, "mlp.shared_expert_gate.weight"
            ),
        ]
    )


FAMILY = Family(
    name="qwen_moe",
    config_class=QwenMoeConfig,
    model_class=DecoderLM,
    tiny=dict(
        moe=MoEConfig(n_experts=4, top_k=2, expert_mlp_dim=16, shared_mlp_dim=16, shared_gate=True)
    ),
    hf=llama_like_mapping(
        architecture=ARCHITECTURE,
        model_type="qwen2_moe",
        defaults={
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 1408,
            "shared_expert_intermediate_size": 5632,
            "norm_topk_prob": False,
            "qkv_bias": True,
        },
        handled_keys=MOE_KEYS.handled
        | frozenset(
            {
                "shared_expert_intermediate_size",
                "qkv_bias",
                "mlp_only_layers",
                "decoder_sparse_step",
                "use_sliding_window",
                "layer_types",
            }
        ),
        # The window settings only act with use_sliding_window (refused above); the router's
        # auxiliary loss is the trainer's business ([loss] in the run config).
        ignored_keys=frozenset(
            {"sliding_window", "max_window_layers", "output_router_logits", "router_aux_loss_coef"}
        ),
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=tensors,
    ),
)
