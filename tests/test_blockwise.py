"""Blockwise attention against the dense `attend`: outputs and gradients (queries, keys,
values, sinks) to float32 rounding over every option, and blocks that no query can see
never read at all."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxzoo.nn.blockwise import blockwise_attend
from eqxzoo.nn.kernels import attend

SCALE = 0.35


def _inputs(batch, seq, heads, kv_seq, kv_heads, head_dim=8, v_head_dim=8, seed=0):
    """Queries, keys, values, an output cotangent and sink logits, standard normal (numpy's
    generator: compiling jax.random's for every shape takes longer than the tests)."""
    rng = np.random.default_rng(seed)
    shapes = [
        (*batch, seq, heads, head_dim),
        (*batch, kv_seq, kv_heads, head_dim),
        (*batch, kv_seq, kv_heads, v_head_dim),
        (*batch, seq, heads, v_head_dim),
        (heads,),
    ]
    return tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in shapes)


def _output_and_grads(attention, q_positions, k_positions, *, with_sinks, **options):
    """A jitted ``(q, k, v, cotangent, sinks, window) -> (out, grads)``: the output and the
    gradients of ``sum(out * cotangent)`` in q, k, v (and the sinks), with the window traced
    as the stacked layers pass it."""
    q_positions, k_positions = jnp.asarray(q_positions), jnp.asarray(k_positions)

    def loss(q, k, v, cotangent, sinks, window):
        sinks = sinks if with_sinks else None
        out = attention(q, k, v, q_positions, k_positions, window=window, sinks=sinks, **options)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    grads = jax.grad(loss, (0, 1, 2, 4) if with_sinks else (0, 1, 2), has_aux=True)
    return jax.jit(lambda *args: grads(*args)[::-1])


def _blockwise(block_size):
    return lambda *args, **kw: blockwise_attend(*args, block_size=block_size, **kw)


def _ring_cache(slots: int, start: int, chunk: int) -> np.ndarray:
    """Key positions of a chunk attending to a ring cache of ``slots`` after ``start``
    tokens (position ``p`` in slot ``p % slots``, unwritten slots -1), then to itself."""
    slot_positions = np.full(slots, -1)
    for p in range(start):
        slot_positions[p % slots] = p
    return np.concatenate([slot_positions, start + np.arange(chunk)])


class Case(NamedTuple):
    batch: tuple[int, ...]
    heads: int
    kv_heads: int
    v_head_dim: int
    q_positions: np.ndarray
    k_positions: np.ndarray
    window: int
    softcap: float | None
    sinks: bool
    block_size: int


CASES = {
    "window, grouped-query, soft-cap, sinks, 37 tokens, key blocks of 8": Case(
        (2,), 4, 2, 8, np.arange(37), np.arange(37), 5, 1.5, True, 8
    ),
    "causal, multi-query, values of another width, batch 2x2": Case(
        (2, 2), 4, 1, 12, np.arange(21), np.arange(21), 0, None, False, 8
    ),
    # One query per (batch, key/value head) pair: the four pairs go through one step.
    "a decoding step over a wrapped ring cache, batch 2": Case(
        (2,), 4, 2, 8, np.array([18]), _ring_cache(16, 18, 1), 9, None, True, 16
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_dense_attention(case: Case, assert_trees_close):
    """Also with the window 0 passed to the same compiled function (a global layer)."""
    seq, kv_seq = len(case.q_positions), len(case.k_positions)
    inputs = _inputs(case.batch, seq, case.heads, kv_seq, case.kv_heads, v_head_dim=case.v_head_dim)
    options = dict(with_sinks=case.sinks, scale=SCALE, softcap=case.softcap)
    positions = (case.q_positions, case.k_positions)
    blockwise = _output_and_grads(_blockwise(case.block_size), *positions, **options)
    dense = _output_and_grads(attend, *positions, **options)
    for window in sorted({case.window, 0}):
        assert_trees_close(blockwise(*inputs, window), dense(*inputs, window), rtol=1e-5, atol=1e-6)


def test_bfloat16_inputs_match_float32():
    """bfloat16 in and out, float32 inside: within bfloat16 rounding of the float32 result."""
    q, k, v, cotangent, sinks = _inputs((2,), 40, 4, 40, 2, head_dim=16, v_head_dim=16)
    positions = np.arange(40)
    options = dict(with_sinks=True, scale=SCALE)
    blockwise = _output_and_grads(_blockwise(16), positions, positions, **options)
    dense = _output_and_grads(attend, positions, positions, **options)
    bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    actual = blockwise(*bf16, cotangent, sinks, 7)
    expected = dense(*[x.astype(jnp.float32) for x in bf16], cotangent, sinks, 7)
    assert actual[0].dtype == jnp.bfloat16
    assert [g.dtype for g in actual[1]] == [jnp.bfloat16] * 3 + [jnp.float32]
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        a, e = np.asarray(a, np.float32), np.asarray(e)
        np.testing.assert_allclose(a, e, atol=2e-2 * np.max(np.abs(e)))


def test_blocks_no_query_sees_are_never_read():
    """Keys in blocks that no query can see (too old for the window, empty cache slots, in
    the future) are NaN: computed and masked, they would make the output NaN (``0 * NaN``),
    as they do the dense attention's. Skipped, they change nothing and get zero gradients."""
    block = window = 16
    q_positions = 48 + np.arange(block)
    # Blocks of 16 keys: 0-15 and 16-31 too old for every query, 32-47 and 48-63 seen (in
    # part), then a block of empty slots and one in the future.
    k_positions = np.concatenate([np.arange(64), np.full(block, -1), 100 + np.arange(block)])
    unseen = (k_positions < 32) | (k_positions >= 64)
    q, k, v, cotangent, sinks = _inputs((), block, 2, len(k_positions), 1)
    options = dict(with_sinks=True, scale=SCALE)
    blockwise = _output_and_grads(_blockwise(block), q_positions, k_positions, **options)
    dense = _output_and_grads(attend, q_positions, k_positions, **options)
    poisoned = [jnp.where(unseen[:, None, None], jnp.nan, x) for x in (k, v)]
    cleaned = [jnp.where(unseen[:, None, None], 0.0, x) for x in (k, v)]
    assert np.isnan(dense(q, *poisoned, cotangent, sinks, window)[0]).all()
    out, (dq, dk, dv, d_sinks) = blockwise(q, *poisoned, cotangent, sinks, window)
    expected_out, expected_grads = dense(q, *cleaned, cotangent, sinks, window)
    np.testing.assert_allclose(out, expected_out, rtol=1e-5, atol=1e-6)
    for actual, expected in zip((dq, dk, dv, d_sinks), expected_grads):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
    assert not np.asarray(dk[unseen]).any() and not np.asarray(dv[unseen]).any()


def _loop_lengths(jaxpr) -> list[int]:
    """The lengths of every ``scan`` in ``jaxpr`` and the jaxprs inside it."""
    lengths = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            lengths.append(eqn.params["length"])
        for param in eqn.params.values():
            for inner in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(inner, "jaxpr", inner)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    lengths += _loop_lengths(inner)
    return sorted(lengths)


def test_the_kernels_loops_do_not_grow_with_the_batch():
    """The batch stays an axis of the kernel's loops (vmapped), not folded into the steps of
    its outer loop: 8 sequences of 4 key/value heads at 1,024 tokens (32 pairs, two steps of
    16 had it been folded) run the same loops, forward and backward, as one. Folded, a batch
    split over devices made every device run every step: on one stage of llama3_1b on dp64
    each device computed all 64 sequences' attention."""
    positions = jnp.arange(1024)

    def lengths(batch):
        q, k, v, _, _ = _inputs((batch,), 1024, 4, 1024, 4)

        def loss(q, k, v):
            out = blockwise_attend(q, k, v, positions, positions, scale=SCALE, block_size=256)
            return jnp.sum(out)

        return _loop_lengths(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr)

    assert lengths(8) == lengths(1)
