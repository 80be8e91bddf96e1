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
import numpy as np
from jax.extend import core
from jaxtyping import Array, PyTree

from eqxzoo.nn.varying import typed_shape


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
        return cls.of_pullback(pullback, weights, x, cotangent)

    @classmethod
    def of_pullback(
        cls, pullback: Callable, weights: PyTree, x: PyTree, cotangent: PyTree
    ) -> tuple["BackwardSplit", list[Array], list[Array]]:
        """`of` for the ``pullback`` of ``jax.vjp(fn, weights, x)`` (only the structures of
        ``weights`` and ``x`` are read)."""
        closed = jax.make_jaxpr(pullback)(cotangent)
        eqns, outvars = _inlined(closed.jaxpr)
        jaxpr = closed.jaxpr.replace(eqns=eqns, outvars=outvars)
        weight_tree = jax.tree.structure(weights)
        n_weight_leaves = weight_tree.num_leaves
        input_vars = jaxpr.outvars[n_weight_leaves:]
        weight_vars = jaxpr.outvars[:n_weight_leaves]
        b_eqns = _needed(eqns, input_vars, stop=frozenset())
        b_defined = frozenset(v for eqn in b_eqns for v in eqn.outvars)
        w_eqns = _needed(eqns, weight_vars, stop=b_defined, skip=frozenset(map(id, b_eqns)))
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


# Equations that only call a jaxpr: their bodies are cut, not the calls (a rematerialised
# layer's whole backward is one ``remat2`` equation; ``jax.jit``-ed helpers are ``pjit``).
CALLS = {"pjit": "jaxpr", "remat2": "jaxpr", "checkpoint": "jaxpr", "closed_call": "call_jaxpr"}


def _inlined(jaxpr: core.Jaxpr) -> tuple[list, list]:
    """``jaxpr``'s equations with every call of `CALLS` (without constants) replaced by the
    equations of its body, renamed apart; and its outputs under the same renaming."""
    renamed: dict = {}

    def read(atom):
        return renamed.get(atom, atom) if isinstance(atom, core.Var) else atom

    flat: list = []

    def walk(eqns, fresh: bool) -> None:
        for eqn in eqns:
            invars = [read(v) for v in eqn.invars]
            body = eqn.params.get(CALLS.get(eqn.primitive.name, ""))
            if isinstance(body, core.ClosedJaxpr) and not body.consts:
                body = body.jaxpr
            if not isinstance(body, core.Jaxpr) or body.constvars:
                outvars = eqn.outvars
                if fresh:
                    outvars = [_fresh(v, renamed) for v in eqn.outvars]
                flat.append(eqn.replace(invars=invars, outvars=outvars))
                continue
            renamed.update(zip(body.invars, invars, strict=True))
            walk(body.eqns, fresh=True)
            for outer, inner in zip(eqn.outvars, body.outvars, strict=True):
                if not isinstance(outer, core.DropVar):
                    renamed[outer] = read(inner)

    walk(jaxpr.eqns, fresh=False)
    return flat, [read(v) for v in jaxpr.outvars]


def _fresh(var, renamed: dict):
    """A new variable for ``var`` of an inlined body (a body inlined twice, such as one
    ``jax.jit``-ed helper called twice, must not share variables)."""
    if isinstance(var, core.DropVar):
        return var
    renamed[var] = core.Var(var.aval)
    return renamed[var]


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


def computed_from_inputs(fn: Callable, *args) -> list[bool]:
    """For each leaf of ``fn(*args)``, whether it is computed from ``args`` or from a value
    of the enclosing trace that ``fn`` closes over; the others are made from constants and
    the device's place on the mesh alone (a context shard's positions, say), the same
    whatever the inputs. Read from the equations of ``fn``'s trace (through `CALLS`; any
    other equation's outputs are computed from all its inputs)."""
    closed = jax.make_jaxpr(fn)(*args)
    eqns, outvars = _inlined(closed.jaxpr)
    traced_consts = (
        v
        for v, value in zip(closed.jaxpr.constvars, closed.consts, strict=True)
        if isinstance(value, jax.core.Tracer)
    )
    live = {*closed.jaxpr.invars, *traced_consts}
    for eqn in eqns:
        if any(isinstance(v, core.Var) and v in live for v in eqn.invars):
            live.update(eqn.outvars)
    return [isinstance(v, core.Var) and v in live for v in outvars]


# --- a stage of stacked layers, split -------------------------------------------------------

LayerFn = Callable[[PyTree, PyTree, Array], tuple[Array, dict[str, Array]]]


@dataclasses.dataclass(frozen=True)
class PullbackResiduals:
    """Which leaves of a pullback of ``fn(weights, x)`` are residuals (kept between the
    forward and the backward, with ``shapes``) and which are the weights (read from the
    weights instead, never stored twice): the pullback's structure, and for each leaf the
    index of the weight it is, or None. One layer's (the split stage keeps them per layer)
    or a whole stage's (the 1F1B executor without stage remat)."""

    tree: Any
    weight_of_leaf: tuple[int | None, ...]
    shapes: tuple[jax.ShapeDtypeStruct, ...]

    @classmethod
    def of(cls, fn: Callable, weights: PyTree, x: Array) -> "PullbackResiduals":
        """The layout of ``fn``'s pullback as traced here; the computation is dead code."""
        _, pullback = jax.vjp(fn, weights, x)
        return cls.of_pullback(pullback, weights)

    @classmethod
    def of_pullback(cls, pullback: Callable, weights: PyTree) -> "PullbackResiduals":
        """`of` for the ``pullback`` of ``jax.vjp(fn, weights, x)``."""
        weight_leaves = jax.tree.leaves(weights)
        leaves = jax.tree.leaves(pullback)
        weight_of_leaf = tuple(
            next((i for i, w in enumerate(weight_leaves) if leaf is w), None) for leaf in leaves
        )
        shapes = tuple(
            typed_shape(leaf)
            for leaf, weight in zip(leaves, weight_of_leaf, strict=True)
            if weight is None
        )
        return cls(jax.tree.structure(pullback), weight_of_leaf, shapes)

    def residuals(self, pullback: Callable) -> list[Array | np.ndarray]:
        """The pullback's leaves that are not weights: what is kept (a NumPy array where the
        function closed over a constant, such as a context shard's position table)."""
        leaves = jax.tree.leaves(pullback)
        return [leaf for leaf, w in zip(leaves, self.weight_of_leaf, strict=True) if w is None]

    def from_inputs(self, fn: Callable, weights: PyTree, x: Array) -> list[bool]:
        """For each residual of ``fn``'s pullback at ``(weights, x)``, whether it is computed
        from them (`computed_from_inputs`); the others are made from constants alone."""
        return computed_from_inputs(lambda w, x: self.residuals(jax.vjp(fn, w, x)[1]), weights, x)

    def pullback(self, weights: PyTree, residuals: Sequence[Array]) -> Callable:
        """The pullback rebuilt from the kept residuals and the weights."""
        stored, weight_leaves = iter(residuals), jax.tree.leaves(weights)
        leaves = [next(stored) if w is None else weight_leaves[w] for w in self.weight_of_leaf]
        return jax.tree.unflatten(self.tree, leaves)


def stage_forward(
    layer_fn: LayerFn, layout: PullbackResiduals, weights: PyTree, data: PyTree, h: Array
) -> tuple[tuple[Array, dict[str, Array]], list[Array]]:
    """The stage's layers (stacked on a leading axis) applied in order: ``(h, aux)`` as
    `eqxzoo.nn.apply_layers` gives it, and every layer's pullback residuals, stacked."""

    def body(h, layer):
        w, d = layer
        (h, aux), pullback = jax.vjp(lambda w, x: layer_fn(w, d, x), w, h)
        return h, (aux, layout.residuals(pullback))

    h, (aux, residuals) = jax.lax.scan(body, h, (weights, data))
    return (h, aux), residuals


FitCotangent = Callable[[PyTree, PyTree], PyTree]


def _as_given(outputs: PyTree, cotangent: PyTree) -> PyTree:
    return cotangent


def stage_input_grad(
    layer_fn: LayerFn,
    layout: PullbackResiduals,
    weights: PyTree,
    data: PyTree,
    residuals: Sequence[Array],
    h_grad: Array,
    aux_grad: dict[str, Array],
    fit: FitCotangent = _as_given,
) -> tuple[Array, list[Array]]:
    """B of the stage: the cotangent of its input from its output's (``h_grad``, and
    ``aux_grad`` for every layer's aux values), layer by layer from the last; and W's stash,
    stacked over layers. ``fit(outputs, cotangent)`` adapts a layer's cotangent to its
    outputs' shapes (a pipeline marks what varies over its stages)."""

    def body(h_grad, layer):
        w, d, stored = layer
        pullback = layout.pullback(w, stored)
        outputs = jax.eval_shape(lambda w, x: layer_fn(w, d, x), w, h_grad)
        cotangent = fit(outputs, (h_grad, aux_grad))
        split, consts, leaves = BackwardSplit.of_pullback(pullback, w, h_grad, cotangent)
        d_h, stash = split.input_grad(consts, leaves)
        return d_h, stash

    return jax.lax.scan(body, h_grad, (weights, data, list(residuals)), reverse=True)


def stage_weight_grad(
    layer_fn: LayerFn,
    weights: PyTree,
    data: PyTree,
    stash: Sequence[Array],
    h_grad: Array,
    aux_grad: dict[str, Array],
    fit: FitCotangent = _as_given,
) -> PyTree:
    """W of the stage: every layer's weight gradients from B's stash, stacked like
    ``weights``. The cut is rebuilt from shapes, in a trace of its own (``h_grad`` and
    ``aux_grad`` give the cotangent's; the layer traced there for the cut is not part of W)."""

    def body(_, layer):
        w, d, stored = layer
        splits = []

        def cut(w, x):
            """The layer's cut, traced apart: none of its forward enters W's program."""
            outputs = jax.eval_shape(lambda w, x: layer_fn(w, d, x), w, x)
            cotangent = fit(outputs, (h_grad, aux_grad))
            splits.append(BackwardSplit.of(lambda w, x: layer_fn(w, d, x), w, x, cotangent)[0])
            return x

        jax.make_jaxpr(cut)(w, h_grad)
        return None, splits[0].weight_grad(stored)

    _, grads = jax.lax.scan(body, None, (weights, data, list(stash)))
    return grads
