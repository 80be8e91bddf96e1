"""The MoE router: each token's top-k experts and their weights (softmax, sigmoid with
DeepSeek's group-limited choice and balancing bias, or GPT-OSS's softmax over the chosen),
the rules its options must keep, and its auxiliary losses."""

from collections.abc import Mapping
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqxzoo.nn.axes import AbstractAxesOwner, LogicalName
from eqxzoo.nn.context import ContextSplit
from eqxzoo.nn.linear import normal_init
from eqxzoo.typed_config import refuse

Scoring = Literal["softmax", "sigmoid", "softmax_topk"]


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


def router_losses(routing: Routing, *, context: ContextSplit | None = None) -> dict[str, Array]:
    """Switch load-balance loss, router z-loss and the per-expert statistics of one sequence:
    each expert's share of the assignments (``expert_fraction``, sums to 1), its mean number
    of a token's top-k choices (``expert_assignments``, sums to k) and its mean router
    probability (``router_probability``). With ``context``, ``routing`` is one shard of the
    sequence: the token means are averaged over the shards before the loss is formed."""
    n_experts = routing.probs.shape[-1]
    assignments = jax.nn.one_hot(routing.experts, n_experts, dtype=jnp.float32)
    means = {
        "expert_assignments": jnp.mean(jnp.sum(assignments, axis=1), axis=0),
        "router_probability": jnp.mean(routing.probs, axis=0),
        "router_z_loss": jnp.mean(jnp.square(jax.nn.logsumexp(routing.logits, axis=-1))),
    }
    if context is not None:
        means = context.mean(means)
    expert_fraction = means["expert_assignments"] / routing.experts.shape[1]
    return {
        "load_balance_loss": n_experts * jnp.sum(expert_fraction * means["router_probability"]),
        "expert_fraction": expert_fraction,
        **means,
    }
