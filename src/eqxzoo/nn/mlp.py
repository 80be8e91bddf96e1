"""Feed-forward blocks: SwiGLU (Llama), GeGLU (Gemma) and GELU (GPT-2)."""

from typing import Literal

import equinox as eqx
import jax
from jaxtyping import Array, Float, PRNGKeyArray

from eqxzoo.nn.linear import Linear

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
            raise ValueError(f"activation must be 'swiglu', 'geglu' or 'gelu', got {activation!r}")
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
            if self.activation == "swiglu":
                hidden = jax.nn.silu(self.gate(x)) * self.up(x)
            elif self.activation == "geglu":
                hidden = jax.nn.gelu(self.gate(x), approximate=True) * self.up(x)
            else:
                hidden = jax.nn.gelu(self.up(x), approximate=True)
            return self.down(hidden)
