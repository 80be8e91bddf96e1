"""Building blocks: shapes, causality, GQA, the MoE paths and their auxiliary losses."""

import contextlib
import io

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from eqxzoo.errors import ConfigError
from eqxzoo.nn import (
    MLP,
    Axes,
    CausalSelfAttention,
    Experts,
    LayerNorm,
    MoE,
    RMSNorm,
    RopeScaling,
    Router,
    Routing,
    Stack,
    apply_rope,
    attend,
    cache_slots,
    embedding_lookup,
    gated_activation,
    logical_axes,
    rope_frequencies,
    router_losses,
)


def test_rms_norm_matches_formula():
    x = jax.random.normal(jax.random.key(0), (5, 16))
    norm = eqx.tree_at(lambda n: n.weight, RMSNorm(16, eps=1e-6), jnp.linspace(0.5, 1.5, 16))
    expected = x / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + 1e-6) * norm.weight
    np.testing.assert_allclose(norm(x), expected, rtol=1e-6)


def test_layer_norm_matches_formula():
    x = jax.random.normal(jax.random.key(1), (5, 16)) * 3 + 1
    norm = LayerNorm(16, eps=1e-5)
    mean, var = np.mean(x, -1, keepdims=True), np.var(x, -1, keepdims=True)
    np.testing.assert_allclose(norm(x), (x - mean) / np.sqrt(var + 1e-5), rtol=1e-5, atol=1e-6)


def saved_after_matching_gradients(module, formula, x, *, probe=1.0, atol: float) -> list[str]:
    """Check that ``module``'s gradients (of its parameters and of ``x``) are autodiff's of
    ``formula(module, x)``, then return the lines `print_saved_residuals` gives for
    ``module(x)``: what its backward keeps."""

    def loss(fn):
        return lambda module, x: jnp.sum(jnp.sin(fn(module, x)) * probe)

    ours = jax.grad(loss(lambda module, x: module(x)), argnums=(0, 1))(module, x)
    reference = jax.grad(loss(formula), argnums=(0, 1))(module, x)
    for got, want in zip(jax.tree.leaves(ours), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=atol)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_saved_residuals(lambda x: module(x), x)
    return printed.getvalue().splitlines()


def _plain_norm(norm, x):
    """The norm's formula left to autodiff."""
    if isinstance(norm, LayerNorm):
        mean = x.mean(-1, keepdims=True)
        normed = (x - mean) / jnp.sqrt(jnp.square(x - mean).mean(-1, keepdims=True) + norm.eps)
        return normed * norm.weight + norm.bias
    axes = tuple(range(-norm.weight.ndim, 0))
    normed = x / jnp.sqrt(jnp.square(x).mean(axes, keepdims=True) + norm.eps)
    return normed * (norm.weight_offset + norm.weight)


@pytest.mark.parametrize(
    "norm",
    [
        LayerNorm(16),
        RMSNorm(16),
        RMSNorm((2, 8), weight_offset=1.0, axis_names=("heads", "head_dim")),
    ],
    ids=["layer", "rms", "rms_two_axes_offset"],
)
def test_norm_gradients_match_autodiff_and_keep_only_the_input(norm):
    """The custom VJP gives autodiff's gradients of the formula, and of the input-sized
    arrays it keeps only the input (the statistics are one value per row)."""
    keys = jax.random.split(jax.random.key(13), 3)
    norm = jax.tree.map(lambda w: w + 0.3 * jax.random.normal(keys[0], w.shape), norm)
    x = jax.random.normal(keys[1], (5, 3, 16)).reshape(5, 3, *norm.weight.shape) * 2 + 0.5
    probe = jax.random.normal(keys[2], x.shape)

    saved = saved_after_matching_gradients(norm, _plain_norm, x, probe=probe, atol=1e-6)
    shape = ",".join(map(str, x.shape))
    input_sized = [line for line in saved if f"[{shape}]" in line]
    assert len(input_sized) == 1 and "from the argument" in input_sized[0], saved


def test_rope_preserves_norm_and_is_relative():
    q = jax.random.normal(jax.random.key(2), (1, 2, 8))
    k = jax.random.normal(jax.random.key(3), (1, 2, 8))
    np.testing.assert_allclose(
        jnp.linalg.norm(apply_rope(q, jnp.array([7]), rope_frequencies(8, 10000.0))),
        jnp.linalg.norm(q),
        rtol=1e-6,
    )

    def score(pq, pk):
        rq = apply_rope(q, jnp.array([pq]), rope_frequencies(8, 100.0))
        rk = apply_rope(k, jnp.array([pk]), rope_frequencies(8, 100.0))
        return jnp.sum(rq * rk, axis=-1)

    np.testing.assert_allclose(score(3, 1), score(12, 10), rtol=1e-5)
    assert not np.allclose(score(3, 1), score(3, 2))


def _attention(n_kv_heads, key=jax.random.key(4), **kwargs):
    return CausalSelfAttention(32, 4, n_kv_heads, 8, key=key, **kwargs)


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_attention_shapes_and_causality(n_kv_heads):
    attention = _attention(n_kv_heads, qk_norm="head", qkv_bias=True)
    x = jax.random.normal(jax.random.key(5), (10, 32))
    y = attention(x)
    assert y.shape == (10, 32) and y.dtype == jnp.float32
    x_changed = x.at[6].set(100.0)
    y_changed = attention(x_changed)
    np.testing.assert_array_equal(y[:6], y_changed[:6])
    assert not np.allclose(y[6:], y_changed[6:])


def test_gqa_with_all_kv_heads_equals_mha():
    """GQA with n_kv_heads == n_heads is MHA; GQA equals MHA with kv heads repeated."""
    gqa = _attention(2)
    x = jax.random.normal(jax.random.key(6), (9, 32))
    repeated = eqx.tree_at(
        lambda a: (a.wq, a.wk, a.wv, a.wo),
        _attention(4),
        (gqa.wq, jnp.repeat(gqa.wk, 2, axis=1), jnp.repeat(gqa.wv, 2, axis=1), gqa.wo),
    )
    np.testing.assert_allclose(gqa(x), repeated(x), rtol=1e-5, atol=1e-6)

    q, k, v = gqa.project_qkv(x, jnp.arange(9))
    k, v = jnp.repeat(k, 2, axis=1), jnp.repeat(v, 2, axis=1)
    scores = jnp.einsum("qnh,knh->nqk", q, k) / np.sqrt(8)
    scores = jnp.where(jnp.tril(jnp.ones((9, 9), bool)), scores, -jnp.inf)
    manual = gqa.project_out(jnp.einsum("nqk,knh->qnh", jax.nn.softmax(scores, -1), v))
    np.testing.assert_allclose(gqa(x), manual, rtol=1e-5, atol=1e-6)


def _reference_attention(q, k, v, q_positions, k_positions, window, scale, softcap, sinks=None):
    """Attention written out in numpy, one query and head at a time; a head's sink is one
    more logit in its softmax, with no value."""
    out = np.zeros(q.shape, np.float64)
    group = q.shape[1] // k.shape[1]
    for t, q_position in enumerate(q_positions):
        for head in range(q.shape[1]):
            kv_head = head // group
            scores = scale * (k[:, kv_head] @ q[t, head])
            if softcap is not None:
                scores = softcap * np.tanh(scores / softcap)
            offsets = q_position - np.asarray(k_positions)
            visible = (np.asarray(k_positions) >= 0) & (offsets >= 0)
            if window:
                visible &= offsets < window
            scores = np.where(visible, scores, -np.inf)
            sink = -np.inf if sinks is None else sinks[head]
            top = max(scores.max(), sink)
            weights = np.exp(scores - top)
            out[t, head] = (weights / (weights.sum() + np.exp(sink - top))) @ v[:, kv_head]
    return out


@pytest.mark.parametrize(("window", "softcap"), [(0, None), (3, None), (4, 1.5), (1, None)])
def test_attend_masks_by_position_window_and_soft_cap(window, softcap):
    """A query at q sees keys at p with q - window < p <= q (window 0: all p <= q) and never
    a negative position (an empty cache slot); scores are soft-capped before the mask."""
    keys = jax.random.split(jax.random.key(11), 3)
    q = jax.random.normal(keys[0], (5, 4, 8))
    k = jax.random.normal(keys[1], (7, 2, 8))
    v = jax.random.normal(keys[2], (7, 2, 8))
    q_positions = jnp.arange(5) + 3
    k_positions = jnp.array([3, 4, -1, 5, 6, 7, 2])  # a cache slot still empty
    got = attend(q, k, v, q_positions, k_positions, window=window, scale=0.3, softcap=softcap)
    expected = _reference_attention(
        *map(np.asarray, (q, k, v, q_positions, k_positions)), window, 0.3, softcap
    )
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [0, 3])
def test_attend_with_sinks(window):
    """Sinks take probability from the real keys: a large sink leaves a head almost no
    output, a very negative one is ordinary attention."""
    keys = jax.random.split(jax.random.key(12), 3)
    q = jax.random.normal(keys[0], (5, 4, 8))
    k = jax.random.normal(keys[1], (6, 2, 8))
    v = jax.random.normal(keys[2], (6, 2, 8))
    q_positions, k_positions = jnp.arange(5) + 1, jnp.array([0, 1, 2, 3, -1, 5])
    sinks = jnp.array([0.5, -1.0, 2.0, 20.0])
    arguments = (q, k, v, q_positions, k_positions)
    got = attend(*arguments, window=window, scale=0.4, sinks=sinks)
    expected = _reference_attention(*map(np.asarray, arguments), window, 0.4, None, sinks)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(got[:, 3]).max()) < 1e-6
    no_sinks = attend(*arguments, window=window, scale=0.4)
    ignored = attend(*arguments, window=window, scale=0.4, sinks=jnp.full((4,), -1e4))
    np.testing.assert_allclose(ignored, no_sinks, rtol=1e-6, atol=1e-7)


def test_attention_sinks_are_a_trained_parameter_per_head():
    attention = _attention(2, sinks=True, init_std=0.5)
    assert attention.sinks.shape == (4,) and float(jnp.abs(attention.sinks).sum()) > 0
    assert logical_axes(attention).sinks == Axes(("heads",))
    x = jax.random.normal(jax.random.key(13), (7, 32))
    grads = jax.grad(lambda a: jnp.sum(a(x) ** 2))(attention)
    assert float(jnp.abs(grads.sinks).sum()) > 0
    without = eqx.tree_at(lambda a: a.sinks, attention, None, is_leaf=lambda x: x is None)
    assert not np.allclose(attention(x), without(x))


def test_ring_cache_slots_keep_the_last_positions():
    np.testing.assert_array_equal(cache_slots(jnp.arange(3, 6), 4), [3, 0, 1])
    # A chunk longer than the ring: only its last 4 tokens are written (4 = not written).
    np.testing.assert_array_equal(cache_slots(jnp.arange(2, 8), 4), [4, 4, 0, 1, 2, 3])


def test_rms_norm_over_several_axes_and_with_a_weight_offset():
    x = jax.random.normal(jax.random.key(12), (3, 4, 8))
    heads = eqx.tree_at(
        lambda n: n.weight,
        RMSNorm((4, 8), axis_names=("heads", "head_dim")),
        jnp.linspace(0.5, 1.5, 32).reshape(4, 8),
    )
    flat = np.asarray(x).reshape(3, 32)
    expected = flat / np.sqrt(np.mean(flat**2, -1, keepdims=True) + 1e-6)
    expected = expected * np.linspace(0.5, 1.5, 32)
    np.testing.assert_allclose(heads(x), expected.reshape(3, 4, 8), rtol=1e-5)
    gemma = RMSNorm(8, weight_offset=1.0)
    np.testing.assert_array_equal(gemma.weight, np.zeros(8))  # scale 1 + 0 at initialisation
    gemma = eqx.tree_at(lambda n: n.weight, gemma, jnp.full(8, 0.25))
    np.testing.assert_allclose(gemma(x), RMSNorm(8)(x) * 1.25, rtol=1e-6)


def test_rope_scalings():
    base = rope_frequencies(16, 10000.0)
    linear = rope_frequencies(16, 10000.0, RopeScaling("linear", 4.0))
    np.testing.assert_allclose(linear, base / 4.0, rtol=1e-6)
    dynamic = RopeScaling("dynamic", 2.0, original_max_positions=8)
    np.testing.assert_allclose(rope_frequencies(16, 10000.0, dynamic, seq_len=8), base, rtol=1e-6)
    longer = rope_frequencies(16, 10000.0, dynamic, seq_len=16)  # base 10000 * 3^(16/14)
    stretched = 10000.0 * 3 ** (16 / 14)
    np.testing.assert_allclose(longer, stretched ** -(np.arange(0, 16, 2) / 16), rtol=1e-5)
    llama3 = rope_frequencies(16, 500000.0, RopeScaling("llama3", 8.0, original_max_positions=64))
    base = rope_frequencies(16, 500000.0)
    wavelengths = 2 * np.pi / np.asarray(base)
    np.testing.assert_allclose(llama3[wavelengths < 16], base[wavelengths < 16], rtol=1e-6)
    np.testing.assert_allclose(llama3[wavelengths > 64], base[wavelengths > 64] / 8.0, rtol=1e-6)


def test_attention_rejects_bad_kv_heads():
    with pytest.raises(ConfigError, match=r"^n_kv_heads: must divide n_heads=4, got 3$"):
        _attention(3)


@pytest.mark.parametrize("activation", ["swiglu", "geglu", "gelu"])
def test_mlp_matches_formula(activation):
    mlp = MLP(16, 24, activation=activation, key=jax.random.key(7))
    x = jax.random.normal(jax.random.key(8), (3, 16))
    if activation == "swiglu":
        hidden = jax.nn.silu(x @ mlp.gate.weight) * (x @ mlp.up.weight)
    elif activation == "geglu":
        hidden = jax.nn.gelu(x @ mlp.gate.weight, approximate=True) * (x @ mlp.up.weight)
    else:
        hidden = jax.nn.gelu(x @ mlp.up.weight)
    np.testing.assert_allclose(mlp(x), hidden @ mlp.down.weight, rtol=1e-6)
    with pytest.raises((ValueError, TypeError), match="relu"):
        MLP(16, 24, activation="relu", key=jax.random.key(0))


@pytest.mark.parametrize("activation", ["swiglu", "geglu", "gelu"])
def test_mlp_gradients_match_formula_and_save_only_the_pre_activations(activation):
    """The backward pass recomputes the activation and the hidden product: of the
    ``(tokens, hidden)`` arrays only the projections' outputs are saved (two gated, one GELU),
    and the gradients are autodiff's of the plain formula."""
    mlp = MLP(16, 24, activation=activation, key=jax.random.key(7))
    x = jax.random.normal(jax.random.key(8), (5, 16))

    def formula(mlp, x):
        act = jax.nn.silu if activation == "swiglu" else jax.nn.gelu
        if mlp.gate is None:
            return act(x @ mlp.up.weight) @ mlp.down.weight
        return (act(x @ mlp.gate.weight) * (x @ mlp.up.weight)) @ mlp.down.weight

    saved = saved_after_matching_gradients(mlp, formula, x, atol=1e-7)
    hidden_sized = [line for line in saved if "[5,24]" in line]
    assert len(hidden_sized) == (1 if activation == "gelu" else 2), saved


def test_embedding_lookup_gradient_scatter_adds_repeated_tokens():
    table = jax.random.normal(jax.random.key(0), (11, 4))
    tokens = jnp.array([[3, 3, 0, 10], [3, 7, 7, 0]])
    weights = jax.random.normal(jax.random.key(1), (2, 4, 4))

    def loss(lookup):
        return lambda table: jnp.sum(jnp.sin(lookup(table, tokens)) * weights)

    got = jax.jit(jax.grad(loss(embedding_lookup)))(table)
    want = jax.grad(loss(lambda table, tokens: jnp.take(table, tokens, axis=0)))(table)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    untouched = [1, 2, 4, 5, 6, 8, 9]
    np.testing.assert_array_equal(np.asarray(got)[untouched], 0.0)
    np.testing.assert_array_equal(embedding_lookup(table, tokens), table[tokens])
    # The zero table is made from the cotangent's first element: a NaN there stays in row 3.
    weights = weights.at[0, 0, 0].set(jnp.nan)
    got = np.asarray(jax.jit(jax.grad(loss(embedding_lookup)))(table))
    np.testing.assert_array_equal(got[untouched], 0.0)
    assert np.isnan(got[3, 0]) and np.isfinite(np.delete(got, 3, axis=0)).all()


def _moe(routing_mode="dropless", **kwargs):
    """A MoE layer whose dropless path is the slotted kernel (slots, overflow blocks)."""
    kwargs = {"normalize_topk": True, "experts": {"dropless_kernel": "slotted"}, **kwargs}
    return MoE(16, 24, 6, 2, routing_mode=routing_mode, key=jax.random.key(9), **kwargs)


# GPT-OSS's experts with a gain and a limit the tests' activations reach.
GPT_OSS_EXPERTS = dict(
    bias=True, activation="clamped_swiglu", alpha=1.5, limit=0.25, dropless_kernel="slotted"
)


def _gpt_oss_moe(routing_mode="dropless", **kwargs):
    """A MoE as GPT-OSS has it: softmax over the top-k logits of a biased router, biased
    experts, the clamped SwiGLU. Weights of std 0.5 make the clamps bite; biases are drawn
    nonzero."""
    moe = MoE(
        16,
        24,
        6,
        2,
        normalize_topk=False,
        router=dict(scoring="softmax_topk", bias=True),
        experts=GPT_OSS_EXPERTS,
        routing_mode=routing_mode,
        init_std=0.1,
        key=jax.random.key(9),
        **kwargs,
    )

    def biases(m):
        return m.router.bias, m.experts.gate_bias, m.experts.up_bias, m.experts.down_bias

    keys = jax.random.split(jax.random.key(19), 4)
    drawn = tuple(0.1 * jax.random.normal(k, b.shape) for k, b in zip(keys, biases(moe)))
    return eqx.tree_at(biases, moe, drawn)


MOE_KINDS = {"swiglu": _moe, "gpt_oss": _gpt_oss_moe}


def _with_mode(moe, routing_mode, capacity_factor=1.25):
    """The same parameters under another routing mode (modes are static fields)."""
    experts = moe.experts
    other = MoE(
        16,
        24,
        6,
        2,
        normalize_topk=moe.router.normalize_topk,
        router=dict(scoring=moe.router.scoring, bias=moe.router.bias is not None),
        experts=dict(
            bias=experts.gate_bias is not None,
            activation=experts.activation,
            alpha=experts.alpha,
            limit=experts.limit,
        ),
        shared_mlp_dim=0 if moe.shared is None else moe.shared.up.weight.shape[1],
        shared_gate=moe.shared_gate is not None,
        routing_mode=routing_mode,
        capacity_factor=capacity_factor,
        key=jax.random.key(99),
    )
    return jax.tree.unflatten(jax.tree.structure(other), jax.tree.leaves(moe))


@pytest.mark.parametrize("normalize_topk", [True, False])
@pytest.mark.parametrize("shared", [0, 20])
@pytest.mark.parametrize("n_tokens", [37, 300])
def test_moe_dropless_equals_dense_reference(normalize_topk, shared, n_tokens):
    """37 tokens: 74 assignments in blocks of 16, about one block per expert; 300 tokens:
    blocks of 64, several per expert."""
    moe = _moe(normalize_topk=normalize_topk, shared_mlp_dim=shared, shared_gate=bool(shared))
    _check_dropless_equals_dense(moe, n_tokens)


@pytest.mark.parametrize("n_tokens", [37, 300])
def test_moe_dropless_equals_dense_with_expert_biases_and_clamped_swiglu(n_tokens):
    """GPT-OSS's experts: the biases and the clamped SwiGLU in the slots, the overflow's
    block loop and the dense reference alike, with both clamps active."""
    moe = _gpt_oss_moe()
    x = jax.random.normal(jax.random.key(10), (n_tokens, 16))
    gate = jnp.einsum("td,edf->etf", x, moe.experts.gate) + moe.experts.gate_bias[:, None]
    up = jnp.einsum("td,edf->etf", x, moe.experts.up) + moe.experts.up_bias[:, None]
    limit = GPT_OSS_EXPERTS["limit"]
    assert float(jnp.mean(gate > limit)) > 0.05 and float(jnp.mean(jnp.abs(up) > limit)) > 0.05
    _check_dropless_equals_dense(moe, n_tokens)


def _check_dropless_equals_dense(moe, n_tokens):
    x = jax.random.normal(jax.random.key(10), (n_tokens, 16))
    dropless, aux = moe(x)
    dense, dense_aux = _with_mode(moe, "dense")(x)
    np.testing.assert_allclose(dropless, dense, rtol=1e-6, atol=1e-7)
    assert float(aux["dropped_fraction"]) == 0.0
    assert 0.0 < float(aux.pop("padding_fraction")) < 0.5
    assert float(dense_aux.pop("padding_fraction")) == 0.0
    jax.tree.map(np.testing.assert_array_equal, aux, dense_aux)


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_moe_capacity_path_equals_dense_when_capacity_is_large(kind):
    moe = MOE_KINDS[kind]()
    x = jax.random.normal(jax.random.key(11), (40, 16))
    dense, _ = _with_mode(moe, "dense")(x)
    large, aux = _with_mode(moe, "capacity", capacity_factor=6.0)(x)
    np.testing.assert_allclose(large, dense, rtol=1e-6, atol=1e-7)
    assert float(aux["dropped_fraction"]) == 0.0


def test_moe_capacity_path_drops_overflow_in_priority_order():
    """Capacity 1 per expert: only the first assignment to each expert survives."""
    experts = Experts(4, 8, 2, init_std=0.5, key=jax.random.key(12))
    x = jax.random.normal(jax.random.key(13), (3, 4))
    routing = Routing(
        logits=jnp.zeros((3, 2)),
        probs=jnp.full((3, 2), 0.5),
        weights=jnp.ones((3, 1)),
        experts=jnp.array([[0], [0], [1]]),
    )
    output, dropped = experts.capacity(x, routing, capacity_factor=2 / 3)
    full = experts.dense(x, routing.weights, routing.experts)
    np.testing.assert_allclose(output[0], full[0], rtol=1e-6)
    np.testing.assert_array_equal(output[1], np.zeros(4))
    np.testing.assert_allclose(output[2], full[2], rtol=1e-6)
    np.testing.assert_allclose(dropped, 1 / 3, rtol=1e-6)


def test_router_topk_and_renormalisation():
    router = Router(8, 5, 2, normalize_topk=False, key=jax.random.key(14))
    x = jax.random.normal(jax.random.key(15), (6, 8))
    routing = router(x)
    probs = jax.nn.softmax(x @ router.weight, axis=-1)
    np.testing.assert_allclose(routing.probs, probs, rtol=1e-6)
    np.testing.assert_allclose(routing.weights, np.sort(probs, axis=-1)[:, ::-1][:, :2], rtol=1e-6)
    normalized = eqx.tree_at(
        lambda r: r.weight,
        Router(8, 5, 2, normalize_topk=True, key=jax.random.key(0)),
        router.weight,
    )(x)
    np.testing.assert_allclose(jnp.sum(normalized.weights, -1), np.ones(6), rtol=1e-6)
    np.testing.assert_array_equal(normalized.experts, routing.experts)


def test_aux_losses_on_a_hand_checked_example():
    """Two tokens, two experts, top-1.

    logits [[ln 3, 0], [0, 0]] -> probs [[.75, .25], [.5, .5]]; choices: expert 0 (token 0),
    expert 0 (token 1; ties break to the lower index). f = [1, 0], p = [.625, .375],
    load balance = 2 * (1 * .625 + 0) = 1.25; z-loss = mean(ln(4)^2, ln(2)^2).
    """
    logits = jnp.array([[np.log(3.0), 0.0], [0.0, 0.0]], jnp.float32)
    probs = jax.nn.softmax(logits, -1)
    weights, choices = jax.lax.top_k(probs, 1)
    routing = Routing(logits=logits, probs=probs, weights=weights, experts=choices)
    losses = router_losses(routing)
    np.testing.assert_allclose(losses["expert_fraction"], [1.0, 0.0])
    np.testing.assert_allclose(losses["load_balance_loss"], 1.25, rtol=1e-6)
    np.testing.assert_allclose(
        losses["router_z_loss"], (np.log(4.0) ** 2 + np.log(2.0) ** 2) / 2, rtol=1e-6
    )


def test_balanced_routing_has_unit_load_balance_loss():
    logits = jnp.zeros((4, 4))
    routing = Routing(
        logits=logits,
        probs=jnp.full((4, 4), 0.25),
        weights=jnp.full((4, 2), 0.5),
        experts=jnp.array([[0, 1], [2, 3], [1, 0], [3, 2]]),
    )
    losses = router_losses(routing)
    np.testing.assert_allclose(losses["load_balance_loss"], 1.0, rtol=1e-6)
    np.testing.assert_allclose(losses["expert_fraction"], np.full(4, 0.25))


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_moe_gradients_flow_through_all_paths(kind):
    x = jax.random.normal(jax.random.key(16), (12, 16))
    moe = MOE_KINDS[kind](shared_mlp_dim=8, shared_gate=True)

    def loss(moe, mode):
        out, aux = _with_mode(moe, mode, 8.0)(x)
        return jnp.sum(out**2) + aux["load_balance_loss"] + aux["router_z_loss"]

    grads = {mode: eqx.filter_grad(loss)(moe, mode) for mode in ("dropless", "capacity", "dense")}
    for mode, rtol in (("dropless", 1e-6), ("capacity", 1e-5)):
        jax.tree.map(
            lambda a, b, rtol=rtol: np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-7),
            grads[mode],
            grads["dense"],
        )
    assert float(jnp.abs(grads["dropless"].router.weight).sum()) > 0
    if kind == "gpt_oss":
        for bias in ("gate_bias", "up_bias", "down_bias"):
            assert float(jnp.abs(getattr(grads["dropless"].experts, bias)).sum()) > 0


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_moe_dropless_gradients_equal_dense_with_several_blocks_per_expert(kind):
    """300 tokens: 600 assignments over 6 experts in blocks of 64 (the block-sparse path's
    block loop, partial last blocks and its weight-gradient accumulation across blocks).

    GPT-OSS's gradients are sums of 300 order-one terms (its biases see every token), so
    their rounding is relative to each array's largest entry."""
    x = jax.random.normal(jax.random.key(17), (300, 16))
    moe = MOE_KINDS[kind](shared_mlp_dim=8)

    def check(a, b):
        atol = 1e-7 if kind == "swiglu" else 1e-6 * float(np.abs(b).max())
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=atol)

    @eqx.filter_jit
    def grads(moe, mode):
        def loss(moe):
            out, aux = _with_mode(moe, mode)(x)
            return jnp.sum(jnp.sin(out)) + aux["load_balance_loss"]

        return eqx.filter_grad(loss)(moe)

    jax.tree.map(check, grads(moe, "dropless"), grads(moe, "dense"))


def test_clamped_swiglu_matches_formula():
    gate = jnp.linspace(-3.0, 3.0, 13)
    up = jnp.linspace(2.5, -2.5, 13)
    clamped_gate, clamped_up = np.minimum(gate, 1.2), np.clip(up, -1.2, 1.2)
    expected = (clamped_up + 1) * clamped_gate / (1 + np.exp(-1.7 * clamped_gate))
    got = gated_activation(gate, up, "clamped_swiglu", 1.7, 1.2)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    swiglu = gated_activation(gate, up, "swiglu", 1.7, 1.2)
    np.testing.assert_allclose(swiglu, jax.nn.silu(gate) * up, rtol=1e-6)


def test_experts_reject_bad_options():
    with pytest.raises(ConfigError, match=r"^limit: must be > 0, got 0\.0$"):
        Experts(4, 8, 2, activation="clamped_swiglu", limit=0.0, key=jax.random.key(0))
    with pytest.raises((ValueError, TypeError), match="gelu"):  # the type checker may be first
        Experts(4, 8, 2, activation="gelu", key=jax.random.key(0))


class _Affine(eqx.Module):
    scale: jax.Array

    def __init__(self, key):
        self.scale = jax.random.normal(key, (4,))

    def __call__(self, h, *, key=None):
        return jnp.tanh(h * self.scale), {"mean": jnp.mean(h)}


@pytest.mark.parametrize("remat_policy", ["none", "full", "dots"])
def test_stack_scan_equals_unrolled(remat_policy):
    key = jax.random.key(17)
    scanned = Stack(_Affine, 5, scan=True, remat_policy=remat_policy, key=key)
    unrolled = Stack(_Affine, 5, scan=False, remat_policy=remat_policy, key=key)
    h = jax.random.normal(jax.random.key(18), (3, 4))
    (hs, aux_s), (hu, aux_u) = scanned(h), unrolled(h)
    np.testing.assert_allclose(hs, hu, rtol=1e-6)
    assert aux_s["mean"].shape == (5,)
    np.testing.assert_allclose(aux_s["mean"], aux_u["mean"], rtol=1e-6)
    expected = h
    for index in range(5):
        expected, _ = scanned.layer(index)(expected)
    np.testing.assert_allclose(hs, expected, rtol=1e-6)
    grad_s = jax.grad(lambda s: jnp.sum(s(h)[0]))(scanned)
    grad_u = jax.grad(lambda s: jnp.sum(s(h)[0]))(unrolled)
    np.testing.assert_allclose(grad_s.layers.scale, grad_u.layers.scale, rtol=1e-5)


def test_stack_rejects_unknown_remat_policy():
    with pytest.raises((ValueError, TypeError), match="some"):
        Stack(_Affine, 2, remat_policy="some", key=jax.random.key(0))


def test_logical_axes_cover_every_parameter():
    moe = _moe(shared_mlp_dim=8, shared_gate=True)
    axes = logical_axes(moe)
    flat = jax.tree.leaves(axes, is_leaf=lambda a: isinstance(a, Axes))
    assert len(flat) == len(jax.tree.leaves(moe))
    assert axes.experts.gate == Axes(("experts", "embed", "mlp"))
    assert axes.router.weight == Axes(("embed", None))
    stacked = logical_axes(Stack(lambda k: MLP(4, 8, key=k), 3, key=jax.random.key(0)))
    assert stacked.layers.up.weight == Axes(("layers", "embed", "mlp"))


def test_logical_axes_reject_unannotated_arrays():
    with pytest.raises(ValueError, match=r"array at \.scale has no logical axes"):
        logical_axes(_Affine(jax.random.key(0)))
