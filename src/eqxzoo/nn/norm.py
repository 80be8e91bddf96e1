"""RMSNorm and LayerNorm over the last axis, computed in float32."""

from collections.abc import Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from eqxzoo.nn.axes import AbstractAxesOwner, LogicalName


class RMSNorm(AbstractAxesOwner):
    """``x / sqrt(mean(x^2) + eps) * weight`` (Llama/Mixtral/Qwen layout, no bias).

    Statistics are taken in float32 whatever the input dtype; the result has the input dtype.
    """

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)
    axis_name: LogicalName = eqx.field(static=True)

    def __init__(self, dim: int, *, eps: float = 1e-6, axis_name: LogicalName = "embed"):
        self.weight = jnp.ones((dim,))
        self.eps = eps
        self.axis_name = axis_name

    def param_axes(self) -> Mapping[str, tuple[LogicalName, ...]]:
        return {"weight": (self.axis_name,)}

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return (self.weight * normed.astype(x.dtype)).astype(x.dtype)


class LayerNorm(AbstractAxesOwner):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last axis (GPT layout)."""

    weight: Float[Array, " dim"]
    bias: Float[Array, " dim"]
    eps: float = eqx.field(static=True)
    axis_name: LogicalName = eqx.field(static=True)

    def __init__(self, dim: int, *, eps: float = 1e-5, axis_name: LogicalName = "embed"):
        self.weight = jnp.ones((dim,))
        self.bias = jnp.zeros((dim,))
        self.eps = eps
        self.axis_name = axis_name

    def param_axes(self) -> Mapping[str, tuple[LogicalName, ...]]:
        return {"weight": (self.axis_name,), "bias": (self.axis_name,)}

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        normed = ((x32 - mean) * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
        return (normed * self.weight + self.bias).astype(x.dtype)
