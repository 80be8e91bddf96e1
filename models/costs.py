"""What a config's model costs: its parameter counts and its training FLOPs per token.

Counted from the family's own model shapes (`jax.eval_shape`: nothing is allocated), so
every family's options (biases, norms, latent attention, shared experts) count as built.
The run reports them and its MFU from them; the trainer below knows models only by contract.
"""

import dataclasses
import math

import equinox as eqx
import jax

from eqxzoo.nn import logical_axes
from eqxzoo.nn.lora import adapter_count
from eqxzoo.nn.parameters import parameter_mask
from models.config import DecoderConfig
from models.registry import model_factory


@dataclasses.dataclass(frozen=True)
class ParameterCounts:
    """``total`` parameters; ``active`` per token (each token uses ``top_k`` of the routed
    experts); ``embedding`` is the input embedding table (not a matmul); ``trainable`` those
    a run trains (with LoRA adapters, only the adapters; else all)."""

    total: int
    active: int
    embedding: int
    trainable: int


def parameter_counts(config: DecoderConfig) -> ParameterCounts:
    """The parameters of ``config``'s model (`eqxzoo.nn.parameters`: floating arrays, less
    the buffers a rule moves instead of a gradient; what the optimizer trains), not the
    per-layer integer data (sliding windows)."""
    shapes = eqx.filter_eval_shape(model_factory(config), key=jax.random.key(0))
    shapes, _ = eqx.partition(shapes, parameter_mask(shapes))
    leaves = jax.tree.leaves(shapes)
    axes = jax.tree.leaves(logical_axes(shapes), is_leaf=lambda a: hasattr(a, "names"))
    total = sum(math.prod(leaf.shape) for leaf in leaves)
    routed = sum(
        math.prod(leaf.shape) for leaf, a in zip(leaves, axes, strict=True) if "experts" in a.names
    )
    active = total
    if config.moe is not None and routed:
        active = total - routed + routed * config.moe.top_k // config.moe.n_experts
    embedding = config.vocab_size * config.d_model
    trainable = adapter_count(shapes) if config.lora is not None else total
    return ParameterCounts(total=total, active=active, embedding=embedding, trainable=trainable)


def flops_per_token(config: DecoderConfig, seq_len: int) -> float:
    """Training FLOPs per token: ``6 N`` over the active matmul parameters (the output head
    included, tied or not; the input embedding lookup excluded) plus attention's scores and
    values over the keys each query sees (`attention_flops_per_token`)."""
    counts = parameter_counts(config)
    head = config.vocab_size * config.d_model if config.tie_embeddings else 0
    matmul_params = counts.active - counts.embedding + head
    return float(6 * matmul_params + attention_flops_per_token(config, seq_len))


def attention_flops_per_token(config: DecoderConfig, seq_len: int) -> float:
    """Attention's training FLOPs per token, ``6 H (d_qk + d_v)`` times the keys a query sees
    on average, summed over the layers: ``(T + 1) / 2`` of a causal sequence of ``T``, fewer
    in a sliding window. PaLM's convention counts all ``T`` keys, which a kernel that skips
    the hidden blocks does not compute (its MFU can pass 100% on long sequences)."""
    windows = config.layer_windows or (0,) * config.n_layers
    keys = sum(visible_keys(seq_len, window) for window in windows)
    return attention_flops_per_key(config) * keys


def attention_flops_per_key(config: DecoderConfig) -> float:
    """One layer's training FLOPs for one query and one key, ``6 H (d_qk + d_v)``: its
    score's and its value's share of the forward's two matmuls (2 FLOPs a multiply-add)
    and of the backward's four (latent attention's query and value heads differ)."""
    latent = config.latent_attention
    if latent is None:
        qk_dim = v_dim = config.attention_head_dim
    else:
        qk_dim, v_dim = latent.qk_nope_head_dim + latent.qk_rope_head_dim, latent.v_head_dim
    return float(6 * config.n_heads * (qk_dim + v_dim))


def visible_keys(seq_len: int, window: int = 0) -> float:
    """The keys a query of a causal sequence of ``seq_len`` sees on average, within
    ``window`` of it (0: all before it): ``min(q + 1, window)`` for the query at ``q``."""
    if window == 0 or window >= seq_len:
        return (seq_len + 1) / 2
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len
