"""Test grids that cover every pair of factor levels a bug could live in, not their product.

A grid is its factors (``{"family": [...], "schedule": [...], ...}``), a rule saying which
combinations can run, and its *requirements*: functions from a case to the keys it covers
(``("family", "schedule")`` covers ``("llama", "zb_h1")``). `covering` picks, greedily, the
valid case that covers the most keys not yet covered, until every key that some valid case
covers is covered: every (family, schedule) pair, say, appears together at least once, in
a few dozen cases instead of thousands. Given what each case costs (its ``cost``: a
relative compile time), ties go to the cheapest case, and a case whose keys the others
cover after all is dropped, the dearest first: the same keys in less time. The choice is
deterministic (remaining ties go to the earliest case of the product), so every xdist
worker collects the same grid.

``EQXZOO_FULL_GRIDS=1`` in the environment gives every valid case of the product instead:
the switch for whoever changes what the grid tests.
"""

import heapq
import itertools
import os
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

import pytest

from models.registry import families, tiny_config

FULL_GRIDS = os.environ.get("EQXZOO_FULL_GRIDS", "") not in ("", "0")

Case = dict[str, Any]
Requirement = Callable[[Case], Iterable[Hashable]]


def pairs_of(*names: str) -> Requirement:
    """The requirement that every combination of the levels of ``names`` appears."""
    return lambda case: [(names, tuple(case[name] for name in names))]


def covering(
    factors: Mapping[str, Sequence],
    requirements: Sequence[Requirement],
    valid: Callable[[Case], bool] = lambda case: True,
    *,
    cost: Callable[[Case], float] = lambda case: 1.0,
    full: bool = FULL_GRIDS,
) -> list[Case]:
    """The valid cases of the product of ``factors`` (every one if ``full``, else a greedy
    covering set of the keys ``requirements`` give, cheap by ``cost``), in product order."""
    names = list(factors)
    cases = [
        case
        for levels in itertools.product(*factors.values())
        if valid(case := dict(zip(names, levels, strict=True)))
    ]
    return cases if full else cover(cases, requirements, cost)


def cover(
    cases: Sequence[Case],
    requirements: Sequence[Requirement],
    cost: Callable[[Case], float] = lambda case: 1.0,
) -> list[Case]:
    """A subset of ``cases``, in their order, covering every key that ``requirements`` give
    for any of them: greedily, the case covering the most keys not yet covered first (of
    equal gains, the one of least ``cost``); then each chosen case whose keys the others
    cover too is dropped, the dearest first."""
    keys = [{key for requirement in requirements for key in requirement(case)} for case in cases]
    costs = [cost(case) for case in cases]
    uncovered = set().union(*keys)
    # Lazy greedy: a case's gain only shrinks as keys are covered, so a stale gain at the top
    # of the heap is recomputed before it is trusted.
    heap = [(-len(case_keys), costs[index], index) for index, case_keys in enumerate(keys)]
    heapq.heapify(heap)
    chosen = []
    while uncovered:
        _, _, index = heapq.heappop(heap)
        entry = (-len(keys[index] & uncovered), costs[index], index)
        if heap and entry > heap[0]:
            heapq.heappush(heap, entry)
            continue
        chosen.append(index)
        uncovered -= keys[index]
    times_covered = Counter(key for index in chosen for key in keys[index])
    for index in sorted(chosen, key=lambda index: -costs[index]):
        if all(times_covered[key] > 1 for key in keys[index]):
            chosen.remove(index)
            times_covered.subtract(keys[index])
    return [cases[index] for index in sorted(chosen)]


def levels_of(*names: str) -> list[Requirement]:
    """The requirements that each level of each of ``names`` appears (alone, not in pairs)."""
    return [pairs_of(name) for name in names]


def slow_except(values: Iterable, fast: Callable[[Any], bool]) -> list:
    """``values`` as pytest parameters, those ``fast`` rejects marked ``slow``: the fast part
    of the suite (``-m "not slow"``) keeps a representative few of a grid, CI runs them all."""
    return [pytest.param(value, marks=() if fast(value) else pytest.mark.slow) for value in values]


def dense_and_one_moe(configs: Mapping[str, Any], moe: str = "mixtral") -> list:
    """The names of ``configs`` as parameters, the MoE ones but ``moe`` marked ``slow`` (a
    dropless MoE compiles for ~20 s: the fast part keeps one)."""
    return slow_except(configs, lambda name: configs[name].moe is None or name == moe)


def full_grids_only(*values: Any, id: str | None = None) -> Any:
    """``values`` as a pytest parameter that runs only with ``EQXZOO_FULL_GRIDS=1``: a case
    kept one switch away, where the suite's other cases (or a command's own check, as the
    planner's ``--calibrate``) show its point."""
    skip = pytest.mark.skipif(not FULL_GRIDS, reason="runs with EQXZOO_FULL_GRIDS=1")
    return pytest.param(*values, id=id, marks=skip)


def case_id(case: Case) -> str:
    """A test id naming every level of the case."""
    return "-".join(str(level) for level in case.values())


def every_family(
    variants: Mapping[str, Any], *, hf_only: bool = False, **tiny_fields: Any
) -> dict[str, Any]:
    """``variants`` (name -> model config) and, for each registered family that none of them
    is of, its tiny example (`models.registry.tiny_config` with ``tiny_fields``): a test
    parametrized by the result covers a new family with no edit to the test. ``hf_only``
    keeps to the families that have a Hugging Face mapping."""
    covered = {type(config) for config in variants.values()}
    added = {
        name: tiny_config(name, **tiny_fields)
        for name, family in families().items()
        if family.config_class not in covered and (family.hf is not None or not hf_only)
    }
    return {**variants, **added}
