"""Mixture-of-Experts feed-forward: a top-k router and gated (SwiGLU) experts.

Three ways to run the same experts on the same routing decisions:

- ``"dropless"``: every (token, choice) assignment computed, at the cost of the assignments
  plus a little padding: each expert's slots as batched matmuls and the overflow past them
  as a block-sparse loop (`eqxzoo.nn.dispatch`), or, where `jax.lax.ragged_dot` is native
  (GPU), the assignments sorted by expert into one grouped matmul per weight.
- ``"capacity"``: each expert takes at most ``capacity`` assignments (first choices of all
  tokens before second choices, tokens in order); overflow is dropped and reported. Fixed
  shapes ``(experts, capacity, embed)``, for hardware where ragged matmuls are slow.
- ``"dense"``: every expert on every token, weighted by the (mostly zero) routing weights.
  ``experts`` times the FLOPs: the reference the other two are tested against.
"""

import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

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
from eqxzoo.nn.grouped import grouped_matmul, padding_fraction, resolve_implementation
from eqxzoo.nn.linear import Linear, normal_init
from eqxzoo.nn.mlp import MLP
from eqxzoo.nn.varying import cotangent_for
from eqxzoo.typed_config import refuse

RoutingMode = Literal["dropless", "capacity", "dense"]
Scoring = Literal["softmax", "sigmoid", "softmax_topk"]
ExpertActivation = Literal["swiglu", "clamped_swiglu"]


class Routing(eqx.Module):
    """A router's decision for ``tokens`` tokens choosing ``k`` of ``experts`` experts each."""

    logits: Float[Array, "tokens experts"]
    probs: Float[Array, "tokens experts"]
    weights: Float[Array, "tokens k"]
    experts: Int[Array, "tokens k"]


class Router(AbstractAxesOwner):
    """Scores every expert, chooses ``k`` per token, and weights the chosen ones.

    ``scoring``:

    - ``"softmax"``: probabilities ``softmax(logits)``, the top ``k`` chosen and weighted by
      their probabilities (Mixtral, Qwen-MoE, DeepSeek-V2);
    - ``"sigmoid"``: independent scores ``sigmoid(logits)``, weighted by their scores
      (DeepSeek-V3);
    - ``"softmax_topk"``: the top ``k`` logits chosen and weighted by a softmax over those
      ``k`` alone (GPT-OSS).

    ``normalize_topk`` renormalises the chosen weights to sum to one; ``scaling`` then
    multiplies them (DeepSeek's ``routed_scaling_factor``). ``bias`` (GPT-OSS) is a trained
    bias of the logits. With ``n_groups > 1`` the experts form equal groups and a token
    chooses only within its ``topk_groups`` best groups, a group scored by its best expert
    (softmax) or its best two (sigmoid), as DeepSeek-V2 and V3 do.

    ``selection_bias`` (DeepSeek-V3's auxiliary-loss-free balancing) is added to the scores
    for choosing only, never to the weights: it is not trained by gradients (it could get
    none) but moved after each step towards a balanced load (`balance_selection_bias`), and
    `BUFFER_FIELDS` keeps it out of the optimizer.

    Logits and scores are float32 whatever the input dtype (router precision matters more
    than its cost). ``Routing.probs`` are per-token distributions over experts for the
    load-balance loss (sigmoid scores are normalised to sum to one, as DeepSeek-V3's
    sequence-wise balance loss does).
    """

    weight: Float[Array, "embed experts"]
    bias: Float[Array, " experts"] | None
    selection_bias: Float[Array, " experts"] | None
    top_k: int = eqx.field(static=True)
    normalize_topk: bool = eqx.field(static=True)
    scoring: Scoring = eqx.field(static=True)
    n_groups: int = eqx.field(static=True)
    topk_groups: int = eqx.field(static=True)
    scaling: float = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        n_experts: int,
        top_k: int,
        *,
        normalize_topk: bool,
        scoring: Scoring = "softmax",
        n_groups: int = 1,
        topk_groups: int = 1,
        scaling: float = 1.0,
        bias: bool = False,
        selection_bias: bool = False,
        init_std: float = 0.02,
        key: PRNGKeyArray,
    ):
        check_top_k(n_experts, top_k)
        check_groups(n_experts, top_k, n_groups, topk_groups)
        if scoring not in ("softmax", "sigmoid", "softmax_topk"):
            refuse("scoring", f"must be 'softmax', 'sigmoid' or 'softmax_topk', got {scoring!r}")
        self.weight = normal_init(key, (d_model, n_experts), init_std)
        self.bias = jnp.zeros((n_experts,)) if bias else None
        self.selection_bias = jnp.zeros((n_experts,)) if selection_bias else None
        self.top_k = top_k
        self.normalize_topk = normalize_topk
        self.scoring = scoring
        self.n_groups = n_groups
        self.topk_groups = topk_groups
        self.scaling = scaling

    def param_axes(self) -> Mapping[str, tuple[LogicalName, ...]]:
        return {"weight": ("embed", None), "bias": (None,), "selection_bias": (None,)}

    def __call__(self, x: Float[Array, "tokens embed"]) -> Routing:
        logits = x.astype(jnp.float32) @ self.weight.astype(jnp.float32)
        if self.bias is not None:
            logits = logits + self.bias.astype(jnp.float32)
        if self.scoring == "softmax_topk":
            top_logits, experts = jax.lax.top_k(logits, self.top_k)
            weights = jax.nn.softmax(top_logits, axis=-1)
            probs = jax.nn.softmax(logits, axis=-1)
        else:
            scores = jax.nn.sigmoid(logits) if self.scoring == "sigmoid" else jax.nn.softmax(logits)
            choice = scores
            if self.selection_bias is not None:
                choice = choice + jax.lax.stop_gradient(self.selection_bias).astype(jnp.float32)
            if self.n_groups > 1:
                choice = self._within_best_groups(choice)
            _, experts = jax.lax.top_k(choice, self.top_k)
            weights = jnp.take_along_axis(scores, experts, axis=-1)
            if self.scoring == "sigmoid":
                probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
            else:
                probs = scores
        if self.normalize_topk:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        if self.scaling != 1.0:
            weights = weights * self.scaling
        return Routing(logits=logits, probs=probs, weights=weights, experts=experts)

    def _within_best_groups(
        self, choice: Float[Array, "tokens experts"]
    ) -> Float[Array, "tokens experts"]:
        """``choice`` with every expert outside the token's ``topk_groups`` best groups set to
        minus infinity."""
        n_tokens, n_experts = choice.shape
        grouped = choice.reshape(n_tokens, self.n_groups, n_experts // self.n_groups)
        best = 2 if self.scoring == "sigmoid" else 1
        group_scores = jnp.sum(jax.lax.top_k(grouped, best)[0], axis=-1)
        _, chosen_groups = jax.lax.top_k(group_scores, self.topk_groups)
        in_chosen = jnp.any(
            chosen_groups[:, :, None] == jnp.arange(self.n_groups)[None, None, :], axis=1
        )
        return jnp.where(in_chosen[:, :, None], grouped, -jnp.inf).reshape(n_tokens, n_experts)


def check_top_k(n_experts: int, top_k: int) -> None:
    """Refuse a ``top_k`` outside ``[1, n_experts]`` (`ConfigError` about ``top_k``)."""
    if not 1 <= top_k <= n_experts:
        refuse("top_k", f"must be between 1 and n_experts={n_experts}, got {top_k}")


def check_groups(n_experts: int, top_k: int, n_groups: int, topk_groups: int) -> None:
    """Refuse expert groups that do not split the experts evenly or leave fewer than
    ``top_k`` experts (or, scored by their best two, groups of one) to choose from."""
    if n_groups < 1 or n_experts % n_groups != 0:
        refuse("n_groups", f"must divide n_experts={n_experts}, got {n_groups}")
    if not 1 <= topk_groups <= n_groups:
        refuse("topk_groups", f"must be in [1, n_groups={n_groups}], got {topk_groups}")
    if n_groups > 1 and topk_groups * (n_experts // n_groups) < top_k:
        refuse(
            "topk_groups",
            f"{topk_groups} groups of {n_experts // n_groups} experts leave fewer than "
            f"top_k={top_k} experts to choose from",
        )


def check_shared_experts(shared_mlp_dim: int, shared_gate: bool) -> None:
    """Refuse a negative shared-expert width, or a gate with no shared experts to gate."""
    if shared_mlp_dim < 0:
        refuse("shared_mlp_dim", f"must be >= 0 (0: no shared experts), got {shared_mlp_dim}")
    if shared_gate and shared_mlp_dim == 0:
        refuse("shared_gate", "needs shared experts: set shared_mlp_dim > 0")


# Router arrays the trainer moves by a rule after each step, never by the optimizer.
BUFFER_FIELDS = ("selection_bias",)


def balance_selection_bias(
    selection_bias: Float[Array, "*layers experts"],
    expert_fraction: Float[Array, "*layers experts"],
    rate: float,
) -> Float[Array, "*layers experts"]:
    """DeepSeek-V3's auxiliary-loss-free balancing: each expert's selection bias moves by
    ``rate`` towards balance, down where the expert took more than the mean load of its
    layer and up where it took less (``bias + rate * sign(mean(f) - f)``)."""
    mean_load = jnp.mean(expert_fraction, axis=-1, keepdims=True)
    step = rate * jnp.sign(mean_load - expert_fraction)
    return selection_bias + step.astype(selection_bias.dtype)


class Experts(AbstractAxesOwner):
    """``n_experts`` gated MLPs stored as stacked ``(experts, ...)`` weights.

    Expert ``e`` computes ``(act(x @ gate[e] + gate_bias[e], x @ up[e] + up_bias[e])) @
    down[e] + down_bias[e]``, the biases optional (``bias``: GPT-OSS). ``activation``
    (`gated_activation`) is ``"swiglu"``, ``silu(gate) * up``, or ``"clamped_swiglu"``
    (GPT-OSS), ``(up + 1) * gate * sigmoid(alpha * gate)`` after clamping the gate above at
    ``limit`` and ``up`` to ``[-limit, limit]``. Every routing path (`dense`, `capacity`,
    `dropless`) runs the experts through `_apply`, so they compute the same function.
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
        init_std: float = 0.02,
        key: PRNGKeyArray,
    ):
        if activation not in ("swiglu", "clamped_swiglu"):
            refuse("activation", f"must be 'swiglu' or 'clamped_swiglu', got {activation!r}")
        if limit <= 0:
            refuse("limit", f"must be > 0, got {limit}")
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
        self, x: Float[Array, "tokens embed"], routing: Routing
    ) -> tuple[Float[Array, "tokens embed"], Float[Array, ""]]:
        """Every assignment computed; returns the output and the fraction of the computed
        rows that are padding. Where `jax.lax.ragged_dot` is native (`resolve_implementation`)
        the assignments are sorted by expert into one grouped matmul per weight; elsewhere
        each expert's slots are batched matmuls and the overflow a block loop
        (`slotted_dropless`), except inside a partitioned mesh (`partitioned_mesh`): there
        the sorted rows and `jax.lax.ragged_dot` keep the program free of data-dependent
        loops and branches, whose partitioner-inserted collectives devices on different
        pipeline stages would reach in different numbers (a deadlock on XLA:CPU)."""
        if resolve_implementation("auto") == "ragged_dot" or partitioned_mesh():
            return self._sorted_dropless(x, routing)
        output, rows = self.slotted_dropless(x, routing.weights, routing.experts)
        return output, padding_fraction_of_rows(rows)

    def slotted_dropless(
        self,
        x: Float[Array, "tokens embed"],
        weights: Float[Array, "tokens k"],
        experts: Int[Array, "tokens k"],
    ) -> tuple[Float[Array, "tokens embed"], Float[Array, "2"]]:
        """Each expert's slots as batched matmuls, the overflow as a block loop
        (`eqxzoo.nn.dispatch`). Returns the output and the rows computed and assigned
        (`eqxzoo.nn.dispatch.computed_and_assigned_rows`)."""
        n_assignments = experts.size
        layout = slot_layout(experts, self.n_experts)
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
            row_experts = jnp.take(flat_experts, overflow.row_assignment)
            outputs = self._apply(
                rows_from_tokens(x, overflow), matmul, lambda b: jnp.take(b, row_experts, axis=0)
            )
            return rows_to_assignments(outputs, overflow)

        few_rows = overflow_rows(n_assignments)
        if few_rows < n_assignments:
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
        self, x: Float[Array, "tokens embed"], routing: Routing
    ) -> tuple[Float[Array, "tokens embed"], Float[Array, ""]]:
        """Sort assignments by expert, grouped matmuls (`jax.lax.ragged_dot`), unsort."""
        n_tokens, top_k = routing.experts.shape
        flat_experts = routing.experts.reshape(-1)
        order = jnp.argsort(flat_experts, stable=True)
        inverse_order = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
        sorted_inputs = permute_rows(jnp.repeat(x, top_k, axis=0), order, inverse_order)
        sorted_experts = jnp.take(flat_experts, order)
        group_sizes = jnp.bincount(flat_experts, length=self.n_experts).astype(jnp.int32)

        def matmul(rows, weights):
            return grouped_matmul(rows, weights, group_sizes, implementation="ragged_dot")

        sorted_outputs = self._apply(
            sorted_inputs, matmul, lambda b: jnp.take(b, sorted_experts, axis=0)
        )
        outputs = permute_rows(sorted_outputs, inverse_order, order).reshape(n_tokens, top_k, -1)
        output = jnp.einsum("tkd,tk->td", outputs, routing.weights.astype(x.dtype))
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
        expert_capacity = max(1, math.ceil(capacity_factor * n_tokens * top_k / self.n_experts))
        choice_major_experts = routing.experts.T.reshape(-1)
        one_hot = jax.nn.one_hot(choice_major_experts, self.n_experts, dtype=jnp.int32)
        slot = jnp.sum((jnp.cumsum(one_hot, axis=0) - 1) * one_hot, axis=-1)
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
        self, x: Float[Array, "tokens embed"], routing: Routing
    ) -> Float[Array, "tokens embed"]:
        """Every expert on every token, combined with the routing weights (zero if unchosen)."""
        n_tokens = x.shape[0]
        combine = jnp.zeros((n_tokens, self.n_experts), x.dtype)
        combine = combine.at[jnp.arange(n_tokens)[:, None], routing.experts].add(
            routing.weights.astype(x.dtype)
        )

        def matmul(rows, weights):
            if rows.ndim == 2:  # the tokens, shared by every expert
                return jnp.einsum("td,edf->etf", rows, weights)
            return jnp.einsum("etf,efd->etd", rows, weights)

        expert_outputs = self._apply(x, matmul, lambda b: b[:, None, :])
        return jnp.einsum("etd,te->td", expert_outputs, combine)


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


class MoE(eqx.Module):
    """Routed gated experts plus optional always-on shared experts.

    ``router`` holds the `Router`'s options beyond ``top_k`` and ``normalize_topk``
    (``scoring``, ``n_groups``, ``topk_groups``, ``scaling``, ``bias``, ``selection_bias``);
    ``experts`` the `Experts`' options (``bias``, ``activation``, ``alpha``, ``limit``).
    Shared experts (Qwen-MoE / DeepSeek-MoE) are one SwiGLU MLP of width ``shared_mlp_dim``
    applied to every token, optionally scaled by ``sigmoid(x @ shared_gate)`` (Qwen2-MoE).

    Returns ``(output, aux)``, ``aux`` holding this layer's:
    - ``load_balance_loss``: ``experts * sum_e f_e * p_e`` (Switch Transformer), ``f_e`` the
      fraction of assignments routed to ``e``, ``p_e`` its mean router probability; 1.0 when
      perfectly balanced;
    - ``router_z_loss``: mean over tokens of ``logsumexp(logits)^2`` (ST-MoE);
    - ``expert_fraction``: ``f``, shape ``(experts,)``;
    - ``dropped_fraction``: assignments dropped by the capacity path (0 otherwise);
    - ``padding_fraction``: the fraction of the rows the dropless path computes that hold
      no assignment (empty slots, the overflow's last blocks; 0 otherwise).

    """

    router: Router
    experts: Experts
    shared: MLP | None
    shared_gate: Linear | None
    routing_mode: RoutingMode = eqx.field(static=True)
    capacity_factor: float = eqx.field(static=True)

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
        init_std: float = 0.02,
        key: PRNGKeyArray,
    ):
        if routing_mode not in ("dropless", "capacity", "dense"):
            refuse(
                "routing_mode", f"must be 'dropless', 'capacity' or 'dense', got {routing_mode!r}"
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
                if self.routing_mode == "dropless":
                    output, padding = self.experts.dropless(tokens, routing)
                elif self.routing_mode == "capacity":
                    output, dropped = jax.vmap(self.experts.capacity, in_axes=(0, 0, None))(
                        tokens.reshape(-1, n_tokens, d_model), per_sequence, self.capacity_factor
                    )
                    output, dropped_fraction = output.reshape(-1, d_model), jnp.mean(dropped)
                else:
                    output = self.experts.dense(tokens, routing)
            if self.shared is not None:
                with jax.named_scope("shared_experts"):
                    shared_output = self.shared(tokens)
                    if self.shared_gate is not None:
                        shared_output = jax.nn.sigmoid(self.shared_gate(tokens)) * shared_output
                output = output + shared_output
            losses = jax.tree.map(
                lambda v: jnp.mean(v, axis=0), jax.vmap(router_losses)(per_sequence)
            )
            fractions = {"dropped_fraction": dropped_fraction, "padding_fraction": padding}
            return output.reshape(x.shape), {**losses, **fractions}


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


def partitioned_mesh() -> bool:
    """Whether the ambient mesh (`jax.set_mesh`, or inside `jax.shard_map`) has an axis of
    more than one device left to XLA's partitioner."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return False
    manual = set(mesh.manual_axes)
    return any(size > 1 for name, size in mesh.shape.items() if name not in manual)


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


def router_losses(routing: Routing) -> dict[str, Array]:
    """Switch load-balance loss, router z-loss and per-expert assignment fractions of one sequence."""
    n_experts = routing.probs.shape[-1]
    assignments = jax.nn.one_hot(routing.experts, n_experts, dtype=jnp.float32)
    expert_fraction = jnp.mean(jnp.sum(assignments, axis=1), axis=0) / routing.experts.shape[1]
    mean_probs = jnp.mean(routing.probs, axis=0)
    return {
        "load_balance_loss": n_experts * jnp.sum(expert_fraction * mean_probs),
        "router_z_loss": jnp.mean(jnp.square(jax.nn.logsumexp(routing.logits, axis=-1))),
        "expert_fraction": expert_fraction,
    }
