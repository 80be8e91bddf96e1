"""Cross-entropy over a large vocabulary without the ``(tokens, vocab)`` logits.

`fused_cross_entropy` takes the final hidden states and the unembedding instead of logits
and computes the logits block by block (a chunk of tokens by a chunk of the vocabulary):
an online log-sum-exp (running max and sum in fp32) in the forward; in the backward, each
block's logits are recomputed from the saved inputs and per-token log-sum-exp and give that
block's share of both gradients. Temporary memory is a few blocks, whatever the vocabulary.

A weight sharded on its vocab axis (``tp``, and ``pp`` outside the pipeline) is split into
``shards`` contiguous blocks of ``vocab / shards`` ids, one a device. Chunk ``i`` takes the
``i``-th run of columns *from every block*, so under GSPMD each device reads its own
columns and only per-token maxima and sums cross devices, once, after the last chunk.
Contiguous chunks of the whole vocabulary would each live on one device and make the
compiler gather the weight; fully strided chunks (ids ``j * n_chunks + i``) keep the
sharding too, but every chunk's read touches every cache line of the weight.
"""

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from eqxzoo.nn.rows import row_max
from eqxzoo.nn.varying import varying_like

Unembedding = Float[Array, "embed vocab"] | Float[Array, "vocab embed"]
"""The head's ``(embed, vocab)`` weight, or a tied ``(vocab, embed)`` embedding table."""

DEFAULT_TOKEN_CHUNK_SIZE = 512
"""Tokens per block (see `DEFAULT_CHUNK_SIZE`)."""

DEFAULT_CHUNK_SIZE = 4096
"""Vocabulary columns per chunk. On 2 CPU cores (4096 tokens, embed 512, fp32), 2048 to
8192 ran within noise of each other; temporary memory grows with the chunk (about 88 MiB at
4096), so the smallest of the fast ones past the matmuls' efficient size."""


@dataclasses.dataclass(frozen=True)
class VocabChunks:
    """How `fused_cross_entropy` walks a vocabulary of ``vocab`` ids held in ``shards``
    contiguous blocks (the weight's vocab sharding; 1 when unsharded): ``n_chunks`` chunks,
    each ``shard_width`` consecutive columns of every block.

    Chunk ``i`` starts at offset ``min(i * shard_width, block - shard_width)`` in each
    block: when ``shard_width`` does not divide the block, the last chunk overlaps the one
    before it, and its columns already seen are masked out (logits at -inf, gradient 0)
    rather than the weight being copied into a padded buffer. ``vocab_major``: the weight
    is ``(vocab, embed)`` (a tied embedding table) rather than ``(embed, vocab)``.
    ``gather``: applied to each chunk's columns as read (`read`; None: as they are).
    """

    vocab: int
    shards: int
    n_chunks: int
    shard_width: int
    vocab_major: bool = False
    gather: Callable[[Array], Array] | None = None

    @property
    def block(self) -> int:
        return self.vocab // self.shards

    @property
    def exact(self) -> bool:
        """Whether the chunks tile every block without overlap (no masking needed)."""
        return self.n_chunks * self.shard_width == self.block

    def start(self, chunk: Int[Array, ""]) -> Int[Array, ""]:
        return jnp.minimum(chunk * self.shard_width, self.block - self.shard_width)

    def vocab_ids(self, chunk: Int[Array, ""]) -> Int[Array, "shards shard_width"]:
        """The chunk's vocabulary ids; -1 for the columns an earlier chunk covered."""
        offsets = self.start(chunk) + jnp.arange(self.shard_width)
        ids = jnp.arange(self.shards)[:, None] * self.block + offsets
        return ids if self.exact else jnp.where(self.is_new(chunk), ids, -1)

    def is_new(self, chunk: Int[Array, ""]) -> Bool[Array, " shard_width"]:
        """Which of the chunk's columns no earlier chunk covered (all but an overlap)."""
        return self.start(chunk) + jnp.arange(self.shard_width) >= chunk * self.shard_width

    @property
    def block_axis(self) -> int:
        return 1 if self.vocab_major else 2

    def blocks(self, weight: Array) -> Array:
        """``weight`` with its vocab axis split into ``(shards, block)``."""
        if self.vocab_major:
            return weight.reshape(self.shards, self.block, weight.shape[1])
        return weight.reshape(weight.shape[0], self.shards, self.block)

    def read(
        self, weight_bits: Array, chunk: Int[Array, ""], dtype: jnp.dtype
    ) -> Float[Array, "embed shards shard_width"]:
        """Chunk ``chunk``'s columns of a weight of ``dtype`` given as `_bits`, embed-major
        whatever the weight's layout. (Split into blocks here, inside the loop: a blocked
        weight entering the loop got a layout that XLA:CPU copied the weight into.)"""
        columns = jax.lax.dynamic_slice_in_dim(
            self.blocks(weight_bits), self.start(chunk), self.shard_width, axis=self.block_axis
        )
        columns = _from_bits(columns, dtype)
        columns = jnp.moveaxis(columns, -1, 0) if self.vocab_major else columns
        return columns if self.gather is None else self.gather(columns)

    def add(
        self,
        gradient: Array,
        chunk: Int[Array, ""],
        columns: Float[Array, "embed shards shard_width"],
        dtype: jnp.dtype,
    ) -> Array:
        """``gradient`` (of a weight of ``dtype``, as `_bits` of its `blocks`: the loop's
        carry, updated in place; through a reshape, XLA copied the whole buffer at every
        chunk) plus the fp32 ``columns`` at chunk ``chunk``'s place."""
        if self.vocab_major:
            columns = jnp.moveaxis(columns, 0, -1)
        start = self.start(chunk)
        if not self.exact:
            earlier = jax.lax.dynamic_slice_in_dim(
                gradient, start, self.shard_width, axis=self.block_axis
            )
            columns += _from_bits(earlier, dtype).astype(jnp.float32)
        return jax.lax.dynamic_update_slice_in_dim(
            gradient, _bits(columns.astype(dtype)), start, axis=self.block_axis
        )


def _bits(x: Array) -> Array:
    """``x``'s bits as ``uint16`` when it is a 16-bit float on XLA:CPU, else ``x``.

    XLA:CPU slices no 16-bit floats: its float normalization converts the whole operand of a
    dynamic slice or update to fp32. From a bf16 weight that made a weight-sized fp32 copy
    (two, with a layout change), and the bf16 weight gradient was converted to fp32 and back
    in full at every chunk. Integers are sliced in place (the bitcast itself is one copy, of
    half the size). Other backends slice bf16 as it is.
    """
    if x.dtype.itemsize == 2 and jax.default_backend() == "cpu":
        return jax.lax.bitcast_convert_type(x, jnp.uint16)
    return x


def _matmul_dtype(h: Array, unembedding: Array) -> jnp.dtype:
    """The operands' dtype for the matmuls: the inputs' own, but fp32 on XLA:CPU, which ran
    bf16 x bf16 -> fp32 matmuls 40% slower than fp32 ones on converted operands (with equal
    results: products of bf16 numbers are exact in fp32, and both accumulate in fp32)."""
    dtype = jnp.result_type(h, unembedding)
    return jnp.promote_types(dtype, jnp.float32) if jax.default_backend() == "cpu" else dtype


def _from_bits(x: Array, dtype: jnp.dtype) -> Array:
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


def vocab_chunks(
    vocab: int, chunk_size: int, vocab_shards: int = 1, vocab_major: bool = False
) -> VocabChunks:
    """Chunks of about ``chunk_size`` columns from each of the ``vocab_shards`` blocks (per
    device, when the weight is sharded so), as even as the block allows: ``n =
    ceil(block / chunk_size)`` chunks of ``ceil(block / n)`` columns a block, the last
    overlapping the one before by fewer than ``n`` columns. A vocabulary not divisible by
    ``vocab_shards`` is walked as one block.

    Examples at 4096, one block: 32000 -> 8 chunks of 4000; 50257 -> 13 of 3866 (one column
    of overlap); 128256 -> 32 of 4008; 151936 -> 38 of 3999; 152064 -> 38 of 4002; 262144
    -> 64 of 4096. In 8 blocks at 1024, 152064 -> 19 chunks of 8 x 1001.
    """
    shards = vocab_shards if vocab % vocab_shards == 0 else 1
    block = vocab // shards
    n_chunks = min(-(-block // chunk_size), block)
    return VocabChunks(vocab, shards, n_chunks, -(-block // n_chunks), vocab_major)


def token_chunks(batch_shape: tuple[int, ...], token_chunk_size: int) -> int:
    """How many chunks `fused_cross_entropy` splits the tokens into: the divisor ``n`` of the
    last batch axis whose chunks of ``tokens / n`` are nearest ``token_chunk_size`` (by
    ratio; ties to fewer chunks). A chunk takes every ``n``-th position of that axis, so an
    axis sharded in contiguous blocks (a flat token axis over ``dp``) stays sharded on
    every chunk whenever its device count divides ``last_axis / n``."""
    n_tokens, last = math.prod(batch_shape), batch_shape[-1]
    small = [n for n in range(1, math.isqrt(last) + 1) if last % n == 0]
    divisors = small + [last // n for n in small]
    return min(divisors, key=lambda n: (abs(math.log(n_tokens / n / token_chunk_size)), n))


def fused_cross_entropy(
    h: Float[Array, "*batch seq embed"],
    unembedding: Unembedding,
    targets: Int[Array, "*batch seq"],
    *,
    vocab_major: bool = False,
    softcap: float | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    token_chunk_size: int = DEFAULT_TOKEN_CHUNK_SIZE,
    vocab_shards: int = 1,
    token_shards: int = 1,
    gather_columns: Callable[[Array], Array] | None = None,
) -> tuple[Float[Array, "*batch seq"], Float[Array, "*batch seq"]]:
    """``(cross_entropy, log_sum_exp)`` per token of the logits ``h @ unembedding`` (then
    ``softcap * tanh(logits / softcap)`` if ``softcap`` is set: Gemma 2's final soft-cap),
    never materialising the logits: not in the forward, the residuals or the backward.

    ``h`` are the final-normed hidden states, ``(tokens, embed)`` or with more leading axes
    (kept as they are, and so is their sharding); ``unembedding`` is the head's ``(embed,
    vocab)`` weight, or with ``vocab_major`` a tied ``(vocab, embed)`` embedding table, read
    as it is (``embedding.T`` works too, but XLA may copy the transposed weight). The caller
    reduces: mean cross-entropy, and a z-loss ``weight * mean(log_sum_exp**2)`` if it wants
    one; the custom VJP takes cotangents for both outputs.

    The logits are computed in blocks of about ``token_chunk_size`` tokens (`token_chunks`)
    by ``chunk_size`` vocabulary columns (`vocab_chunks`), so temporary memory is a few
    blocks, independent of both the vocabulary and the number of tokens (plus the fp32
    ``d_h`` and the weight gradient in the backward). ``vocab_shards`` is the number of
    devices ``unembedding``'s vocab axis is sharded over (e.g. ``tp``, times ``pp`` where
    the head runs outside the pipeline): every chunk then takes columns from every device's
    block and nothing vocab-sized crosses devices. ``token_shards`` is the number of
    devices the leading token axis is split over in contiguous blocks (the batch's ``dp x
    ep``): the backward sums the weight gradient per shard inside its loops and across the
    shards once a vocabulary chunk, where one sum for all made the partitioner reduce every
    block's partial over the devices (once per token chunk, ``n`` times the gradient). A
    leading axis it does not divide is taken as one shard. ``gather_columns`` is applied
    to each chunk's ``(embed, shards, shard_width)`` columns as they are read, in the
    forward and the backward: a caller whose weight is split on its model dimension (FSDP)
    gathers them there, one chunk at a time. Results do not depend on these beyond
    rounding; communication does.

    Matmuls accumulate in fp32 (`_matmul_dtype`); log-sum-exp and softmax are fp32; the
    logits' gradient is rounded to the inputs' dtype, as autodiff of bf16 logits would, and
    the gradients come back in the inputs' dtypes. The backward does one matmul more than
    autodiff of plain logits (it recomputes them) and never reads or writes a ``(tokens,
    vocab)`` array.
    """
    vocab = unembedding.shape[0 if vocab_major else 1]
    chunks = dataclasses.replace(
        vocab_chunks(vocab, chunk_size, vocab_shards, vocab_major), gather=gather_columns
    )
    n_token_chunks = token_chunks(targets.shape, token_chunk_size)
    leading = targets.shape[0] // (n_token_chunks if targets.ndim == 1 else 1)
    shards = token_shards if leading % token_shards == 0 else 1
    with jax.named_scope("fused_cross_entropy"):
        return _cross_entropy(softcap, chunks, n_token_chunks, shards, h, unembedding, targets)


def _split_tokens(x: Array, n_batch: int, n_token_chunks: int) -> Array:
    """``x`` with the last of its ``n_batch`` leading axes viewed as ``(positions /
    n_token_chunks, n_token_chunks)``: token chunk ``k`` is index ``k`` of axis ``n_batch``."""
    axis = n_batch - 1
    return x.reshape(*x.shape[:axis], -1, n_token_chunks, *x.shape[axis + 1 :])


def _by_shard(x: Array, axis: int, shards: int) -> Array:
    """``x`` with axis ``axis`` viewed as ``(shards, size / shards)``."""
    return x.reshape(*x.shape[:axis], shards, -1, *x.shape[axis + 1 :])


def _take(x: Array, index: Int[Array, ""], axis: int) -> Array:
    return jax.lax.dynamic_index_in_dim(x, index, axis, keepdims=False)


def _put(x: Array, index: Int[Array, ""], axis: int, value: Array) -> Array:
    return jax.lax.dynamic_update_index_in_dim(x, value, index, axis)


def _chunk_logits(
    h: Float[Array, "*batch embed"],
    columns: Float[Array, "embed shards shard_width"],
    chunk: Int[Array, ""],
    softcap: float | None,
    chunks: VocabChunks,
) -> Float[Array, "*batch shards shard_width"]:
    """A block's fp32 logits, soft-capped; columns an earlier chunk covered at -inf."""
    logits = jax.lax.dot_general(
        h, columns, (((h.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    if not chunks.exact:
        logits = jnp.where(chunks.is_new(chunk), logits, -jnp.inf)
    return logits


def _forward(
    h: Float[Array, "*batch embed"],
    unembedding: Unembedding,
    targets: Int[Array, "*batch"],
    softcap: float | None,
    chunks: VocabChunks,
    n_token_chunks: int,
) -> tuple[Float[Array, "*batch"], Float[Array, "*batch"]]:
    """Online log-sum-exp over the vocabulary chunks (outer loop; each chunk's columns are
    read once and reused by every token chunk of the inner loop), and each token's target
    logit from its chunk.

    The running max, sum and target logit are kept per block ``(*batch, shards)`` and
    combined after the last chunk, so a vocab-sharded weight needs no communication inside
    the loop, only one reduction of per-token scalars at the end.
    """
    n_batch = targets.ndim
    matmul_dtype = _matmul_dtype(h, unembedding)
    h_split = _split_tokens(h, n_batch, n_token_chunks).astype(matmul_dtype)
    targets_split = _split_tokens(targets, n_batch, n_token_chunks)
    weight_bits = _bits(unembedding)

    def vocab_step(state, chunk):
        columns = chunks.read(weight_bits, chunk, unembedding.dtype).astype(matmul_dtype)
        vocab_ids = chunks.vocab_ids(chunk)

        def token_step(state, token_chunk):
            running_max, running_sum, target_logit = (
                _take(part, token_chunk, n_batch) for part in state
            )
            logits = _chunk_logits(
                _take(h_split, token_chunk, n_batch), columns, chunk, softcap, chunks
            )
            new_max = jnp.maximum(running_max, row_max(logits))
            running_sum = running_sum * jnp.exp(running_max - new_max) + jnp.sum(
                jnp.exp(logits - new_max[..., None]), axis=-1
            )
            is_target = _take(targets_split, token_chunk, n_batch)[..., None, None] == vocab_ids
            target_logit += jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1)
            updated = (new_max, running_sum, target_logit)
            return tuple(
                _put(part, token_chunk, n_batch, new) for part, new in zip(state, updated)
            ), None

        return jax.lax.scan(token_step, state, jnp.arange(n_token_chunks))[0], None

    per_block = (*targets_split.shape, chunks.shards)
    start = tuple(
        varying_like(initial, h, unembedding, targets)
        for initial in (
            jnp.full(per_block, -jnp.inf, jnp.float32),
            jnp.zeros(per_block, jnp.float32),
            jnp.zeros(per_block, jnp.float32),
        )
    )
    (running_max, running_sum, target_logit), _ = jax.lax.scan(
        vocab_step, start, jnp.arange(chunks.n_chunks)
    )
    log_sum_exp = jax.nn.logsumexp(running_max + jnp.log(running_sum), axis=-1)
    cross_entropy = log_sum_exp - jnp.sum(target_logit, axis=-1)
    return cross_entropy.reshape(targets.shape), log_sum_exp.reshape(targets.shape)


def _backward(
    h: Float[Array, "*batch embed"],
    unembedding: Unembedding,
    targets: Int[Array, "*batch"],
    log_sum_exp: Float[Array, "*batch"],
    d_cross_entropy: Float[Array, "*batch"],
    d_log_sum_exp: Float[Array, "*batch"],
    softcap: float | None,
    chunks: VocabChunks,
    n_token_chunks: int,
    token_shards: int,
) -> tuple[Float[Array, "*batch embed"], Unembedding]:
    """``(d_h, d_unembedding)`` block by block: ``d_logits = softmax * (d_ce + d_lse) -
    onehot(target) * d_ce`` (times the soft-cap's derivative 1 - (capped / softcap)^2).

    Vocabulary chunks are the outer loop: a chunk's ``h^T @ d_logits`` sums over the token
    chunks in fp32, one partial sum per token shard (batched over the shards: each device
    sums its own tokens), then over the shards, and is written once into the weight
    gradient. ``d_h`` accumulates ``d_logits @ columns^T`` in fp32, one partial sum per
    block, summed after the last chunk (with a single accumulator GSPMD all-reduced a
    ``(tokens, embed)`` partial over the shards at every chunk). ``h`` is transposed to embed-major once, outside the loops:
    XLA:CPU ran ``h^T @ d_logits`` at half speed contracting ``h``'s leading axis.
    """
    compute_dtype = jnp.result_type(h, unembedding)
    matmul_dtype = _matmul_dtype(h, unembedding)
    n_batch = targets.ndim
    # A token block's axes once its leading axis is split into (shards, tokens): the token
    # axes of h (embed-major: embed, shards, tokens) and of d_logits (shards, tokens, ...).
    h_tokens, d_logits_tokens = tuple(range(2, n_batch + 2)), tuple(range(1, n_batch + 1))
    weight_bits = _bits(unembedding)
    h_split = _split_tokens(h, n_batch, n_token_chunks).astype(matmul_dtype)
    h_embed_major = jnp.moveaxis(h_split, -1, 0)
    targets_split, log_sum_exp, d_cross_entropy, d_softmax = (
        _split_tokens(x, n_batch, n_token_chunks)
        for x in (targets, log_sum_exp, d_cross_entropy, d_cross_entropy + d_log_sum_exp)
    )

    def vocab_step(carry, chunk):
        d_h_by_block, d_unembedding = carry
        columns = chunks.read(weight_bits, chunk, unembedding.dtype).astype(matmul_dtype)
        vocab_ids = chunks.vocab_ids(chunk)

        def token_step(carry, token_chunk):
            d_h_by_block, d_columns = carry
            per_token = (
                _take(x, token_chunk, n_batch)[..., None, None]
                for x in (targets_split, log_sum_exp, d_softmax, d_cross_entropy)
            )
            target, token_log_sum_exp, token_d_softmax, token_d_cross_entropy = per_token
            h_chunk = _take(h_split, token_chunk, n_batch)
            logits = _chunk_logits(h_chunk, columns, chunk, softcap, chunks)
            d_logits = jnp.exp(logits - token_log_sum_exp) * token_d_softmax - jnp.where(
                target == vocab_ids, token_d_cross_entropy, 0.0
            )
            if softcap is not None:
                d_logits = d_logits * (1.0 - jnp.square(logits / softcap))
            if not chunks.exact:
                d_logits = jnp.where(chunks.is_new(chunk), d_logits, 0.0)
            d_logits = d_logits.astype(compute_dtype).astype(matmul_dtype)
            d_h_chunk = _take(d_h_by_block, token_chunk, n_batch + 1) + jax.lax.dot_general(
                d_logits,
                columns,
                (((n_batch + 1,), (2,)), ((n_batch,), (1,))),
                preferred_element_type=jnp.float32,
            )
            # Token shard s, then its tokens: the shards a batch axis of the matmul.
            d_columns += jax.lax.dot_general(
                _by_shard(_take(h_embed_major, token_chunk, n_batch + 1), 1, token_shards),
                _by_shard(d_logits, 0, token_shards),
                ((h_tokens, d_logits_tokens), ((1,), (0,))),
                preferred_element_type=jnp.float32,
            )
            return (_put(d_h_by_block, token_chunk, n_batch + 1, d_h_chunk), d_columns), None

        by_shard = jnp.zeros((token_shards, *columns.shape), jnp.float32)
        start = (d_h_by_block, varying_like(by_shard, d_h_by_block))
        (d_h_by_block, d_columns), _ = jax.lax.scan(token_step, start, jnp.arange(n_token_chunks))
        d_columns = jnp.sum(d_columns, axis=0)
        d_unembedding = chunks.add(d_unembedding, chunk, d_columns, unembedding.dtype)
        return (d_h_by_block, d_unembedding), None

    inputs = (h, unembedding, targets, log_sum_exp, d_cross_entropy, d_log_sum_exp)
    start = (
        varying_like(jnp.zeros((chunks.shards, *h_split.shape), jnp.float32), *inputs),
        varying_like(_bits(chunks.blocks(jnp.zeros_like(unembedding))), *inputs),
    )
    (d_h_by_block, d_unembedding), _ = jax.lax.scan(vocab_step, start, jnp.arange(chunks.n_chunks))
    d_h = jnp.sum(d_h_by_block, axis=0).reshape(h.shape).astype(h.dtype)
    return d_h, _from_bits(d_unembedding, unembedding.dtype).reshape(unembedding.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _cross_entropy(
    softcap: float | None,
    chunks: VocabChunks,
    n_token_chunks: int,
    token_shards: int,
    h: Float[Array, "*batch embed"],
    unembedding: Unembedding,
    targets: Int[Array, "*batch"],
) -> tuple[Float[Array, "*batch"], Float[Array, "*batch"]]:
    return _forward(h, unembedding, targets, softcap, chunks, n_token_chunks)


def _cross_entropy_forward(softcap, chunks, n_token_chunks, token_shards, h, unembedding, targets):
    outputs = _forward(h, unembedding, targets, softcap, chunks, n_token_chunks)
    return outputs, (h, unembedding, targets, outputs[1])


def _cross_entropy_backward(softcap, chunks, n_token_chunks, token_shards, residuals, cotangents):
    h, unembedding, targets, log_sum_exp = residuals
    d_h, d_unembedding = _backward(
        h,
        unembedding,
        targets,
        log_sum_exp,
        *cotangents,
        softcap,
        chunks,
        n_token_chunks,
        token_shards,
    )
    return d_h, d_unembedding, None


_cross_entropy.defvjp(_cross_entropy_forward, _cross_entropy_backward)
