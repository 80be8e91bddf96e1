"""Causal self-attention with multi-head, grouped-query and multi-query layouts.

`CausalSelfAttention.__call__` attends within a sequence; `CausalSelfAttention.cached_forward`
attends to a fixed-length key/value cache of earlier tokens (for incremental decoding).
"""

from collections.abc import Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqxzoo.nn.axes import AbstractAxesOwner, LogicalName
from eqxzoo.nn.linear import dense, normal_init
from eqxzoo.nn.norm import RMSNorm
from eqxzoo.nn.rope import apply_rope


class CausalSelfAttention(AbstractAxesOwner):
    """Causal self-attention with rotary embeddings.

    ``n_kv_heads == n_heads`` is MHA, ``1`` is MQA, anything dividing ``n_heads`` is GQA.
    Projections are kept per head (``wq: (embed, heads, head_dim)``) so that the logical
    ``heads`` axis can be sharded over tensor parallelism without reshapes. Optional q/k/v
    biases (Qwen2) and QK-norm (an RMSNorm over ``head_dim`` applied to queries and keys
    before the rotation, as in Qwen3/OLMo-2).
    """

    wq: Float[Array, "embed heads head_dim"]
    wk: Float[Array, "embed kv_heads head_dim"]
    wv: Float[Array, "embed kv_heads head_dim"]
    wo: Float[Array, "heads head_dim embed"]
    bq: Float[Array, "heads head_dim"] | None
    bk: Float[Array, "kv_heads head_dim"] | None
    bv: Float[Array, "kv_heads head_dim"] | None
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    n_heads: int = eqx.field(static=True)
    n_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    rope_theta: float = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        rope_theta: float = 10000.0,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        init_std: float = 0.02,
        key: PRNGKeyArray,
    ):
        if n_heads % n_kv_heads != 0:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.wq = normal_init(kq, (d_model, n_heads, head_dim), init_std)
        self.wk = normal_init(kk, (d_model, n_kv_heads, head_dim), init_std)
        self.wv = normal_init(kv, (d_model, n_kv_heads, head_dim), init_std)
        self.wo = normal_init(ko, (n_heads, head_dim, d_model), init_std)
        self.bq = jnp.zeros((n_heads, head_dim)) if qkv_bias else None
        self.bk = jnp.zeros((n_kv_heads, head_dim)) if qkv_bias else None
        self.bv = jnp.zeros((n_kv_heads, head_dim)) if qkv_bias else None
        self.q_norm = RMSNorm(head_dim, eps=norm_eps, axis_name="head_dim") if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps=norm_eps, axis_name="head_dim") if qk_norm else None
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.rope_theta = rope_theta

    def param_axes(self) -> Mapping[str, tuple[LogicalName, ...]]:
        return {
            "wq": ("embed", "heads", "head_dim"),
            "wk": ("embed", "kv_heads", "head_dim"),
            "wv": ("embed", "kv_heads", "head_dim"),
            "wo": ("heads", "head_dim", "embed"),
            "bq": ("heads", "head_dim"),
            "bk": ("kv_heads", "head_dim"),
            "bv": ("kv_heads", "head_dim"),
        }

    def project_qkv(
        self, x: Float[Array, "*batch seq embed"], positions: Int[Array, " seq"]
    ) -> tuple[
        Float[Array, "*batch seq heads head_dim"],
        Float[Array, "*batch seq kv_heads head_dim"],
        Float[Array, "*batch seq kv_heads head_dim"],
    ]:
        """Queries, keys (both normed and rotated) and values for ``x`` at ``positions``."""
        q, k, v = dense(x, self.wq), dense(x, self.wk), dense(x, self.wv)
        if self.bq is not None:
            q, k, v = q + self.bq, k + self.bk, v + self.bv
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, positions, self.rope_theta)
        k = apply_rope(k, positions, self.rope_theta)
        return q, k, v

    def project_out(
        self, attended: Float[Array, "*batch seq heads head_dim"]
    ) -> Float[Array, "*batch seq embed"]:
        return dense(attended, self.wo, n_contract=2)

    def __call__(
        self, x: Float[Array, "*batch seq embed"], positions: Int[Array, " seq"] | None = None
    ) -> Float[Array, "*batch seq embed"]:
        """Attention over each sequence; any leading axes are independent sequences."""
        with jax.named_scope("attention"):
            if positions is None:
                positions = jnp.arange(x.shape[-2])
            q, k, v = self.project_qkv(x, positions)
            lead_shape, seq_shape = q.shape[:-3], q.shape[-3:]
            attended = jax.nn.dot_product_attention(
                q.reshape(-1, *seq_shape),
                k.reshape(-1, *k.shape[-3:]),
                v.reshape(-1, *v.shape[-3:]),
                is_causal=True,
            )
            return self.project_out(attended.reshape(*lead_shape, *seq_shape))

    def cached_forward(
        self,
        x: Float[Array, "seq embed"],
        keys: Float[Array, "max_len kv_heads head_dim"],
        values: Float[Array, "max_len kv_heads head_dim"],
        start: Int[Array, ""],
    ) -> tuple[
        Float[Array, "seq embed"],
        Float[Array, "max_len kv_heads head_dim"],
        Float[Array, "max_len kv_heads head_dim"],
    ]:
        """Attention of ``x``, the tokens at positions ``start, ..., start + seq - 1``, over a cache.

        Their rotated keys and values are written into ``keys``/``values`` at those positions
        (rows before ``start`` hold the earlier tokens); each query then attends to every
        cache row at or before its own position, so rows not yet written are masked out and
        the cache keeps one static shape however far decoding has gone. With ``start = 0``
        and ``seq = max_len`` this is `__call__`. Returns the output and the updated cache;
        the caller ensures ``start + seq <= max_len``.
        """
        positions = start + jnp.arange(x.shape[0])
        q, k, v = self.project_qkv(x, positions)
        keys = jax.lax.dynamic_update_slice_in_dim(keys, k.astype(keys.dtype), start, axis=0)
        values = jax.lax.dynamic_update_slice_in_dim(values, v.astype(values.dtype), start, axis=0)
        visible = jnp.arange(keys.shape[0])[None, :] <= positions[:, None]
        attended = jax.nn.dot_product_attention(
            q[None],
            keys[None].astype(q.dtype),
            values[None].astype(q.dtype),
            mask=visible[None, None],
        )
        return self.project_out(attended[0]), keys, values
