"""Dense projections and token embeddings, each with logical axes."""

import math
from collections.abc import Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqxzoo.nn.axes import AbstractAxesOwner, LogicalName
from eqxzoo.nn.lora import LoraWeight
from eqxzoo.nn.varying import cotangent_for


def dense(
    x: Float[Array, "..."], w: Float[Array, "..."] | LoraWeight, n_contract: int = 1
) -> Float[Array, "..."]:
    """Contract the last ``n_contract`` axes of ``x`` with the first ``n_contract`` of ``w``
    (of a `LoraWeight`: with its base, plus the adapter's low-rank path, never merged).

    Every leading axis of ``x`` (batch, sequence) is flattened into one token axis, so both
    the product and its gradients are plain 2-D matmuls. The weight gradient is computed as
    ``tokens^T @ d_out`` (`_matmul`): XLA:CPU otherwise contracts over ``(batch, seq)`` by
    materialising a transposed copy of the output gradient, which ran the backward of a GELU
    MLP at 8x its forward instead of 2x.
    """
    if isinstance(w, LoraWeight):
        assert w.n_in == n_contract, (w.n_in, n_contract)
        low_rank = dense(dense(x, w.lora_a, n_contract), w.lora_b)
        return dense(x, w.base, n_contract) + (w.scale * low_rank).astype(x.dtype)
    in_shape, out_shape = w.shape[:n_contract], w.shape[n_contract:]
    lead_shape = x.shape[: x.ndim - n_contract]
    assert x.shape[x.ndim - n_contract :] == in_shape, (x.shape, w.shape)
    tokens = x.reshape(math.prod(lead_shape), math.prod(in_shape))
    out = _matmul(tokens, w.reshape(math.prod(in_shape), math.prod(out_shape)))
    return out.reshape(*lead_shape, *out_shape)


@jax.custom_vjp
def _matmul(x: Float[Array, "tokens in"], w: Float[Array, "in out"]) -> Float[Array, "tokens out"]:
    return x @ w


def _matmul_forward(x, w):
    return x @ w, (x, w)


def _matmul_backward(residuals, d_out):
    x, w = residuals
    d_x = d_out @ w.T
    d_w = jax.lax.dot_general(x, d_out, (((0,), (0,)), ((), ())))
    return cotangent_for(d_x.astype(x.dtype), x), cotangent_for(d_w.astype(w.dtype), w)


_matmul.defvjp(_matmul_forward, _matmul_backward)


def normal_init(key: PRNGKeyArray, shape: tuple[int, ...], std: float) -> Array:
    """Normal initialisation with standard deviation ``std`` (Hugging Face's ``initializer_range``)."""
    return std * jax.random.normal(key, shape, jnp.float32)


class Linear(AbstractAxesOwner):
    """``y = x @ weight (+ bias)`` with ``weight`` of shape ``(in_features, out_features)``.

    Stored input-major (``torch.nn.Linear`` is output-major) so the logical axes read in the
    order data flows: ``(in_axis, out_axis)``.
    """

    weight: Float[Array, "in_features out_features"] | LoraWeight
    bias: Float[Array, " out_features"] | None
    in_axis: LogicalName = eqx.field(static=True)
    out_axis: LogicalName = eqx.field(static=True)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        in_axis: LogicalName,
        out_axis: LogicalName,
        use_bias: bool = False,
        init_std: float = 0.02,
        key: PRNGKeyArray,
    ):
        self.weight = normal_init(key, (in_features, out_features), init_std)
        self.bias = jnp.zeros((out_features,)) if use_bias else None
        self.in_axis = in_axis
        self.out_axis = out_axis

    def param_axes(self) -> Mapping[str, tuple[LogicalName, ...]]:
        return {"weight": (self.in_axis, self.out_axis), "bias": (self.out_axis,)}

    def __call__(
        self, x: Float[Array, "*batch in_features"]
    ) -> Float[Array, "*batch out_features"]:
        y = dense(x, self.weight)
        return y if self.bias is None else y + self.bias


class Embedding(AbstractAxesOwner):
    """An embedding table ``(rows, embed)``: token embeddings (rows on the logical ``vocab``
    axis) or learned positions (``row_axis=None``). A tied output layer reads the token
    table as it is stored (`eqxzoo.nn.HeadInputs`, ``vocab_major``)."""

    weight: Float[Array, "rows embed"]
    row_axis: LogicalName = eqx.field(static=True)

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        *,
        init_std: float = 0.02,
        row_axis: LogicalName = "vocab",
        key: PRNGKeyArray,
    ):
        self.weight = normal_init(key, (vocab_size, d_model), init_std)
        self.row_axis = row_axis

    def param_axes(self) -> Mapping[str, tuple[LogicalName, ...]]:
        return {"weight": (self.row_axis, "embed")}

    def __call__(self, tokens: Int[Array, "*batch seq"]) -> Float[Array, "*batch seq embed"]:
        return embedding_lookup(self.weight, tokens)


@jax.custom_vjp
def embedding_lookup(
    table: Float[Array, "rows embed"], tokens: Int[Array, "*batch seq"]
) -> Float[Array, "*batch seq embed"]:
    """The rows of ``table`` at ``tokens``; the gradient scatter-adds into a table of zeros
    that is allocated only once the output's cotangent exists.

    Plain autodiff makes the same scatter, but its zero table is a constant that XLA:CPU
    schedules at the start of the step: a ``(vocab, embed)`` buffer (311 MB at a 152k
    vocabulary in fp32) then stays live through the whole forward and backward pass, at the
    activations' peak. Here the zero is computed from the cotangent's first element (an exact
    zero whatever its value), a data dependency the scheduler cannot hoist; an
    `jax.lax.optimization_barrier` does not survive XLA:CPU's passes. Where the cotangent is
    sharded, that element costs one scalar broadcast.
    """
    return jnp.take(table, tokens, axis=0)


def _lookup_forward(table, tokens):
    return jnp.take(table, tokens, axis=0), (table, tokens)


def _lookup_backward(residuals, cotangent):
    table, tokens = residuals
    first = cotangent[(0,) * cotangent.ndim].astype(table.dtype)
    zero = jnp.where(jnp.isfinite(first), jnp.abs(first) * 0, 0)
    grad = jnp.broadcast_to(zero, table.shape).at[tokens].add(cotangent.astype(table.dtype))
    return cotangent_for(grad, table), None


embedding_lookup.defvjp(_lookup_forward, _lookup_backward)
