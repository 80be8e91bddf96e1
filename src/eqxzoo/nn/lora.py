"""Low-rank adapters (LoRA): a frozen weight plus a trained update of low rank.

`LoraWeight` stands where a projection's weight stood: ``base`` is the weight, ``lora_a`` and
``lora_b`` the adapter, ``scale = alpha / rank``, and `eqxzoo.nn.linear.dense` computes
``x @ base + scale * (x @ lora_a) @ lora_b`` from it, never the merged weight. The adapter
lives in the model's own pytree, so it is stacked, staged, sharded (``lora_a`` like the
weight's input axes, ``lora_b`` like its output axes) and checkpointed with its layer; a
trainer trains only it (`FROZEN_BESIDE_ADAPTERS`). ``lora_b`` starts at zero: an adapted model
first computes what its base does.

Which weights can take one is each module's to say (`ADAPTABLE`: a module class's projection
fields, with how many input axes each contracts); `add_adapters` wraps those named by
``targets`` in one module, and `merge_adapters` folds every adapter back into its weight.
"""

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from eqxzoo.nn.axes import AbstractAxesOwner, LogicalName

ADAPTER_FIELDS = ("lora_a", "lora_b")
# A `trainable_mask` freeze pattern that leaves only the adapters trained.
FROZEN_BESIDE_ADAPTERS = rf"^(?!.*\.({'|'.join(ADAPTER_FIELDS)})$)"


def is_adapter_path(path: str) -> bool:
    """Whether an array's path (``jax.tree_util.keystr``'s form, or a checkpoint's saved
    name) is a LoRA adapter's."""
    return path.endswith(tuple("." + name for name in ADAPTER_FIELDS))


class LoraWeight(AbstractAxesOwner):
    """``base`` (the frozen weight, ``(*in, *out)``) and its adapter ``lora_a`` ``(*in,
    rank)`` and ``lora_b`` ``(rank, *out)``: the weight ``base + scale * lora_a @ lora_b``.
    ``axes`` are the weight's logical axes, ``n_in`` how many of them are inputs."""

    base: Float[Array, "..."]
    lora_a: Float[Array, "..."]
    lora_b: Float[Array, "..."]
    scale: float = eqx.field(static=True)
    n_in: int = eqx.field(static=True)
    axes: tuple[LogicalName, ...] = eqx.field(static=True)

    def param_axes(self) -> Mapping[str, tuple[LogicalName, ...]]:
        return {
            "base": self.axes,
            "lora_a": (*self.axes[: self.n_in], None),
            "lora_b": (None, *self.axes[self.n_in :]),
        }

    @property
    def rank(self) -> int:
        return self.lora_a.shape[-1]

    def merged(self) -> Float[Array, "..."]:
        """``base + scale * lora_a @ lora_b`` in ``base``'s layout and dtype (float32 sums);
        stacked layers (leading axes before the weight's own) merge each its own."""
        return self.merged_from(self.base, self.lora_a, self.lora_b)

    def merged_from(self, base: Array, lora_a: Array, lora_b: Array) -> Float[Array, "..."]:
        """`merged` of these arrays in place of this weight's own (read from elsewhere)."""
        lead = base.shape[: base.ndim - len(self.axes)]
        a = jnp.asarray(lora_a).reshape(*lead, -1, self.rank).astype(jnp.float32)
        b = jnp.asarray(lora_b).reshape(*lead, self.rank, -1).astype(jnp.float32)
        update = (a @ b).reshape(base.shape)
        return (jnp.asarray(base).astype(jnp.float32) + self.scale * update).astype(base.dtype)


# Module class name -> {projection field: input axes it contracts}. A field holding a
# `Linear` (the MLPs' gate, up and down) is adapted through its ``weight``.
ADAPTABLE: dict[str, dict[str, int]] = {
    "CausalSelfAttention": {"wq": 1, "wk": 1, "wv": 1, "wo": 2},
    "LatentAttention": {"wq": 1, "wq_a": 1, "wq_b": 1, "wkv_a": 1, "wkv_b": 1, "wo": 2},
    "MLP": {"gate": 1, "up": 1, "down": 1},
}


def adaptable_names() -> tuple[str, ...]:
    """Every projection name a LoRA target may name (`ADAPTABLE`)."""
    return tuple(sorted({name for fields in ADAPTABLE.values() for name in fields}))


def add_adapters(
    module: eqx.Module,
    targets: Sequence[str],
    rank: int,
    alpha: float,
    *,
    key: PRNGKeyArray,
) -> eqx.Module:
    """``module`` (one unstacked layer's attention or MLP) with each of its `ADAPTABLE`
    projections named in ``targets`` wrapped in a `LoraWeight` of ``rank``: ``lora_a``
    uniform within ``1 / sqrt(inputs)`` (`lora_a_bound`), ``lora_b`` zero. A target it does not have
    wraps nothing."""
    fields = ADAPTABLE.get(type(module).__name__, {})
    chosen = [name for name in fields if name in targets and getattr(module, name) is not None]
    keys = jax.random.split(key, max(len(chosen), 1))
    for name, field_key in zip(chosen, keys, strict=False):
        value, n_in = getattr(module, name), fields[name]

        def adapter(weight, axes, field_key=field_key, n_in=n_in):
            shape = (*weight.shape[:n_in], rank)
            bound = lora_a_bound(shape)
            lora_a = jax.random.uniform(field_key, shape, minval=-bound, maxval=bound)
            lora_a = lora_a.astype(weight.dtype)
            lora_b = jnp.zeros((rank, *weight.shape[n_in:]), weight.dtype)
            return LoraWeight(weight, lora_a, lora_b, alpha / rank, n_in, tuple(axes))

        if isinstance(value, AbstractAxesOwner):  # a `Linear`: its weight
            adapted = eqx.tree_at(
                lambda v: v.weight, value, adapter(value.weight, value.param_axes()["weight"])
            )
        else:
            adapted = adapter(value, module.param_axes()[name])
        module = eqx.tree_at(lambda m, name=name: getattr(m, name), module, adapted)
    return module


def is_lora_weight(node) -> bool:
    return isinstance(node, LoraWeight)


def merge_adapters(model: PyTree, read: Callable[[Any], Array] = lambda x: x) -> PyTree:
    """``model`` with every `LoraWeight` replaced by its merged weight: the plain model the
    adapters make (what a Hugging Face export of the merged model holds). ``read`` turns
    an adapted weight's arrays into arrays first (`numpy.asarray` for a checkpoint's lazy
    readers); nothing else is read."""

    def merge(node):
        if not is_lora_weight(node):
            return node
        arrays = tuple(read(x) for x in (node.base, node.lora_a, node.lora_b))
        return node.merged_from(*arrays)

    return jax.tree.map(merge, model, is_leaf=is_lora_weight)


def adapter_count(model: PyTree) -> int:
    """The number of adapter parameters in ``model``."""
    adapters = [
        node for node in jax.tree.leaves(model, is_leaf=is_lora_weight) if is_lora_weight(node)
    ]
    return sum(math.prod(n.lora_a.shape) + math.prod(n.lora_b.shape) for n in adapters)


def lora_a_bound(shape: tuple[int, ...]) -> float:
    """The bound of ``lora_a``'s uniform initialisation, ``1 / sqrt(inputs)`` (PEFT's default,
    torch's Kaiming-uniform with ``a = sqrt(5)``): ``lora_a`` of ``shape`` ``(*in, rank)``."""
    return 1.0 / math.sqrt(math.prod(shape[:-1]))


def with_new_adapters(model: PyTree, adapted: PyTree, seed: int) -> PyTree:
    """``model`` (no adapters; its arrays anything indexable, such as a checkpoint's lazy
    readers) with the adapters ``adapted`` has (the same model with them, abstract), drawn
    anew on the host from ``seed``, as `add_adapters` draws them.
    Arrays are matched by where they sit; the result is ``adapted``'s structure (its static
    options) with ``model``'s arrays."""
    arrays = {
        jax.tree_util.keystr(path): leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(model)
    }
    drawn = iter(range(len(arrays) + 1))

    def fill(path, node):
        array = arrays[jax.tree_util.keystr(path)]
        if not is_lora_weight(node):
            return array
        rng = np.random.default_rng([seed, next(drawn)])
        bound = lora_a_bound(node.lora_a.shape[-(node.n_in + 1) :])
        lora_a = rng.uniform(-bound, bound, node.lora_a.shape).astype(np.float32)
        lora_b = np.zeros(node.lora_b.shape, np.float32)
        return LoraWeight(array, lora_a, lora_b, node.scale, node.n_in, node.axes)

    return jax.tree_util.tree_map_with_path(fill, adapted, is_leaf=is_lora_weight)
