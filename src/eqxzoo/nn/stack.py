"""A stack of identical layers stored as one module with a leading layer axis."""

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from eqxzoo.nn.axes import AbstractAxesOwner, LogicalName
from eqxzoo.nn.documents import Documents
from eqxzoo.typed_config import refuse

RematPolicy = Literal["none", "full", "dots"]

_REMAT_POLICIES: dict[str, Callable[..., Any] | None] = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def remat(fn: Callable, policy: RematPolicy) -> Callable:
    """``fn`` rematerialised under ``policy`` (``"none"`` returns it unchanged)."""
    if policy == "none":
        return fn
    if policy not in _REMAT_POLICIES:
        refuse("remat_policy", f"must be one of none, full, dots; got {policy!r}")
    return jax.checkpoint(fn, policy=_REMAT_POLICIES[policy])


class Stack(AbstractAxesOwner):
    """``n_layers`` layers of one structure, every array carrying a leading ``layers`` axis.

    Built with `eqx.filter_vmap` over split keys, so a 64-layer model is one set of arrays
    and compiles as fast as a 1-layer one; applied with `jax.lax.scan` (``scan=True``) or a
    Python loop (``scan=False``, for tests and debugging). Each layer is called as
    ``layer(h, key=key) -> (h, aux)`` (with ``documents=`` too when given: packed
    documents, `eqxzoo.nn.Documents`); the per-layer ``aux`` dicts are returned stacked on a
    leading ``layers`` axis.
    """

    layers: PyTree
    n_layers: int = eqx.field(static=True)
    scan: bool = eqx.field(static=True)
    remat_policy: RematPolicy = eqx.field(static=True)

    stacked_axis: ClassVar[str | None] = "layers"

    def __init__(
        self,
        make_layer: Callable[[PRNGKeyArray], eqx.Module],
        n_layers: int,
        *,
        scan: bool = True,
        remat_policy: RematPolicy = "none",
        key: PRNGKeyArray,
    ):
        remat(lambda: None, remat_policy)  # validates the policy name
        self.layers = eqx.filter_vmap(make_layer)(jax.random.split(key, n_layers))
        self.n_layers = n_layers
        self.scan = scan
        self.remat_policy = remat_policy

    def param_axes(self) -> Mapping[str, tuple[LogicalName, ...]]:
        return {}

    def layer(self, index: int) -> eqx.Module:
        """The ``index``-th layer as an ordinary (unstacked) module."""
        params, static = eqx.partition(self.layers, eqx.is_array)
        return eqx.combine(jax.tree.map(lambda p: p[index], params), static)

    def __call__(
        self,
        h: Float[Array, "*batch seq embed"],
        *,
        documents: Documents | None = None,
        key: PRNGKeyArray | None = None,
    ) -> tuple[Float[Array, "*batch seq embed"], dict[str, Array]]:
        return apply_layers(
            self.layers,
            h,
            documents=documents,
            key=key,
            scan=self.scan,
            remat_policy=self.remat_policy,
        )


def run_layer(
    layer: Callable,
    h: Float[Array, "*batch seq embed"],
    *,
    documents: Documents | None = None,
    key: PRNGKeyArray | None = None,
) -> tuple[Float[Array, "*batch seq embed"], Any]:
    """``layer(h, key=key)``, with ``documents=`` only where there are packed documents (a
    layer that never sees any need not take them)."""
    if documents is None:
        return layer(h, key=key)
    return layer(h, documents=documents, key=key)


def apply_layers(
    layers: PyTree,
    h: Float[Array, "*batch seq embed"],
    *,
    documents: Documents | None = None,
    key: PRNGKeyArray | None = None,
    scan: bool = True,
    remat_policy: RematPolicy = "none",
) -> tuple[Float[Array, "*batch seq embed"], dict[str, Array]]:
    """Apply stacked ``layers`` (leading axis = layer) in order to ``h`` (of sequences
    packed with ``documents``, when given).

    Shared by `Stack` and the pipeline stages, which hold a slice of the same stacked layers.
    Returns the final hidden states and each layer's aux values stacked on a leading axis.
    """
    params, static = eqx.partition(layers, eqx.is_array)
    n_layers = jax.tree.leaves(params)[0].shape[0]
    layer_keys = None if key is None else jax.random.split(key, n_layers)

    def one_layer(h, layer_params, layer_key):
        return run_layer(eqx.combine(layer_params, static), h, documents=documents, key=layer_key)

    one_layer = remat(one_layer, remat_policy)
    if scan:

        def body(h, xs):
            layer_params, layer_key = xs
            return one_layer(h, layer_params, layer_key)

        return jax.lax.scan(body, h, (params, layer_keys))
    auxes = []
    for index in range(n_layers):
        layer_params = jax.tree.map(lambda p: p[index], params)  # noqa: B023 (used at once)
        h, aux = one_layer(h, layer_params, None if layer_keys is None else layer_keys[index])
        auxes.append(aux)
    return h, jax.tree.map(lambda *values: jnp.stack(values), *auxes)
