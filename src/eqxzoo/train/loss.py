"""The training loss: token-mean cross-entropy plus the weighted MoE auxiliary losses, computed
through the pipeline (`pipelined_loss`) or the plain way as a reference (`sequential_loss`)."""

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from eqxzoo.nn import LanguageModel, summarize_layer_aux
from eqxzoo.parallel import activation_sharding, run_pipeline
from eqxzoo.train.settings import StepConfig
from eqxzoo.train.state import cast_floats


def pipelined_loss(
    model: LanguageModel,
    tokens: Int[Array, "microbatches batch seq"],
    targets: Int[Array, "microbatches batch seq"],
    *,
    config: StepConfig,
    mesh: Mesh,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """Token-mean cross-entropy plus weighted aux losses, with the blocks pipelined over ``pp``.

    ``model`` is in the pipeline layout. Embedding, prefix and head run outside the pipeline.
    """
    model = cast_floats(model, config.precision.compute)
    n_micro = tokens.shape[0]
    with jax.named_scope("embed"):
        h = model.embed(tokens)
    if model.prefix is not None:
        with jax.named_scope("prefix"):
            h, _ = model.prefix(h)
    with jax.named_scope("pipeline"):
        h, layer_aux_sums = run_pipeline(
            model.blocks.layers,
            h,
            schedule=config.schedule,
            mesh=mesh,
            remat_policy=model.blocks.remat_policy,
            remat_stages=config.remat_stages,
            rules=config.rules,
            bubble_fill=config.bubble_fill,
        )
    with jax.named_scope("head"):
        logits = jax.lax.with_sharding_constraint(
            model.head(h), activation_sharding(mesh, "microbatches", "batch", rules=config.rules)
        )
    logits = logits.astype(config.precision.output)
    aux = summarize_layer_aux(jax.tree.map(lambda v: v / n_micro, layer_aux_sums))
    return total_loss(logits, targets, aux, config)


def sequential_loss(
    model: LanguageModel,
    tokens: Int[Array, "microbatches batch seq"],
    targets: Int[Array, "microbatches batch seq"],
    *,
    config: StepConfig,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """The same loss computed the plain way: the (unstaged) model vmapped over every sequence."""
    model = cast_floats(model, config.precision.compute)
    logits, aux = jax.vmap(jax.vmap(model))(tokens)
    aux = jax.tree.map(lambda v: jnp.mean(v, axis=(0, 1)), aux)
    return total_loss(logits.astype(config.precision.output), targets, aux, config)


def total_loss(
    logits: Float[Array, "*batch seq vocab"],
    targets: Int[Array, "*batch seq"],
    aux: dict[str, Array],
    config: StepConfig,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """Mean cross-entropy plus the weighted load-balance and router z-losses (MoE models);
    returns ``(loss, {"cross_entropy": ..., **aux})``."""
    with jax.named_scope("loss"):
        cross_entropy = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))
        loss = cross_entropy
        if "load_balance_loss" in aux:
            loss = loss + config.load_balance_weight * aux["load_balance_loss"]
            loss = loss + config.router_z_weight * aux["router_z_loss"]
    return loss.astype(jnp.float32), {"cross_entropy": cross_entropy, **aux}
