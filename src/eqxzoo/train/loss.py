"""The training loss: token-mean cross-entropy plus the weighted MoE auxiliary losses, computed
through the pipeline (`pipelined_loss`, differentiated by autodiff), with its gradients by
the 1F1B-family executor (`pipelined_loss_and_grad`), or the plain way as a reference
(`sequential_loss`)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int, PyTree

from eqxzoo.nn import LanguageModel, summarize_layer_aux
from eqxzoo.parallel import activation_sharding, pipeline_value_and_grad, run_pipeline
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

    ``model`` is in the pipeline layout. Embedding, prefix and head run outside the pipeline;
    the prefix's layers split the microbatches over ``pp`` (rule ``prefix_microbatches``)
    where they divide, instead of every stage computing them all.
    """
    model = cast_floats(model, config.precision.compute)
    n_micro = tokens.shape[0]
    with jax.named_scope("embed"):
        h = model.embed(tokens)
    if model.prefix is not None:
        with jax.named_scope("prefix"):
            if n_micro % mesh.shape["pp"] == 0:
                h = jax.lax.with_sharding_constraint(
                    h,
                    activation_sharding(mesh, "prefix_microbatches", "batch", rules=config.rules),
                )
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
            skip_bubbles=config.skip_bubbles,
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
    return with_aux_losses(cross_entropy, aux, config)


AUX_LOSS_WEIGHTS = {"load_balance_loss": "load_balance_weight", "router_z_loss": "router_z_weight"}


def with_aux_losses(
    cross_entropy: Float[Array, ""], aux: dict[str, Array], config: StepConfig
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """``(loss, metrics)``: the cross-entropy plus each MoE aux loss times its weight."""
    loss = cross_entropy
    for name, weight in AUX_LOSS_WEIGHTS.items():
        if name in aux:
            loss = loss + getattr(config, weight) * aux[name]
    return loss.astype(jnp.float32), {"cross_entropy": cross_entropy, **aux}


def pipelined_loss_and_grad(
    model: LanguageModel,
    tokens: Int[Array, "microbatches batch seq"],
    targets: Int[Array, "microbatches batch seq"],
    *,
    config: StepConfig,
    mesh: Mesh,
) -> tuple[tuple[Float[Array, ""], dict[str, Array]], PyTree]:
    """``((loss, metrics), grads)`` of `pipelined_loss` by the 1F1B-family executor
    (`eqxzoo.parallel.pipeline_value_and_grad`), which runs the backward itself.

    The embedding (and prefix) run on the first virtual stage and the head and loss on the
    last, one microbatch at a time, so no ``(microbatches, ...)`` activation exists.
    ``grads`` has ``model``'s structure (the pipeline layout), with None for non-float leaves.
    """
    model = cast_floats(model, config.precision.compute)
    outer = eqx.tree_at(lambda m: m.blocks.layers, model, None)
    n_micro, n_tokens = tokens.shape[0], tokens.size
    n_layers = model.blocks.n_layers

    def first(outer, tokens):
        h = outer.embed(tokens)
        if outer.prefix is not None:
            h, _ = outer.prefix(h)
        return h

    def last(outer, h, targets):
        logits = outer.head(h).astype(config.precision.output)
        token_losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return jnp.sum(token_losses) / n_tokens

    aux_scales = {
        name: getattr(config, weight) / (n_micro * n_layers)
        for name, weight in AUX_LOSS_WEIGHTS.items()
    }
    with jax.named_scope("pipeline"):
        cross_entropy, layer_aux, layer_grads, outer_grads = pipeline_value_and_grad(
            model.blocks.layers,
            outer,
            tokens,
            targets,
            first=first,
            last=last,
            aux_scales=aux_scales,
            schedule=config.schedule,
            mesh=mesh,
            remat_policy=model.blocks.remat_policy,
            remat_stages=config.remat_stages,
            rules=config.rules,
            bubble_fill=config.bubble_fill,
        )
    aux = summarize_layer_aux(jax.tree.map(lambda v: v / n_micro, layer_aux))
    grads = eqx.tree_at(
        lambda m: m.blocks.layers, outer_grads, layer_grads, is_leaf=lambda x: x is None
    )
    return with_aux_losses(cross_entropy, aux, config), grads
