"""Mixture-of-Experts feed-forward: a top-k router (`eqxzoo.nn.router`), gated (SwiGLU)
routed experts (`eqxzoo.nn.experts`) and optional shared experts, as one layer.

Three ways to run the same experts on the same routing decisions:

- ``"dropless"``: every (token, choice) assignment computed, at the cost of the assignments
  plus a little padding: each expert's slots as batched matmuls and the overflow past them
  as a block-sparse loop (`eqxzoo.nn.dispatch`), or the assignments sorted by expert into
  one grouped matmul per weight (`jax.lax.ragged_dot`): `Experts`' ``dropless_kernel``.
- ``"capacity"``: each expert takes at most ``capacity`` assignments (first choices of all
  tokens before second choices, tokens in order); overflow is dropped and reported. Fixed
  shapes ``(experts, capacity, embed)``, for hardware where ragged matmuls are slow.
- ``"dense"``: every expert on every token, weighted by the (mostly zero) routing weights.
  ``experts`` times the FLOPs: the reference the other two are tested against.
"""

from collections.abc import Mapping
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from eqxzoo.nn.context import ContextSplit
from eqxzoo.nn.expert_parallel import ExpertSplit, exchange
from eqxzoo.nn.experts import Experts, capacity_of, capacity_slots
from eqxzoo.nn.linear import Linear
from eqxzoo.nn.mlp import MLP
from eqxzoo.nn.router import Router, Routing, router_losses
from eqxzoo.typed_config import refuse

RoutingMode = Literal["dropless", "capacity", "dense"]


def check_shared_experts(shared_mlp_dim: int, shared_gate: bool) -> None:
    """Refuse a negative shared-expert width, or a gate with no shared experts to gate."""
    if shared_mlp_dim < 0:
        refuse("shared_mlp_dim", f"must be >= 0 (0: no shared experts), got {shared_mlp_dim}")
    if shared_gate and shared_mlp_dim == 0:
        refuse("shared_gate", "needs shared experts: set shared_mlp_dim > 0")


class MoE(eqx.Module):
    """Routed gated experts plus optional always-on shared experts.

    ``router`` holds the `Router`'s options beyond ``top_k`` and ``normalize_topk``
    (``scoring``, ``n_groups``, ``topk_groups``, ``scaling``, ``bias``, ``selection_bias``);
    ``experts`` the `Experts`' options (``bias``, ``activation``, ``alpha``, ``limit``,
    ``dropless_kernel``).
    Shared experts (Qwen-MoE / DeepSeek-MoE) are one SwiGLU MLP of width ``shared_mlp_dim``
    applied to every token, optionally scaled by ``sigmoid(x @ shared_gate)`` (Qwen2-MoE).

    Returns ``(output, aux)``, ``aux`` holding this layer's:
    - ``load_balance_loss``: ``experts * sum_e f_e * p_e`` (Switch Transformer), ``f_e`` the
      fraction of assignments routed to ``e``, ``p_e`` its mean router probability; 1.0 when
      perfectly balanced;
    - ``router_z_loss``: mean over tokens of ``logsumexp(logits)^2`` (ST-MoE);
    - ``expert_fraction``: ``f``, shape ``(experts,)``;
    - ``expert_assignments``: ``top_k * f``, each expert's mean number of a token's choices;
    - ``router_probability``: ``p``, shape ``(experts,)`` (with ``expert_assignments``, what
      a load-balance loss pooled over layers needs: `eqxzoo.train.loss_terms`);
    - ``dropped_fraction``: assignments dropped by the capacity path (0 otherwise);
    - ``padding_fraction``: the fraction of the rows the dropless path computes that hold
      no assignment (empty slots, the overflow's last blocks; 0 otherwise).

    With a ``context`` split (`eqxzoo.nn.ContextSplit`) each device routes its shard of every
    sequence, and the statistics above are averaged over the shards before the losses are
    formed from them: the whole sequence's, as without the split (``padding_fraction``, a
    property of each device's own grouped matmul, is the shards' mean). Capacity routing
    ranks a whole sequence's assignments in order and is refused there.

    With an ``expert_split`` (`eqxzoo.nn.ExpertSplit`) the layer holds its device's block of
    the routed experts and its own tokens: each device routes its tokens, exchanges them
    with the devices of their experts (`eqxzoo.nn.expert_parallel.exchange`; dense routing
    gathers every device's tokens instead), and the statistics are averaged over the
    devices: the whole axis's batch's, as on one device. ``aux`` then also holds
    ``device_load``, shape ``(devices,)``: the rows (tokens) each device of the axis received,
    over their mean (all 1.0 when balanced).
    """

    router: Router
    experts: Experts
    shared: MLP | None
    shared_gate: Linear | None
    routing_mode: RoutingMode = eqx.field(static=True)
    capacity_factor: float = eqx.field(static=True)
    context: ContextSplit | None = eqx.field(static=True)
    expert_split: ExpertSplit | None = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        expert_mlp_dim: int,
        n_experts: int,
        top_k: int,
        *,
        normalize_topk: bool = True,
        router: Mapping[str, Any] | None = None,
        experts: Mapping[str, Any] | None = None,
        shared_mlp_dim: int = 0,
        shared_gate: bool = False,
        routing_mode: RoutingMode = "dropless",
        capacity_factor: float = 1.25,
        context: ContextSplit | None = None,
        expert_split: ExpertSplit | None = None,
        init_std: float = 0.02,
        key: PRNGKeyArray,
    ):
        if routing_mode not in ("dropless", "capacity", "dense"):
            refuse(
                "routing_mode", f"must be 'dropless', 'capacity' or 'dense', got {routing_mode!r}"
            )
        if routing_mode == "capacity" and context is not None:
            refuse(
                "routing_mode",
                "'capacity' ranks each sequence's assignments in order, which a sequence split "
                "over a context-parallel axis cannot: route 'dropless' (or mesh.cp = 1)",
            )
        check_shared_experts(shared_mlp_dim, shared_gate)
        kr, ke, ks, kg = jax.random.split(key, 4)
        self.router = Router(
            d_model,
            n_experts,
            top_k,
            normalize_topk=normalize_topk,
            init_std=init_std,
            key=kr,
            **(router or {}),
        )
        self.experts = Experts(
            d_model, expert_mlp_dim, n_experts, init_std=init_std, key=ke, **(experts or {})
        )
        self.shared = (
            MLP(d_model, shared_mlp_dim, activation="swiglu", init_std=init_std, key=ks)
            if shared_mlp_dim > 0
            else None
        )
        self.shared_gate = (
            Linear(d_model, 1, in_axis="embed", out_axis=None, init_std=init_std, key=kg)
            if shared_gate
            else None
        )
        self.routing_mode = routing_mode
        self.capacity_factor = capacity_factor
        self.context = context
        self.expert_split = expert_split

    def __call__(
        self, x: Float[Array, "*batch tokens embed"]
    ) -> tuple[Float[Array, "*batch tokens embed"], dict[str, Array]]:
        """Route every token; leading axes are independent sequences.

        The result equals `jax.vmap` of the call over the leading axes (per-sequence
        capacity and load-balance statistics, then averaged), while the dropless path sorts
        the tokens of all sequences together into one grouped matmul per weight.
        """
        with jax.named_scope("moe"):
            n_tokens, d_model = x.shape[-2:]
            tokens = x.reshape(-1, d_model)
            with jax.named_scope("router"):
                routing = self.router(tokens)
            per_sequence = jax.tree.map(lambda a: a.reshape(-1, n_tokens, *a.shape[1:]), routing)
            dropped_fraction = jnp.zeros((), jnp.float32)
            padding = jnp.zeros((), jnp.float32)
            with jax.named_scope("experts"):
                if self.expert_split is not None:
                    output, padding, dropped_fraction, device_load = self._exchanged(
                        tokens, routing, n_tokens
                    )
                elif self.routing_mode == "dropless":
                    output, padding = self.experts.dropless(
                        tokens, routing.weights, routing.experts
                    )
                elif self.routing_mode == "capacity":
                    output, dropped = jax.vmap(self.experts.capacity, in_axes=(0, 0, None))(
                        tokens.reshape(-1, n_tokens, d_model), per_sequence, self.capacity_factor
                    )
                    output, dropped_fraction = output.reshape(-1, d_model), jnp.mean(dropped)
                else:
                    output = self.experts.dense(tokens, routing.weights, routing.experts)
            if self.shared is not None:
                with jax.named_scope("shared_experts"):
                    shared_output = self.shared(tokens)
                    if self.shared_gate is not None:
                        shared_output = jax.nn.sigmoid(self.shared_gate(tokens)) * shared_output
                output = output + shared_output
            losses = jax.tree.map(
                lambda v: jnp.mean(v, axis=0),
                jax.vmap(lambda one: router_losses(one, context=self.context))(per_sequence),
            )
            fractions = {"dropped_fraction": dropped_fraction, "padding_fraction": padding}
            if self.context is not None:
                fractions = self.context.mean(fractions)
            aux = {**losses, **fractions}
            if self.expert_split is not None:
                aux = {**self.expert_split.mean(aux), "device_load": device_load}
            return output.reshape(x.shape), aux

    def _exchanged(
        self, tokens: Float[Array, "tokens embed"], routing: Routing, n_tokens: int
    ) -> tuple[
        Float[Array, "tokens embed"], Float[Array, ""], Float[Array, ""], Float[Array, " devices"]
    ]:
        """The routed experts' output where they are split over devices: their output, the
        padding and dropped fractions, and the device load (the class docstring)."""
        split = self.expert_split
        n_experts = self.router.weight.shape[-1]
        if self.routing_mode == "dense":
            zero, balanced = jnp.zeros((), jnp.float32), jnp.ones((split.devices(),))
            return self._gathered_dense(tokens, routing, n_experts), zero, zero, balanced
        kept, capacity = None, None
        dropped = jnp.zeros((), jnp.float32)
        if self.routing_mode == "capacity":
            top_k = routing.experts.shape[-1]
            per_sequence = routing.experts.reshape(-1, n_tokens, top_k)
            expert_capacity = capacity_of(n_tokens, top_k, n_experts, self.capacity_factor)
            slots = jax.vmap(lambda e: capacity_slots(e, n_experts))(per_sequence)
            kept = jnp.swapaxes(slots.reshape(-1, top_k, n_tokens), 1, 2) < expert_capacity
            kept = kept.reshape(routing.experts.shape)
            dropped = 1.0 - jnp.mean(kept.astype(jnp.float32))
            local_experts = n_experts // split.devices()
            capacity = min(tokens.shape[0], per_sequence.shape[0] * local_experts * expert_capacity)

        def row_experts(rows, weights, experts, expected):
            return self.experts.dropless(rows, weights, experts, expected_assignments=expected)

        output, padding, received = exchange(
            split,
            tokens,
            routing.weights,
            routing.experts,
            n_experts,
            row_experts,
            kept=kept,
            capacity=capacity,
        )
        return output, padding, dropped, received / jnp.mean(received)

    def _gathered_dense(
        self, tokens: Float[Array, "tokens embed"], routing: Routing, n_experts: int
    ) -> Float[Array, "tokens embed"]:
        """Dense routing over split experts: every device's tokens through this device's
        experts, the partial outputs summed and scattered back."""
        axis = self.expert_split.axis_name
        local_experts = n_experts // self.expert_split.devices()
        first = jax.lax.axis_index(axis) * local_experts
        everyone = jax.lax.all_gather((tokens, routing.experts, routing.weights), axis, tiled=True)
        all_tokens, experts, weights = everyone
        mine = (experts >= first) & (experts < first + local_experts)
        local = jnp.where(mine, experts - first, local_experts)
        partial = self.experts.dense(all_tokens, weights, local)
        return jax.lax.psum_scatter(partial, axis, scatter_dimension=0, tiled=True)


def moe_layers(tree: PyTree) -> list[MoE]:
    """The `MoE` layers in ``tree`` (stacked ones once each)."""
    found = jax.tree.leaves(tree, is_leaf=lambda node: isinstance(node, MoE))
    return [layer for layer in found if isinstance(layer, MoE)]


def expert_split_axes(tree: PyTree) -> frozenset[str]:
    """The mesh axes the `MoE` layers of ``tree`` split their experts over
    (`eqxzoo.nn.ExpertSplit`)."""
    return frozenset(
        layer.expert_split.axis_name for layer in moe_layers(tree) if layer.expert_split is not None
    )


def has_data_dependent_loops(tree: PyTree) -> bool:
    """Whether a `MoE` in ``tree`` runs its dropless experts slotted, whose overflow is a loop
    of as many iterations as the routing overflows (`Experts`' ``dropless_kernel``)."""
    return any(
        layer.routing_mode == "dropless" and layer.experts.dropless_kernel == "slotted"
        for layer in moe_layers(tree)
    )


def dispatches_by_sort(tree: PyTree) -> bool:
    """Whether a `MoE` in ``tree`` routes dropless: it sorts all its tokens, of every
    sequence, by their experts (either of `Experts`' ``dropless_kernel``)."""
    return any(layer.routing_mode == "dropless" for layer in moe_layers(tree))
