"""Causal self-attention with multi-head, grouped-query and multi-query layouts, sliding windows,
logit soft-capping and the per-family options of the zoo (biases, QK-norm, rotary or none).

`eqxzoo.nn.kernels.attend` is the attention itself, with its mask built from positions: a
query at position ``q`` sees the keys at positions ``p`` with ``q - window < p <= q``
(``window = 0``: every ``p <= q``), and never a key at a negative position (an unwritten
cache slot). `CausalSelfAttention.__call__` attends within a sequence; `CausalSelfAttention.cached_forward`
attends to a key/value cache of earlier tokens (incremental decoding), which may be a ring of
the last ``window`` positions when that is all a model ever reads.
"""

from collections.abc import Mapping
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqxzoo.nn.axes import AbstractAxesOwner, LogicalName
from eqxzoo.nn.context import ContextSplit
from eqxzoo.nn.documents import Documents
from eqxzoo.nn.kernels import DEFAULT_BLOCK_SIZE, AttentionKernel, attend
from eqxzoo.nn.linear import dense, normal_init
from eqxzoo.nn.lora import LoraWeight
from eqxzoo.nn.norm import RMSNorm
from eqxzoo.nn.rope import RopeScaling, apply_rope, rope_amplitude, rope_frequencies
from eqxzoo.typed_config import refuse

QKNorm = Literal["none", "head", "all_heads"]


def check_kv_heads(n_heads: int, n_kv_heads: int) -> None:
    """Refuse key/value heads that do not split the query heads into equal groups."""
    if n_kv_heads < 1:
        refuse("n_kv_heads", f"must be >= 1, got {n_kv_heads}")
    if n_heads % n_kv_heads != 0:
        refuse("n_kv_heads", f"must divide n_heads={n_heads}, got {n_kv_heads}")


class CausalSelfAttention(AbstractAxesOwner):
    """Causal self-attention, optionally windowed, soft-capped and rotary-embedded.

    ``n_kv_heads == n_heads`` is MHA, ``1`` is MQA, anything dividing ``n_heads`` is GQA.
    Projections are kept per head (``wq: (embed, heads, head_dim)``) so that the logical
    ``heads`` axis can be sharded over tensor parallelism without reshapes. Options:

    - biases on q/k/v (Qwen2) and on the output (GPT-2, ``attention_bias`` families);
    - QK-norm: an RMSNorm of queries and keys before the rotation, per head over
      ``head_dim`` (``"head"``: Qwen3, Gemma 3) or over all heads at once (``"all_heads"``:
      OLMo 2, OLMoE); ``clip_qkv`` clamps queries, keys and values after it (OLMoE);
    - rotary embeddings with base ``rope_theta`` (None: no positional rotation, GPT-2) and
      ``rope_scaling``; layers with a window use ``local_rope_theta`` if set (Gemma 3);
    - ``window``: the layer's sliding window as per-layer *data* (an integer array, 0 for
      full attention; stacked layers carry one value each, so windowed and global layers
      share one structure); None when no layer of the model has one;
    - ``scale`` of the scores (default ``head_dim^-0.5``) and ``softcap`` (Gemma 2);
    - ``sinks``: a trained logit per head joining each softmax (`attend`; GPT-OSS);
    - ``kernel`` and ``block_size``: how `attend` computes it (the same attention either way);
    - ``context``: the sequence split over a context-parallel mesh axis (`ContextSplit`; the
      layer then runs on a shard of each sequence inside a region manual over that axis and
      attends across shards, ``kernel`` aside).
    """

    wq: Float[Array, "embed heads head_dim"] | LoraWeight
    wk: Float[Array, "embed kv_heads head_dim"] | LoraWeight
    wv: Float[Array, "embed kv_heads head_dim"] | LoraWeight
    wo: Float[Array, "heads head_dim embed"] | LoraWeight
    bq: Float[Array, "heads head_dim"] | None
    bk: Float[Array, "kv_heads head_dim"] | None
    bv: Float[Array, "kv_heads head_dim"] | None
    bo: Float[Array, " embed"] | None
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    window: Int[Array, ""] | None
    sinks: Float[Array, " heads"] | None
    n_heads: int = eqx.field(static=True)
    n_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    rope_theta: float | None = eqx.field(static=True)
    rope_scaling: RopeScaling | None = eqx.field(static=True)
    local_rope_theta: float | None = eqx.field(static=True)
    scale: float = eqx.field(static=True)
    softcap: float | None = eqx.field(static=True)
    clip_qkv: float | None = eqx.field(static=True)
    kernel: AttentionKernel = eqx.field(static=True)
    block_size: int = eqx.field(static=True)
    context: ContextSplit | None = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        rope_theta: float | None = 10000.0,
        rope_scaling: RopeScaling | None = None,
        local_rope_theta: float | None = None,
        window: int | None = None,
        qkv_bias: bool = False,
        out_bias: bool = False,
        qk_norm: QKNorm = "none",
        norm_eps: float = 1e-6,
        norm_weight_offset: float = 0.0,
        clip_qkv: float | None = None,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: bool = False,
        kernel: AttentionKernel = "auto",
        block_size: int = DEFAULT_BLOCK_SIZE,
        context: ContextSplit | None = None,
        init_std: float = 0.02,
        key: PRNGKeyArray,
    ):
        check_kv_heads(n_heads, n_kv_heads)
        if qk_norm not in ("none", "head", "all_heads"):
            refuse("qk_norm", f"must be 'none', 'head' or 'all_heads', got {qk_norm!r}")
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.wq = normal_init(kq, (d_model, n_heads, head_dim), init_std)
        self.wk = normal_init(kk, (d_model, n_kv_heads, head_dim), init_std)
        self.wv = normal_init(kv, (d_model, n_kv_heads, head_dim), init_std)
        self.wo = normal_init(ko, (n_heads, head_dim, d_model), init_std)
        self.bq = jnp.zeros((n_heads, head_dim)) if qkv_bias else None
        self.bk = jnp.zeros((n_kv_heads, head_dim)) if qkv_bias else None
        self.bv = jnp.zeros((n_kv_heads, head_dim)) if qkv_bias else None
        self.bo = jnp.zeros((d_model,)) if out_bias else None
        norm = dict(eps=norm_eps, weight_offset=norm_weight_offset)
        if qk_norm == "head":
            self.q_norm = RMSNorm(head_dim, axis_names=("head_dim",), **norm)
            self.k_norm = RMSNorm(head_dim, axis_names=("head_dim",), **norm)
        elif qk_norm == "all_heads":
            self.q_norm = RMSNorm((n_heads, head_dim), axis_names=("heads", "head_dim"), **norm)
            self.k_norm = RMSNorm(
                (n_kv_heads, head_dim), axis_names=("kv_heads", "head_dim"), **norm
            )
        else:
            self.q_norm = self.k_norm = None
        self.window = None if window is None else jnp.asarray(window, jnp.int32)
        self.sinks = (
            normal_init(jax.random.fold_in(key, 4), (n_heads,), init_std) if sinks else None
        )
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.local_rope_theta = local_rope_theta
        self.scale = head_dim**-0.5 if scale is None else scale
        self.softcap = softcap
        self.clip_qkv = clip_qkv
        self.kernel = kernel
        self.block_size = block_size
        self.context = context

    def param_axes(self) -> Mapping[str, tuple[LogicalName, ...]]:
        return {
            "wq": ("embed", "heads", "head_dim"),
            "wk": ("embed", "kv_heads", "head_dim"),
            "wv": ("embed", "kv_heads", "head_dim"),
            "wo": ("heads", "head_dim", "embed"),
            "bq": ("heads", "head_dim"),
            "bk": ("kv_heads", "head_dim"),
            "bv": ("kv_heads", "head_dim"),
            "bo": ("embed",),
            "window": (),
            "sinks": ("heads",),
        }

    @property
    def layer_window(self) -> Int[Array, ""] | int:
        """This layer's window (0: the whole causal prefix)."""
        return 0 if self.window is None else self.window

    def rotary_frequencies(self, seq_len: Int[Array, ""] | int) -> Float[Array, " half"] | None:
        """This layer's rotary frequencies for a sequence of ``seq_len`` positions so far."""
        if self.rope_theta is None:
            return None
        frequencies = rope_frequencies(self.head_dim, self.rope_theta, self.rope_scaling, seq_len)
        if self.local_rope_theta is not None and self.window is not None:
            local = rope_frequencies(self.head_dim, self.local_rope_theta)
            frequencies = jnp.where(self.window > 0, local, frequencies)
        return frequencies

    def project_qkv(
        self,
        x: Float[Array, "*batch seq embed"],
        positions: Int[Array, "*#batch seq"],
        seq_len: Int[Array, ""] | int | None = None,
    ) -> tuple[
        Float[Array, "*batch seq heads head_dim"],
        Float[Array, "*batch seq kv_heads head_dim"],
        Float[Array, "*batch seq kv_heads head_dim"],
    ]:
        """Queries, keys (both normed and rotated) and values for ``x`` at ``positions`` (per
        sequence with packed documents) of a sequence of ``seq_len`` positions so far
        (default: the last position plus one)."""
        q, k, v = dense(x, self.wq), dense(x, self.wk), dense(x, self.wv)
        if self.bq is not None:
            q, k, v = q + self.bq, k + self.bk, v + self.bv
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (jnp.clip(a, -self.clip_qkv, self.clip_qkv) for a in (q, k, v))
        frequencies = self.rotary_frequencies(positions[-1] + 1 if seq_len is None else seq_len)
        if frequencies is not None:
            amplitude = rope_amplitude(self.rope_scaling)
            if self.local_rope_theta is not None and self.window is not None:
                amplitude = jnp.where(self.window > 0, 1.0, amplitude)
            q = apply_rope(q, positions, frequencies, amplitude)
            k = apply_rope(k, positions, frequencies, amplitude)
        return q, k, v

    def project_out(
        self, attended: Float[Array, "*batch seq heads head_dim"]
    ) -> Float[Array, "*batch seq embed"]:
        out = dense(attended, self.wo, n_contract=2)
        return out if self.bo is None else out + self.bo

    def __call__(
        self,
        x: Float[Array, "*batch seq embed"],
        positions: Int[Array, " seq"] | None = None,
        documents: Documents | None = None,
    ) -> Float[Array, "*batch seq embed"]:
        """Attention over each sequence; any leading axes are independent sequences. With a
        ``context`` split, ``x`` is this device's shard of each sequence and ``positions``
        (default: the split's) its tokens' positions. With ``documents`` (packed in each
        sequence) a token attends only within its own and is rotated by its position there."""
        with jax.named_scope("attention"):
            if self.context is not None:
                return self._attend_across_shards(x, positions, documents)
            positions_are_indices = positions is None
            if positions is None:
                positions = jnp.arange(x.shape[-2])
            rotated = positions if documents is None else documents.positions
            q, k, v = self.project_qkv(x, rotated, positions[-1] + 1)
            segments = None if documents is None else documents.segments
            attended = attend(
                q,
                k,
                v,
                positions,
                positions,
                window=self.layer_window,
                scale=self.scale,
                softcap=self.softcap,
                sinks=self.sinks,
                kernel=self.kernel,
                block_size=self.block_size,
                positions_are_indices=positions_are_indices,
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
        q, k, v = self.project_qkv(x, rotated, seq_len)
        attended = self.context.attend(
            q,
            k,
            v,
            positions,
            window=self.layer_window,
            scale=self.scale,
            softcap=self.softcap,
            sinks=self.sinks,
            block_size=self.block_size,
            segments=None if documents is None else documents.segments,
        )
        return self.project_out(attended)

    def empty_cache(
        self, slots: int, dtype
    ) -> tuple[Float[Array, "slots kv_heads head_dim"], Float[Array, "slots kv_heads head_dim"]]:
        """This layer's empty cache of ``slots`` positions: keys and values."""
        shape = (slots, self.n_kv_heads, self.head_dim)
        return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)

    def cached_forward(
        self,
        x: Float[Array, "seq embed"],
        cache: tuple[
            Float[Array, "cache kv_heads head_dim"], Float[Array, "cache kv_heads head_dim"]
        ],
        cache_positions: Int[Array, " cache"],
        start: Int[Array, ""],
    ) -> tuple[
        Float[Array, "seq embed"],
        tuple[Float[Array, "cache kv_heads head_dim"], Float[Array, "cache kv_heads head_dim"]],
    ]:
        """Attention of ``x``, the tokens at positions ``start, ..., start + seq - 1``, over a
        cache of earlier tokens and themselves.

        ``cache`` is ``(keys, values)`` (`empty_cache`): slot ``i`` holds the (rotated) key
        and the value of position ``cache_positions[i]`` (negative: empty). The queries
        attend to the cached keys and their own together, masked by position, so the cache
        may be a ring: position ``p`` is written to slot ``p % cache``, and of a chunk longer
        than the cache only its last ``cache`` tokens are kept. A cache at least as long as
        the sequence, or as the longest window of a model whose every layer is windowed,
        gives `__call__`'s result. Returns the output and the cache with these tokens written.
        """
        keys, values = cache
        seq = x.shape[0]
        positions = start + jnp.arange(seq)
        q, k, v = self.project_qkv(x, positions)
        attended = attend(
            q,
            jnp.concatenate([keys.astype(q.dtype), k]),
            jnp.concatenate([values.astype(q.dtype), v]),
            positions,
            jnp.concatenate([cache_positions, positions]),
            window=self.layer_window,
            scale=self.scale,
            softcap=self.softcap,
            sinks=self.sinks,
            kernel=self.kernel,
            block_size=self.block_size,
        )
        return self.project_out(attended), write_cache(cache, (k, v), positions)


def write_cache(
    cache: tuple[Array, ...], entries: tuple[Array, ...], positions: Int[Array, " seq"]
) -> tuple[Array, ...]:
    """Each ``(slots, ...)`` array of ``cache`` with the matching ``(seq, ...)`` array of
    ``entries``, the chunk at consecutive ``positions``, written to its slots (`cache_slots`),
    in the cache's dtype."""
    slots = cache_slots(positions, cache[0].shape[0])
    return tuple(
        stored.at[slots].set(new.astype(stored.dtype), mode="drop")
        for stored, new in zip(cache, entries, strict=True)
    )


def cache_slots(positions: Int[Array, " seq"], size: int) -> Int[Array, " seq"]:
    """The cache slot each of a chunk's consecutive ``positions`` is written to in a ring of
    ``size`` slots: ``position % size``, or ``size`` (out of range: not written) for the
    tokens a later token of the same chunk overwrites."""
    seq = positions.shape[0]
    superseded = jnp.arange(seq) < seq - size
    return jnp.where(superseded, size, positions % size)
