"""The fused, chunked cross-entropy: equal to optax on full logits in value and gradients, in
bf16 close to fp32, on a vocab-sharded mesh without gathering the weight, and never holding
a ``(tokens, vocab)`` array."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import models
from eqxzoo.nn.cross_entropy import fused_cross_entropy, token_chunks, vocab_chunks
from eqxzoo.parallel import Schedule
from eqxzoo.parallel.collectives import collectives
from eqxzoo.train.loss import token_cross_entropy
from eqxzoo.train.settings import StepConfig

TOKENS, EMBED = 24, 16
Z_LOSS_WEIGHT = 1e-2


def _inputs(vocab: int, seed: int = 0, tokens: int = TOKENS, embed: int = EMBED):
    h_key, weight_key, targets_key = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(h_key, (tokens, embed)),
        jax.random.normal(weight_key, (embed, vocab)) / np.sqrt(embed),
        jax.random.randint(targets_key, (tokens,), 0, vocab),
    )


def _plain_loss(h, unembedding, targets, softcap=None, z_loss_weight=Z_LOSS_WEIGHT):
    logits = jnp.dot(h, unembedding, preferred_element_type=jnp.float32)
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    log_sum_exp = jax.nn.logsumexp(logits, axis=-1)
    return jnp.mean(cross_entropy) + z_loss_weight * jnp.mean(log_sum_exp**2)


def _fused_loss(h, unembedding, targets, z_loss_weight=Z_LOSS_WEIGHT, **options):
    cross_entropy, log_sum_exp = fused_cross_entropy(h, unembedding, targets, **options)
    return jnp.mean(cross_entropy) + z_loss_weight * jnp.mean(log_sum_exp**2)


def _loss_and_grads(loss, *args, **options):
    return jax.jit(jax.value_and_grad(lambda h, w, t: loss(h, w, t, **options), (0, 1)))(*args)


@pytest.mark.parametrize(
    "vocab, chunk_size, token_chunk_size, softcap, z_loss_weight",
    [
        (64, 16, 512, None, 0.0),
        (64, 16, 8, 2.0, Z_LOSS_WEIGHT),
        (53, 8, 12, None, Z_LOSS_WEIGHT),
    ],
    ids=["one-token-chunk", "token-chunks-softcap-zloss", "prime-overlap-zloss"],
)
def test_matches_optax_on_full_logits(
    vocab, chunk_size, token_chunk_size, softcap, z_loss_weight, assert_trees_close
):
    """Loss and both gradients equal to fp32 rounding, with Gemma 2's soft-cap and a z-loss
    on the log-sum-exp, the 24 tokens in one chunk or in 3 or 2; 64 ids in 4 chunks of 16,
    the prime 53 in 7 of 8, the last overlapping the one before by 3."""
    inputs = _inputs(vocab)
    expected = _loss_and_grads(_plain_loss, *inputs, softcap=softcap, z_loss_weight=z_loss_weight)
    actual = _loss_and_grads(
        _fused_loss,
        *inputs,
        softcap=softcap,
        z_loss_weight=z_loss_weight,
        chunk_size=chunk_size,
        token_chunk_size=token_chunk_size,
    )
    assert_trees_close(actual, expected, rtol=1e-5)


def test_outputs_are_per_token_cross_entropy_and_log_sum_exp():
    """Leading axes stay: ``(2, 12)`` tokens in 3 chunks of every third position."""
    h, unembedding, targets = _inputs(40)
    logits = h @ unembedding
    fused = jax.jit(fused_cross_entropy, static_argnames=("chunk_size", "token_chunk_size"))
    cross_entropy, log_sum_exp = fused(
        h.reshape(2, 12, EMBED),
        unembedding,
        targets.reshape(2, 12),
        chunk_size=8,
        token_chunk_size=8,
    )
    assert cross_entropy.shape == log_sum_exp.shape == (2, 12)
    np.testing.assert_allclose(
        cross_entropy.reshape(-1),
        optax.softmax_cross_entropy_with_integer_labels(logits, targets),
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        log_sum_exp.reshape(-1), jax.nn.logsumexp(logits, axis=-1), rtol=1e-5
    )


def test_tied_embedding_layout(assert_trees_close):
    """A tied ``(vocab, embed)`` table, read as it is (``vocab_major``) or passed transposed:
    the same loss, and gradients that reach the table."""
    h, unembedding, targets = _inputs(48)
    embedding = unembedding.T

    def tied(loss, transpose, **options):
        def tied_loss(h, embedding):
            return loss(h, embedding.T if transpose else embedding, targets, **options)

        return jax.jit(jax.value_and_grad(tied_loss, (0, 1)))(h, embedding)

    expected = tied(_plain_loss, transpose=True)
    assert_trees_close(
        tied(_fused_loss, transpose=False, vocab_major=True, chunk_size=20), expected, rtol=1e-5
    )
    assert_trees_close(tied(_fused_loss, transpose=True, chunk_size=20), expected, rtol=1e-5)


def test_bfloat16_close_to_float32():
    """bf16 inputs: fp32 log-sum-exp, gradients in bf16 within bf16 rounding of fp32."""
    inputs = _inputs(64, tokens=32, embed=32)
    bf16_inputs = (inputs[0].astype(jnp.bfloat16), inputs[1].astype(jnp.bfloat16), inputs[2])
    loss, (d_h, d_unembedding) = _loss_and_grads(_fused_loss, *bf16_inputs, chunk_size=16)
    assert loss.dtype == jnp.float32
    assert d_h.dtype == d_unembedding.dtype == jnp.bfloat16
    expected = _loss_and_grads(_plain_loss, *inputs)
    for actual, reference in zip((loss, d_h, d_unembedding), jax.tree.leaves(expected)):
        scale = np.max(np.abs(reference))
        np.testing.assert_allclose(
            np.asarray(actual, np.float32), reference, rtol=0, atol=2e-2 * scale
        )


def _data_movement(hlo: str) -> list[str]:
    """The compiled program's instructions that move array slices between devices."""
    return re.findall(r"^.*(?:all-gather|all-to-all|collective-permute).*$", hlo, re.MULTILINE)


@pytest.mark.parametrize(
    "mesh_shape, weight_axes, vocab",
    [({"dp": 2, "tp": 4}, "tp", 256), ({"dp": 2, "pp": 2, "tp": 2}, ("pp", "tp"), 240)],
    ids=["dp2-tp4", "dp2-pp2-tp2-overlap"],
)
def test_vocab_sharded_weight_is_never_gathered(mesh_shape, weight_axes, vocab, assert_trees_close):
    """With the weight's vocab axis sharded over 4 devices and tokens over ``dp``, the
    compiled loss and gradients move no array slices between devices (no all-gather,
    all-to-all or permute): only per-token scalars and the gradients' partial sums are
    all-reduced. The weight's gradient comes back sharded like the weight. 256 ids are 4
    blocks of 64 in 8 chunks of 4 x 8 columns; 240 are 4 blocks of 60, the last chunk
    overlapping; 32 tokens in 4 chunks of 8."""
    mesh = jax.make_mesh(
        tuple(mesh_shape.values()), tuple(mesh_shape), axis_types=(AxisType.Auto,) * len(mesh_shape)
    )
    h, unembedding, targets = _inputs(vocab, tokens=32)
    by_tokens = NamedSharding(mesh, P("dp"))
    h, targets = jax.device_put(h, by_tokens), jax.device_put(targets, by_tokens)
    unembedding = jax.device_put(unembedding, NamedSharding(mesh, P(None, weight_axes)))
    options = dict(softcap=3.0, chunk_size=8, token_chunk_size=8, vocab_shards=4)
    chunks = vocab_chunks(vocab, 8, 4)
    assert (chunks.shards, chunks.n_chunks, chunks.shard_width) == (4, 8, 8)

    step = jax.jit(jax.value_and_grad(lambda h, w, t: _fused_loss(h, w, t, **options), (0, 1)))
    hlo = step.lower(h, unembedding, targets).compile().as_text()
    assert _data_movement(hlo) == []
    assert "all-reduce" in hlo
    actual = step(h, unembedding, targets)
    assert actual[1][1].sharding.is_equivalent_to(unembedding.sharding, 2)
    expected = _loss_and_grads(_plain_loss, h, unembedding, targets, softcap=3.0)
    assert_trees_close(actual, expected, rtol=1e-5)


def _collective_bytes(hlo: str) -> dict[str, float]:
    """Bytes the compiled program moves by each collective kind, each loop iteration counted."""
    total: dict[str, float] = {}
    for c in collectives(hlo):
        total[c.kind] = total.get(c.kind, 0) + c.bytes * c.times
    return total


@pytest.mark.parametrize(
    "shape, fsdp",
    [((64,), False), ((4, 16), False), ((64,), True)],
    ids=["flat", "batch-seq", "fsdp"],
)
def test_the_weight_gradient_is_summed_over_the_token_shards_once_a_chunk(
    shape, fsdp, assert_trees_close
):
    """Tokens split over dp4: each device sums its own tokens' share of a vocabulary chunk's
    gradient over the token chunks, and the devices sum theirs once a chunk, the weight's
    float32 gradient all-reduced once in all (16 x 256 x 4 bytes, and a few per-token sums).
    One accumulator for all the shards made the partitioner sum every block's partial over
    dp: 8 token chunks, 8 times the gradient. With the weight split over dp on its model
    dimension (FSDP) and `gather_columns` gathering each chunk as it is read, the weight
    crosses once in the forward and once in the backward (without it, once a token chunk:
    6 times). 64 tokens in 8 chunks of 8, flat or as 4 sequences of 16 (the chunks along the
    sequence); 256 ids in 8 chunks of 32."""
    mesh = jax.make_mesh((4,), ("dp",), axis_types=(AxisType.Auto,))
    h, unembedding, targets = _inputs(256, tokens=64)
    h, targets = h.reshape(*shape, EMBED), targets.reshape(shape)
    by_tokens = NamedSharding(mesh, P("dp"))
    h, targets = jax.device_put(h, by_tokens), jax.device_put(targets, by_tokens)
    options = dict(chunk_size=32, token_chunk_size=8, token_shards=4)
    if fsdp:
        unembedding = jax.device_put(unembedding, by_tokens)
        options["gather_columns"] = functools.partial(
            jax.lax.with_sharding_constraint, shardings=NamedSharding(mesh, P())
        )
    step = jax.jit(jax.value_and_grad(lambda h, w, t: _fused_loss(h, w, t, **options), (0, 1)))
    moved = _collective_bytes(step.lower(h, unembedding, targets).compile().as_text())
    weight = unembedding.size * 4
    assert weight <= moved["all-reduce"] < 1.1 * weight
    assert moved.get("all-gather", 0) == (2 * weight if fsdp else 0)
    expected = _loss_and_grads(_plain_loss, h.reshape(64, EMBED), unembedding, targets.reshape(64))
    loss, (d_h, d_unembedding) = step(h, unembedding, targets)
    assert_trees_close((loss, (d_h.reshape(64, EMBED), d_unembedding)), expected, rtol=1e-5)


def _largest_array(closed_jaxpr) -> int:
    """The most elements of any value in a jaxpr, its sub-jaxprs (scan and custom-VJP bodies,
    cond branches) included."""

    def walk(jaxpr) -> int:
        sizes = [np.prod(v.aval.shape, dtype=int) for v in jaxpr.invars + jaxpr.constvars]
        for eqn in jaxpr.eqns:
            sizes += [np.prod(v.aval.shape, dtype=int) for v in eqn.outvars]
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        sizes.append(walk(sub.jaxpr))
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        sizes.append(walk(sub))
        return max(sizes)

    return walk(closed_jaxpr.jaxpr)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_no_tokens_by_vocab_array_in_the_gradient(softcap):
    """The jaxpr of the gradient holds nothing as large as the ``(tokens, vocab)`` logits
    (the weight ``(embed, vocab)`` is the largest value); the plain loss does."""
    tokens, embed, vocab = 48, 8, 384
    inputs = _inputs(vocab, tokens=tokens, embed=embed)

    def largest(loss, **options):
        gradient = jax.grad(lambda h, w: loss(h, w, inputs[2], softcap=softcap, **options), (0, 1))
        return _largest_array(jax.make_jaxpr(gradient)(*inputs[:2]))

    assert largest(_fused_loss, chunk_size=32, token_chunk_size=16) == embed * vocab
    assert largest(_plain_loss) >= tokens * vocab


@pytest.mark.parametrize(
    "vocab, n_chunks, width",
    [
        (32000, 8, 4000),
        (50257, 13, 3866),
        (128256, 32, 4008),
        (151936, 38, 3999),
        (152064, 38, 4002),
        (262144, 64, 4096),
    ],
)
def test_vocab_chunks_of_real_vocabularies(vocab, n_chunks, width):
    """About 4096 columns a chunk, the last overlapping by fewer ids than there are chunks;
    with the vocabulary in 8 blocks (a weight sharded 8 ways), 512 columns from each."""
    chunks = vocab_chunks(vocab, 4096)
    assert (chunks.n_chunks, chunks.shard_width) == (n_chunks, width)
    assert 0 <= n_chunks * width - vocab < n_chunks
    sharded = vocab_chunks(vocab, 512, vocab_shards=8)
    if vocab % 8 == 0:
        assert (sharded.shards, sharded.n_chunks) == (8, n_chunks)
        assert 0 <= sharded.n_chunks * sharded.shard_width - vocab // 8 < sharded.n_chunks
    else:
        assert sharded == vocab_chunks(vocab, 512)


def test_token_chunks_stride_the_last_axis():
    assert token_chunks((4096,), 512) == 8
    assert token_chunks((8, 2048), 512) == 32
    assert token_chunks((8, 2048), 100_000) == 1
    assert token_chunks((7,), 2) == 7


def test_the_loss_of_each_token_is_its_own_whatever_the_leading_axes(tiny_config):
    """`token_cross_entropy` flattens ``(microbatches, batch, seq)`` batch-major (to keep a
    dp split): each token's loss and log-sum-exp are those of its sequence alone, and one
    sequence without leading axes is taken as it is."""
    config = tiny_config("llama", n_layers=1)
    model = models.DecoderLM(config, key=jax.random.key(0))
    step = StepConfig(schedule=Schedule("gpipe", 1, 1, 1))
    h = jax.random.normal(jax.random.key(1), (3, 2, 8, config.d_model))
    targets = jax.random.randint(jax.random.key(2), (3, 2, 8), 0, config.vocab_size)
    whole = token_cross_entropy(model, h, targets, step)
    for m, b in ((0, 1), (2, 0)):
        alone = token_cross_entropy(model, h[m, b], targets[m, b], step)
        for part, one in zip(whole, alone, strict=True):
            np.testing.assert_allclose(part[m, b], one, rtol=1e-6)


def test_a_context_split_keeps_each_devices_tokens_in_the_loss(tiny_config):
    """`token_cross_entropy` over ``(microbatches, batch, seq)`` tokens, the batch split over
    dp2 and the sequence over cp4 (`TokenOrder`): each device computes its own tokens'
    logits, 1/8 of the matmul FLOPs one device runs, and each token's loss and log-sum-exp
    are as on one device. Flattened batch-major (the microbatches between the batch and the
    sequence), the partitioner gathered the sequence over cp: 1/2 of one device's FLOPs."""
    from eqxzoo.parallel.collectives import matmul_flops
    from eqxzoo.parallel.mesh import MESH_AXES

    config = tiny_config("llama", n_layers=1)
    model = models.DecoderLM(config, key=jax.random.key(0))
    step = StepConfig(schedule=Schedule("gpipe", 1, 1, 1))
    mesh = jax.make_mesh((2, 1, 1, 1, 4), MESH_AXES, axis_types=(AxisType.Auto,) * 5)
    h = jax.random.normal(jax.random.key(1), (3, 4, 32, config.d_model))
    targets = jax.random.randint(jax.random.key(2), (3, 4, 32), 0, config.vocab_size)
    split = (
        jax.device_put(h, NamedSharding(mesh, P(None, "dp", "cp", None))),
        jax.device_put(targets, NamedSharding(mesh, P(None, "dp", "cp"))),
    )
    on_mesh = jax.jit(lambda h, t: token_cross_entropy(model, h, t, step, mesh))
    alone = jax.jit(lambda h, t: token_cross_entropy(model, h, t, step))
    for part, one in zip(on_mesh(*split), alone(h, targets), strict=True):
        np.testing.assert_allclose(part, one, rtol=1e-6)
    device = matmul_flops(on_mesh.lower(*split).compile().as_text())
    whole = matmul_flops(alone.lower(h, targets).compile().as_text())
    assert device == pytest.approx(whole / 8, rel=0.01)
