"""One pipeline stage's actions timed in isolation on this machine's first device: what the
schedule model's measured costs (`eqxzoo.parallel.schedule.Costs`) need on hardware where
an idle tick costs time.

``python -m pipelines.bench.action_times CONFIG.toml [--stages P] [--repeats N]`` builds the
config's model (``[model]`` and ``[precision]`` only: no data, mesh or run is needed, so it
runs wherever JAX and the zoo import), takes the layers of one stage (``L / P`` of them, in
the compute dtype) and one device's microbatch (``data.batch_size / mesh.dp`` sequences of
``data.seq_len`` tokens), and times each action as the 1F1B executor runs it
(`eqxzoo.parallel.backward_split`): F (the stage forward keeping each layer's pullback
residuals), B (input cotangent and W's stash, from stored residuals), W (weight gradients
from the stash), and with stage remat, which recomputes the forward first, B as F+B and
1F1B's BW as F+BW (the stage's whole `jax.vjp`, applied). It prints one JSON object:
milliseconds per action (median of ``--repeats`` timed calls after two warm-ups) and each
relative to F.
"""

import argparse
import json
import sys
import tomllib

import equinox as eqx
import jax
import jax.numpy as jnp

import models
from eqxzoo.nn.stack import remat
from eqxzoo.parallel.backward_split import (
    PullbackResiduals,
    stage_forward,
    stage_input_grad,
    stage_weight_grad,
)
from eqxzoo.train.report import median_seconds


def stage_action_times(document: dict, stages: int, repeats: int) -> dict:
    """``{"ms": {action: ms}, "relative": {action: ms / F}, "shape": ...}`` for one stage of
    the run config ``document`` (a parsed TOML) cut into ``stages``."""
    config = models.registry.config_from_table(document["model"])
    compute = document.get("precision", {}).get("compute", "float32")
    data = document.get("data", {})
    dp = document.get("mesh", {}).get("dp", 1)
    batch, seq = max(1, data.get("batch_size", 1) // dp), data.get("seq_len", 128)
    model = models.DecoderLM(config, key=jax.random.key(0))
    per_stage = config.n_layers // stages
    layers = jax.tree.map(
        lambda a: a[:per_stage].astype(compute) if eqx.is_inexact_array(a) else a[:per_stage],
        eqx.filter(model.blocks.layers, eqx.is_array),
    )
    static = eqx.filter(model.blocks.layers, eqx.is_array, inverse=True)
    weights, layer_data = eqx.partition(layers, eqx.is_inexact_array)
    remat_policy = document["model"].get("remat", "none")
    layer_fn = remat(lambda w, d, h: eqx.combine(w, d, static)(h, key=None), remat_policy)
    h = jax.random.normal(jax.random.key(1), (batch, seq, config.d_model), compute)
    layouts = []

    def trace_layout(weights, h):
        """The layout as the executor finds it: from a traced layer (its pullback's leaves
        differ from an eager one's)."""
        first_weights, first_data = jax.tree.map(lambda a: a[0], (weights, layer_data))
        layouts.append(
            PullbackResiduals.of(lambda w, x: layer_fn(w, first_data, x), first_weights, h)
        )
        return h

    jax.make_jaxpr(trace_layout)(weights, h)
    (layout,) = layouts

    @jax.jit
    def forward(weights, h):
        return stage_forward(layer_fn, layout, weights, layer_data, h)

    (out, aux), residuals = forward(weights, h)
    aux_grad = jax.tree.map(lambda v: jnp.ones(v.shape[1:], v.dtype), aux)
    h_grad = jnp.ones_like(out)

    @jax.jit
    def input_grad(weights, residuals, h_grad):
        return stage_input_grad(layer_fn, layout, weights, layer_data, residuals, h_grad, aux_grad)

    @jax.jit
    def recompute_and_input_grad(weights, h, h_grad):
        _, residuals = stage_forward(layer_fn, layout, weights, layer_data, h)
        return stage_input_grad(layer_fn, layout, weights, layer_data, residuals, h_grad, aux_grad)

    _, stash = input_grad(weights, residuals, h_grad)

    @jax.jit
    def weight_grad(weights, stash, h_grad):
        return stage_weight_grad(layer_fn, weights, layer_data, stash, h_grad, aux_grad)

    @jax.jit
    def both(weights, h, h_grad):
        def stage(w, x):
            def body(x, layer):
                w, d = layer
                return layer_fn(w, d, x)

            return jax.lax.scan(body, x, (w, layer_data))

        outputs, pullback = jax.vjp(stage, weights, h)
        cotangent = (h_grad, jax.tree.map(jnp.ones_like, outputs[1]))
        return pullback(cotangent)

    actions = {
        "F": lambda: forward(weights, h),
        "B": lambda: input_grad(weights, residuals, h_grad),
        "W": lambda: weight_grad(weights, stash, h_grad),
        "F+BW": lambda: both(weights, h, h_grad),
        "F+B": lambda: recompute_and_input_grad(weights, h, h_grad),
    }
    ms = {
        name: 1e3 * median_seconds(call, repeats=repeats, warmup=2)
        for name, call in actions.items()
    }
    return {
        "device": str(jax.devices()[0].device_kind),
        "shape": {"layers": per_stage, "batch": batch, "seq": seq, "dtype": compute},
        "ms": ms,
        "relative": {name: value / ms["F"] for name, value in ms.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.bench.action_times")
    parser.add_argument("config")
    parser.add_argument("--stages", type=int, default=None, help="default: the config's pp")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    with open(args.config, "rb") as file:
        document = tomllib.load(file)
    stages = args.stages or document.get("mesh", {}).get("pp", 1)
    print(json.dumps(stage_action_times(document, stages, args.repeats), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
