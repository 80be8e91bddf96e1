"""The routed experts: each expert's gated MLP, run on the tokens routed to it by the
dropless, capacity or dense path (the `MoE` layer picks one)."""

import math
from collections.abc import Callable, Mapping
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqxzoo.nn.axes import AbstractAxesOwner, LogicalName
from eqxzoo.nn.dispatch import (
    OVERFLOW_BLOCK,
    RowMap,
    computed_and_assigned_rows,
    rows_from_tokens,
    rows_to_assignments,
    slot_layout,
)
from eqxzoo.nn.dispatch import padding_fraction as padding_fraction_of_rows
from eqxzoo.nn.grouped import grouped_matmul, padding_fraction
from eqxzoo.nn.linear import normal_init
from eqxzoo.nn.router import Routing
from eqxzoo.nn.varying import cotangent_for
from eqxzoo.typed_config import refuse

ExpertActivation = Literal["swiglu", "clamped_swiglu"]
DroplessKernel = Literal["sorted", "slotted"]


class Experts(AbstractAxesOwner):
    """``n_experts`` gated MLPs stored as stacked ``(experts, ...)`` weights.

    Expert ``e`` computes ``(act(x @ gate[e] + gate_bias[e], x @ up[e] + up_bias[e])) @
    down[e] + down_bias[e]``, the biases optional (``bias``: GPT-OSS). ``activation``
    (`gated_activation`) is ``"swiglu"``, ``silu(gate) * up``, or ``"clamped_swiglu"``
    (GPT-OSS), ``(up + 1) * gate * sigmoid(alpha * gate)`` after clamping the gate above at
    ``limit`` and ``up`` to ``[-limit, limit]``. Every routing path (`dense`, `capacity`,
    `dropless`) runs the experts through `_apply`, so they compute the same function.

    ``dropless_kernel`` is how `dropless` runs them: ``"sorted"`` (assignments sorted by
    expert, one `jax.lax.ragged_dot` per weight: no data-dependent loop, so it runs inside any
    partitioned program) or ``"slotted"`` (each expert's slots as batched matmuls, the
    overflow a block loop of as many iterations as the routing overflows: faster where
    ``ragged_dot`` is not native, `eqxzoo.nn.grouped.resolve_implementation`).
    """

    gate: Float[Array, "experts embed mlp"]
    up: Float[Array, "experts embed mlp"]
    down: Float[Array, "experts mlp embed"]
    gate_bias: Float[Array, "experts mlp"] | None
    up_bias: Float[Array, "experts mlp"] | None
    down_bias: Float[Array, "experts embed"] | None
    activation: ExpertActivation = eqx.field(static=True)
    alpha: float = eqx.field(static=True)
    limit: float = eqx.field(static=True)
    dropless_kernel: DroplessKernel = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        hidden_dim: int,
        n_experts: int,
        *,
        bias: bool = False,
        activation: ExpertActivation = "swiglu",
        alpha: float = 1.702,
        limit: float = 7.0,
        dropless_kernel: DroplessKernel = "sorted",
        init_std: float = 0.02,
        key: PRNGKeyArray,
    ):
        if activation not in ("swiglu", "clamped_swiglu"):
            refuse("activation", f"must be 'swiglu' or 'clamped_swiglu', got {activation!r}")
        if limit <= 0:
            refuse("limit", f"must be > 0, got {limit}")
        check_dropless_kernel(dropless_kernel)
        kg, ku, kd = jax.random.split(key, 3)
        self.gate = normal_init(kg, (n_experts, d_model, hidden_dim), init_std)
        self.up = normal_init(ku, (n_experts, d_model, hidden_dim), init_std)
        self.down = normal_init(kd, (n_experts, hidden_dim, d_model), init_std)
        self.gate_bias = jnp.zeros((n_experts, hidden_dim)) if bias else None
        self.up_bias = jnp.zeros((n_experts, hidden_dim)) if bias else None
        self.down_bias = jnp.zeros((n_experts, d_model)) if bias else None
        self.activation = activation
        self.alpha = alpha
        self.limit = limit
        self.dropless_kernel = dropless_kernel

    def param_axes(self) -> Mapping[str, tuple[LogicalName, ...]]:
        return {
            "gate": ("experts", "embed", "mlp"),
            "up": ("experts", "embed", "mlp"),
            "down": ("experts", "mlp", "embed"),
            "gate_bias": ("experts", "mlp"),
            "up_bias": ("experts", "mlp"),
            "down_bias": ("experts", "embed"),
        }

    @property
    def n_experts(self) -> int:
        return self.gate.shape[0]

    def _apply(
        self,
        rows: Array,
        matmul: Callable[[Array, Array], Array],
        row_bias: Callable[[Array], Array],
    ) -> Array:
        """The experts on ``rows`` in any path's layout: ``matmul(rows, weight)`` multiplies
        each row by its expert's ``(experts, in, out)`` weight, ``row_bias(bias)`` gives each
        row its expert's row of an ``(experts, out)`` bias, shaped to add to the product."""
        gate, up = matmul(rows, self.gate), matmul(rows, self.up)
        if self.gate_bias is not None:
            gate, up = gate + row_bias(self.gate_bias), up + row_bias(self.up_bias)
        hidden = gated_activation(gate, up, self.activation, self.alpha, self.limit)
        out = matmul(hidden, self.down)
        return out if self.down_bias is None else out + row_bias(self.down_bias)

    def dropless(
        self,
        x: Float[Array, "tokens embed"],
        weights: Float[Array, "tokens k"],
        experts: Int[Array, "tokens k"],
        *,
        expected_assignments: int | None = None,
    ) -> tuple[Float[Array, "tokens embed"], Float[Array, ""]]:
        """Every assignment computed, by ``dropless_kernel``; returns each token's weighted
        sum of its chosen experts' outputs and the fraction of the computed rows that are
        padding. A choice of ``n_experts`` names no expert of these (expert parallelism: a
        token's experts on other devices) and is skipped; ``expected_assignments`` (default:
        every choice) is how many choices name one, on average, which the slotted kernel
        sizes its slots for."""
        if self.dropless_kernel == "sorted":
            return self._sorted_dropless(x, weights, experts)
        output, rows = self.slotted_dropless(x, weights, experts, expected_assignments)
        return output, padding_fraction_of_rows(rows)

    def slotted_dropless(
        self,
        x: Float[Array, "tokens embed"],
        weights: Float[Array, "tokens k"],
        experts: Int[Array, "tokens k"],
        expected_assignments: int | None = None,
    ) -> tuple[Float[Array, "tokens embed"], Float[Array, "2"]]:
        """Each expert's slots as batched matmuls, the overflow as a block loop
        (`eqxzoo.nn.dispatch`). Returns the output and the rows computed and assigned
        (`eqxzoo.nn.dispatch.computed_and_assigned_rows`)."""
        n_assignments = expected_assignments or experts.size
        layout = slot_layout(experts, self.n_experts, expected_assignments)
        slot_inputs = rows_from_tokens(x, layout.slots)
        slot_inputs = slot_inputs.reshape(self.n_experts, layout.capacity, -1)
        slot_outputs = self._apply(slot_inputs, batched_matmul, lambda b: b[:, None, :])
        per_choice = rows_to_assignments(slot_outputs.reshape(-1, x.shape[-1]), layout.slots)
        flat_experts = experts.reshape(-1)

        def overflow_outputs(overflow: RowMap) -> Float[Array, "tokens k embed"]:
            def matmul(rows, weights):
                return grouped_matmul(
                    rows,
                    weights,
                    layout.overflow_sizes,
                    implementation="blocks",
                    block=OVERFLOW_BLOCK,
                )

            # Unused rows get some expert's bias; no assignment reads them back.
            row_experts = jnp.minimum(
                jnp.take(flat_experts, overflow.row_assignment), self.n_experts - 1
            )
            outputs = self._apply(
                rows_from_tokens(x, overflow), matmul, lambda b: jnp.take(b, row_experts, axis=0)
            )
            return rows_to_assignments(outputs, overflow)

        few_rows = overflow_rows(n_assignments)
        if few_rows < experts.size:
            per_choice += jax.lax.cond(
                jnp.sum(layout.overflow_sizes) <= few_rows,
                lambda: overflow_outputs(layout.overflow.first_rows(few_rows)),
                lambda: overflow_outputs(layout.overflow),
            )
        else:
            per_choice += overflow_outputs(layout.overflow)
        output = jnp.einsum("tkd,tk->td", per_choice, weights.astype(x.dtype))
        return output, computed_and_assigned_rows(layout)

    def _sorted_dropless(
        self,
        x: Float[Array, "tokens embed"],
        weights: Float[Array, "tokens k"],
        experts: Int[Array, "tokens k"],
    ) -> tuple[Float[Array, "tokens embed"], Float[Array, ""]]:
        """Sort assignments by expert, grouped matmuls (`jax.lax.ragged_dot`), unsort. Choices
        of no expert here sort last, past every group: the grouped matmuls leave them zero."""
        n_tokens, top_k = experts.shape
        flat_experts = experts.reshape(-1)
        order = jnp.argsort(flat_experts, stable=True)
        inverse_order = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
        sorted_inputs = permute_rows(jnp.repeat(x, top_k, axis=0), order, inverse_order)
        sorted_experts = jnp.minimum(jnp.take(flat_experts, order), self.n_experts - 1)
        group_sizes = jnp.bincount(flat_experts, length=self.n_experts).astype(jnp.int32)

        def matmul(rows, weights):
            return grouped_matmul(rows, weights, group_sizes, implementation="ragged_dot")

        sorted_outputs = self._apply(
            sorted_inputs, matmul, lambda b: jnp.take(b, sorted_experts, axis=0)
        )
        outputs = permute_rows(sorted_outputs, inverse_order, order).reshape(n_tokens, top_k, -1)
        outputs = jnp.where((experts < self.n_experts)[..., None], outputs, 0)
        output = jnp.einsum("tkd,tk->td", outputs, weights.astype(x.dtype))
        padding = padding_fraction(group_sizes, order.shape[0], implementation="ragged_dot")
        return output, padding

    def capacity(
        self, x: Float[Array, "tokens embed"], routing: Routing, capacity_factor: float
    ) -> tuple[Float[Array, "tokens embed"], Float[Array, ""]]:
        """Fixed-capacity dispatch; returns the output and the fraction of dropped assignments.

        ``capacity = ceil(capacity_factor * tokens * k / experts)`` slots per expert. Slots
        are filled first by every token's first choice, then second choices, and so on, each
        in token order (GShard/Switch priority).
        """
        n_tokens, top_k = routing.experts.shape
        expert_capacity = capacity_of(n_tokens, top_k, self.n_experts, capacity_factor)
        choice_major_experts = routing.experts.T.reshape(-1)
        slot = capacity_slots(routing.experts, self.n_experts)
        kept = slot < expert_capacity
        token_index = jnp.tile(jnp.arange(n_tokens), top_k)
        dispatched = jnp.zeros((self.n_experts, expert_capacity, x.shape[-1]), x.dtype)
        dispatched = dispatched.at[choice_major_experts, slot].set(x[token_index], mode="drop")

        def matmul(rows, weights):
            return jnp.einsum("ecd,edf->ecf", rows, weights)

        expert_outputs = self._apply(dispatched, matmul, lambda b: b[:, None, :])
        gathered = expert_outputs[choice_major_experts, jnp.minimum(slot, expert_capacity - 1)]
        gathered = jnp.where(kept[:, None], gathered, 0.0).reshape(top_k, n_tokens, -1)
        output = jnp.einsum("ktd,tk->td", gathered, routing.weights.astype(x.dtype))
        return output, 1.0 - jnp.mean(kept.astype(jnp.float32))

    def dense(
        self,
        x: Float[Array, "tokens embed"],
        weights: Float[Array, "tokens k"],
        experts: Int[Array, "tokens k"],
    ) -> Float[Array, "tokens embed"]:
        """Every expert on every token, combined with the routing weights (zero if unchosen;
        a choice of ``n_experts``, no expert here, is skipped)."""
        n_tokens = x.shape[0]
        here = experts < self.n_experts
        combine = jnp.zeros((n_tokens, self.n_experts), x.dtype)
        combine = combine.at[jnp.arange(n_tokens)[:, None], jnp.where(here, experts, 0)].add(
            jnp.where(here, weights, 0).astype(x.dtype)
        )

        def matmul(rows, weights):
            if rows.ndim == 2:  # the tokens, shared by every expert
                return jnp.einsum("td,edf->etf", rows, weights)
            return jnp.einsum("etf,efd->etd", rows, weights)

        expert_outputs = self._apply(x, matmul, lambda b: b[:, None, :])
        return jnp.einsum("etd,te->td", expert_outputs, combine)


def capacity_of(n_tokens: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    """Slots per expert of the capacity path: ``ceil(capacity_factor * tokens * k /
    experts)``, at least 1."""
    return max(1, math.ceil(capacity_factor * n_tokens * top_k / n_experts))


def capacity_slots(experts: Int[Array, "tokens k"], n_experts: int) -> Int[Array, " assignments"]:
    """Each assignment's slot at its expert in the capacity path's priority (every token's
    first choice, then second choices, ..., each in token order), choice-major: assignment
    ``j * tokens + t`` is token ``t``'s ``j``-th choice."""
    choice_major_experts = experts.T.reshape(-1)
    one_hot = jax.nn.one_hot(choice_major_experts, n_experts, dtype=jnp.int32)
    return jnp.sum((jnp.cumsum(one_hot, axis=0) - 1) * one_hot, axis=-1)


def gated_activation(
    gate: Float[Array, "*rows mlp"],
    up: Float[Array, "*rows mlp"],
    activation: ExpertActivation,
    alpha: float,
    limit: float,
) -> Float[Array, "*rows mlp"]:
    """``silu(gate) * up`` (``"swiglu"``) or GPT-OSS's ``"clamped_swiglu"``: ``gate`` clamped
    above at ``limit``, ``up`` to ``[-limit, limit]``, then ``(up + 1) * gate * sigmoid(alpha
    * gate)`` (the clamps keep the activations of its low-precision experts bounded)."""
    if activation == "swiglu":
        return jax.nn.silu(gate) * up
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(alpha * gate)


@jax.custom_vjp
def permute_rows(
    x: Float[Array, "rows features"], order: Int[Array, " rows"], inverse: Int[Array, " rows"]
) -> Float[Array, "rows features"]:
    """``x[order]`` for a permutation ``order`` whose inverse is ``inverse``; its VJP is the
    gather ``dy[inverse]``, not the scatter-add JAX would transpose a gather into (XLA:CPU
    scatters row by row: ~10% of a 64-expert layer's time)."""
    return jnp.take(x, order, axis=0)


def _permute_rows_forward(x, order, inverse):
    return jnp.take(x, order, axis=0), (x, inverse)


def _permute_rows_backward(residuals, dy):
    x, inverse = residuals
    return cotangent_for(jnp.take(dy, inverse, axis=0), x), None, None


permute_rows.defvjp(_permute_rows_forward, _permute_rows_backward)


def check_dropless_kernel(kernel: str) -> None:
    """Refuse a ``dropless_kernel`` that is not one of `DroplessKernel`'s."""
    if kernel not in ("sorted", "slotted"):
        refuse("dropless_kernel", f"must be 'sorted' or 'slotted', got {kernel!r}")


def overflow_rows(n_assignments: int) -> int:
    """Rows for the overflow of a balanced router: an eighth of the assignments, in whole
    `OVERFLOW_BLOCK` blocks (more overflow runs on ``n_assignments`` rows, slower)."""
    return -(-n_assignments // (8 * OVERFLOW_BLOCK)) * OVERFLOW_BLOCK


def batched_matmul(
    x: Float[Array, "experts rows in_features"], w: Float[Array, "experts in_features out_features"]
) -> Float[Array, "experts rows out_features"]:
    """Each expert's rows times its matrix, accumulated in float32, in the inputs' dtype."""
    product = jnp.einsum("erd,edf->erf", x, w, preferred_element_type=jnp.float32)
    return product.astype(jnp.result_type(x.dtype, w.dtype))
