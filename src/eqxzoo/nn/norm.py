"""RMSNorm and LayerNorm over the trailing axes, computed in float32.

Each has a custom VJP that keeps only the input and the per-row statistics for the backward
pass (Apex's and Megatron's fused norms do the same) and recomputes the normalised rows
there: left to autodiff, a LayerNorm kept four arrays of its input's size, and in a layer
scan every kept array is another stacked buffer to zero, fill and read back (the reference
step at T 256: 1.04-1.10x faster, 32 MiB less temporary memory).
"""

import functools
from collections.abc import Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from eqxzoo.nn.axes import AbstractAxesOwner, LogicalName
from eqxzoo.nn.varying import cotangent_for
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
        return _rms_norm(self.eps, self.weight_offset, x, self.weight)


def _rms_norm_forward(eps, weight_offset, x, weight):
    axes = tuple(range(-weight.ndim, 0))
    x32 = x.astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=axes, keepdims=True) + eps)
    normed = x32 * inv_rms
    if weight_offset == 0.0:
        out = (weight * normed.astype(x.dtype)).astype(x.dtype)
    else:
        out = (normed * (weight_offset + weight.astype(jnp.float32))).astype(x.dtype)
    return out, (x, inv_rms, weight)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _rms_norm(eps, weight_offset, x, weight):
    return _rms_norm_forward(eps, weight_offset, x, weight)[0]


def _rms_norm_backward(eps, weight_offset, residuals, d_out):
    """With ``n = x / rms`` and ``g = d_out * scale``: ``dx = (g - n mean(g n)) / rms``."""
    x, inv_rms, weight = residuals
    axes = tuple(range(-weight.ndim, 0))
    normed = x.astype(jnp.float32) * inv_rms
    d_out = d_out.astype(jnp.float32)
    scaled = d_out * (weight_offset + weight.astype(jnp.float32))
    d_x = inv_rms * (scaled - normed * jnp.mean(scaled * normed, axis=axes, keepdims=True))
    d_weight = jnp.sum(d_out * normed, axis=tuple(range(x.ndim - weight.ndim)))
    return d_x.astype(x.dtype), cotangent_for(d_weight.astype(weight.dtype), weight)


_rms_norm.defvjp(_rms_norm_forward, _rms_norm_backward)


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
        return _layer_norm(self.eps, x, self.weight, self.bias)


def _layer_norm_forward(eps, x, weight, bias):
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    inv_std = jax.lax.rsqrt(jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True) + eps)
    normed = ((x32 - mean) * inv_std).astype(x.dtype)
    return (normed * weight + bias).astype(x.dtype), (x, mean, inv_std, weight, bias)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _layer_norm(eps, x, weight, bias):
    return _layer_norm_forward(eps, x, weight, bias)[0]


def _layer_norm_backward(eps, residuals, d_out):
    """With ``n = (x - mean) / std`` and ``g = d_out * weight``: ``dx = (g - mean(g) - n
    mean(g n)) / std``."""
    x, mean, inv_std, weight, bias = residuals
    normed = (x.astype(jnp.float32) - mean) * inv_std
    d_out = d_out.astype(jnp.float32)
    scaled = d_out * weight.astype(jnp.float32)
    centred = scaled - jnp.mean(scaled, axis=-1, keepdims=True)
    d_x = inv_std * (centred - normed * jnp.mean(scaled * normed, axis=-1, keepdims=True))
    tokens = tuple(range(x.ndim - 1))
    d_weight = jnp.sum(d_out * normed, axis=tokens).astype(weight.dtype)
    d_bias = jnp.sum(d_out, axis=tokens).astype(bias.dtype)
    return d_x.astype(x.dtype), cotangent_for(d_weight, weight), cotangent_for(d_bias, bias)


_layer_norm.defvjp(_layer_norm_forward, _layer_norm_backward)
