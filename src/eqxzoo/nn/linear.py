"""Dense projections and token embeddings, each with logical axes."""

from collections.abc import Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqxzoo.nn.axes import AbstractAxesOwner, LogicalName


def normal_init(key: PRNGKeyArray, shape: tuple[int, ...], std: float) -> Array:
    """Normal initialisation with standard deviation ``std`` (Hugging Face's ``initializer_range``)."""
    return std * jax.random.normal(key, shape, jnp.float32)


class Linear(AbstractAxesOwner):
    """``y = x @ weight (+ bias)`` with ``weight`` of shape ``(in_features, out_features)``.

    Stored input-major (``torch.nn.Linear`` is output-major) so the logical axes read in the
    order data flows: ``(in_axis, out_axis)``.
    """

    weight: Float[Array, "in_features out_features"]
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
        y = x @ self.weight
        return y if self.bias is None else y + self.bias


class Embedding(AbstractAxesOwner):
    """Token embedding table ``(vocab, embed)``; `attend` reuses it as a tied output layer."""

    weight: Float[Array, "vocab embed"]

    def __init__(self, vocab_size: int, d_model: int, *, init_std: float = 0.02, key: PRNGKeyArray):
        self.weight = normal_init(key, (vocab_size, d_model), init_std)

    def param_axes(self) -> Mapping[str, tuple[LogicalName, ...]]:
        return {"weight": ("vocab", "embed")}

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq embed"]:
        return jnp.take(self.weight, tokens, axis=0)

    def attend(self, h: Float[Array, "seq embed"]) -> Float[Array, "seq vocab"]:
        """Logits against the embedding table (tied input/output embeddings)."""
        return h @ self.weight.T
