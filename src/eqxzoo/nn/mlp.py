"""Feed-forward blocks: SwiGLU (Llama), GeGLU (Gemma) and GELU (GPT-2)."""

import functools
from typing import Literal

import equinox as eqx
import jax
from jaxtyping import Array, Float, PRNGKeyArray

from eqxzoo.nn.linear import Linear
from eqxzoo.typed_config import refuse

Activation = Literal["swiglu", "geglu", "gelu"]

GATED = ("swiglu", "geglu")


class MLP(eqx.Module):
    """``down(silu(gate(x)) * up(x))`` for SwiGLU, ``down(gelu(gate(x)) * up(x))`` for GeGLU,
    ``down(gelu(up(x)))`` for GELU; GELU is the tanh approximation throughout (GPT-2's
    ``gelu_new``, Gemma's ``gelu_pytorch_tanh``).

    ``gate`` is ``None`` for GELU. At equal parameter count a GELU MLP has ``1.5x`` the hidden
    width of a gated one.
    """

    gate: Linear | None
    up: Linear
    down: Linear
    activation: Activation = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        hidden_dim: int,
        *,
        activation: Activation = "swiglu",
        use_bias: bool = False,
        init_std: float = 0.02,
        key: PRNGKeyArray,
    ):
        if activation not in (*GATED, "gelu"):
            refuse("activation", f"must be 'swiglu', 'geglu' or 'gelu', got {activation!r}")
        kg, ku, kd = jax.random.split(key, 3)
        linear = dict(use_bias=use_bias, init_std=init_std)
        self.gate = (
            Linear(d_model, hidden_dim, in_axis="embed", out_axis="mlp", key=kg, **linear)
            if activation in GATED
            else None
        )
        self.up = Linear(d_model, hidden_dim, in_axis="embed", out_axis="mlp", key=ku, **linear)
        self.down = Linear(hidden_dim, d_model, in_axis="mlp", out_axis="embed", key=kd, **linear)
        self.activation = activation

    def __call__(self, x: Float[Array, "*batch embed"]) -> Float[Array, "*batch embed"]:
        with jax.named_scope("mlp"):
            if self.gate is None:
                return _down_of_activation(self.down, self.activation, self.up(x), None)
            return _down_of_activation(self.down, self.activation, self.gate(x), self.up(x))


@functools.partial(
    jax.checkpoint, static_argnums=(1,), policy=jax.checkpoint_policies.nothing_saveable
)
def _down_of_activation(
    down: Linear,
    activation: Activation,
    pre: Float[Array, "*batch mlp"],
    up: Float[Array, "*batch mlp"] | None,
) -> Float[Array, "*batch embed"]:
    """``down(act(pre) * up)`` (``down(act(pre))`` without ``up``), saving only ``pre`` and
    ``up`` for the backward pass: the activation and the hidden product are recomputed there.

    Plain autodiff saves four more ``(tokens, mlp)`` arrays per layer (the activation's
    internals and the hidden product), each as large as ``pre``; recomputing them costs a few
    elementwise passes and no matmul (the down projection's output is not needed again).
    """
    hidden = jax.nn.silu(pre) if activation == "swiglu" else jax.nn.gelu(pre, approximate=True)
    return down(hidden if up is None else hidden * up)
