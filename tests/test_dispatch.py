"""The expert-major dropless path (`eqxzoo.nn.dispatch`): the slot layout, the gathers and
their VJPs, and `Experts.dropless` equal to the dense reference at rtol 1e-6 (fp32) for
routings that fill the slots exactly, leave experts empty, overflow a little (the few-rows
branch) and send everything to one expert (the all-rows branch)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxzoo.nn.dispatch import (
    RowMap,
    computed_and_assigned_rows,
    padding_fraction,
    rows_from_tokens,
    rows_to_assignments,
    slot_capacity,
    slot_layout,
)
from eqxzoo.nn.experts import Experts, overflow_rows
from eqxzoo.nn.router import Routing

N_TOKENS, TOP_K, N_EXPERTS, D_MODEL = 48, 2, 6, 8


def _choices(kind: str) -> jnp.ndarray:
    """``(tokens, k)`` expert choices, distinct per token."""
    tokens = np.arange(N_TOKENS)
    if kind == "balanced":  # 16 per expert: every slot used, no overflow
        first = tokens % N_EXPERTS
        second = (first + 1 + tokens // N_EXPERTS % (N_EXPERTS - 1)) % N_EXPERTS
    elif kind == "empty_experts":  # experts 3..5 unused, 0..2 overflow by 16 each
        first = tokens % 3
        second = (first + 1) % 3
    elif kind == "one_expert_first":  # every token's first choice is expert 4
        first = np.full(N_TOKENS, 4)
        second = tokens % 4
    elif kind == "random":
        rng = np.random.default_rng(0)
        pairs = [rng.choice(N_EXPERTS, 2, replace=False) for _ in tokens]
        first, second = np.array(pairs).T
    else:
        raise ValueError(kind)
    return jnp.asarray(np.stack([first, second], axis=1), jnp.int32)


# Overflow rows of each routing: none; past `overflow_rows` (16 of 96 assignments), so the
# all-rows branch; past it again; within it, the few-rows branch.
OVERFLOW = {"balanced": 0, "empty_experts": 48, "one_expert_first": 32, "random": 13}
KINDS = list(OVERFLOW)


def _routing(kind: str) -> Routing:
    experts = _choices(kind)
    weights = jax.random.uniform(jax.random.key(1), experts.shape, minval=0.1, maxval=1.0)
    logits = jnp.zeros((N_TOKENS, N_EXPERTS))
    return Routing(logits=logits, probs=jax.nn.softmax(logits), weights=weights, experts=experts)


def _experts(kernel: str = "slotted") -> Experts:
    return Experts(
        D_MODEL, 12, N_EXPERTS, dropless_kernel=kernel, init_std=0.3, key=jax.random.key(2)
    )


def _gpt_oss_experts(kernel: str = "slotted") -> Experts:
    """GPT-OSS's experts: biases drawn nonzero, the clamped SwiGLU at a limit the projections
    often pass."""
    experts = Experts(
        D_MODEL,
        12,
        N_EXPERTS,
        bias=True,
        activation="clamped_swiglu",
        alpha=1.5,
        limit=0.5,
        dropless_kernel=kernel,
        init_std=0.3,
        key=jax.random.key(2),
    )

    def biases(e):
        return e.gate_bias, e.up_bias, e.down_bias

    keys = jax.random.split(jax.random.key(7), 3)
    drawn = tuple(0.3 * jax.random.normal(k, b.shape) for k, b in zip(keys, biases(experts)))
    return eqx.tree_at(biases, experts, drawn)


def test_capacity_and_overflow_rows():
    assert slot_capacity(96, 6) == 16 and slot_capacity(4096, 64) == 64
    assert slot_capacity(74, 6) == 16 and slot_capacity(5, 8) == 5
    assert overflow_rows(96) == 16 and overflow_rows(4096) == 512


@pytest.mark.parametrize("kind", KINDS)
def test_every_assignment_in_exactly_one_row(kind):
    experts = _choices(kind)
    layout = slot_layout(experts, N_EXPERTS)
    capacity = layout.capacity
    in_slots, in_overflow = layout.slots.assignment_in, layout.overflow.assignment_in
    assert not bool(jnp.any(in_slots & in_overflow)) and bool(jnp.all(in_slots | in_overflow))
    flat = np.asarray(experts).reshape(-1)
    for rows in (layout.slots, layout.overflow):
        used = np.asarray(rows.row_assignment)[np.asarray(rows.row_used)]
        placed = np.flatnonzero(np.asarray(rows.assignment_in).reshape(-1))
        np.testing.assert_array_equal(np.sort(used), placed)
        back = np.asarray(rows.row_assignment)[np.asarray(rows.assignment_row).reshape(-1)]
        np.testing.assert_array_equal(back[placed], placed)
    slot_expert = np.asarray(layout.slots.assignment_row).reshape(-1) // capacity
    placed_in_slots = np.asarray(in_slots).reshape(-1)
    np.testing.assert_array_equal(slot_expert[placed_in_slots], flat[placed_in_slots])
    sizes = np.bincount(flat, minlength=N_EXPERTS)
    np.testing.assert_array_equal(layout.overflow_sizes, np.maximum(sizes - capacity, 0))


def test_padding_fraction_counts_empty_slots_and_overflow_blocks():
    layout = slot_layout(_choices("empty_experts"), N_EXPERTS)
    # 6 x 16 slots, 48 used; overflow 16 + 16 + 16 rows in three 16-row blocks.
    rows = computed_and_assigned_rows(layout)
    np.testing.assert_array_equal(rows, [96 + 48, 96])
    np.testing.assert_allclose(padding_fraction(rows), 48 / (96 + 48))
    balanced = computed_and_assigned_rows(slot_layout(_choices("balanced"), N_EXPERTS))
    assert float(padding_fraction(balanced)) == 0.0


@pytest.mark.parametrize("kind", ["random", "one_expert_first"])
def test_gathers_and_their_gradients(kind):
    """``rows_from_tokens`` and ``rows_to_assignments`` equal plain indexing, and so do their
    VJPs (gathers standing in for autodiff's scatter-adds)."""
    layout = slot_layout(_choices(kind), N_EXPERTS)
    x = jax.random.normal(jax.random.key(3), (N_TOKENS, D_MODEL))

    def plain_rows(x, rows: RowMap):
        values = x[rows.row_assignment // rows.top_k]
        return jnp.where(rows.row_used[:, None], values, 0)

    def plain_back(values, rows: RowMap):
        return jnp.where(rows.assignment_in[..., None], values[rows.assignment_row], 0)

    for rows in (layout.slots, layout.overflow):
        weights = jnp.cos(jnp.arange(rows.row_used.shape[0] * D_MODEL)).reshape(-1, D_MODEL)

        def loss(x, gather, back, rows=rows, weights=weights):
            return jnp.sum(jnp.sin(back(gather(x, rows) * weights, rows)))

        ours = jax.value_and_grad(loss)(x, rows_from_tokens, rows_to_assignments)
        plain = jax.value_and_grad(loss)(x, plain_rows, plain_back)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), ours, plain
        )


def _outputs_and_gradients(experts: Experts, routing: Routing, mode: str):
    x = jax.random.normal(jax.random.key(4), (N_TOKENS, D_MODEL))
    target = jnp.sin(jnp.arange(N_TOKENS * D_MODEL)).reshape(N_TOKENS, D_MODEL)

    def loss(experts, x, weights):
        output = getattr(experts, mode)(x, weights, routing.experts)
        output = output[0] if isinstance(output, tuple) else output
        return jnp.sum(jnp.sin(output) * target), output

    grads, output = eqx.filter_jit(eqx.filter_grad(loss, has_aux=True))(experts, x, routing.weights)
    return output, grads


@pytest.mark.parametrize("kind", KINDS)
def test_dropless_equals_dense_reference_with_gradients(kind):
    experts, routing = _experts(), _routing(kind)
    layout = slot_layout(routing.experts, N_EXPERTS)
    assert int(jnp.sum(layout.overflow_sizes)) == OVERFLOW[kind]
    got = _outputs_and_gradients(experts, routing, "dropless")
    expected = _outputs_and_gradients(experts, routing, "dense")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), got, expected)


@pytest.mark.parametrize("kind", ["balanced", "random", "one_expert_first"])
def test_dropless_equals_dense_with_expert_biases_and_clamped_swiglu(kind):
    """Each overflow row's biases are its expert's, in both branches and in the slots."""
    experts, routing = _gpt_oss_experts(), _routing(kind)
    got = _outputs_and_gradients(experts, routing, "dropless")
    expected = _outputs_and_gradients(experts, routing, "dense")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), got, expected)
    assert float(jnp.abs(got[1].gate_bias).sum()) > 0


def test_overflow_past_the_few_rows_branch_is_exact():
    """Every first choice on expert 4: 32 of its 48 assignments beyond its 16 slots, more
    than `overflow_rows` (16), so the all-rows branch runs."""
    experts, routing = _experts(), _routing("one_expert_first")
    layout = slot_layout(routing.experts, N_EXPERTS)
    assert int(jnp.sum(layout.overflow_sizes)) > overflow_rows(N_TOKENS * TOP_K)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6),
        _outputs_and_gradients(experts, routing, "dropless"),
        _outputs_and_gradients(experts, routing, "dense"),
    )


@pytest.mark.parametrize("make_experts", [_experts, _gpt_oss_experts])
def test_sorted_dropless_equals_dense_reference(make_experts):
    """The sorted kernel: assignments sorted by expert, one `jax.lax.ragged_dot` per weight."""
    experts, routing = make_experts("sorted"), _routing("random")
    x = jax.random.normal(jax.random.key(5), (N_TOKENS, D_MODEL))
    output, padding = experts.dropless(x, routing.weights, routing.experts)
    np.testing.assert_allclose(
        output, experts.dense(x, routing.weights, routing.experts), rtol=1e-6, atol=1e-6
    )
    assert 0.0 <= float(padding) < 1.0


def test_dropless_under_vmap_equals_per_sequence():
    experts = _experts()
    routings = [_routing(kind) for kind in ("random", "empty_experts")]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *routings)
    xs = jax.random.normal(jax.random.key(6), (2, N_TOKENS, D_MODEL))
    batched, _ = jax.jit(jax.vmap(experts.dropless))(xs, stacked.weights, stacked.experts)
    for x, routing, got in zip(xs, routings, batched):
        dense = experts.dense(x, routing.weights, routing.experts)
        np.testing.assert_allclose(got, dense, rtol=1e-6, atol=1e-6)
