"""A backward pass in two halves that share their work: B, the input cotangent, and W, the
weight gradients (the zero-bubble schedules' split, arXiv 2401.10241).

Every matrix multiplication of a layer's backward is one or the other: ``dX = dY W^T`` carries
the cotangent back through the layer (B), ``dW = X^T dY`` consumes it (W). Taking the vjp
with respect to the weights alone is not W: to reach the first projection's weights it
carries the cotangent back through everything after it again. Here the layer's pullback is
traced once into a jaxpr and its equations are cut in two (`BackwardSplit`): B is every
equation the input cotangent needs; W is every other equation the weight gradients need,
reading from B only the values that cross the cut (the cotangents of the weight-consuming
outputs, and the forward residuals W needs, such as each projection's input). Nothing is
computed twice: B's and W's equations partition the pullback's.

The cut is made on the pullback's own equations, so it needs no knowledge of the layer:
attention, MoE experts, latent attention, norms with weights, biases all split alike. An
equation is cut as a whole (a nested jaxpr, such as a ``jax.jit``-ed helper or a custom
VJP, goes to B if B needs any of its outputs). The split depends on shapes only: W, run at
another time, re-traces the layer on placeholder inputs to rebuild the same cut
(`BackwardSplit.of`), and reads its values from the stash B returned.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core
from jaxtyping import Array, PyTree


@dataclasses.dataclass(frozen=True)
class BackwardSplit:
    """The pullback's jaxpr cut into B's and W's equations.

    ``jaxpr``'s inputs are the pullback's residuals (its constvars) and the cotangent's
    leaves; its outputs the weight gradients' leaves, then the input cotangent's.
    ``stash`` lists, in a fixed order, the variables W reads that it does not compute.
    """

    jaxpr: core.Jaxpr
    b_eqns: tuple[Any, ...]
    w_eqns: tuple[Any, ...]
    stash: tuple[Any, ...]
    n_weight_leaves: int
    weight_tree: Any
    input_tree: Any

    @classmethod
    def of(
        cls, fn: Callable[[PyTree, PyTree], PyTree], weights: PyTree, x: PyTree, cotangent: PyTree
    ) -> tuple["BackwardSplit", list[Array], list[Array]]:
        """The split of ``fn``'s backward at ``(weights, x)``, with the pullback's residuals
        and the cotangent's leaves (the values B evaluates on)."""
        _, pullback = jax.vjp(fn, weights, x)
        closed = jax.make_jaxpr(pullback)(cotangent)
        jaxpr = closed.jaxpr
        weight_tree = jax.tree.structure(weights)
        n_weight_leaves = weight_tree.num_leaves
        input_vars = jaxpr.outvars[n_weight_leaves:]
        weight_vars = jaxpr.outvars[:n_weight_leaves]
        b_eqns = _needed(jaxpr.eqns, input_vars, stop=frozenset())
        b_defined = frozenset(v for eqn in b_eqns for v in eqn.outvars)
        w_eqns = _needed(jaxpr.eqns, weight_vars, stop=b_defined, skip=frozenset(map(id, b_eqns)))
        w_defined = frozenset(v for eqn in w_eqns for v in eqn.outvars)
        stash = _ordered_unique(
            v
            for v in [*(v for eqn in w_eqns for v in eqn.invars), *weight_vars]
            if isinstance(v, core.Var) and v not in w_defined
        )
        split = cls(
            jaxpr,
            tuple(b_eqns),
            tuple(w_eqns),
            tuple(stash),
            n_weight_leaves,
            weight_tree,
            jax.tree.structure(x),
        )
        return split, list(closed.consts), jax.tree.leaves(cotangent)

    def input_grad(
        self, consts: Sequence[Array], cotangent: Sequence[Array]
    ) -> tuple[PyTree, list]:
        """B: the input cotangent, and the stash W reads."""
        env = dict(zip(self.jaxpr.constvars, consts, strict=True))
        env |= dict(zip(self.jaxpr.invars, cotangent, strict=True))
        _evaluate(self.b_eqns, env)
        input_leaves = [_read(env, v) for v in self.jaxpr.outvars[self.n_weight_leaves :]]
        return self.input_tree.unflatten(input_leaves), [env[v] for v in self.stash]

    def weight_grad(self, stash: Sequence[Array]) -> PyTree:
        """W: the weight gradients from B's stash alone."""
        env = dict(zip(self.stash, stash, strict=True))
        _evaluate(self.w_eqns, env)
        leaves = [_read(env, v) for v in self.jaxpr.outvars[: self.n_weight_leaves]]
        return self.weight_tree.unflatten(leaves)

    @property
    def stash_shapes(self) -> list[jax.ShapeDtypeStruct]:
        return [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in self.stash]


def _needed(eqns, wanted, *, stop: frozenset, skip: frozenset = frozenset()) -> list:
    """The equations (in order) that ``wanted`` variables need, not looking past variables
    in ``stop`` (computed elsewhere) nor taking equations in ``skip``."""
    live = {v for v in wanted if isinstance(v, core.Var) and v not in stop}
    taken = []
    for eqn in reversed(eqns):
        if id(eqn) in skip or not any(v in live for v in eqn.outvars):
            continue
        taken.append(eqn)
        live |= {v for v in eqn.invars if isinstance(v, core.Var) and v not in stop}
    return taken[::-1]


def _ordered_unique(items) -> list:
    seen, ordered = set(), []
    for item in items:
        if item not in seen:
            seen.add(item)
            ordered.append(item)
    return ordered


def _read(env: dict, var) -> Any:
    return var.val if isinstance(var, core.Literal) else env[var]


def _evaluate(eqns, env: dict) -> None:
    """Bind each equation's primitive on its inputs from ``env``; write its outputs there."""
    for eqn in eqns:
        params = eqn.primitive.get_bind_params(eqn.params)
        with eqn.ctx.manager:
            outputs = eqn.primitive.bind(*[_read(env, v) for v in eqn.invars], **params)
        if not eqn.primitive.multiple_results:
            outputs = [outputs]
        for var, value in zip(eqn.outvars, outputs, strict=True):
            if not isinstance(var, core.DropVar):
                env[var] = value


def matmul_flops(eqns) -> int:
    """The FLOPs of the matrix multiplications among ``eqns`` (2 per multiply-add), inside
    nested jaxprs too (a ``scan`` body counted ``length`` times): ``dot_general``, and
    ``ragged_dot_general`` (grouped expert matmuls) counted as the dense products of its
    groups, ``2 * size(lhs) * (rhs dims neither contracted, batched nor grouped)``."""
    total = 0
    for eqn in eqns:
        if eqn.primitive.name in ("dot_general", "ragged_dot_general"):
            total += _dot_flops(eqn)
            continue
        repeats = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        for inner in _inner_jaxprs(eqn.params):
            total += repeats * matmul_flops(inner.eqns)
    return total


def _inner_jaxprs(params: dict):
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, core.Jaxpr):
                yield item


def _dot_flops(eqn) -> int:
    if eqn.primitive.name == "dot_general":
        (_, rhs_contract), (_, rhs_batch) = eqn.params["dimension_numbers"]
        rhs_other = set(rhs_contract) | set(rhs_batch)
    else:
        numbers = eqn.params["ragged_dot_dimension_numbers"]
        (_, rhs_contract), (_, rhs_batch) = numbers.dot_dimension_numbers
        rhs_other = set(rhs_contract) | set(rhs_batch) | set(numbers.rhs_group_dimensions)
    lhs_shape, rhs_shape = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    free = [size for axis, size in enumerate(rhs_shape) if axis not in rhs_other]
    return 2 * _product(lhs_shape) * _product(free)


def _product(sizes) -> int:
    total = 1
    for size in sizes:
        total *= int(size)
    return total
