"""GPT-2 (``GPT2LMHeadModel``): learned position embeddings, LayerNorm before each sublayer,
biases on every projection, a GELU (tanh) MLP, tied embeddings, and Hugging Face's ``Conv1D``
layout (weights stored ``(in, out)``, queries, keys and values in one ``c_attn`` tensor)."""

import dataclasses
from typing import Any, ClassVar

import jax.numpy as jnp

from eqxzoo.nn import Activation
from eqxzoo.typed_config import refuse
from models.config import DecoderConfig, NormKind, PositionKind
from models.decoder import DecoderLM
from models.family import COMMON_IGNORED_KEYS, Family, HFConfig, HFMapping, LayerTensors, Tensor
from models.hf_fields import check_expressible
from models.hf_tensors import copied
from models.tensor_files import Sliceable


@dataclasses.dataclass(frozen=True)
class GPT2Config(DecoderConfig):
    """GPT-2: learned positions, LayerNorm, biases everywhere, GELU MLP of ``4 d_model``."""

    family: ClassVar[str] = "gpt2"
    vocab_size: int = 50257
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    mlp_dim: int = 3072
    activation: Activation = "gelu"
    norm: NormKind = "layer"
    norm_eps: float = 1e-5
    positions: PositionKind = "learned"
    max_positions: int = 1024
    qkv_bias: bool = True
    attention_out_bias: bool = True
    mlp_bias: bool = True
    tie_embeddings: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.moe is not None:
            refuse("moe", "gpt2 is dense")


ARCHITECTURE = "GPT2LMHeadModel"

FIXED = {
    "activation": "gelu",
    "norm": "layer",
    "positions": "learned",
    "qkv_bias": True,
    "attention_out_bias": True,
    "mlp_bias": True,
}
# Both names transformers gives the tanh approximation of GELU.
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")


def config_from_hf(hf_config: HFConfig) -> GPT2Config:
    activation = hf_config.get("activation_function")
    if activation not in TANH_GELU:
        raise hf_config.error(
            "activation_function",
            f"{activation!r} is not supported; supported: {', '.join(TANH_GELU)}",
        )
    d_model = hf_config.get("n_embd")
    return GPT2Config(
        vocab_size=hf_config.get("vocab_size"),
        d_model=d_model,
        n_layers=hf_config.get("n_layer"),
        n_heads=hf_config.get("n_head"),
        mlp_dim=hf_config.get("n_inner", 4 * d_model),
        norm_eps=float(hf_config.get("layer_norm_epsilon")),
        max_positions=hf_config.get("n_positions"),
        tie_embeddings=bool(hf_config.get("tie_word_embeddings")),
        init_std=float(hf_config.get("initializer_range")),
    )


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    check_expressible(config, ARCHITECTURE, fixed=FIXED, free=frozenset({"max_positions"}))
    if config.kv_heads != config.n_heads or config.head_dim not in (
        None,
        config.d_model // config.n_heads,
    ):
        refuse(
            "n_kv_heads",
            f"{ARCHITECTURE} has as many key/value heads as heads of "
            "d_model / n_heads features; leave n_kv_heads and head_dim unset",
        )
    return {
        "vocab_size": config.vocab_size,
        "n_embd": config.d_model,
        "n_layer": config.n_layers,
        "n_head": config.n_heads,
        "n_inner": config.mlp_dim,
        "n_positions": config.max_positions,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": config.init_std,
    }


def _attention(m):
    return m.blocks.layers.attention


def fused_qkv(name: str, kind: str) -> Tensor:
    """``c_attn``'s weight ``(embed, 3 * embed)`` <-> ``(wq, wk, wv)``, each ``(embed, heads,
    head_dim)``; or its bias ``(3 * embed,)`` <-> ``(bq, bk, bv)``, each ``(heads, head_dim)``."""
    is_weight = kind == "weight"

    def where(m):
        a = _attention(m)
        return (a.wq, a.wk, a.wv) if is_weight else (a.bq, a.bk, a.bv)

    def to_hf(parts) -> dict[str, Any]:
        if is_weight:
            parts = [part.reshape(part.shape[0], -1) for part in parts]
        else:
            parts = [part.reshape(-1) for part in parts]
        return {name: jnp.concatenate(parts, axis=-1)}

    def from_hf(read: LayerTensors, shapes) -> tuple[Sliceable, ...]:
        fused = read(name)
        width = fused.shape[-1] // 3
        return tuple(
            fused.window(fused.ndim - 1, i * width, (i + 1) * width).reshape(shape)
            for i, shape in enumerate(shapes)
        )

    return Tensor(where, True, to_hf, from_hf)


def conv1d(where, name: str) -> Tensor:
    """A ``Conv1D`` weight: stored ``(in, out)`` like the zoo's `Linear`."""
    return Tensor(where, True, lambda a: {name: a}, lambda read, shape: read(name))


def attention_out(name: str) -> Tensor:
    """``wo (heads, head_dim, embed)`` <-> ``c_proj.weight (heads * head_dim, embed)``."""
    return Tensor(
        lambda m: _attention(m).wo,
        True,
        lambda a: {name: a.reshape(-1, a.shape[-1])},
        lambda read, shape: read(name).reshape(shape),
    )


def _layers(m):
    return m.blocks.layers


def tensors(config: DecoderConfig) -> list[Tensor]:
    layers = _layers
    table = [
        copied(lambda m: m.embedding.weight, "transformer.wte.weight", layered=False),
        copied(lambda m: m.position_embedding.weight, "transformer.wpe.weight", layered=False),
        copied(lambda m: m.final_norm.weight, "transformer.ln_f.weight", layered=False),
        copied(lambda m: m.final_norm.bias, "transformer.ln_f.bias", layered=False),
        copied(lambda m: layers(m).attention_norm.weight, "ln_1.weight"),
        copied(lambda m: layers(m).attention_norm.bias, "ln_1.bias"),
        fused_qkv("attn.c_attn.weight", "weight"),
        fused_qkv("attn.c_attn.bias", "bias"),
        attention_out("attn.c_proj.weight"),
        copied(lambda m: _attention(m).bo, "attn.c_proj.bias"),
        copied(lambda m: layers(m).mlp_norm.weight, "ln_2.weight"),
        copied(lambda m: layers(m).mlp_norm.bias, "ln_2.bias"),
        conv1d(lambda m: layers(m).mlp.up.weight, "mlp.c_fc.weight"),
        copied(lambda m: layers(m).mlp.up.bias, "mlp.c_fc.bias"),
        conv1d(lambda m: layers(m).mlp.down.weight, "mlp.c_proj.weight"),
        copied(lambda m: layers(m).mlp.down.bias, "mlp.c_proj.bias"),
    ]
    if not config.tie_embeddings:
        table.append(
            Tensor(
                lambda m: m.unembedding.weight,
                False,
                lambda a: {"lm_head.weight": a.T},
                lambda read, shape: read("lm_head.weight").T,
            )
        )
    return table


FAMILY = Family(
    name="gpt2",
    config_class=GPT2Config,
    model_class=DecoderLM,
    tiny=dict(n_kv_heads=None, max_positions=16),
    hf=HFMapping(
        architecture=ARCHITECTURE,
        model_type="gpt2",
        defaults={
            "n_positions": 1024,
            "layer_norm_epsilon": 1e-5,
            "activation_function": "gelu_new",
            "initializer_range": 0.02,
            "tie_word_embeddings": True,
        },
        handled_keys=frozenset(
            {
                "architectures",
                "model_type",
                "vocab_size",
                "n_embd",
                "n_layer",
                "n_head",
                "n_inner",
                "n_positions",
                "activation_function",
                "layer_norm_epsilon",
                "tie_word_embeddings",
                "initializer_range",
            }
        ),
        # Dropout only acts in training mode (the zoo's layers have none: the function at
        # evaluation is the same); summary_* configure GPT2DoubleHeadsModel's classifier;
        # reorder_and_upcast_attn changes only the float16 rounding order; n_ctx is
        # n_positions' old name.
        ignored_keys=COMMON_IGNORED_KEYS
        | {
            "attn_pdrop",
            "embd_pdrop",
            "resid_pdrop",
            "summary_activation",
            "summary_first_dropout",
            "summary_proj_to_labels",
            "summary_type",
            "summary_use_proj",
            "reorder_and_upcast_attn",
            "n_ctx",
        },
        pinned_keys={
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "add_cross_attention": False,
        },
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=tensors,
        ignored_tensor_suffixes=(".attn.bias", ".attn.masked_bias"),
        layer_format="transformer.h.{}.",
    ),
)
