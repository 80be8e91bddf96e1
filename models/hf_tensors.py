"""The `Tensor` constructors: how each zoo array is stored in a Hugging Face checkpoint
(copied, transposed, split into heads, flattened, per expert), and the tables the
Llama-like families share."""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from models.config import DecoderConfig
from models.family import LayerTensors, Tensor
from models.tensor_files import Sliceable, stack


def copied(where: Callable, name: str, *, layered: bool = True) -> Tensor:
    """Norm weights and the embedding table: same layout on both sides."""
    return Tensor(where, layered, lambda a: {name: a}, lambda read, shape: read(name))


def linear(where: Callable, name: str, *, layered: bool = True) -> Tensor:
    """A `Linear` weight ``(in, out)`` <-> a torch ``nn.Linear`` weight ``(out, in)``."""
    return Tensor(where, layered, lambda a: {name: a.T}, lambda read, shape: read(name).T)


def heads_in(where: Callable, name: str) -> Tensor:
    """``wq/wk/wv (embed, heads, head_dim)`` <-> ``q/k/v_proj.weight (heads * head_dim, embed)``."""
    return Tensor(
        where,
        True,
        lambda a: {name: a.reshape(a.shape[0], -1).T},
        lambda read, shape: read(name).T.reshape(shape),
    )


def heads_out(where: Callable, name: str) -> Tensor:
    """``wo (heads, head_dim, embed)`` <-> ``o_proj.weight (embed, heads * head_dim)``."""
    return Tensor(
        where,
        True,
        lambda a: {name: a.reshape(-1, a.shape[-1]).T},
        lambda read, shape: read(name).T.reshape(shape),
    )


def flattened(where: Callable, name: str) -> Tensor:
    """A per-head array ``(heads, head_dim)`` (``bq/bk/bv``, an all-heads QK-norm weight) <->
    a flat ``(heads * head_dim,)`` tensor (``q_proj.bias``, OLMo 2's ``q_norm.weight``)."""
    return Tensor(
        where, True, lambda a: {name: a.reshape(-1)}, lambda read, shape: read(name).reshape(shape)
    )


def experts(where: Callable, prefix: str, expert_name: str, fused: str) -> Tensor:
    """Stacked expert weights ``(experts, in, out)`` <-> one ``(out, in)`` tensor per expert.

    Also reads transformers 5's fused layout: ``fused`` is ``"gate"`` or ``"up"`` (a half of
    ``experts.gate_up_proj (experts, 2 * mlp, embed)``) or ``"down"`` (``experts.down_proj
    (experts, embed, mlp)``).
    """

    def name(expert: int) -> str:
        return f"{prefix}experts.{expert}.{expert_name}.weight"

    def to_hf(a) -> dict[str, Any]:
        return {name(expert): a[expert].T for expert in range(a.shape[0])}

    def from_hf(read: LayerTensors, shape: tuple[int, ...]) -> Sliceable:
        n_experts, rows, columns = shape
        if fused == "down" and read.has(f"{prefix}experts.down_proj"):
            return read(f"{prefix}experts.down_proj", (n_experts, columns, rows)).transpose(0, 2, 1)
        if fused in ("gate", "up") and read.has(f"{prefix}experts.gate_up_proj"):
            gate_up = read(f"{prefix}experts.gate_up_proj", (n_experts, 2 * columns, rows))
            start = 0 if fused == "gate" else columns
            return gate_up.window(1, start, start + columns).transpose(0, 2, 1)
        return stack([read(name(expert)).T for expert in range(n_experts)])

    return Tensor(where, True, to_hf, from_hf)


# Where the zoo's block norms sit in a Llama-layout checkpoint: before each sublayer.
LLAMA_NORMS = {"attention_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}


def model_tensors(config: DecoderConfig, prefix: str = "model.") -> list[Tensor]:
    """The token embedding, the final norm and (untied) the output head."""
    tensors = [
        copied(lambda m: m.embedding.weight, f"{prefix}embed_tokens.weight", layered=False),
        copied(lambda m: m.final_norm.weight, f"{prefix}norm.weight", layered=False),
    ]
    if not config.tie_embeddings:
        tensors.append(linear(lambda m: m.unembedding.weight, "lm_head.weight", layered=False))
    return tensors


def norm_tensors(names: Mapping[str, str]) -> list[Tensor]:
    """Each block norm ``{zoo field: Hugging Face module name}`` (``attention_norm``,
    ``attention_post_norm``, ``mlp_norm``, ``mlp_post_norm``)."""

    def norm_weight(field: str) -> Callable:
        return lambda m: getattr(m.blocks.layers, field).weight

    return [copied(norm_weight(field), f"{name}.weight") for field, name in names.items()]


def attention_tensors(config: DecoderConfig, prefix: str = "self_attn.") -> list[Tensor]:
    """q/k/v/o projections, their biases and QK-norm weights, as ``{prefix}q_proj.weight``,
    ``{prefix}q_norm.weight``, ... (Llama's layout, kept by the families derived from it)."""

    def attention(m):
        return m.blocks.layers.attention

    tensors = [
        heads_in(lambda m: attention(m).wq, f"{prefix}q_proj.weight"),
        heads_in(lambda m: attention(m).wk, f"{prefix}k_proj.weight"),
        heads_in(lambda m: attention(m).wv, f"{prefix}v_proj.weight"),
        heads_out(lambda m: attention(m).wo, f"{prefix}o_proj.weight"),
    ]
    if config.qkv_bias:
        tensors += [
            flattened(lambda m: attention(m).bq, f"{prefix}q_proj.bias"),
            flattened(lambda m: attention(m).bk, f"{prefix}k_proj.bias"),
            flattened(lambda m: attention(m).bv, f"{prefix}v_proj.bias"),
        ]
    if config.attention_out_bias:
        tensors.append(copied(lambda m: attention(m).bo, f"{prefix}o_proj.bias"))
    if config.qk_norm:
        norm = copied if config.qk_norm_over == "head" else flattened
        tensors += [
            norm(lambda m: attention(m).q_norm.weight, f"{prefix}q_norm.weight"),
            norm(lambda m: attention(m).k_norm.weight, f"{prefix}k_norm.weight"),
        ]
    return tensors


def mlp_tensors(prefix: str = "mlp.") -> list[Tensor]:
    """A gated MLP's ``{prefix}gate_proj``, ``up_proj`` and ``down_proj`` weights."""
    return [
        linear(lambda m: m.blocks.layers.mlp.gate.weight, f"{prefix}gate_proj.weight"),
        linear(lambda m: m.blocks.layers.mlp.up.weight, f"{prefix}up_proj.weight"),
        linear(lambda m: m.blocks.layers.mlp.down.weight, f"{prefix}down_proj.weight"),
    ]


def llama_like_tensors(config: DecoderConfig) -> list[Tensor]:
    """Embedding, final norm, head and every layer's norms and attention, named as in
    ``LlamaForCausalLM`` (and the families that copied its layout)."""
    return model_tensors(config) + norm_tensors(LLAMA_NORMS) + attention_tensors(config)


class _PrefixAsBlocks:
    """A model seen with its prefix in place of its blocks, so that a `Tensor` written for
    the blocks (``m.blocks.layers...``) picks the same array of the prefix's layers."""

    def __init__(self, model: Any):
        self.model = model

    @property
    def blocks(self) -> Any:
        return self.model.prefix


def on_prefix(tensors: list[Tensor]) -> list[Tensor]:
    """The layered ``tensors`` of the blocks, stored for the prefix's layers instead (the
    prefix's layers have the blocks' layout where they share a part: norms, attention)."""
    return [
        dataclasses.replace(t, where=lambda m, t=t: t.where(_PrefixAsBlocks(m)), stack="prefix")
        for t in tensors
        if t.layered
    ]


def routed_experts_tensors(prefix: str, names: tuple[str, str, str]) -> list[Tensor]:
    """The router and the routed experts' ``(gate, up, down)`` weights, stored per expert as
    ``{prefix}experts.{e}.{name}.weight`` with the router at ``{prefix}gate.weight``."""
    return [
        linear(lambda m: m.blocks.layers.mlp.router.weight, f"{prefix}gate.weight"),
        experts(lambda m: m.blocks.layers.mlp.experts.gate, prefix, names[0], "gate"),
        experts(lambda m: m.blocks.layers.mlp.experts.up, prefix, names[1], "up"),
        experts(lambda m: m.blocks.layers.mlp.experts.down, prefix, names[2], "down"),
    ]
