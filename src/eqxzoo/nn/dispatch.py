"""Expert-major dispatch of routed tokens: each expert's slots, the overflow, gathers both ways.

A loop of row blocks (`grouped_matmul`'s ``"blocks"``) pays for every block it runs; one
batched matmul over ``(experts, capacity)`` slots runs at the speed of a dense matmul over
the same rows (XLA:CPU: equal FLOP/s at 8 experts of width 512). Dropless routing here puts
each expert's first ``capacity`` assignments (`slot_capacity`: the mean load, rounded up to a
multiple of 8) into its slots, computed by batched matmuls, and the rest, the overflow, packed
in expert order into rows for the block loop: nothing is dropped, and with a balanced router
almost every assignment is in a slot.

Tokens reach rows and rows come back to the (token, choice) assignments through `RowMap`
gathers (`rows_from_tokens`, `rows_to_assignments`), each the other's VJP: autodiff would
transpose a gather into a scatter-add, which XLA:CPU runs row by row.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from eqxzoo.nn.varying import cotangent_for

OVERFLOW_BLOCK = 16


class RowMap(eqx.Module):
    """Rows filled from (token, choice) assignments (assignment ``t * k + j`` is token
    ``t``'s ``j``-th choice): row ``i`` holds assignment ``row_assignment[i]`` where
    ``row_used[i]``; assignment ``(t, j)`` sits in row ``assignment_row[t, j]`` where
    ``assignment_in[t, j]``."""

    top_k: int = eqx.field(static=True)
    row_assignment: Int[Array, " rows"]
    row_used: Bool[Array, " rows"]
    assignment_row: Int[Array, "tokens k"]
    assignment_in: Bool[Array, "tokens k"]

    def first_rows(self, n_rows: int) -> "RowMap":
        """The map restricted to its first ``n_rows`` rows, for when no assignment is in a
        later one."""
        return RowMap(
            top_k=self.top_k,
            row_assignment=self.row_assignment[:n_rows],
            row_used=self.row_used[:n_rows],
            assignment_row=jnp.minimum(self.assignment_row, n_rows - 1),
            assignment_in=self.assignment_in,
        )


def _gather(values: Array, index: Array, used: Array) -> Array:
    return jnp.where(used[..., None], jnp.take(values, index, axis=0), 0).astype(values.dtype)


@jax.custom_vjp
def rows_from_tokens(x: Float[Array, "tokens embed"], rows: RowMap) -> Float[Array, "rows embed"]:
    """Each row's token (zero in unused rows)."""
    return _gather(x, rows.row_assignment // rows.top_k, rows.row_used)


def _rows_from_tokens_forward(x, rows):
    return rows_from_tokens(x, rows), (x, rows)


def _rows_from_tokens_backward(residuals, row_cotangent):
    x, rows = residuals
    per_choice = rows_to_assignments(row_cotangent, rows)
    return cotangent_for(jnp.sum(per_choice, axis=1).astype(x.dtype), x), None


rows_from_tokens.defvjp(_rows_from_tokens_forward, _rows_from_tokens_backward)


@jax.custom_vjp
def rows_to_assignments(
    row_values: Float[Array, "rows features"], rows: RowMap
) -> Float[Array, "tokens k features"]:
    """Each assignment's row (zero for assignments in no row of ``rows``)."""
    return _gather(row_values, rows.assignment_row, rows.assignment_in)


def _rows_to_assignments_forward(row_values, rows):
    return rows_to_assignments(row_values, rows), (row_values, rows)


def _rows_to_assignments_backward(residuals, cotangent):
    row_values, rows = residuals
    flat = cotangent.reshape(-1, cotangent.shape[-1])
    return cotangent_for(_gather(flat, rows.row_assignment, rows.row_used), row_values), None


rows_to_assignments.defvjp(_rows_to_assignments_forward, _rows_to_assignments_backward)


def slot_capacity(n_assignments: int, n_experts: int) -> int:
    """Slots per expert: ``n_assignments / n_experts`` rounded up to a multiple of 8, at
    least 1 and at most ``n_assignments``."""
    mean = -(-n_assignments // n_experts)
    return max(1, min(-(-mean // 8) * 8, n_assignments))


class SlotLayout(eqx.Module):
    """Where each assignment goes: ``slots``, ``experts * capacity`` rows (expert-major), or
    ``overflow``, the assignments past each expert's capacity packed at the front of
    ``tokens * k`` rows in expert order, ``overflow_sizes`` per expert."""

    slots: RowMap
    overflow: RowMap
    overflow_sizes: Int[Array, " experts"]
    n_experts: int = eqx.field(static=True)

    @property
    def capacity(self) -> int:
        return self.slots.row_assignment.shape[0] // self.n_experts


def slot_layout(
    experts: Int[Array, "tokens k"], n_experts: int, expected_assignments: int | None = None
) -> SlotLayout:
    """The layout of the router's choices ``experts``; within an expert, assignments keep
    their order. A choice of ``n_experts`` (no expert here: a row of an expert-parallel
    exchange that chose experts of other devices) takes no row. Slots are sized for
    ``expected_assignments`` (default: every choice)."""
    n_tokens, top_k = experts.shape
    n_assignments = n_tokens * top_k
    capacity = slot_capacity(expected_assignments or n_assignments, n_experts)
    flat = experts.reshape(-1)
    here = experts < n_experts
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    clamped = jnp.minimum(flat, n_experts - 1)
    rank = jnp.argsort(order) - starts[clamped]
    slot = jnp.arange(capacity)
    overflow_sizes = jnp.maximum(sizes - capacity, 0)
    overflow_ends = jnp.cumsum(overflow_sizes)
    overflow_starts = overflow_ends - overflow_sizes
    row = jnp.arange(n_assignments)
    ended = jnp.sum(row[:, None] >= overflow_ends[None, :], axis=1)
    row_expert = jnp.minimum(ended, n_experts - 1)
    overflow_rank = starts[row_expert] + capacity + row - overflow_starts[row_expert]

    def in_order(position):
        return order[jnp.clip(position, 0, n_assignments - 1)]

    def per_assignment(values):
        return values.reshape(n_tokens, top_k)

    slots = RowMap(
        top_k=top_k,
        row_assignment=in_order(starts[:, None] + slot).reshape(-1),
        row_used=(slot < sizes[:, None]).reshape(-1),
        assignment_row=per_assignment(clamped * capacity + jnp.clip(rank, 0, capacity - 1)),
        assignment_in=here & per_assignment(rank < capacity),
    )
    overflow = RowMap(
        top_k=top_k,
        row_assignment=in_order(overflow_rank),
        row_used=row < overflow_ends[-1],
        assignment_row=per_assignment(
            jnp.clip(overflow_starts[clamped] + rank - capacity, 0, n_assignments - 1)
        ),
        assignment_in=here & per_assignment(rank >= capacity),
    )
    return SlotLayout(
        slots=slots, overflow=overflow, overflow_sizes=overflow_sizes, n_experts=n_experts
    )


def computed_and_assigned_rows(layout: SlotLayout) -> Float[Array, "2"]:
    """How many rows the layout computes (every slot, the overflow in blocks of
    `OVERFLOW_BLOCK`) and how many of them hold an assignment (float32, to be summed across
    devices)."""
    overflow_blocks = jnp.sum((layout.overflow_sizes + OVERFLOW_BLOCK - 1) // OVERFLOW_BLOCK)
    computed = layout.slots.row_used.shape[0] + overflow_blocks * OVERFLOW_BLOCK
    assigned = jnp.sum(layout.slots.row_used) + jnp.sum(layout.overflow_sizes)
    return jnp.stack([computed, assigned]).astype(jnp.float32)


def padding_fraction(rows: Float[Array, "2"]) -> Float[Array, ""]:
    """The fraction of computed rows that hold no assignment, from
    `computed_and_assigned_rows`."""
    computed, assigned = rows[0], rows[1]
    return jnp.where(computed > 0, (computed - assigned) / jnp.maximum(computed, 1.0), 0.0)
