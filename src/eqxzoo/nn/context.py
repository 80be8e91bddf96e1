"""Attention over a sequence split along a context-parallel mesh axis (`context_attend`).

Each device holds a shard of every sequence's tokens (their queries, keys and values) and
the positions they sit at; attention needs every key a query may see, and those are spread
over the axis. Two ways to bring them together, both exact:

- ``"all_gather"``: gather the keys and values (and their positions) of the whole axis,
  then attend blockwise (`eqxzoo.nn.blockwise`). Simple, one collective each way; best where
  keys and values are small beside the queries (grouped-query and latent attention). Its
  backward is the gather's transpose, a reduce-scatter of their gradients.
- ``"ring"``: keep one shard of keys and values at a time. Over ``n`` steps each device
  attends its queries to the shard it holds, folds the partial result into a running
  output and log-sum-exp, and passes the shard to its neighbour (`jax.lax.ppermute`: the
  next shard's transfer can run under this shard's compute). The backward runs the ring
  again: each step recomputes the shard's scores from the saved global log-sum-exp
  (FlashAttention-2's backward, one shard of keys at a time), keeps its queries' gradient
  and sends the keys' and values' gradients around with their shard, home after ``n``
  steps. Memory holds two shards of keys and values, never the sequence.

Positions may be in any order, so a causal sequence can be laid out for balance
(`balanced_order`: each shard a chunk from the front and its mirror from the back): every
shard then has the same attention work, and the block pairs a causal mask or a window
empties are skipped inside each step, whole steps included.
"""

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PyTree

from eqxzoo.nn.blockwise import (
    DEFAULT_BLOCK_SIZE,
    _Blocks,
    _blockwise_bwd,
    _forward,
    _from_blocks,
    _sink_rows,
    blockwise_attend,
    on_one_batch_axis,
)
from eqxzoo.nn.varying import cotangent_for, varying_like


def balanced_order(seq: int, shards: int) -> np.ndarray:
    """The positions ``0 .. seq - 1`` in the order that cuts into ``shards`` equal shards of
    equal causal work: the sequence in ``2 * shards`` chunks, shard ``i`` holding chunk
    ``i`` and chunk ``2 * shards - 1 - i`` (torchtitan's and MaxText's head-tail layout)."""
    if seq % (2 * shards):
        raise ValueError(f"a sequence of {seq} does not split into 2 x {shards} equal chunks")
    chunks = np.arange(seq).reshape(2 * shards, -1)
    return np.concatenate([np.concatenate([chunks[i], chunks[-1 - i]]) for i in range(shards)])


ContextStrategy = Literal["ring", "all_gather"]


def context_calls(
    seq: int, shards: int, strategy: ContextStrategy
) -> tuple[np.ndarray, np.ndarray]:
    """The query and key positions ``(calls, ...)`` of each blockwise call a sequence of
    ``seq`` split over ``shards`` runs, over all its devices: the ring's each pair of
    shards, the all-gather's each shard against the whole
    (`eqxzoo.nn.blockwise.block_counts` counts them)."""
    order = balanced_order(seq, shards).reshape(shards, -1)
    if strategy == "all_gather":
        return order, np.broadcast_to(order.reshape(1, -1), (shards, seq))
    return np.repeat(order, shards, axis=0), np.tile(order, (shards, 1))


@dataclasses.dataclass(frozen=True)
class ContextSplit:
    """Where a layer's sequence is split: over the mesh axis ``axis_name``, in the
    `balanced_order` layout, attended across shards by ``strategy`` (`context_attend`).

    A layer holding one (a static field) must be called inside a region manual over
    ``axis_name`` (the trainer's pipeline and prefix regions) on its shard of every sequence;
    it finds its tokens' positions from its index on the axis (`positions`), and averages the
    statistics it reports over the shards (`mean`), so that each equals the whole sequence's.
    """

    axis_name: str
    strategy: ContextStrategy = "ring"

    def shards(self) -> int:
        return jax.lax.axis_size(self.axis_name)

    def locate(
        self, local_seq: int, positions: Int[Array, " seq"] | None = None
    ) -> tuple[Int[Array, " seq"], int]:
        """A shard of ``local_seq`` tokens' positions (``positions``, or by default this
        device's in the split) and the whole sequence's length."""
        if positions is None:
            positions = self.positions(local_seq)
        return positions, local_seq * self.shards()

    def positions(self, local_seq: int) -> Int[Array, " seq"]:
        """The positions of this device's ``local_seq`` tokens in the whole sequence."""
        shards = self.shards()
        order = balanced_order(local_seq * shards, shards).reshape(shards, local_seq)
        return jnp.asarray(order, jnp.int32)[jax.lax.axis_index(self.axis_name)]

    def mean(self, tree: PyTree) -> PyTree:
        """Per-shard means (over equal numbers of tokens) as the whole sequence's."""
        return jax.lax.pmean(tree, self.axis_name)

    def attend(
        self,
        q: Float[Array, "*batch seq heads head_dim"],
        k: Float[Array, "*batch seq kv_heads head_dim"],
        v: Float[Array, "*batch seq kv_heads v_head_dim"],
        positions: Int[Array, " seq"],
        **options,
    ) -> Float[Array, "*batch seq heads v_head_dim"]:
        """`context_attend` over this split's axis, by its strategy."""
        return context_attend(
            q, k, v, positions, axis_name=self.axis_name, strategy=self.strategy, **options
        )


def context_attend(
    q: Float[Array, "*batch seq heads head_dim"],
    k: Float[Array, "*batch seq kv_heads head_dim"],
    v: Float[Array, "*batch seq kv_heads v_head_dim"],
    positions: Int[Array, " seq"],
    *,
    axis_name: str,
    strategy: str = "ring",
    window: Int[Array, ""] | int = 0,
    scale: float,
    softcap: float | None = None,
    sinks: Float[Array, " heads"] | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    segments: Int[Array, "*batch seq"] | None = None,
) -> Float[Array, "*batch seq heads v_head_dim"]:
    """`eqxzoo.nn.blockwise.blockwise_attend` of this device's shard of the queries against
    the keys and values of every shard along ``axis_name`` (called inside a region manual
    over it): ``positions`` are this shard's tokens' positions in the sequence, the keys'
    and the queries' alike, and so are ``segments`` (packed documents; they travel with the
    keys). Same options (window, soft-cap, sinks, grouped-query heads), the same result to
    float32 rounding; ``strategy`` as the module docstring says."""
    if strategy == "all_gather":
        gather = functools.partial(jax.lax.all_gather, axis_name=axis_name, tiled=True)
        return blockwise_attend(
            q,
            gather(k, axis=k.ndim - 3),
            gather(v, axis=v.ndim - 3),
            positions,
            gather(positions, axis=0),
            window=window,
            scale=scale,
            softcap=softcap,
            sinks=sinks,
            block_size=block_size,
            q_segments=segments,
            k_segments=None if segments is None else gather(segments, axis=segments.ndim - 1),
        )
    if strategy != "ring":
        raise ValueError(
            f'context parallel strategy must be "ring" or "all_gather", got {strategy!r}'
        )

    def run(blocks, q, k, v, segments):
        return _ring(
            blocks,
            axis_name,
            q,
            k,
            v,
            positions.astype(jnp.int32),
            jnp.asarray(window, jnp.int32),
            sinks,
            segments,
        )

    lead = math.prod(q.shape[:-3])
    flat = None if segments is None else segments.reshape(lead, -1).astype(jnp.int32)
    return on_one_batch_axis(
        run, q, k, v, flat, block_size=block_size, scale=scale, softcap=softcap
    )


def _shift(tree, axis_name: str):
    """Every array of ``tree`` passed to the next device along ``axis_name``: a
    `jax.lax.ppermute`, or on XLA:CPU an all-to-all in which each device's other slots are
    zeros. XLA:CPU's collective-permute inside a conditional that some devices of the program
    skip (pipeline stages idling in a bubble) read wrong buffers (measured: gradients off by
    100x on pp 2 x cp 2), while its all-to-all, grouped by the axis, is exact there; it moves
    ``n`` times the bytes, which simulated devices do not feel."""
    n = jax.lax.axis_size(axis_name)
    if jax.default_backend() != "cpu":
        return jax.lax.ppermute(tree, axis_name, [(i, (i + 1) % n) for i in range(n)])
    index = jax.lax.axis_index(axis_name)

    def shift(x):
        outgoing = jnp.zeros((n, *x.shape), x.dtype).at[(index + 1) % n].set(x)
        incoming = jax.lax.all_to_all(outgoing, axis_name, 0, 0, tiled=False)
        return incoming[(index - 1) % n]

    return jax.tree.map(shift, tree)


def _held_segments(segments, k_segments):
    """The queries' and the held keys' segment ids as `_forward` takes them (None: none)."""
    return None if segments is None else (segments, k_segments)


def _ring_forward(blocks, axis_name, q, k, v, positions, window, sinks, segments):
    """The output and the float32 log-sum-exp of every row in `_forward`'s block layout
    (+inf where a row sees nothing, sink included), folded over the ring's shards.
    ``segments``: this shard's tokens' segment ids ``(b, seq)`` (they travel with the keys),
    or None."""
    n = jax.lax.axis_size(axis_name)
    b, seq, n_heads, _ = q.shape
    groups = n_heads // k.shape[2]

    def fold(carry, _):
        out, lse, k_held, v_held, k_positions, k_segments = carry
        # Sent first, so that the transfer can run while this shard is attended to.
        arriving = _shift((k_held, v_held, k_positions, k_segments), axis_name)
        part, part_lse = _forward(
            blocks,
            q,
            k_held,
            v_held,
            positions,
            k_positions,
            window,
            None,
            _held_segments(segments, k_segments),
        )
        part_lse = jnp.where(part_lse == jnp.inf, -jnp.inf, part_lse)
        new_lse = jnp.logaddexp(lse, part_lse)
        safe = jnp.where(new_lse == -jnp.inf, 0.0, new_lse)
        weight_old = _as_rows(jnp.exp(lse - safe), b, groups, seq)
        weight_part = _as_rows(jnp.exp(part_lse - safe), b, groups, seq)
        out = out * weight_old + part.astype(jnp.float32) * weight_part
        return (out, new_lse, *arriving), None

    sources = (q, k, v, positions)
    lse0 = varying_like(jnp.full(_lse_shape(blocks, q, k.shape[2]), -jnp.inf), *sources)
    out0 = varying_like(jnp.zeros((*q.shape[:3], v.shape[-1]), jnp.float32), *sources)
    init = (out0, lse0, k, v, positions, segments)
    (out, lse, *_), _ = jax.lax.scan(fold, init, None, length=n)
    if sinks is not None:
        sink_rows = _sink_rows(sinks, b, k.shape[2], blocks.q_block, blocks.per_step)
        with_sink = jnp.logaddexp(lse, sink_rows[:, None])
        out = out * _as_rows(jnp.exp(lse - with_sink), b, groups, seq)
        lse = with_sink
    lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)
    return out.astype(q.dtype), lse


def _lse_shape(blocks: _Blocks, q: Array, n_kv_heads: int) -> tuple[int, ...]:
    """`_forward`'s log-sum-exp layout: ``(steps, query blocks, per_step, rows)``."""
    b, seq, n_heads, _ = q.shape
    n_q = -(-seq // blocks.q_block)
    groups = n_heads // n_kv_heads
    return (b * n_kv_heads // blocks.per_step, n_q, blocks.per_step, blocks.q_block * groups)


def _as_rows(lse_like: Array, b: int, groups: int, seq: int) -> Array:
    """A per-row value in `_forward`'s block layout as ``(b, seq, heads, 1)``."""
    return _from_blocks(lse_like[..., None], b, groups, seq)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ring(blocks, axis_name, q, k, v, positions, window, sinks, segments):
    return _ring_forward(blocks, axis_name, q, k, v, positions, window, sinks, segments)[0]


def _ring_fwd(blocks, axis_name, q, k, v, positions, window, sinks, segments):
    out, lse = _ring_forward(blocks, axis_name, q, k, v, positions, window, sinks, segments)
    return out, (q, k, v, positions, window, sinks, segments, out, lse)


def _ring_bwd(blocks, axis_name, residuals, d_out):
    """`_blockwise_bwd` of each shard of keys against this device's queries, with the
    global output and log-sum-exp: the shard's part of every gradient. The queries'
    accumulate here; the keys' and values' travel with their shard and arrive home after
    the ``n``-th pass. The sinks' gradient (their probability against the global
    log-sum-exp) is taken once, from the first step."""
    q, k, v, positions, window, sinks, segments, out, lse = residuals
    n = jax.lax.axis_size(axis_name)

    def step(carry, _):
        dq, k_held, v_held, k_positions, k_segments, dk_held, dv_held = carry
        arriving = _shift((k_held, v_held, k_positions, k_segments), axis_name)
        held_segments = _held_segments(segments, k_segments)
        parts = _blockwise_bwd(
            blocks,
            (q, k_held, v_held, positions, k_positions, window, sinks, held_segments, out, lse),
            d_out,
        )
        d_q, d_k, d_v, _, _, _, d_sinks, _ = parts
        dq = dq + d_q.astype(jnp.float32)
        dk_held = dk_held + d_k.astype(jnp.float32)
        dv_held = dv_held + d_v.astype(jnp.float32)
        return (dq, *arriving, *_shift((dk_held, dv_held), axis_name)), d_sinks

    def zeros(x):
        return varying_like(jnp.zeros(x.shape, jnp.float32), q, k, v, d_out)

    init = (zeros(q), k, v, positions, segments, zeros(k), zeros(v))
    (dq, _, _, _, _, dk, dv), d_sinks = jax.lax.scan(step, init, None, length=n)
    # Each device's rows' share of the sinks' gradient: summed over the axis.
    d_sinks = None if sinks is None else cotangent_for(d_sinks[0], sinks)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, d_sinks, None


_ring.defvjp(_ring_fwd, _ring_bwd)
