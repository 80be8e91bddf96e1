"""Multi-head latent attention (DeepSeek-V2/V3): keys and values expanded per head from one
small latent per token, which is all a KV cache has to keep beside one rotary key.

Each head's query and key are ``qk_nope_head_dim`` features without position followed by
``qk_rope_head_dim`` rotated ones; the rotated part of the key is one projection shared by
every head. Rotations use the rotate-half layout of `eqxzoo.nn.rope`; DeepSeek's checkpoints
rotate interleaved pairs ``(2i, 2i + 1)`` instead, so converting them permutes the rotary
output columns of the query and latent projections (`deinterleave_rope_columns`), which
leaves every score unchanged.
"""

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqxzoo.nn.attention import write_cache
from eqxzoo.nn.axes import AbstractAxesOwner, LogicalName
from eqxzoo.nn.context import ContextSplit
from eqxzoo.nn.documents import Documents
from eqxzoo.nn.kernels import DEFAULT_BLOCK_SIZE, AttentionKernel, attend
from eqxzoo.nn.linear import dense, normal_init
from eqxzoo.nn.lora import LoraWeight
from eqxzoo.nn.norm import RMSNorm
from eqxzoo.nn.rope import (
    RopeScaling,
    apply_rope,
    check_rotary_dim,
    rope_amplitude,
    rope_frequencies,
    yarn_mscale,
)


@runtime_checkable
class Columns(Protocol):
    """An array (NumPy, JAX, or a lazy checkpoint view) whose last axis holds columns."""

    shape: tuple[int, ...]

    def take(self, indices: Any, axis: int) -> Any: ...


def deinterleave_rope_columns(w: Columns, rope_dim: int) -> Columns:
    """``w`` with the last ``rope_dim`` entries of its last axis reordered from interleaved
    pairs to rotate-half: entries ``(2i, 2i + 1)`` move to ``(i, i + rope_dim / 2)``.

    Applied to the rotary output columns of a DeepSeek checkpoint's query and latent
    projections (and biases), it gives the weights `LatentAttention` computes the same
    scores with. Works on NumPy and JAX arrays and lazy checkpoint views
    (`models.tensor_files.LazyArray.take`).
    """
    order = np.concatenate([np.arange(0, rope_dim, 2), np.arange(1, rope_dim, 2)])
    return _permute_tail(w, order)


def interleave_rope_columns(w: Columns, rope_dim: int) -> Columns:
    """The inverse of `deinterleave_rope_columns` (for saving to a DeepSeek checkpoint)."""
    half = rope_dim // 2
    order = np.stack([np.arange(half), np.arange(half) + half], axis=-1).reshape(-1)
    return _permute_tail(w, order)


def _permute_tail(w, order: np.ndarray):
    """``w`` with its last ``len(order)`` columns reordered by ``order`` (through ``take``,
    which lazy checkpoint views have too)."""
    kept = w.shape[-1] - order.shape[0]
    return w.take(np.concatenate([np.arange(kept), kept + order]), axis=-1)


class LatentAttention(AbstractAxesOwner):
    """Causal multi-head latent attention, as transformers' ``DeepseekV3Attention`` and
    ``DeepseekV2Attention`` compute it (with de-interleaved rotary columns, module docstring).

    - Queries: ``wq (embed, heads, qk_head_dim)``, or with ``q_lora_rank`` a bottleneck
      ``wq_a (embed, q_lora)`` -> RMSNorm ``q_norm`` -> ``wq_b (q_lora, heads, qk_head_dim)``.
    - Keys and values: ``wkv_a (embed, kv_lora + qk_rope_head_dim)`` gives each token's latent
      (normed by ``kv_norm``) and its rotary key, shared by all heads; ``wkv_b (kv_lora, heads,
      qk_nope_head_dim + v_head_dim)`` expands the latent into each head's unrotated key
      and its value (one array, as checkpoints store it, so loading reads it once).
      ``wo (heads, v_head_dim, embed)`` projects back.
    - ``attention_bias``: biases on ``wq_a``, ``wkv_a`` and ``wo``, where DeepSeek has them.
    - Scores are scaled by ``qk_head_dim^-0.5``, times ``yarn_mscale(factor,
      mscale_all_dim)^2`` when ``rope_scaling`` sets ``mscale_all_dim`` (the YaRN temperature
      that DeepSeek puts in the softmax rather than in cos and sin).
    - ``kernel`` and ``block_size``: how `eqxzoo.nn.attend` computes the attention;
      ``context``: the sequence split over a context-parallel mesh axis, as
      `eqxzoo.nn.CausalSelfAttention` has it (each device expands its own latents; the
      expanded keys and values go round).

    The latent and bottleneck axes have no logical name: they are small and replicated.
    ``norm_eps`` is that of the two latent norms (DeepSeek's: 1e-6, whatever ``rms_norm_eps``).
    """

    wq: Float[Array, "embed heads qk_head_dim"] | LoraWeight | None
    wq_a: Float[Array, "embed q_lora"] | LoraWeight | None
    bq_a: Float[Array, " q_lora"] | None
    q_norm: RMSNorm | None
    wq_b: Float[Array, "q_lora heads qk_head_dim"] | LoraWeight | None
    wkv_a: Float[Array, "embed kv_lora_and_rope"] | LoraWeight
    bkv_a: Float[Array, " kv_lora_and_rope"] | None
    kv_norm: RMSNorm
    wkv_b: Float[Array, "kv_lora heads nope_and_v"] | LoraWeight
    wo: Float[Array, "heads v_head_dim embed"] | LoraWeight
    bo: Float[Array, " embed"] | None
    n_heads: int = eqx.field(static=True)
    q_lora_rank: int | None = eqx.field(static=True)
    kv_lora_rank: int = eqx.field(static=True)
    qk_nope_head_dim: int = eqx.field(static=True)
    qk_rope_head_dim: int = eqx.field(static=True)
    v_head_dim: int = eqx.field(static=True)
    rope_theta: float = eqx.field(static=True)
    rope_scaling: RopeScaling | None = eqx.field(static=True)
    scale: float = eqx.field(static=True)
    kernel: AttentionKernel = eqx.field(static=True)
    block_size: int = eqx.field(static=True)
    context: ContextSplit | None = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        rope_theta: float = 10000.0,
        rope_scaling: RopeScaling | None = None,
        attention_bias: bool = False,
        norm_eps: float = 1e-6,
        kernel: AttentionKernel = "auto",
        block_size: int = DEFAULT_BLOCK_SIZE,
        context: ContextSplit | None = None,
        init_std: float = 0.02,
        key: PRNGKeyArray,
    ):
        check_rotary_dim(qk_rope_head_dim, "qk_rope_head_dim")
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        kq, kq_b, kkv_a, kk_b, kv_b, ko = jax.random.split(key, 6)
        if q_lora_rank is None:
            self.wq = normal_init(kq, (d_model, n_heads, qk_head_dim), init_std)
            self.wq_a = self.bq_a = self.q_norm = self.wq_b = None
        else:
            self.wq = None
            self.wq_a = normal_init(kq, (d_model, q_lora_rank), init_std)
            self.bq_a = jnp.zeros((q_lora_rank,)) if attention_bias else None
            self.q_norm = RMSNorm(q_lora_rank, eps=norm_eps, axis_names=(None,))
            self.wq_b = normal_init(kq_b, (q_lora_rank, n_heads, qk_head_dim), init_std)
        self.wkv_a = normal_init(kkv_a, (d_model, kv_lora_rank + qk_rope_head_dim), init_std)
        self.bkv_a = jnp.zeros((kv_lora_rank + qk_rope_head_dim,)) if attention_bias else None
        self.kv_norm = RMSNorm(kv_lora_rank, eps=norm_eps, axis_names=(None,))
        self.wkv_b = normal_init(
            kk_b, (kv_lora_rank, n_heads, qk_nope_head_dim + v_head_dim), init_std
        )
        self.wo = normal_init(ko, (n_heads, v_head_dim, d_model), init_std)
        self.bo = jnp.zeros((d_model,)) if attention_bias else None
        self.n_heads = n_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        scale = qk_head_dim**-0.5
        if rope_scaling is not None and rope_scaling.mscale_all_dim:
            scale *= yarn_mscale(rope_scaling.factor, rope_scaling.mscale_all_dim) ** 2
        self.scale = scale
        self.kernel = kernel
        self.block_size = block_size
        self.context = context

    def param_axes(self) -> Mapping[str, tuple[LogicalName, ...]]:
        return {
            "wq": ("embed", "heads", "head_dim"),
            "wq_a": ("embed", None),
            "bq_a": (None,),
            "wq_b": (None, "heads", "head_dim"),
            "wkv_a": ("embed", None),
            "bkv_a": (None,),
            "wkv_b": (None, "heads", "head_dim"),
            "wo": ("heads", "head_dim", "embed"),
            "bo": ("embed",),
        }

    def _rotate(
        self,
        x: Float[Array, "*batch seq heads rope"],
        positions: Int[Array, "*#batch seq"],
        seq_len: Int[Array, ""] | int | None,
    ) -> Float[Array, "*batch seq heads rope"]:
        frequencies = rope_frequencies(
            self.qk_rope_head_dim,
            self.rope_theta,
            self.rope_scaling,
            positions[-1] + 1 if seq_len is None else seq_len,
        )
        return apply_rope(x, positions, frequencies, rope_amplitude(self.rope_scaling))

    def queries(
        self,
        x: Float[Array, "*batch seq embed"],
        positions: Int[Array, "*#batch seq"],
        seq_len: Int[Array, ""] | int | None = None,
    ) -> Float[Array, "*batch seq heads qk_head_dim"]:
        """Each head's query: ``qk_nope_head_dim`` plain features, then the rotated ones
        (``seq_len``: the positions so far, default the last one plus one)."""
        if self.wq is not None:
            q = dense(x, self.wq)
        else:
            q_latent = dense(x, self.wq_a)
            if self.bq_a is not None:
                q_latent = q_latent + self.bq_a
            q = dense(self.q_norm(q_latent), self.wq_b)
        q_nope, q_rope = jnp.split(q, [self.qk_nope_head_dim], axis=-1)
        return jnp.concatenate([q_nope, self._rotate(q_rope, positions, seq_len)], axis=-1)

    def compress(
        self,
        x: Float[Array, "*batch seq embed"],
        positions: Int[Array, "*#batch seq"],
        seq_len: Int[Array, ""] | int | None = None,
    ) -> tuple[Float[Array, "*batch seq kv_lora"], Float[Array, "*batch seq rope"]]:
        """What the cache keeps of each token: its normed latent and its rotated shared key."""
        latent_and_rope = dense(x, self.wkv_a)
        if self.bkv_a is not None:
            latent_and_rope = latent_and_rope + self.bkv_a
        latent, k_rope = jnp.split(latent_and_rope, [self.kv_lora_rank], axis=-1)
        k_rope = self._rotate(k_rope[..., None, :], positions, seq_len)[..., 0, :]
        return self.kv_norm(latent), k_rope

    def expand(
        self,
        latent: Float[Array, "*batch kv_seq kv_lora"],
        k_rope: Float[Array, "*batch kv_seq rope"],
    ) -> tuple[
        Float[Array, "*batch kv_seq heads qk_head_dim"],
        Float[Array, "*batch kv_seq heads v_head_dim"],
    ]:
        """Per-head keys (the latent's expansion, then the shared rotary key) and values."""
        expanded = dense(latent, self.wkv_b)
        k_nope, values = jnp.split(expanded, [self.qk_nope_head_dim], axis=-1)
        shared = jnp.broadcast_to(k_rope[..., None, :], (*k_nope.shape[:-1], k_rope.shape[-1]))
        return jnp.concatenate([k_nope, shared], axis=-1), values

    def project_out(
        self, attended: Float[Array, "*batch seq heads v_head_dim"]
    ) -> Float[Array, "*batch seq embed"]:
        out = dense(attended, self.wo, n_contract=2)
        return out if self.bo is None else out + self.bo

    def __call__(
        self,
        x: Float[Array, "*batch seq embed"],
        positions: Int[Array, " seq"] | None = None,
        documents: Documents | None = None,
    ) -> Float[Array, "*batch seq embed"]:
        """Attention over each sequence; any leading axes are independent sequences. With
        ``documents`` (packed in each sequence) a token attends only within its own and is
        rotated by its position there."""
        with jax.named_scope("attention"):
            if self.context is not None:
                return self._attend_across_shards(x, positions, documents)
            if positions is None:
                positions = jnp.arange(x.shape[-2])
            rotated = positions if documents is None else documents.positions
            seq_len = positions[-1] + 1
            keys, values = self.expand(*self.compress(x, rotated, seq_len))
            segments = None if documents is None else documents.segments
            attended = attend(
                self.queries(x, rotated, seq_len),
                keys,
                values,
                positions,
                positions,
                scale=self.scale,
                kernel=self.kernel,
                block_size=self.block_size,
                q_segments=segments,
                k_segments=segments,
            )
            return self.project_out(attended)

    def _attend_across_shards(
        self,
        x: Float[Array, "*batch seq embed"],
        positions: Int[Array, " seq"] | None,
        documents: Documents | None,
    ) -> Float[Array, "*batch seq embed"]:
        positions, seq_len = self.context.locate(x.shape[-2], positions)
        rotated = positions if documents is None else documents.positions
        keys, values = self.expand(*self.compress(x, rotated, seq_len))
        attended = self.context.attend(
            self.queries(x, rotated, seq_len),
            keys,
            values,
            positions,
            scale=self.scale,
            block_size=self.block_size,
            segments=None if documents is None else documents.segments,
        )
        return self.project_out(attended)

    def empty_cache(
        self, slots: int, dtype
    ) -> tuple[Float[Array, "slots kv_lora"], Float[Array, "slots rope"]]:
        """This layer's empty cache of ``slots`` positions: latents and rotated shared keys."""
        return (
            jnp.zeros((slots, self.kv_lora_rank), dtype),
            jnp.zeros((slots, self.qk_rope_head_dim), dtype),
        )

    def cached_forward(
        self,
        x: Float[Array, "seq embed"],
        cache: tuple[Float[Array, "cache kv_lora"], Float[Array, "cache rope"]],
        cache_positions: Int[Array, " cache"],
        start: Int[Array, ""],
    ) -> tuple[
        Float[Array, "seq embed"], tuple[Float[Array, "cache kv_lora"], Float[Array, "cache rope"]]
    ]:
        """Attention of ``x``, the tokens at positions ``start, ..., start + seq - 1``, over a
        cache of earlier tokens and themselves (`CausalSelfAttention.cached_forward`'s
        contract, ring included).

        ``cache`` is ``(latents, rope_keys)`` (`empty_cache`): slot ``i`` holds the normed
        latent and the rotated shared key of position ``cache_positions[i]`` (negative:
        empty), a ``kv_lora + qk_rope_head_dim`` vector a token instead of per-head keys and
        values; they are expanded per head here. Returns the output and the cache with these
        tokens written.
        """
        latents, rope_keys = cache
        seq = x.shape[0]
        positions = start + jnp.arange(seq)
        latent, k_rope = self.compress(x, positions)
        keys, values = self.expand(
            jnp.concatenate([latents.astype(latent.dtype), latent]),
            jnp.concatenate([rope_keys.astype(k_rope.dtype), k_rope]),
        )
        attended = attend(
            self.queries(x, positions),
            keys,
            values,
            positions,
            jnp.concatenate([cache_positions, positions]),
            scale=self.scale,
            kernel=self.kernel,
            block_size=self.block_size,
        )
        return self.project_out(attended), write_cache(cache, (latent, k_rope), positions)
