"""The attention kernels behind `attend`: the dense one, the blockwise one
(`eqxzoo.nn.blockwise`) and cuDNN's fused kernel on GPUs, and how the kernel is chosen."""

from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from eqxzoo.nn.blockwise import DEFAULT_BLOCK_SIZE, blockwise_attend
from eqxzoo.nn.rows import softmax_rows
from eqxzoo.typed_config import refuse

AttentionKernel = Literal["auto", "blockwise", "dense", "cudnn"]


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
    q_segments: Int[Array, "*batch seq"] | None = None,
    k_segments: Int[Array, "*batch kv_seq"] | None = None,
) -> Float[Array, "*batch seq heads v_head_dim"]:
    """Softmax attention of each query over the keys its position (and segment, with packed
    documents) may see (`dense_attend` defines it), computed by ``kernel``
    (`choose_kernel` resolves ``"auto"``):

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
        segmented=q_segments is not None,
    )
    options = dict(
        window=window,
        scale=scale,
        softcap=softcap,
        sinks=sinks,
        q_segments=q_segments,
        k_segments=k_segments,
    )
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
    segmented: bool = False,
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
        segmented=segmented,
    )
    if requested == "cudnn" and supported is not True:
        refuse("kernel", f"'cudnn' cannot compute this attention: {supported}")
    if requested != "auto":
        return requested
    if platform == "gpu" and supported is True:
        return "cudnn"
    return "dense" if kv_seq <= block_size else "blockwise"


CUDNN_PLATFORM = "gpu"
CUDNN_DTYPES = ("bfloat16", "float16")


def cudnn_runs(*, dtype=None, platform: str | None = None) -> Literal[True] | str:
    """True where cuDNN's fused attention runs at all: inputs of ``dtype`` on ``platform``'s
    devices (either one None: not asked), else the reason it cannot (``"takes ..."``,
    ``"runs ..."``).

    What a run decides before its first step: the compute dtype in its config, the platform
    once it has devices. `cudnn_supports` adds what the model's attention must be."""
    if dtype is not None and jnp.dtype(dtype).name not in CUDNN_DTYPES:
        return f"takes bfloat16 or float16, not {jnp.dtype(dtype).name}"
    if platform is not None and platform != CUDNN_PLATFORM:
        return f"runs only on an NVIDIA GPU, not on {platform}"
    return True


def cudnn_supports(
    *,
    dtype,
    windowed: bool,
    softcap: float | None,
    sinks: bool,
    same_head_dims: bool,
    positions_are_indices: bool,
    segmented: bool = False,
) -> Literal[True] | str:
    """True where `cudnn_attend` computes the same attention, else the reason it cannot."""
    runs = cudnn_runs(dtype=dtype)
    if runs is not True:
        return f"it {runs}"
    reasons = {
        "a sliding window that is per-layer data": windowed,
        "a logit soft-cap": softcap is not None,
        "attention sinks": sinks,
        "value heads of another size than query heads": not same_head_dims,
        "positions other than 0, 1, ... (a KV cache)": not positions_are_indices,
        "masks between packed documents": segmented,
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
    q_segments: Int[Array, "*batch seq"] | None = None,
    k_segments: Int[Array, "*batch kv_seq"] | None = None,
) -> Float[Array, "*batch seq heads v_head_dim"]:
    """Softmax attention of each query over the keys its position may see.

    Scores are ``scale * q.k``, then ``softcap * tanh(score / softcap)`` if ``softcap`` is
    set (Gemma 2), masked by position (module docstring; ``window`` may be a traced per-layer
    value), normalised in float32. Query head ``h`` reads key/value head
    ``h // (heads / kv_heads)`` (grouped-query attention). Values may have another head
    dimension than queries and keys (latent attention). ``sinks`` (GPT-OSS) is one logit
    per head that joins every softmax of the head as a key with no value: the probabilities
    of the real keys then sum to less than one, so a head can attend to nothing.
    ``q_segments`` and ``k_segments`` (packed documents, per sequence): a query sees only
    the keys of its own segment as well.

    The matmuls run head-major: queries, keys and values are moved to ``(heads, seq,
    head_dim)`` first and the result back after, so that each matmul and its two gradients
    contract the minor axis of a contiguous block; left to XLA:CPU, the same einsums on the
    token-major arrays transposed the ``(seq, kv_seq)`` scores in the backward pass (fwd+bwd
    of 8 x 256 tokens, 4 heads: 32 -> 27 ms; at 1,024 tokens 219 -> 114 ms).
    """
    *batch, seq, n_heads, head_dim = q.shape
    n_kv_heads = k.shape[-2]
    groups, kv_seq = n_heads // n_kv_heads, k.shape[-3]
    grouped = q.reshape(*batch, seq, n_kv_heads, groups, head_dim)
    # (..., kv_heads, rows, head_dim): a key/value head's rows are its groups' tokens.
    rows = jnp.moveaxis(grouped, -4, -2).reshape(*batch, n_kv_heads, groups * seq, head_dim)
    k, v = jnp.moveaxis(k, -3, -2), jnp.moveaxis(v, -3, -2)  # (..., kv_heads, kv_seq, d)
    scores = jnp.einsum("...krd,...ksd->...krs", rows, k, preferred_element_type=jnp.float32)
    scores = scores.reshape(*batch, n_kv_heads, groups, seq, kv_seq)
    scores = scores * scale
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    offsets = q_positions[:, None] - k_positions[None, :]
    visible = (k_positions[None, :] >= 0) & (offsets >= 0)
    visible = visible & ((window == 0) | (offsets < window))
    if q_segments is not None:
        same = q_segments[..., :, None] == k_segments[..., None, :]
        visible = visible & same[..., None, None, :, :]
    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    if sinks is not None:
        sink_logits = sinks.astype(jnp.float32).reshape(n_kv_heads, -1, 1, 1)
        sink_logits = jnp.broadcast_to(sink_logits, (*scores.shape[:-1], 1))
        scores = jnp.concatenate([scores, sink_logits], axis=-1)
    # The softmax runs on the rows the matmul reads, so that its output is the one array
    # both backward passes keep.
    probs = softmax_rows(scores.reshape(*batch, n_kv_heads, groups * seq, -1))
    probs = probs if sinks is None else probs[..., :kv_seq]
    probs = probs.astype(v.dtype)
    attended = jnp.einsum("...krs,...ksd->...krd", probs, v, preferred_element_type=jnp.float32)
    attended = attended.reshape(*batch, n_kv_heads, groups, seq, v.shape[-1])
    attended = jnp.moveaxis(attended, -2, -4)  # (..., seq, kv_heads, groups, v_head_dim)
    return attended.reshape(*batch, seq, n_heads, v.shape[-1]).astype(q.dtype)
