"""The training loss's terms, declared once: the ``[loss]`` section (`LossConfig`) and the
table of weighted terms (`LOSS_TERMS`) that both pipeline executors loop over.

A term is either per token (computed from each token's cross-entropy and its logits'
log-sum-exp, averaged over the batch's tokens) or one of the model's per-layer auxiliary
values (``aux``, averaged over layers and microbatches by the model and the pipeline). The
loss is the sum of each term times its weight, in the table's order; a per-token term with
weight 0 is not computed at all. Adding a term is one `LossTerm` here and its weight in
`LossConfig` (README, "Adding a loss term").
"""

import dataclasses
from collections.abc import Callable, Mapping

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
    them (DeepSeek-V3's auxiliary-loss-free balancing; 0 freezes them)."""

    load_balance_weight: float = runtime_field(0.01)
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


@dataclasses.dataclass(frozen=True)
class LossTerm:
    """One term of the loss: its metric ``name``, its ``weight`` in a `LossConfig`, and
    ``per_token`` (from each token's cross-entropy and log-sum-exp), or None for the model's
    per-layer aux value of that name (absent for dense models: the term is then 0)."""

    name: str
    weight: Callable[[LossConfig], float]
    per_token: TokenValues | None = None


LOSS_TERMS = (
    LossTerm("cross_entropy", lambda config: 1.0, lambda cross_entropy, _: cross_entropy),
    LossTerm("z_loss", lambda config: config.z_loss_weight, lambda _, lse: jnp.square(lse)),
    LossTerm("load_balance_loss", lambda config: config.load_balance_weight),
    LossTerm("router_z_loss", lambda config: config.router_z_weight),
)


def token_terms(config: LossConfig) -> tuple[LossTerm, ...]:
    """The per-token terms this config computes (the cross-entropy, and those of nonzero weight)."""
    return tuple(
        term for term in LOSS_TERMS if term.per_token is not None and term.weight(config) != 0
    )


def layer_terms() -> tuple[LossTerm, ...]:
    """The terms that weight a per-layer aux value of the model."""
    return tuple(term for term in LOSS_TERMS if term.per_token is None)


def weighted_loss(
    parts: Mapping[str, Float[Array, ""]], aux: Mapping[str, Array], config: LossConfig
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """``(loss, metrics)`` from the per-token terms' means (``parts``) and the model's aux
    values: the sum of each present term times its weight, in `LOSS_TERMS`' order; the
    metrics are every part and every aux value, unweighted."""
    metrics = {**parts, **aux}
    loss = sum(
        term.weight(config) * metrics[term.name] for term in LOSS_TERMS if term.name in metrics
    )
    return jnp.asarray(loss, jnp.float32), metrics
