"""Blockwise (flash-style) attention: `attend`'s result without its ``(seq, kv_seq)`` scores.

Queries and keys are cut into blocks. Each query block runs an online softmax over the key
blocks it may see (running maximum and sum, float32), and the backward pass recomputes the
scores block by block from the saved output and per-query log-sum-exp (FlashAttention-2), so
memory is linear in the sequence. Which block pairs can hold a visible key is decided from
the blocks' smallest and largest positions, for any positions; the other pairs are never
visited, so causal attention costs about half of the dense one and a sliding window of ``w``
about ``w / seq`` of it. Pairs that are visible throughout skip the mask as well.

Layout: a query block's rows are its tokens times the query heads that share one key/value
head (``rows = q_block * groups``), so each key block is read once for a whole group. The
outer loop runs over (batch, key/value head) pairs, as many per step as keep the step's
scores within `SCORES_PER_STEP` (more when blocks are short: a chunk, a decoding step). The
backward pass works on transposed scores ``(keys, rows)``, which keeps each of its five
matmuls in a layout XLA:CPU runs fast (a transposed left operand ran at half speed).
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int, Shaped

from eqxzoo.nn.rows import row_max
from eqxzoo.nn.varying import cotangent_for, varying_like

DEFAULT_BLOCK_SIZE = 256
"""Tokens per key block and rows per query block (`_Blocks.choose` says why)."""


def blockwise_attend(
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
    block_size: int = DEFAULT_BLOCK_SIZE,
    q_segments: Int[Array, "*batch seq"] | None = None,
    k_segments: Int[Array, "*batch kv_seq"] | None = None,
) -> Float[Array, "*batch seq heads v_head_dim"]:
    """`eqxzoo.nn.kernels.attend`, computed over blocks of keys and queries.

    Same arguments and result (masking by position with a possibly traced ``window``,
    grouped-query heads, ``softcap``, ``sinks``, a value head dimension of its own), to
    float32 rounding, for any positions (a ring-ordered cache with empty slots included).
    Scores are computed only for the block pairs whose position ranges may hold a visible
    key: with ascending positions, the causal triangle or the window's band. A query that
    sees no key at all gets zeros (`attend` would average every value; no caller asks for
    one). Differentiable in ``q``, ``k``, ``v`` and ``sinks`` by a custom VJP that saves only
    the inputs, the output and one float32 log-sum-exp per query and head.

    ``block_size`` keys make a key block and ``block_size`` rows a query block (rows: tokens
    times the query heads that share a key/value head); the default measured fastest on
    XLA:CPU (`_Blocks.choose`). With ``q_segments`` and ``k_segments`` (packed documents,
    per sequence) a query sees only keys of its own segment: every visited pair is then
    masked, none taken as seen throughout.
    """

    def run(blocks, q, k, v, segments):
        return _blockwise(
            blocks,
            q,
            k,
            v,
            q_positions.astype(jnp.int32),
            k_positions.astype(jnp.int32),
            jnp.asarray(window, jnp.int32),
            sinks,
            segments,
        )

    segments = flat_segments(q_segments, k_segments, math.prod(q.shape[:-3]))
    return on_one_batch_axis(
        run, q, k, v, segments, block_size=block_size, scale=scale, softcap=softcap
    )


Segments = tuple[Int[Array, "b seq"], Int[Array, "b kv_seq"]]


def flat_segments(
    q_segments: Int[Array, "*batch seq"] | None,
    k_segments: Int[Array, "*batch kv_seq"] | None,
    lead: int,
) -> Segments | None:
    """The queries' and keys' segment ids with their batch axes flattened into ``lead``
    (`on_one_batch_axis`), or None without them."""
    if q_segments is None:
        assert k_segments is None
        return None
    return (
        q_segments.reshape(lead, q_segments.shape[-1]).astype(jnp.int32),
        k_segments.reshape(lead, k_segments.shape[-1]).astype(jnp.int32),
    )


def on_one_batch_axis(
    run, q, k, v, segments, *, block_size: int, scale: float, softcap: float | None
):
    """``run(blocks, q, k, v, segments)`` on each sequence of the leading batch axes of
    ``q``, ``k`` and ``v`` (and of ``segments``: a pytree of ``(lead, ...)`` arrays, or
    None), as a batch of one, vmapped over the sequences, the `_Blocks` chosen for one
    sequence's shapes; its output ``(1, seq, heads, v_head_dim)`` reshaped back to the batch
    axes.

    The batch stays an axis of every array in the kernel's loops, which a compiler that
    splits the batch over devices keeps split. Folded into the loops' steps (pairs of a
    sequence and a key/value head), it made every device run every step: on one stage of
    llama3_1b on dp64, each device computed the attention of all 64 sequences (the step's
    matrix FLOPs 1.67x the kernel's own, 2.6 GiB more memory)."""
    *batch, seq, n_heads, head_dim = q.shape
    kv_seq, n_kv_heads, v_head_dim = k.shape[-3], k.shape[-2], v.shape[-1]
    lead = math.prod(batch)
    blocks = _Blocks.choose(
        block_size, seq, kv_seq, n_kv_heads, n_heads // n_kv_heads, scale, softcap
    )

    def one(q, k, v, segments):
        segments = jax.tree.map(lambda s: s[None], segments)
        return run(blocks, q[None], k[None], v[None], segments)[0]

    out = jax.vmap(one)(
        q.reshape(lead, seq, n_heads, head_dim),
        k.reshape(lead, kv_seq, n_kv_heads, head_dim),
        v.reshape(lead, kv_seq, n_kv_heads, v_head_dim),
        segments,
    )
    return out.reshape(*batch, seq, n_heads, v_head_dim)


class _Blocks(NamedTuple):
    """The static settings of one blockwise attention: score scale and soft-cap, tokens per
    query block and per key block, and how many (batch, key/value head) pairs each step of
    the outer loop processes together (one batched matmul)."""

    scale: float
    softcap: float | None
    q_block: int
    k_block: int
    per_step: int

    @classmethod
    def choose(cls, block_size, seq, kv_seq, n_pairs, groups, scale, softcap) -> "_Blocks":
        """Query blocks of ``block_size`` rows and key blocks of ``block_size`` keys, and as
        many (batch, key/value head) pairs per step as keep the step's scores within
        `SCORES_PER_STEP` elements: one batched matmul for many pairs costs fewer loop
        iterations than a matmul each, which matters most for a short chunk or a decoding
        step (tiny blocks).

        Measured on 2 cores with XLA:CPU's Eigen dots, forward and backward, 4 heads of 64
        and 2,048 tokens a batch: 256 x 256 tiles, 16 pairs a step, ran T = 512 / 1,024 /
        2,048 in 40 / 59 / 99 ms where 512 x 512 tiles two pairs a step took 50 (dense) / 74
        / 112 ms: fewer masked key positions on the diagonal blocks, fewer loop iterations.
        """
        q_block = min(seq, max(1, block_size // groups))
        k_block = min(block_size, kv_seq)
        fits = [
            d
            for d in range(1, n_pairs + 1)
            if n_pairs % d == 0 and d * q_block * groups * k_block <= SCORES_PER_STEP
        ]
        return cls(scale, softcap, q_block, k_block, max(fits, default=1))


SCORES_PER_STEP = 2**20
"""At most this many float32 scores (4 MiB) in one step of the blockwise kernel's outer loop
(`_Blocks.choose`): up to 16 pairs of 256 x 256 blocks."""


LOOP_SCOPES = (
    "key_blocks_seen_whole",
    "key_blocks_masked",
    "query_blocks_seen_whole",
    "query_blocks_masked",
)
"""The named scopes of the kernel's four loops of data-dependent length: a query block's
over the key blocks it sees whole and over those it sees in part (the forward pass), a key
block's over its query blocks likewise (the backward pass)."""


def _visit(step, n_full, n_visited, state, scopes: tuple[str, ...]):
    """``step(n, state, masked=...)`` over the ``order`` entries a block sees whole
    (``0 .. n_full``, unmasked) and then over those it sees in part (``.. n_visited``), each
    loop in its named scope of `LOOP_SCOPES` (``scopes``: the two)."""
    whole, part = scopes
    with jax.named_scope(whole):
        state = jax.lax.fori_loop(0, n_full, functools.partial(step, masked=False), state)
    with jax.named_scope(part):
        return jax.lax.fori_loop(n_full, n_visited, functools.partial(step, masked=True), state)


class BlockCounts(NamedTuple):
    """What the kernel computes over some calls of it (`block_counts`): its query and key
    blocks, the block pairs it visits of them (all, and those seen whole, without a mask),
    and the scores a dense kernel would compute over the same calls."""

    q_block: int
    k_block: int
    n_q: int
    n_k: int
    seen_whole: int
    visited: int
    scores: int

    @property
    def share(self) -> float:
        """The share of the dense kernel's scores the kernel computes (padding included):
        what its matmuls are of the dense kernel's."""
        return self.visited * self.q_block * self.k_block / self.scores

    def loop_trips(self, segmented: bool = False) -> dict[str, float]:
        """The mean trip count of each of the `LOOP_SCOPES` loops, which a static count of
        the compiled program cannot know (with packed documents, ``segmented``, every
        visited pair is masked)."""
        whole = 0 if segmented else self.seen_whole
        return dict(
            zip(
                LOOP_SCOPES,
                (
                    whole / self.n_q,
                    (self.visited - whole) / self.n_q,
                    whole / self.n_k,
                    (self.visited - whole) / self.n_k,
                ),
                strict=True,
            )
        )


def block_counts(
    q_positions: Int[ArrayLike, "calls seq"],
    k_positions: Int[ArrayLike, "calls kv_seq"],
    *,
    groups: int,
    window: int = 0,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> BlockCounts:
    """`BlockCounts` of the kernel's calls on the rows of ``q_positions`` and
    ``k_positions`` (each call's query and key positions), queries coming ``groups`` to a
    key/value head, from its own blocks and plan: one call of ``0 .. seq - 1`` both for
    causal self-attention, a context split's calls for each pair of shards it attends
    (`eqxzoo.nn.context.context_calls`)."""
    q_positions, k_positions = jnp.asarray(q_positions), jnp.asarray(k_positions)
    (calls, q_len), k_len = q_positions.shape, k_positions.shape[1]
    blocks = _Blocks.choose(block_size, q_len, k_len, 1, groups, 1.0, None)
    plans = jax.vmap(lambda q, k: _plan(q, k, window, blocks, by_key=False))(
        q_positions, k_positions
    )
    return BlockCounts(
        q_block=blocks.q_block,
        k_block=blocks.k_block,
        n_q=calls * plans.q_positions.shape[1],
        n_k=calls * plans.k_positions.shape[1],
        seen_whole=int(plans.n_full.sum()),
        visited=int(plans.n_visited.sum()),
        scores=calls * q_len * k_len,
    )


class _Plan(NamedTuple):
    """Positions cut into blocks, and the order in which each block visits the other side's.

    ``order[i]`` lists first the blocks that block ``i`` sees entirely (``n_full[i]`` of
    them: no mask needed), then those it may see in part (up to ``n_visited[i]``), then the
    ones it cannot see, which are never touched.
    """

    q_positions: Int[Array, "n_q q_block"]
    k_positions: Int[Array, "n_k k_block"]
    order: Int[Array, "n m"]
    n_full: Int[Array, " n"]
    n_visited: Int[Array, " n"]


def _plan(
    q_positions: Int[Array, " seq"],
    k_positions: Int[Array, " kv_seq"],
    window: Int[ArrayLike, ""],
    blocks: _Blocks,
    *,
    by_key: bool,
) -> _Plan:
    """Block the positions and order the block pairs, for each query block (``by_key``
    False: the forward pass) or for each key block (True: the backward pass).

    Padded queries repeat the last position (their rows are dropped; the block's position
    range is unchanged) and padded keys sit at -1, which no query sees. A pair is skipped only
    if no query of the one block can see any key of the other: every key is empty, in the
    future of every query, or out of every query's window.
    """
    n_q = -(-q_positions.shape[0] // blocks.q_block)
    n_k = -(-k_positions.shape[0] // blocks.k_block)
    q_pad = n_q * blocks.q_block - q_positions.shape[0]
    q_pos = jnp.pad(q_positions, (0, q_pad), mode="edge").reshape(n_q, blocks.q_block)
    k_pad = n_k * blocks.k_block - k_positions.shape[0]
    k_pos = jnp.pad(k_positions, (0, k_pad), constant_values=-1).reshape(n_k, blocks.k_block)
    q_min, q_max = q_pos.min(1)[:, None], q_pos.max(1)[:, None]
    k_max = k_pos.max(1)[None, :]
    k_min = jnp.where(k_pos >= 0, k_pos, jnp.iinfo(jnp.int32).max).min(1)[None, :]
    all_keys = (k_pos.min(1) >= 0)[None, :]
    windowed = window != 0
    visited = (k_max >= 0) & (k_min <= q_max) & (~windowed | (q_min - k_max < window))
    full = all_keys & (k_max <= q_min) & (~windowed | (q_max - k_min < window))
    if by_key:
        visited, full = visited.T, full.T
    rank = jnp.where(full, 0, jnp.where(visited, 1, 2))
    return _Plan(
        q_positions=q_pos,
        k_positions=k_pos,
        order=jnp.argsort(rank, axis=1, stable=True).astype(jnp.int32),
        n_full=full.sum(1, dtype=jnp.int32),
        n_visited=visited.sum(1, dtype=jnp.int32),
    )


def _to_blocks(
    x: Shaped[Array, "b t heads d"], block: int, groups: int, per_step: int
) -> Shaped[Array, "steps n per_step rows d"]:
    """Pad the sequence to whole blocks and bring each block's rows together: ``rows`` is
    ``block * groups`` (token-major), one entry per batch element and key/value head, and
    these ``b * kv_heads`` entries ``per_step`` at a time."""
    b, t, heads, d = x.shape
    n = -(-t // block)
    x = jnp.pad(x, ((0, 0), (0, n * block - t), (0, 0), (0, 0)))
    x = x.reshape(b, n, block, heads // groups, groups, d).transpose(0, 3, 1, 2, 4, 5)
    x = x.reshape(-1, per_step, n, block * groups, d)
    return x.transpose(0, 2, 1, 3, 4)


def _segment_blocks(
    segments: Int[Array, "b t"], heads: int, block: int, groups: int, per_step: int
) -> Int[Array, "steps n per_step rows"]:
    """Each token's segment id in the layout of `_to_blocks` (padding: segment 0, which a
    padded key's position hides and a padded query's dropped row does not need)."""
    b, t = segments.shape
    spread = jnp.broadcast_to(segments[:, :, None, None], (b, t, heads, 1))
    return _to_blocks(spread, block, groups, per_step)[..., 0]


def _same_segment(
    q_segments: Int[Array, "c rows"], k_segments: Int[Array, "c keys"]
) -> Bool[Array, "c rows keys"]:
    return q_segments[:, :, None] == k_segments[:, None, :]


def _from_blocks(
    x: Float[Array, "steps n per_step rows d"], b: int, groups: int, t: int
) -> Float[Array, "b t heads d"]:
    steps, n, per_step, rows, d = x.shape
    x = x.transpose(0, 2, 1, 3, 4).reshape(b, -1, n, rows // groups, groups, d)
    x = x.transpose(0, 2, 3, 1, 4, 5)
    return x.reshape(b, n * rows // groups, -1, d)[:, :t]


def _logits(raw: Array, blocks: _Blocks) -> Array:
    """Scores from raw ``q.k`` products: scaled and soft-capped, an increasing function."""
    scores = raw * blocks.scale
    if blocks.softcap is not None:
        scores = blocks.softcap * jnp.tanh(scores / blocks.softcap)
    return scores


def _visible(
    row_positions: Int[Array, " rows"], k_positions: Int[Array, " keys"], window
) -> Bool[Array, "rows keys"]:
    offsets = row_positions[:, None] - k_positions[None, :]
    visible = (k_positions[None, :] >= 0) & (offsets >= 0)
    return visible & ((window == 0) | (offsets < window))


def _dot(a: Array, b: Array, spec: str) -> Float[Array, "..."]:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _sink_rows(
    sinks: Float[Array, " heads"], b: int, n_kv_heads: int, q_block: int, per_step: int
) -> Float[Array, "steps per_step rows"]:
    """Each row's sink logit, in the layout of `_to_blocks` (rows: tokens times heads)."""
    rows = jnp.tile(sinks.astype(jnp.float32).reshape(n_kv_heads, -1), (1, q_block))
    return jnp.broadcast_to(rows, (b, *rows.shape)).reshape(-1, per_step, rows.shape[-1])


def _forward(blocks, q, k, v, q_positions, k_positions, window, sinks, segments=None):
    """The output ``(b, seq, heads, v_head_dim)`` and the float32 log-sum-exp of every row
    ``(steps, n_q, per_step, rows)`` (+inf for a row that sees nothing, so that its
    probabilities recompute to zero). ``segments``: the queries' and keys' segment ids
    (`flat_segments`), or None."""
    b, seq, n_heads, _ = q.shape
    n_kv_heads = k.shape[2]
    groups = n_heads // n_kv_heads
    per_step = blocks.per_step
    plan = _plan(q_positions, k_positions, window, blocks, by_key=False)
    q_blocks = _to_blocks(q, blocks.q_block, groups, per_step)
    k_blocks = _to_blocks(k, blocks.k_block, 1, per_step)
    v_blocks = _to_blocks(v, blocks.k_block, 1, per_step)
    segment_blocks = _blocked_segments(segments, blocks, n_heads, n_kv_heads)
    n_full = plan.n_full if segments is None else jnp.zeros_like(plan.n_full)
    rows = blocks.q_block * groups
    if sinks is None:
        sink_rows = jnp.full((q_blocks.shape[0], per_step, rows), -jnp.inf, jnp.float32)
    else:
        sink_rows = _sink_rows(sinks, b, n_kv_heads, blocks.q_block, per_step)

    # Inside `jax.shard_map` the loop carries vary over what the inputs vary over.
    sources = (q, k, v, q_positions, k_positions, jnp.asarray(window))
    sources += () if sinks is None else (sinks,)

    def step(inputs):
        q_step, k_step, v_step, sink_step, segment_step = inputs
        # The sink is a key with logit `sink` and a zero value: the softmax starts from it.
        max0 = varying_like(sink_step, *sources)
        sum0 = jnp.zeros_like(max0) if sinks is None else jnp.ones_like(max0)
        acc0 = varying_like(jnp.zeros((per_step, rows, v.shape[-1]), jnp.float32), *sources)

        def query_block(_, inputs):
            q_block, q_pos, order, n_full, n_visited, q_segment = inputs
            row_pos = jnp.repeat(q_pos, groups)

            def key_block(n, state, masked: bool):
                running_max, running_sum, acc = state
                j = order[n]
                raw = _dot(q_block, k_step[j], "crd,csd->crs")
                if masked:
                    visible = _visible(row_pos, plan.k_positions[j], window)
                    if segment_step is not None:
                        visible = visible & _same_segment(q_segment, segment_step[1][j])
                    raw = jnp.where(visible, raw, -jnp.inf)
                # The logits are increasing in the raw products: their row maximum is the
                # logit of the raw maximum, which saves a pass over the block.
                new_max = jnp.maximum(running_max, _logits(row_max(raw), blocks))
                finite_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
                probs = jnp.exp(_logits(raw, blocks) - finite_max[..., None])
                if masked:
                    probs = jnp.where(visible, probs, 0.0)
                rescale = jnp.exp(running_max - finite_max)
                running_sum = rescale * running_sum + probs.sum(-1)
                pv = _dot(probs.astype(v.dtype), v_step[j], "crs,csd->crd")
                return new_max, running_sum, rescale[..., None] * acc + pv

            running_max, running_sum, acc = _visit(
                key_block, n_full, n_visited, (max0, sum0, acc0), LOOP_SCOPES[:2]
            )
            seen = running_sum > 0
            out = acc / jnp.where(seen, running_sum, 1.0)[..., None]
            lse = jnp.where(seen, running_max + jnp.log(running_sum), jnp.inf)
            return None, (out.astype(q.dtype), lse)

        q_segment_step = None if segment_step is None else segment_step[0]
        xs = (q_step, plan.q_positions, plan.order, n_full, plan.n_visited, q_segment_step)
        return jax.lax.scan(query_block, None, xs)[1]

    out, lse = jax.lax.map(step, (q_blocks, k_blocks, v_blocks, sink_rows, segment_blocks))
    return _from_blocks(out, b, groups, seq), lse


def _blocked_segments(
    segments: Segments | None, blocks: _Blocks, n_heads: int, n_kv_heads: int
) -> tuple[Int[Array, "steps n_q per_step rows"], Int[Array, "steps n_k per_step keys"]] | None:
    """The queries' segment ids per row and the keys' per key, in the blocks' layouts."""
    if segments is None:
        return None
    q_segments, k_segments = segments
    groups = n_heads // n_kv_heads
    return (
        _segment_blocks(q_segments, n_heads, blocks.q_block, groups, blocks.per_step),
        _segment_blocks(k_segments, n_kv_heads, blocks.k_block, 1, blocks.per_step),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blockwise(blocks, q, k, v, q_positions, k_positions, window, sinks, segments):
    return _forward(blocks, q, k, v, q_positions, k_positions, window, sinks, segments)[0]


def _blockwise_fwd(blocks, q, k, v, q_positions, k_positions, window, sinks, segments):
    out, lse = _forward(blocks, q, k, v, q_positions, k_positions, window, sinks, segments)
    return out, (q, k, v, q_positions, k_positions, window, sinks, segments, out, lse)


def _blockwise_bwd(blocks, residuals, d_out):
    """FlashAttention-2's backward pass over key blocks, each visiting its query blocks.

    With ``P = exp(S - lse)`` recomputed per pair and ``D = rowsum(dO * O)``: ``dV += P^T
    dO``, ``dS = P * (dO V^T - D)`` (times the soft-cap's ``1 - tanh^2``), ``dK += scale
    dS^T Q``, ``dQ += scale dS K``. Everything is computed transposed, ``(keys, rows)``;
    ``dQ`` accumulates as ``dQ^T = K^T dS^T`` over all query blocks.
    """
    q, k, v, q_positions, k_positions, window, sinks, segments, out, lse = residuals
    b, seq, n_heads, _ = q.shape
    n_kv_heads = k.shape[2]
    groups = n_heads // n_kv_heads
    per_step = blocks.per_step
    plan = _plan(q_positions, k_positions, window, blocks, by_key=True)
    segment_blocks = _blocked_segments(segments, blocks, n_heads, n_kv_heads)
    n_full = plan.n_full if segments is None else jnp.zeros_like(plan.n_full)
    q_blocks = _to_blocks(q, blocks.q_block, groups, per_step)
    k_blocks = _to_blocks(k, blocks.k_block, 1, per_step)
    v_blocks = _to_blocks(v, blocks.k_block, 1, per_step)
    d_out_blocks = _to_blocks(d_out.astype(q.dtype), blocks.q_block, groups, per_step)
    out_blocks = _to_blocks(out, blocks.q_block, groups, per_step)
    # D: each row's softmax term of its scores' gradient (the sink's value is zero).
    delta = _dot(d_out_blocks, out_blocks, "...rd,...rd->...r")
    sources = (q, k, v, d_out, q_positions, k_positions, jnp.asarray(window))

    def step(inputs):
        q_step, k_step, v_step, d_out_step, lse_step, delta_step, segment_step = inputs

        def key_block(dq_t, inputs):
            k_block, v_block, k_pos, order, n_full, n_visited, k_segment = inputs
            k_block_t = jnp.swapaxes(k_block, -1, -2)

            def query_block(n, state, masked: bool):
                dq_t, dk, dv = state
                i = order[n]
                q_block, d_out_block = q_step[i], d_out_step[i]
                raw_t = _dot(k_block, q_block, "csd,crd->csr")
                logits_t = _logits(raw_t, blocks)
                probs_t = jnp.exp(logits_t - lse_step[i][..., None, :])
                if masked:
                    row_pos = jnp.repeat(plan.q_positions[i], groups)
                    visible = _visible(row_pos, k_pos, window)
                    if segment_step is not None:
                        visible = visible & _same_segment(segment_step[0][i], k_segment)
                    probs_t = jnp.where(jnp.swapaxes(visible, -1, -2), probs_t, 0.0)
                dv = dv + _dot(probs_t.astype(d_out.dtype), d_out_block, "csr,crd->csd")
                dp_t = _dot(v_block, d_out_block, "csd,crd->csr")
                ds_t = probs_t * (dp_t - delta_step[i][..., None, :])
                if blocks.softcap is not None:
                    capped = logits_t / blocks.softcap
                    ds_t = ds_t * (1 - capped * capped)
                ds_t = ds_t * blocks.scale
                dk = dk + _dot(ds_t.astype(q.dtype), q_block, "csr,crd->csd")
                dq_t_i = _dot(k_block_t, ds_t.astype(k.dtype), "cds,csr->cdr")
                dq_t_i = dq_t_i + jax.lax.dynamic_index_in_dim(dq_t, i, keepdims=False)
                return jax.lax.dynamic_update_index_in_dim(dq_t, dq_t_i, i, 0), dk, dv

            dk0 = varying_like(jnp.zeros(k_block.shape, jnp.float32), *sources)
            dv0 = varying_like(jnp.zeros(v_block.shape, jnp.float32), *sources)
            dq_t, dk, dv = _visit(query_block, n_full, n_visited, (dq_t, dk0, dv0), LOOP_SCOPES[2:])
            return dq_t, (dk.astype(k.dtype), dv.astype(v.dtype))

        dq_t0 = varying_like(jnp.zeros(jnp.swapaxes(q_step, -1, -2).shape, jnp.float32), *sources)
        k_segment_step = None if segment_step is None else segment_step[1]
        xs = (k_step, v_step, plan.k_positions, plan.order, n_full, plan.n_visited, k_segment_step)
        dq_t, (dk, dv) = jax.lax.scan(key_block, dq_t0, xs)
        return jnp.swapaxes(dq_t, -1, -2), dk, dv

    dq, dk, dv = jax.lax.map(
        step, (q_blocks, k_blocks, v_blocks, d_out_blocks, lse, delta, segment_blocks)
    )
    dq = _from_blocks(dq, b, groups, seq).astype(q.dtype)
    dk = _from_blocks(dk, b, 1, k.shape[1])
    dv = _from_blocks(dv, b, 1, v.shape[1])
    d_sinks = None
    if sinks is not None:
        # The sink's probability is exp(sink - lse) and its value zero, so its logit's
        # gradient is -P_sink * D summed over the rows of its head (padded rows have D = 0).
        sink_rows = _sink_rows(sinks, b, n_kv_heads, blocks.q_block, per_step)
        per_row = jnp.exp(sink_rows[:, None] - lse) * delta
        per_row = per_row.transpose(0, 2, 1, 3).reshape(b, n_kv_heads, -1, groups)
        d_sinks = -per_row.sum((0, 2)).reshape(n_heads).astype(sinks.dtype)
        # Rows split over a manual axis the sinks are not (a context-parallel sequence).
        d_sinks = cotangent_for(d_sinks, sinks)
    return dq, dk, dv, None, None, None, d_sinks, None


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)
