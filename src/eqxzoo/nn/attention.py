"""Causal self-attention with multi-head, grouped-query and multi-query layouts, sliding windows,
logit soft-capping and the per-family options of the zoo (biases, QK-norm, rotary or none).

`attend` is the attention itself, with its mask built from positions: a query at position
``q`` sees the keys at positions ``p`` with ``q - window < p <= q`` (``window = 0``: every
``p <= q``), and never a key at a negative position (an unwritten cache slot).
`CausalSelfAttention.__call__` attends within a sequence; `CausalSelfAttention.cached_forward`
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
from eqxzoo.nn.blockwise import blockwise_attend
from eqxzoo.nn.linear import dense, normal_init
from eqxzoo.nn.norm import RMSNorm
from eqxzoo.nn.rope import RopeScaling, apply_rope, rope_amplitude, rope_frequencies
from eqxzoo.typed_config import refuse

QKNorm = Literal["none", "head", "all_heads"]


AttentionKernel = Literal["auto", "blockwise", "dense", "cudnn"]
DEFAULT_BLOCK_SIZE = 512


def check_kv_heads(n_heads: int, n_kv_heads: int) -> None:
    """Refuse key/value heads that do not split the query heads into equal groups."""
    if n_kv_heads < 1:
        refuse("n_kv_heads", f"must be >= 1, got {n_kv_heads}")
    if n_heads % n_kv_heads != 0:
        refuse("n_kv_heads", f"must divide n_heads={n_heads}, got {n_kv_heads}")


def attend(
    q: Float[Array, "*batch seq heads head_dim"],
    k: Float[Array, "*batch kv_seq kv_heads head_dim"],
    v: Float[Array, "*batch kv_seq kv_heads v_head_dim"],
    q_positions: Int[Array, " seq"],
    k_positions: Int[Array, " kv_seq"],
    *,
    window: Int[Array, ""] | int = 0,
    scale: float,
    softcap: float | None = None,
    sinks: Float[Array, " heads"] | None = None,
    kernel: AttentionKernel = "dense",
    block_size: int = DEFAULT_BLOCK_SIZE,
    positions_are_indices: bool = False,
) -> Float[Array, "*batch seq heads v_head_dim"]:
    """Softmax attention of each query over the keys its position may see (`dense_attend`
    defines it), computed by ``kernel`` (`choose_kernel` resolves ``"auto"``):

    - ``"dense"``: the whole ``(heads, seq, kv_seq)`` score matrix, masked (the reference);
    - ``"blockwise"``: `eqxzoo.nn.blockwise.blockwise_attend`, an online softmax over key
      blocks of ``block_size`` that skips the blocks no query of a block may see, with a
      custom VJP that recomputes them: memory linear in the sequence;
    - ``"cudnn"``: `jax.nn.dot_product_attention`'s cuDNN kernel (GPU), for causal
      self-attention without soft-cap, sinks or windows; ``positions_are_indices`` says that
      both position vectors are ``0, 1, ...`` (the only masking it expresses).
    """
    kernel = choose_kernel(
        kernel,
        dtype=q.dtype,
        kv_seq=k.shape[-3],
        block_size=block_size,
        windowed=not (isinstance(window, int) and window == 0),
        softcap=softcap,
        sinks=sinks is not None,
        same_head_dims=q.shape[-1] == v.shape[-1],
        positions_are_indices=positions_are_indices,
    )
    options = dict(window=window, scale=scale, softcap=softcap, sinks=sinks)
    if kernel == "dense":
        return dense_attend(q, k, v, q_positions, k_positions, **options)
    if kernel == "blockwise":
        return blockwise_attend(q, k, v, q_positions, k_positions, block_size=block_size, **options)
    return cudnn_attend(q, k, v, scale=scale)


def choose_kernel(
    requested: AttentionKernel,
    *,
    dtype,
    kv_seq: int,
    block_size: int,
    windowed: bool,
    softcap: float | None,
    sinks: bool,
    same_head_dims: bool,
    positions_are_indices: bool,
    platform: str | None = None,
) -> Literal["blockwise", "dense", "cudnn"]:
    """The kernel ``"auto"`` means here: on a GPU, cuDNN where it computes this attention
    (`cudnn_supports`), else blockwise; elsewhere blockwise, or dense when every key fits
    one block (the two then do the same work). An explicit request is kept; ``"cudnn"``
    where cuDNN cannot compute the attention raises."""
    platform = platform or jax.default_backend()
    supported = cudnn_supports(
        dtype=dtype,
        windowed=windowed,
        softcap=softcap,
        sinks=sinks,
        same_head_dims=same_head_dims,
        positions_are_indices=positions_are_indices,
    )
    if requested == "cudnn" and supported is not True:
        refuse("kernel", f"'cudnn' cannot compute this attention: {supported}")
    if requested != "auto":
        return requested
    if platform == "gpu" and supported is True:
        return "cudnn"
    return "dense" if kv_seq <= block_size else "blockwise"


def cudnn_supports(
    *,
    dtype,
    windowed: bool,
    softcap: float | None,
    sinks: bool,
    same_head_dims: bool,
    positions_are_indices: bool,
) -> Literal[True] | str:
    """True where `cudnn_attend` computes the same attention, else the reason it cannot."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"it takes bfloat16 or float16, not {jnp.dtype(dtype).name}"
    reasons = {
        "a sliding window that is per-layer data": windowed,
        "a logit soft-cap": softcap is not None,
        "attention sinks": sinks,
        "value heads of another size than query heads": not same_head_dims,
        "positions other than 0, 1, ... (a KV cache)": not positions_are_indices,
    }
    unsupported = [reason for reason, present in reasons.items() if present]
    return f"it has no {', '.join(unsupported)}" if unsupported else True


def cudnn_attend(
    q: Float[Array, "*batch seq heads head_dim"],
    k: Float[Array, "*batch seq kv_heads head_dim"],
    v: Float[Array, "*batch seq kv_heads head_dim"],
    *,
    scale: float,
    implementation: Literal["cudnn", "xla"] | None = "cudnn",
) -> Float[Array, "*batch seq heads head_dim"]:
    """Causal self-attention by `jax.nn.dot_product_attention` (cuDNN's fused kernel on a
    GPU; ``implementation="xla"`` computes the same anywhere, which the tests use), for
    any leading batch axes."""
    *batch, seq, n_heads, head_dim = q.shape
    flat = [a.reshape(-1, *a.shape[-3:]) for a in (q, k, v)]
    attended = jax.nn.dot_product_attention(
        *flat, scale=scale, is_causal=True, implementation=implementation
    )
    return attended.reshape(*batch, seq, n_heads, head_dim)


def dense_attend(
    q: Float[Array, "*batch seq heads head_dim"],
    k: Float[Array, "*batch kv_seq kv_heads head_dim"],
    v: Float[Array, "*batch kv_seq kv_heads v_head_dim"],
    q_positions: Int[Array, " seq"],
    k_positions: Int[Array, " kv_seq"],
    *,
    window: Int[Array, ""] | int = 0,
    scale: float,
    softcap: float | None = None,
    sinks: Float[Array, " heads"] | None = None,
) -> Float[Array, "*batch seq heads v_head_dim"]:
    """Softmax attention of each query over the keys its position may see.

    Scores are ``scale * q.k``, then ``softcap * tanh(score / softcap)`` if ``softcap`` is
    set (Gemma 2), masked by position (module docstring; ``window`` may be a traced per-layer
    value), normalised in float32. Query head ``h`` reads key/value head
    ``h // (heads / kv_heads)`` (grouped-query attention). Values may have another head
    dimension than queries and keys (latent attention). ``sinks`` (GPT-OSS) is one logit
    per head that joins every softmax of the head as a key with no value: the probabilities
    of the real keys then sum to less than one, so a head can attend to nothing.
    """
    *batch, seq, n_heads, head_dim = q.shape
    n_kv_heads = k.shape[-2]
    grouped = q.reshape(*batch, seq, n_kv_heads, n_heads // n_kv_heads, head_dim)
    scores = jnp.einsum("...tkgd,...skd->...kgts", grouped, k, preferred_element_type=jnp.float32)
    scores = scores * scale
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    offsets = q_positions[:, None] - k_positions[None, :]
    visible = (k_positions[None, :] >= 0) & (offsets >= 0)
    visible = visible & ((window == 0) | (offsets < window))
    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        sink_logits = sinks.astype(jnp.float32).reshape(n_kv_heads, -1, 1, 1)
        sink_logits = jnp.broadcast_to(sink_logits, (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink_logits], axis=-1), axis=-1)
        probs = probs[..., :-1]
    probs = probs.astype(v.dtype)
    attended = jnp.einsum("...kgts,...skd->...tkgd", probs, v, preferred_element_type=jnp.float32)
    return attended.reshape(*batch, seq, n_heads, v.shape[-1]).astype(q.dtype)


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
    - ``kernel`` and ``block_size``: how `attend` computes it (the same attention either way).
    """

    wq: Float[Array, "embed heads head_dim"]
    wk: Float[Array, "embed kv_heads head_dim"]
    wv: Float[Array, "embed kv_heads head_dim"]
    wo: Float[Array, "heads head_dim embed"]
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

    def rotary_frequencies(self, seq_len: Int[Array, ""]) -> Float[Array, " half"] | None:
        """This layer's rotary frequencies for a sequence of ``seq_len`` positions so far."""
        if self.rope_theta is None:
            return None
        frequencies = rope_frequencies(self.head_dim, self.rope_theta, self.rope_scaling, seq_len)
        if self.local_rope_theta is not None and self.window is not None:
            local = rope_frequencies(self.head_dim, self.local_rope_theta)
            frequencies = jnp.where(self.window > 0, local, frequencies)
        return frequencies

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
        if self.clip_qkv is not None:
            q, k, v = (jnp.clip(a, -self.clip_qkv, self.clip_qkv) for a in (q, k, v))
        frequencies = self.rotary_frequencies(positions[-1] + 1)
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
        self, x: Float[Array, "*batch seq embed"], positions: Int[Array, " seq"] | None = None
    ) -> Float[Array, "*batch seq embed"]:
        """Attention over each sequence; any leading axes are independent sequences."""
        with jax.named_scope("attention"):
            positions_are_indices = positions is None
            if positions is None:
                positions = jnp.arange(x.shape[-2])
            q, k, v = self.project_qkv(x, positions)
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
