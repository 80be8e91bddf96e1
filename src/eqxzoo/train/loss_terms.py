"""The training loss's terms, declared once: the ``[loss]`` section (`LossConfig`) and the
table of weighted terms (`LOSS_TERMS`) that both pipeline executors loop over.

A term is either per token (computed from each token's cross-entropy and its logits'
log-sum-exp, averaged over the batch's tokens) or computed from the model's per-layer
auxiliary values (``aux``) of one microbatch, averaged over layers, and then averaged over
the microbatches (as gradient accumulation over microbatches computes it, one forward pass
each). The loss is the sum of each term times its weight, in the table's order; a per-token
term with weight 0 is not computed at all. Adding a term is one `LossTerm` here and its
weight in `LossConfig` (README, "Adding a loss term").
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Literal

import jax.numpy as jnp
from jaxtyping import Array, Float

from eqxzoo.nn.cross_entropy import DEFAULT_CHUNK_SIZE
from eqxzoo.typed_config import check_fields, require_at_least, runtime_field

TokenValues = Callable[[Float[Array, "*tokens"], Float[Array, "*tokens"]], Float[Array, "*tokens"]]


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """``[loss]``: the weights of the terms added to the cross-entropy (`LOSS_TERMS`):
    ``load_balance_weight`` and ``router_z_weight`` of the MoE auxiliary losses,
    ``z_loss_weight`` of the z-loss, the mean squared log-sum-exp of the logits (PaLM used
    1e-4; 0: none); ``chunk_size``: the vocabulary chunk of the fused cross-entropy
    (`eqxzoo.nn.fused_cross_entropy`; 0 computes the whole logits instead); and
    ``bias_update_rate``: how far each step moves the balancing biases of routers that have
    them (DeepSeek-V3's auxiliary-loss-free balancing; 0 freezes them).

    ``load_balance_pooling`` says what the load-balance loss balances (`load_balance`):
    ``"layer"``, each layer's experts over each sequence (Switch Transformer's loss per
    layer and sequence, averaged; 1 when balanced); ``"microbatch"``, the experts of all
    layers pooled over a microbatch's tokens, as transformers' ``load_balancing_loss_func``
    computes it for one forward pass (top_k when balanced), so that a Hugging Face config's
    ``router_aux_loss_coef`` is this ``load_balance_weight`` unchanged."""

    load_balance_weight: float = runtime_field(0.01)
    load_balance_pooling: Literal["layer", "microbatch"] = runtime_field("layer")
    router_z_weight: float = runtime_field(0.001)
    z_loss_weight: float = runtime_field(0.0)
    chunk_size: int = runtime_field(DEFAULT_CHUNK_SIZE)
    bias_update_rate: float = runtime_field(0.001)

    def __post_init__(self):
        check_fields(self)
        require_at_least(
            self,
            0,
            "load_balance_weight",
            "router_z_weight",
            "z_loss_weight",
            "chunk_size",
            "bias_update_rate",
        )


AuxValues = Callable[[Mapping[str, Array], LossConfig], Float[Array, ""]]


@dataclasses.dataclass(frozen=True)
class LossTerm:
    """One term of the loss: its metric ``name``, its ``weight`` in a `LossConfig`, and how
    it is computed: ``per_token`` (from each token's cross-entropy and log-sum-exp), or
    ``from_aux`` (from the layer means of one microbatch's aux values; the term is absent
    where the model has no aux value of its name, as dense models have none)."""

    name: str
    weight: Callable[[LossConfig], float]
    per_token: TokenValues | None = None
    from_aux: AuxValues | None = None


def load_balance(aux: Mapping[str, Array], config: LossConfig) -> Float[Array, ""]:
    """The load-balance loss of one microbatch from its aux values' layer means: their
    ``load_balance_loss`` (per layer and sequence), or pooled over layers and the
    microbatch's tokens, ``experts * sum_e A_e * P_e`` with ``A`` the mean assignments and
    ``P`` the mean router probability of every layer (transformers'
    ``load_balancing_loss_func``)."""
    if config.load_balance_pooling == "layer":
        return aux["load_balance_loss"]
    probability = aux["router_probability"]
    return probability.shape[-1] * jnp.sum(aux["expert_assignments"] * probability)


LOSS_TERMS = (
    LossTerm("cross_entropy", lambda config: 1.0, lambda cross_entropy, _: cross_entropy),
    LossTerm("z_loss", lambda config: config.z_loss_weight, lambda _, lse: jnp.square(lse)),
    LossTerm("load_balance_loss", lambda config: config.load_balance_weight, None, load_balance),
    LossTerm(
        "router_z_loss",
        lambda config: config.router_z_weight,
        None,
        lambda aux, config: aux["router_z_loss"],
    ),
)


def token_terms(config: LossConfig) -> tuple[LossTerm, ...]:
    """The per-token terms this config computes (the cross-entropy, and those of nonzero weight)."""
    return tuple(
        term for term in LOSS_TERMS if term.per_token is not None and term.weight(config) != 0
    )


def aux_terms(aux: Mapping[str, Array], config: LossConfig) -> dict[str, Float[Array, ""]]:
    """The unweighted value of each term computed from the model's aux values, for one
    microbatch from their layer means (`eqxzoo.nn.layer_means`)."""
    return {
        term.name: term.from_aux(aux, config)
        for term in LOSS_TERMS
        if term.from_aux is not None and term.name in aux
    }


def weighted_aux_loss(aux: Mapping[str, Array], config: LossConfig) -> Float[Array, ""]:
    """The weighted sum of `aux_terms` (0 for a model without aux values)."""
    weights = {term.name: term.weight(config) for term in LOSS_TERMS}
    values = aux_terms(aux, config)
    return jnp.asarray(sum(weights[name] * value for name, value in values.items()), jnp.float32)


def weighted_loss(
    parts: Mapping[str, Float[Array, ""]], aux: Mapping[str, Array], config: LossConfig
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """``(loss, metrics)`` from the per-token terms' means (``parts``) and the metrics of the
    model's aux values (the aux terms' values among them): the sum of each present term
    times its weight, in `LOSS_TERMS`' order; the metrics are every part and every aux
    value, unweighted."""
    metrics = {**parts, **aux}
    loss = sum(
        term.weight(config) * metrics[term.name] for term in LOSS_TERMS if term.name in metrics
    )
    return jnp.asarray(loss, jnp.float32), metrics
