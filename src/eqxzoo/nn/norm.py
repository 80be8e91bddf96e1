"""RMSNorm and LayerNorm over the trailing axes, computed in float32."""

from collections.abc import Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from eqxzoo.nn.axes import AbstractAxesOwner, LogicalName
from eqxzoo.typed_config import refuse


class RMSNorm(AbstractAxesOwner):
    """``x / sqrt(mean(x^2) + eps) * (weight_offset + weight)`` over the trailing axes.

    ``weight_offset = 0`` is the Llama/Mistral/Qwen layout; Gemma stores ``weight`` around
    zero and scales by ``1 + weight`` (``weight_offset = 1``, ``weight`` initialised to zeros).
    ``shape`` may span several trailing axes (OLMo 2 normalises queries over all heads at
    once: ``(heads, head_dim)``), each with its logical name in ``axis_names``. Statistics
    are taken in float32 whatever the input dtype; the result has the input dtype.
    """

    weight: Float[Array, "*dims"]
    eps: float = eqx.field(static=True)
    weight_offset: float = eqx.field(static=True)
    axis_names: tuple[LogicalName, ...] = eqx.field(static=True)

    def __init__(
        self,
        shape: int | tuple[int, ...],
        *,
        eps: float = 1e-6,
        weight_offset: float = 0.0,
        axis_names: tuple[LogicalName, ...] = ("embed",),
    ):
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if len(axis_names) != len(shape):
            refuse("axis_names", f"{axis_names} do not name the axes of shape {shape}")
        self.weight = jnp.full(shape, 1.0 - weight_offset)
        self.eps = eps
        self.weight_offset = weight_offset
        self.axis_names = axis_names

    def param_axes(self) -> Mapping[str, tuple[LogicalName, ...]]:
        return {"weight": self.axis_names}

    def __call__(self, x: Float[Array, "*batch dims"]) -> Float[Array, "*batch dims"]:
        axes = tuple(range(-self.weight.ndim, 0))
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=axes, keepdims=True) + self.eps)
        if self.weight_offset == 0.0:
            return (self.weight * normed.astype(x.dtype)).astype(x.dtype)
        scale = self.weight_offset + self.weight.astype(jnp.float32)
        return (normed * scale).astype(x.dtype)


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
