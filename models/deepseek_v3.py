"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): multi-head latent attention in every layer, the
first ``first_k_dense_replace`` layers dense (the model's prefix), the rest a MoE of sigmoid-
scored experts chosen within the best groups, with shared experts and the auxiliary-loss-free
balancing bias.

DeepSeek's checkpoints rotate interleaved pairs of the rotary features (``rope_interleave``,
the default); the zoo rotates halves, so reading permutes those output columns of the query
and latent projections and writing permutes them back (`eqxzoo.nn.mla`). The MLA tensor
table is shared with DeepSeek-V2 (`mla_tensors`).
"""

import dataclasses
from typing import Any, ClassVar

from eqxzoo.nn import deinterleave_rope_columns, interleave_rope_columns
from eqxzoo.typed_config import architecture_field, refuse
from models.config import DecoderConfig, LatentAttentionConfig, MoEConfig
from models.decoder import DecoderLM
from models.family import Family, HFConfig, Tensor, llama_like_mapping
from models.hf_fields import MoEKeys, common_fields, common_hf_fields, moe_fields, moe_hf_fields
from models.hf_tensors import (
    LLAMA_NORMS,
    copied,
    experts,
    heads_in,
    heads_out,
    linear,
    mlp_tensors,
    model_tensors,
    norm_tensors,
    on_prefix,
)

ARCHITECTURE = "DeepseekV3ForCausalLM"
# The MoE keys of both DeepSeek configs (V2's router never renormalises), and V3's.
LATENT_MOE_KEYS = MoEKeys(("n_routed_experts",), "moe_intermediate_size", normalize_topk=None)
MOE_KEYS = dataclasses.replace(LATENT_MOE_KEYS, normalize_topk="norm_topk_prob")

# DecoderConfig (and MoEConfig) fields a DeepSeek config.json states beyond the common ones;
# the family configs fix the router's scoring and balancing bias.
FREE = frozenset(
    {
        "rope_scaling",
        "first_dense_layers",
        "latent_attention",
        "moe.scoring",
        "moe.selection_bias",
        "moe.n_groups",
        "moe.topk_groups",
        "moe.routed_scaling",
    }
)


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config(DecoderConfig):
    """DeepSeek-V3: latent attention, dense first layers, then sigmoid-routed MoE layers with
    group-limited choice, shared experts and the balancing bias. ``rope_interleave`` only
    says how a checkpoint stores the rotary columns (the model computes the same either
    way)."""

    family: ClassVar[str] = "deepseek_v3"
    moe: MoEConfig | None = MoEConfig(
        n_experts=16,
        top_k=4,
        expert_mlp_dim=256,
        shared_mlp_dim=256,
        scoring="sigmoid",
        n_groups=4,
        topk_groups=2,
        routed_scaling=2.5,
        selection_bias=True,
    )
    first_dense_layers: int = 1
    latent_attention: LatentAttentionConfig | None = LatentAttentionConfig(
        q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64
    )
    rope_interleave: bool = architecture_field(True)

    def __post_init__(self):
        super().__post_init__()
        if self.latent_attention is None:
            refuse("latent_attention", "DeepSeek-V3 attends with a [latent_attention] table")
        if self.moe is None:
            refuse("moe", "DeepSeek-V3 needs a [moe] table")
        if self.moe.scoring != "sigmoid" or not self.moe.selection_bias:
            refuse(
                "moe.scoring",
                "DeepSeek-V3 routes by sigmoid scores with a balancing bias: set "
                "scoring = 'sigmoid' and selection_bias = true",
            )


def latent_fields(hf_config: HFConfig) -> dict[str, Any]:
    """The shape fields of a DeepSeek ``config.json`` read with `common_fields`, for latent
    attention: its ``head_dim`` and ``num_key_value_heads`` describe the rotary key and
    every head, so they are not the zoo's ``head_dim`` / ``n_kv_heads``."""
    fields = common_fields(hf_config)
    fields.update(head_dim=None, n_kv_heads=None)
    fields["latent_attention"] = LatentAttentionConfig(
        q_lora_rank=hf_config.values.get("q_lora_rank"),
        kv_lora_rank=hf_config.get("kv_lora_rank"),
        qk_nope_head_dim=hf_config.get("qk_nope_head_dim"),
        qk_rope_head_dim=hf_config.get("qk_rope_head_dim"),
        v_head_dim=hf_config.get("v_head_dim"),
        bias=bool(hf_config.get("attention_bias", False)),
    )
    fields["first_dense_layers"] = hf_config.get("first_k_dense_replace", 0)
    return fields


def latent_to_hf(config: DecoderConfig, architecture: str) -> dict[str, Any]:
    """The ``config.json`` fields of `latent_fields`, after `common_hf_fields`."""
    fields = common_hf_fields(config, architecture, free=FREE)
    latent = config.latent_attention
    if latent.norm_eps != 1e-6:
        refuse(
            "latent_attention.norm_eps",
            f"{architecture} builds its latent norms with 1e-6, got {latent.norm_eps}",
        )
    moe = config.moe
    if moe.shared_mlp_dim % moe.expert_mlp_dim:
        refuse(
            "moe.shared_mlp_dim",
            f"{architecture}'s shared experts are n_shared_experts x "
            f"expert_mlp_dim wide; {moe.shared_mlp_dim} is not a multiple of "
            f"{moe.expert_mlp_dim}",
        )
    return {
        **fields,
        "head_dim": latent.qk_rope_head_dim,
        "q_lora_rank": latent.q_lora_rank,
        "kv_lora_rank": latent.kv_lora_rank,
        "qk_nope_head_dim": latent.qk_nope_head_dim,
        "qk_rope_head_dim": latent.qk_rope_head_dim,
        "v_head_dim": latent.v_head_dim,
        "attention_bias": latent.bias,
        "first_k_dense_replace": config.first_dense_layers,
        **moe_hf_fields(moe, LATENT_MOE_KEYS),
        "n_shared_experts": moe.shared_mlp_dim // moe.expert_mlp_dim,
        "routed_scaling_factor": moe.routed_scaling,
        "n_group": moe.n_groups,
        "topk_group": moe.topk_groups,
    }


def config_from_hf(hf_config: HFConfig) -> DeepseekV3Config:
    fields = latent_fields(hf_config)
    moe_config = moe_fields(hf_config, MOE_KEYS)
    moe = MoEConfig(
        **moe_config,
        shared_mlp_dim=hf_config.get("n_shared_experts") * moe_config["expert_mlp_dim"],
        scoring="sigmoid",
        n_groups=hf_config.get("n_group"),
        topk_groups=hf_config.get("topk_group"),
        routed_scaling=float(hf_config.get("routed_scaling_factor")),
        selection_bias=True,
    )
    return DeepseekV3Config(
        **fields, moe=moe, rope_interleave=bool(hf_config.get("rope_interleave", True))
    )


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    return {
        **latent_to_hf(config, ARCHITECTURE),
        **moe_hf_fields(config.moe, MOE_KEYS),
        "rope_interleave": config.rope_interleave,
    }


def _rope_columns(interleaved: bool, rope_dim: int) -> tuple:
    """``(to_hf, from_hf)`` maps of arrays whose last axis ends with rotary columns: the
    interleaving permutation and its inverse, or the identity."""
    if not interleaved:
        return (lambda a: a), (lambda a: a)
    return (
        lambda a: interleave_rope_columns(a, rope_dim),
        lambda a: deinterleave_rope_columns(a, rope_dim),
    )


def mla_tensors(config: DecoderConfig, *, interleaved: bool) -> list[Tensor]:
    """Latent attention's arrays (`eqxzoo.nn.LatentAttention`) as DeepSeek stores them under
    ``self_attn.``: the torch ``(out, in)`` projections, the rotary columns interleaved where
    ``interleaved``."""
    latent = config.latent_attention
    to_hf_rope, from_hf_rope = _rope_columns(interleaved, latent.qk_rope_head_dim)

    def attention(m):
        return m.blocks.layers.attention

    def heads_with_rope(where, name: str) -> Tensor:
        """``(in, heads, qk_head_dim)`` <-> ``(heads * qk_head_dim, in)``, rope columns last."""
        return Tensor(
            where,
            True,
            lambda a: {name: to_hf_rope(a).reshape(a.shape[0], -1).T},
            lambda read, shape: from_hf_rope(read(name).T.reshape(shape)),
        )

    def rope_last(where, name: str, transpose: bool) -> Tensor:
        """``wkv_a`` (``(embed, kv_lora + rope)`` <-> ``(kv_lora + rope, embed)``) or its bias."""
        flip = (lambda a: a.T) if transpose else (lambda a: a)
        return Tensor(
            where,
            True,
            lambda a: {name: flip(to_hf_rope(a))},
            lambda read, shape: from_hf_rope(flip(read(name))),
        )

    prefix = "self_attn."
    tensors = [
        rope_last(lambda m: attention(m).wkv_a, f"{prefix}kv_a_proj_with_mqa.weight", True),
        copied(lambda m: attention(m).kv_norm.weight, f"{prefix}kv_a_layernorm.weight"),
        heads_in(lambda m: attention(m).wkv_b, f"{prefix}kv_b_proj.weight"),
        heads_out(lambda m: attention(m).wo, f"{prefix}o_proj.weight"),
    ]
    if latent.q_lora_rank is None:
        tensors.append(heads_with_rope(lambda m: attention(m).wq, f"{prefix}q_proj.weight"))
    else:
        tensors += [
            linear(lambda m: attention(m).wq_a, f"{prefix}q_a_proj.weight"),
            copied(lambda m: attention(m).q_norm.weight, f"{prefix}q_a_layernorm.weight"),
            heads_with_rope(lambda m: attention(m).wq_b, f"{prefix}q_b_proj.weight"),
        ]
    if latent.bias:
        tensors += [
            rope_last(lambda m: attention(m).bkv_a, f"{prefix}kv_a_proj_with_mqa.bias", False),
            copied(lambda m: attention(m).bo, f"{prefix}o_proj.bias"),
        ]
        if latent.q_lora_rank is not None:
            tensors.append(copied(lambda m: attention(m).bq_a, f"{prefix}q_a_proj.bias"))
    return tensors


def deepseek_tensors(
    config: DecoderConfig, *, interleaved: bool, selection_bias: bool
) -> list[Tensor]:
    """Every array of a DeepSeek model: embedding, final norm and head; each layer's norms
    and latent attention; the prefix's dense MLPs; the blocks' router (and balancing bias),
    routed experts and shared experts."""

    def mlp(m):
        return m.blocks.layers.mlp

    shared = "mlp.shared_experts."
    layer_tensors = norm_tensors(LLAMA_NORMS) + mla_tensors(config, interleaved=interleaved)
    blocks = layer_tensors + [
        linear(lambda m: mlp(m).router.weight, "mlp.gate.weight"),
        experts(lambda m: mlp(m).experts.gate, "mlp.", "gate_proj", "gate"),
        experts(lambda m: mlp(m).experts.up, "mlp.", "up_proj", "up"),
        experts(lambda m: mlp(m).experts.down, "mlp.", "down_proj", "down"),
        linear(lambda m: mlp(m).shared.gate.weight, f"{shared}gate_proj.weight"),
        linear(lambda m: mlp(m).shared.up.weight, f"{shared}up_proj.weight"),
        linear(lambda m: mlp(m).shared.down.weight, f"{shared}down_proj.weight"),
    ]
    if selection_bias:
        blocks.append(
            copied(lambda m: mlp(m).router.selection_bias, "mlp.gate.e_score_correction_bias")
        )
    prefix = on_prefix(layer_tensors + mlp_tensors()) if config.first_dense_layers else []
    return model_tensors(config) + prefix + blocks


def tensors(config: DecoderConfig) -> list[Tensor]:
    return deepseek_tensors(config, interleaved=config.rope_interleave, selection_bias=True)


# Keys of the original DeepSeek config.json files, pinned at what transformers computes.
DEEPSEEK_PINNED = {"moe_layer_freq": 1, "pretraining_tp": 1}

# Keys that do not change what transformers computes: the multi-token-prediction layer
# (which transformers drops), derived sizes, expert-parallel and auxiliary-loss settings.
DEEPSEEK_IGNORED = frozenset(
    {
        "num_nextn_predict_layers",
        "qk_head_dim",
        "ep_size",
        "aux_loss_alpha",
        "seq_aux",
        "output_router_logits",
        "router_aux_loss_coef",
    }
)

LATENT_KEYS = frozenset(
    {
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "attention_bias",
        "first_k_dense_replace",
        *LATENT_MOE_KEYS.handled,
        "n_shared_experts",
        "routed_scaling_factor",
        "n_group",
        "topk_group",
    }
)

# The tiny examples' experts and latent attention (V2's are derived from them).
TINY_MOE = MoEConfig(
    n_experts=4,
    top_k=2,
    expert_mlp_dim=16,
    shared_mlp_dim=16,
    scoring="sigmoid",
    n_groups=2,
    topk_groups=1,
    routed_scaling=2.5,
    selection_bias=True,
)
TINY_LATENT = LatentAttentionConfig(
    q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8
)

FAMILY = Family(
    name="deepseek_v3",
    config_class=DeepseekV3Config,
    model_class=DecoderLM,
    # One dense prefix layer, latent attention, group-limited sigmoid routing with the
    # balancing bias.
    tiny=dict(first_dense_layers=1, n_kv_heads=None, moe=TINY_MOE, latent_attention=TINY_LATENT),
    hf=llama_like_mapping(
        architecture=ARCHITECTURE,
        model_type="deepseek_v3",
        defaults={
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "num_experts_per_tok": 8,
            "n_group": 8,
            "topk_group": 4,
            "n_shared_experts": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "first_k_dense_replace": 3,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
        },
        handled_keys=LATENT_KEYS | {"norm_topk_prob", "rope_interleave"},
        ignored_keys=DEEPSEEK_IGNORED,
        pinned_keys={**DEEPSEEK_PINNED, "scoring_func": "sigmoid", "topk_method": "noaux_tc"},
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=tensors,
    ),
)
