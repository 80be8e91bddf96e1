"""GPT-OSS (``GptOssForCausalLM``): sliding-window and full layers alternating, attention with
q/k/v/output biases and a learned sink logit per head, every MLP a MoE whose router takes a
softmax over its top-k biased logits and whose experts have biases and a clamped SwiGLU.

Hugging Face stores each layer's experts as ``gate_up_proj (experts, embed, 2 * mlp)`` with the
gate and up projections interleaved (``[..., 0::2]`` the gate), and ``down_proj (experts, mlp,
embed)``, both input-major; the zoo keeps gate and up apart. MXFP4-quantised checkpoints (the
released ones) are refused: dequantise them first.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax.numpy as jnp

from eqxzoo.typed_config import refuse
from models.config import DecoderConfig, MoEConfig
from models.decoder import DecoderLM
from models.family import Family, HFConfig, LayerTensors, Tensor, llama_like_mapping
from models.hf_fields import (
    MoEKeys,
    common_fields,
    common_hf_fields,
    moe_fields,
    moe_hf_fields,
    read_layer_types,
)
from models.hf_tensors import copied, linear, llama_like_tensors
from models.tensor_files import Sliceable

# What GPT-OSS's router and experts are, beyond their sizes and the clamp's constants.
GPT_OSS_MOE: Mapping[str, Any] = {
    "scoring": "softmax_topk",
    "router_bias": True,
    "expert_bias": True,
    "expert_activation": "clamped_swiglu",
    "n_groups": 1,
    "topk_groups": 1,
    "routed_scaling": 1.0,
    "selection_bias": False,
}


@dataclasses.dataclass(frozen=True)
class GptOssConfig(DecoderConfig):
    """GPT-OSS: every second layer full attention, the others a ``sliding_window``; attention
    sinks; ``top_k`` of ``n_experts`` biased, clamped-SwiGLU experts chosen by a softmax over
    the top-k biased router logits (`GPT_OSS_MOE`, which a ``[model.moe]`` table must
    repeat). ``moe.normalize_topk`` changes nothing: those weights already sum to one. A
    model without sliding layers says so in ``layer_types``; ``sliding_window`` stays set.

    Defaults: Hugging Face's for what the layers compute (norm epsilon, rotary base, window,
    biases, sinks, experts), except rotary scaling (Hugging Face's default is YaRN, which the
    zoo does not model yet); the builder's for the other shapes. (A field left at None
    means its `DecoderConfig` default in a saved run config, so none here defaults to
    anything else.)
    """

    family: ClassVar[str] = "gpt_oss"
    global_layer_every: ClassVar[int | None] = 2
    norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    sliding_window: int | None = 128
    qkv_bias: bool = True
    attention_out_bias: bool = True
    attention_sinks: bool = True
    moe: MoEConfig | None = MoEConfig(
        n_experts=128, top_k=4, expert_mlp_dim=2880, normalize_topk=False, **GPT_OSS_MOE
    )

    def __post_init__(self):
        super().__post_init__()
        if self.sliding_window is None:
            refuse(
                "sliding_window",
                "GPT-OSS keeps a window: to have no sliding layers, make every layer "
                "'full_attention' in layer_types",
            )
        if self.moe is None:
            refuse("moe", "gpt_oss needs a [moe] table")
        if self.moe.shared_mlp_dim:
            refuse("moe.shared_mlp_dim", "GPT-OSS has no shared experts")
        for name, value in GPT_OSS_MOE.items():
            if getattr(self.moe, name) != value:
                refuse(
                    f"moe.{name}",
                    f"GPT-OSS's router and experts need {value!r}, got {getattr(self.moe, name)!r}",
                )


ARCHITECTURE = "GptOssForCausalLM"
MOE_KEYS = MoEKeys(("num_local_experts",), "intermediate_size", normalize_topk=None)

# Hugging Face's rotary settings when config.json has none.
HF_DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
FIXED = {"attention_sinks": True}
FREE = frozenset(
    {
        "qkv_bias",
        "attention_out_bias",
        "sliding_window",
        "layer_types",
        "rope_scaling",
        "moe.expert_bias",
        "moe.expert_activation",
        "moe.scoring",
        "moe.router_bias",
    }
)


def _refuse_quantization(hf_config: HFConfig) -> None:
    """Quantised checkpoints (the released GPT-OSS ones are MXFP4) hold no float experts."""
    quantization = hf_config.values.get("quantization_config")
    if quantization is None:
        return
    method = quantization.get("quant_method") if isinstance(quantization, Mapping) else None
    if method == "mxfp4":
        raise hf_config.error(
            "quantization_config",
            "MXFP4 checkpoints are not supported: dequantise first (transformers: "
            "Mxfp4Config(dequantize=True), then save_pretrained)",
        )
    raise hf_config.error(
        "quantization_config",
        f"{quantization!r}: quantised checkpoints are not supported; dequantise first",
    )


def config_from_hf(hf_config: HFConfig) -> GptOssConfig:
    _refuse_quantization(hf_config)
    values = hf_config.values
    if not values.get("rope_parameters") and not values.get("rope_scaling"):
        values = {**values, "rope_parameters": HF_DEFAULT_ROPE}
        hf_config = HFConfig(values, hf_config.defaults, hf_config.where)
    fields = common_fields(hf_config)
    window = values.get("sliding_window", hf_config.defaults["sliding_window"])
    if window is None:
        raise hf_config.error(
            "sliding_window",
            "null is not supported: GPT-OSS's sliding layers need a window (transformers' "
            "cache fails without one)",
        )
    layer_types = read_layer_types(hf_config, fields["n_layers"])
    bias = bool(hf_config.get("attention_bias"))
    moe = MoEConfig(
        **moe_fields(hf_config, MOE_KEYS),
        normalize_topk=False,
        swiglu_alpha=float(hf_config.get("swiglu_alpha")),
        swiglu_limit=float(hf_config.get("swiglu_limit")),
        **GPT_OSS_MOE,
    )
    return GptOssConfig(
        **fields,
        sliding_window=window,
        layer_types=layer_types,
        qkv_bias=bias,
        attention_out_bias=bias,
        attention_sinks=True,
        moe=moe,
    )


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    fields = common_hf_fields(config, ARCHITECTURE, fixed=FIXED, free=FREE)
    if config.attention_out_bias != config.qkv_bias:
        refuse("attention_out_bias", f"{ARCHITECTURE} has q/k/v and output biases or neither")
    moe = config.moe
    return {
        **fields,
        "attention_bias": config.qkv_bias,
        "sliding_window": config.sliding_window,
        "layer_types": list(config.attention_layer_types),
        **moe_hf_fields(moe, MOE_KEYS),
        "swiglu_alpha": moe.swiglu_alpha,
        "swiglu_limit": moe.swiglu_limit,
    }


def interleaved(where: Callable, name: str) -> Tensor:
    """A pair ``(gate, up)`` of ``(..., mlp)`` arrays <-> one ``(..., 2 * mlp)`` tensor holding
    them alternately: ``[..., 0::2]`` the gate, ``[..., 1::2]`` up."""

    def to_hf(pair) -> dict[str, Any]:
        gate, up = pair
        return {name: jnp.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], -1)}

    def from_hf(read: LayerTensors, shapes) -> tuple[Sliceable, Sliceable]:
        gate_shape, _ = shapes
        stored = read(name, (*gate_shape[:-1], 2 * gate_shape[-1]))
        return stored.strided(-1, 0, 2), stored.strided(-1, 1, 2)

    return Tensor(where, True, to_hf, from_hf)


def tensors(config: DecoderConfig) -> list[Tensor]:
    def attention(m):
        return m.blocks.layers.attention

    def router(m):
        return m.blocks.layers.mlp.router

    def experts(m):
        return m.blocks.layers.mlp.experts

    return llama_like_tensors(config) + [
        copied(lambda m: attention(m).sinks, "self_attn.sinks"),
        linear(lambda m: router(m).weight, "mlp.router.weight"),
        copied(lambda m: router(m).bias, "mlp.router.bias"),
        interleaved(lambda m: (experts(m).gate, experts(m).up), "mlp.experts.gate_up_proj"),
        interleaved(
            lambda m: (experts(m).gate_bias, experts(m).up_bias), "mlp.experts.gate_up_proj_bias"
        ),
        copied(lambda m: experts(m).down, "mlp.experts.down_proj"),
        copied(lambda m: experts(m).down_bias, "mlp.experts.down_proj_bias"),
    ]


FAMILY = Family(
    name="gpt_oss",
    config_class=GptOssConfig,
    model_class=DecoderLM,
    tiny=dict(
        sliding_window=3,
        moe=dataclasses.replace(GptOssConfig().moe, n_experts=4, top_k=2, expert_mlp_dim=16),
    ),
    hf=llama_like_mapping(
        architecture=ARCHITECTURE,
        model_type="gpt_oss",
        defaults={
            "rms_norm_eps": 1e-5,
            "rope_theta": 150000.0,
            "sliding_window": 128,
            "attention_bias": True,
            "num_local_experts": 128,
            "num_experts_per_tok": 4,
            "swiglu_alpha": 1.702,
            "swiglu_limit": 7.0,
        },
        handled_keys=MOE_KEYS.handled
        | frozenset(
            {
                "attention_bias",
                "sliding_window",
                "layer_types",
                "swiglu_alpha",
                "swiglu_limit",
                "quantization_config",
            }
        ),
        # The router's auxiliary loss is the trainer's business ([loss] in the run config);
        # OpenAI's released config.json also has experts_per_token and initial_context_length,
        # which transformers does not read.
        ignored_keys=frozenset(
            {
                "output_router_logits",
                "router_aux_loss_coef",
                "experts_per_token",
                "initial_context_length",
            }
        ),
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=tensors,
    ),
)
