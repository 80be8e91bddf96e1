"""Expert parallelism by all-to-all: each device holds its own tokens and a block of the
experts, and a routed token travels to the devices of its chosen experts and back.

Outside the experts the devices of the expert axis are data-parallel: each routes its own
tokens. `exchange` then sends every token once to each device that holds at least one of its
chosen experts (with its choices and their weights: the receiver computes the weighted sum of
its own experts' outputs, so a token choosing two experts of one device travels once),
computes the received rows with the local experts (the dropless kernels of
`eqxzoo.nn.experts`), and sends the sums back: one `jax.lax.all_to_all` each way, of
``(devices, capacity, embed)`` rows. ``capacity``, the rows each device sends each other, is
`pair_capacity`: the mean a balanced router sends, times a margin. Dropless stays dropless:
where any device of the axis would send more than that to some device, the whole axis
exchanges at the worst case instead (every token to one device: ``capacity = tokens``), a
`jax.lax.cond` on a predicate the axis agrees on (a `jax.lax.pmax`), so every device reaches
the same collectives. XLA:CPU has no `jax.lax.ragged_all_to_all`.

Both directions' row maps are `eqxzoo.nn.dispatch.RowMap` gathers, whose VJPs are gathers
too; the all-to-all is its own transpose, so the backward pass is the same exchange run the
other way.
"""

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec
from jaxtyping import Array, Bool, Float, Int

from eqxzoo.nn.dispatch import RowMap, rows_from_tokens, rows_to_assignments

# Rows a device sends each other device, over the mean of a balanced router: imbalance up to
# this margin runs the exchange of that size; more runs the worst case.
PAIR_CAPACITY_MARGIN = 1.5

RowExperts = Callable[
    [Float[Array, "rows embed"], Float[Array, "rows k"], Int[Array, "rows k"], int],
    tuple[Float[Array, "rows embed"], Float[Array, ""]],
]


@dataclasses.dataclass(frozen=True)
class ExpertSplit:
    """The routed experts split in equal contiguous blocks over the mesh axis ``axis_name``
    (device ``i`` holds experts ``i * E / n`` to ``(i + 1) * E / n - 1``, as the ``experts``
    sharding rule splits them), each device of it holding its own tokens.

    A layer holding one (a static field) must be called inside a region manual over
    ``axis_name`` (the trainer's pipeline regions) with its block of the experts' weights.
    """

    axis_name: str

    def devices(self) -> int:
        return jax.lax.axis_size(self.axis_name)

    def mean(self, tree):
        """Statistics of each device's tokens (equal numbers of them) as the whole axis's."""
        return jax.lax.pmean(tree, self.axis_name)


def pair_capacity(n_tokens: int, top_k: int, n_devices: int, local_experts: int) -> int:
    """Rows a device sends each device of the axis: the mean under a balanced router (each
    token sent once to each device holding one of its ``top_k`` experts, `distinct_devices`)
    times `PAIR_CAPACITY_MARGIN`, rounded up to a multiple of 8, at most ``n_tokens``."""
    mean = n_tokens * distinct_devices(top_k, n_devices, local_experts) / n_devices
    rows = -(-math.ceil(mean * PAIR_CAPACITY_MARGIN) // 8) * 8
    return max(1, min(rows, n_tokens))


def distinct_devices(top_k: int, n_devices: int, local_experts: int) -> float:
    """The expected number of devices a token's ``top_k`` distinct experts, chosen uniformly
    from ``n_devices`` blocks of ``local_experts``, fall on."""
    n_experts = n_devices * local_experts
    none_here = math.comb(n_experts - local_experts, top_k) / math.comb(n_experts, top_k)
    return n_devices * (1.0 - none_here)


def exchange(
    split: ExpertSplit,
    x: Float[Array, "tokens embed"],
    weights: Float[Array, "tokens k"],
    experts: Int[Array, "tokens k"],
    n_experts: int,
    row_experts: RowExperts,
    *,
    kept: Bool[Array, "tokens k"] | None = None,
    capacity: int | None = None,
) -> tuple[Float[Array, "tokens embed"], Float[Array, ""], Float[Array, " devices"]]:
    """Each token's weighted sum of its chosen experts' outputs, the experts computed on the
    devices that hold them.

    ``experts`` are global expert ids (of ``n_experts``); ``kept`` marks the choices to
    compute (all by default; capacity routing drops some). ``row_experts(rows, weights,
    local_experts, expected)`` computes received rows: each row's weighted sum over its
    choices of this device's experts (a choice of ``E / n`` names none of them), with
    ``expected`` such choices in all on average, and the fraction of the rows its kernel
    computes that are padding. ``capacity`` fixes the rows per device pair (a bound the
    caller guarantees); by default `pair_capacity`, with the worst case where it does not
    suffice (module docstring).

    Returns the output, the kernel's padding fraction, and the rows each device of the axis
    received (the same on every device), for the load report.
    """
    n_devices = split.devices()
    n_tokens, top_k = experts.shape
    local_experts = n_experts // n_devices
    if kept is None:
        kept = jnp.ones(experts.shape, bool)
    device = jnp.where(kept, experts // local_experts, n_devices)
    # A token goes to a device once, on its first choice there.
    earlier = jnp.tril(jnp.ones((top_k, top_k), bool), -1)
    repeated = jnp.any((device[:, :, None] == device[:, None, :]) & earlier[None], axis=-1)
    first = kept & ~repeated
    sends = jnp.any(device[:, :, None] == jnp.arange(n_devices)[None, None, :], axis=1)
    rank = jnp.cumsum(sends, axis=0) - 1
    slot = jnp.take_along_axis(rank, jnp.minimum(device, n_devices - 1), axis=1)
    sent_rows = jnp.sum(sends, axis=0)
    received = jax.lax.psum(sent_rows, split.axis_name).astype(jnp.float32)
    expected = n_tokens * top_k

    choices = jnp.where(kept, experts, -1)

    def run(capacity: int) -> tuple[Float[Array, "tokens embed"], Float[Array, ""]]:
        rows = _send_map(device, first, slot, sent_rows, capacity, n_devices)
        row_token = rows.row_assignment // top_k
        arrived = _exchanged(rows_from_tokens(x, rows), split)
        sent_choices = jnp.where(rows.row_used[:, None], jnp.take(choices, row_token, axis=0), -1)
        arrived_choices = _exchanged(sent_choices, split)
        arrived_weights = _exchanged(jnp.take(weights, row_token, axis=0), split)
        here = jax.lax.axis_index(split.axis_name)
        mine = (arrived_choices >= 0) & (arrived_choices // local_experts == here)
        local = jnp.where(mine, arrived_choices - here * local_experts, local_experts)
        outputs, padding = row_experts(
            _features_whole(arrived), jnp.where(mine, arrived_weights, 0), local, expected
        )
        returned = _exchanged(_features_whole(outputs), split)
        return jnp.sum(rows_to_assignments(returned, rows), axis=1), padding

    if capacity is None:
        capacity = pair_capacity(n_tokens, top_k, n_devices, local_experts)
        if capacity < n_tokens:
            fits = jax.lax.pmax(jnp.max(sent_rows), split.axis_name) <= capacity
            output, padding = jax.lax.cond(fits, lambda: run(capacity), lambda: run(n_tokens))
            return output, padding, received
    return *run(capacity), received


def _send_map(
    device: Int[Array, "tokens k"],
    first: Bool[Array, "tokens k"],
    slot: Int[Array, "tokens k"],
    sent_rows: Int[Array, " devices"],
    capacity: int,
    n_devices: int,
) -> RowMap:
    """Rows ``(devices x capacity)``: device ``d``'s block holds, in token order, the tokens
    sent to it, each at its first choice of an expert there."""
    n_tokens, top_k = device.shape
    n_rows = n_devices * capacity
    assignment_in = first & (slot < capacity)
    assignment_row = jnp.minimum(device, n_devices - 1) * capacity + jnp.clip(slot, 0, capacity - 1)
    target = jnp.where(assignment_in, assignment_row, n_rows).reshape(-1)
    row_assignment = (
        jnp.zeros((n_rows,), jnp.int32)
        .at[target]
        .set(jnp.arange(n_tokens * top_k, dtype=jnp.int32), mode="drop")
    )
    row_used = (jnp.arange(capacity)[None, :] < sent_rows[:, None]).reshape(-1)
    return RowMap(
        top_k=top_k,
        row_assignment=row_assignment,
        row_used=row_used,
        assignment_row=assignment_row,
        assignment_in=assignment_in,
    )


def _features_whole(rows: Float[Array, "rows embed"]) -> Float[Array, "rows embed"]:
    """``rows`` with their features on every device of the axes the compiler splits (the
    rows as it chooses). Left to it, the experts' weights (FSDP over dp) split the rows'
    features too, and with dp and tp both split XLA's partitioner crashed (a CHECK on
    device groups while partitioning the gathers back to the tokens). Nothing to say where
    every axis is manual."""
    mesh = jax.sharding.get_abstract_mesh()
    if AxisType.Auto not in mesh.axis_types:
        return rows
    return jax.lax.with_sharding_constraint(rows, PartitionSpec(PartitionSpec.UNCONSTRAINED, None))


def _exchanged(rows: Array, split: ExpertSplit) -> Array:
    """``(devices x capacity, ...)`` rows, block ``d`` sent to device ``d``; returns the
    blocks received, block ``s`` from device ``s``."""
    return jax.lax.all_to_all(rows, split.axis_name, 0, 0, tiled=True)
