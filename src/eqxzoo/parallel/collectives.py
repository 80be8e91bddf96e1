"""What a compiled program communicates: its collectives, counted and sized from the HLO.

`collective_traffic` reads the optimized HLO text of a compiled step (``compiled.as_text()``)
and returns, for each kind of collective, how many run per execution of the program and the
bytes of the buffers they exchange. Collectives inside a ``while`` loop count once per
iteration (XLA's ``known_trip_count``); of a ``conditional``'s branches the costliest counts
(a device runs one branch per visit). A collective's bytes are those of its larger side, the
whole buffer (the gathered result of an all-gather, the operand of a reduce-scatter, the
reduced buffer of an all-reduce): a measure to compare programs by, not wire bytes, which
depend on the algorithm and the topology.

`links` splits the same traffic by where it runs: for each collective, the mesh axes its
device groups span (read from ``replica_groups`` or ``source_target_pairs``: SPMD programs
name devices by their position in the mesh) and whether a group spans several slices
(`eqxzoo.parallel.MeshConfig.slice_indices`), which puts its bytes on the slow network.

`matmul_flops` counts the program's ``dot`` FLOPs the same way (each loop iteration, a
conditional's dearest branch): what it computes, beside what it communicates, which XLA's
``cost_analysis()`` undercounts by a loop's trip count. Given how often the branches of some
conditionals run (``branch_runs``: a pipeline's actions, which a tick runs only where its
table names them), it counts those branches so instead: what the devices run on average.
"""

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import numpy as np

COLLECTIVES = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
)
_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (.+?) ([a-z][\w\-]*)\((.*)$")
_SHAPE = re.compile(r"\b(pred|[su](?:8|16|32|64)|bf16|f(?:16|32|64))\[([\d,]*)\]")
_DEFINED = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_LOOP_SCOPE = re.compile(r'op_name="[^"]*/(\w+)/while"')
_CALLED = re.compile(r"\b(?:body|to_apply|calls)=%?([\w.\-]+)")
_BRANCHES = re.compile(
    r"(?:branch_computations=\{([^}]*)\}|(?:true|false)_computation=%?([\w.\-]+))"
)
_GROUP_LIST = re.compile(r"(?:replica_groups|source_target_pairs)=\{((?:\{[\d,]*\},?)*)\}")
_GROUP_MESH = re.compile(
    r"replica_groups=mesh\[([^\]]*)\]"
    r"(?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? \{([^}]*)\}"
)
_GROUP_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Collectives of one kind per execution: how many, and the bytes of their buffers."""

    count: int | float = 0
    bytes: int | float = 0

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(self.count + other.count, self.bytes + other.bytes)

    def __mul__(self, times: int) -> "Traffic":
        return Traffic(self.count * times, self.bytes * times)


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        elements = 1
        for dim in filter(None, dims.split(",")):
            elements *= int(dim)
        total += elements * _BYTES[dtype]
    return total


def _kind(opcode: str) -> str | None:
    base = opcode.removesuffix("-start")
    return base if base in COLLECTIVES else None


def _parse(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    computations: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header and "=" not in line.split("{")[0].split("(")[0]:
            current = header.group(1)
            computations[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif current is not None and line.strip() == "}":
            current = None
        elif current is not None:
            computations[current].append(line)
    return computations, entry


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction: its kind, the bytes of its buffer, how many times one
    execution of the program runs it, and its instruction text (its device groups)."""

    kind: str
    bytes: int
    times: int | float
    text: str


Picked = TypeVar("Picked")
# How many times each branch of a conditional runs per visit, from its instruction's line
# (None: the costliest branch once).
BranchRuns = Callable[[str], Sequence[float] | None]


def _counted(
    hlo_text: str,
    pick: Callable[[str, str, str, str, Mapping[str, str]], Picked | None],
    weight: Callable[[Picked], float],
    branch_runs: BranchRuns | None = None,
    loop_trips: Mapping[str, float] | None = None,
) -> list[tuple[Picked, int | float]]:
    """What ``pick(line, result, opcode, rest, results)`` keeps of the instructions of the
    program ``hlo_text`` (optimized HLO) that one execution runs, each with how many times
    it runs: a ``while`` body's by its known trip count (one whose length is data, by
    ``loop_trips`` of the named scope it was made in, else once), a ``conditional``'s
    branches as ``branch_runs`` says, else its costliest branch's (by the ``weight`` of what
    it runs) once. ``results`` maps the names of the instructions of the same computation
    to their result shapes."""
    computations, entry = _parse(hlo_text)
    memo: dict[str, list[tuple[Picked, int | float]]] = {}

    def counted_in(name: str) -> list[tuple[Picked, int | float]]:
        if name in memo:
            return memo[name]
        memo[name] = []
        lines = computations.get(name, ())
        results = {}
        for line in lines:
            defined = _DEFINED.match(line)
            if defined:
                results[defined.group(1)] = defined.group(2)
        found: list[tuple[Picked, int | float]] = []
        for line in lines:
            instruction = _INSTRUCTION.match(line)
            if instruction is None:
                continue
            result, opcode, rest = instruction.groups()
            picked = pick(line, result, opcode, rest, results)
            if picked is not None:
                found.append((picked, 1))
                continue
            branches = _BRANCHES.findall(rest)
            if opcode == "conditional" and branches:
                names = [
                    branch.strip().lstrip("%")
                    for listed, single in branches
                    for branch in (listed.split(",") if listed else [single])
                ]
                runs = branch_runs(line) if branch_runs is not None else None
                if runs is not None:
                    for branch, run in zip(names, runs, strict=True):
                        found.extend((item, times * run) for item, times in counted_in(branch))
                    continue
                found.extend(
                    max(
                        (counted_in(branch) for branch in names),
                        key=lambda run: sum(weight(item) * times for item, times in run),
                    )
                )
                continue
            repeats: int | float = 1
            if opcode == "while":
                trip, scope = _TRIP_COUNT.search(rest), _LOOP_SCOPE.search(rest)
                if trip:
                    repeats = int(trip.group(1))
                elif scope and loop_trips and scope.group(1) in loop_trips:
                    repeats = loop_trips[scope.group(1)]
            for called in _CALLED.findall(rest):
                found.extend((item, times * repeats) for item, times in counted_in(called))
        memo[name] = found
        return found

    return counted_in(entry)


def collectives(hlo_text: str, branch_runs: BranchRuns | None = None) -> list[Collective]:
    """Every collective the program ``hlo_text`` (optimized HLO) runs, with how many times:
    a ``while`` body's by its known trip count, a ``conditional``'s branches as
    ``branch_runs`` says, else its costliest branch's once."""

    def pick(line: str, result: str, opcode: str, rest: str, _) -> Collective | None:
        kind = _kind(opcode)
        if kind is None:
            return None
        operands = rest.split("), ")[0]
        return Collective(kind, max(_shape_bytes(result), _shape_bytes(operands)), 1, line)

    return [
        dataclasses.replace(c, times=times)
        for c, times in _counted(hlo_text, pick, lambda c: c.bytes, branch_runs)
    ]


def _dims(shape: str) -> list[int]:
    found = _SHAPE.search(shape)
    return [int(d) for d in found.group(2).split(",") if d] if found else []


def matmul_flops(
    hlo_text: str,
    branch_runs: BranchRuns | None = None,
    loop_trips: Mapping[str, float] | None = None,
) -> float:
    """The FLOPs of the ``dot`` instructions the program ``hlo_text`` (optimized HLO) runs,
    ``2 x`` the result's elements ``x`` the contracted size each, counted as `collectives`
    counts (a loop's body each iteration, a conditional's dearest branch once, or its
    branches as ``branch_runs`` says) and a loop of data-dependent length (the blockwise
    attention's: `eqxzoo.nn.blockwise.LOOP_SCOPES`) as often as ``loop_trips`` (by the
    named scope it was made in) says it runs, else once: XLA's own cost analysis counts a
    loop's body once, whatever its trip count."""

    def pick(line: str, result: str, opcode: str, rest: str, results) -> float | None:
        if opcode != "dot":
            return None
        first = rest.split(",")[0].strip()
        lhs = first if _SHAPE.search(first) else results.get(first.split()[-1].lstrip("%"), "")
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
        lhs_dims = _dims(lhs)
        contracted = (
            math.prod(lhs_dims[int(d)] for d in contracting.group(1).split(",") if d)
            if contracting
            else 1
        )
        return 2.0 * math.prod(_dims(result)) * contracted

    counted = _counted(hlo_text, pick, lambda f: f, branch_runs, loop_trips)
    return sum(flops * times for flops, times in counted)


def collective_traffic(hlo_text: str) -> dict[str, Traffic]:
    """``{kind: Traffic}`` of the program ``hlo_text`` (optimized HLO), for every kind in
    `COLLECTIVES` that it runs."""
    total: dict[str, Traffic] = {}
    for c in collectives(hlo_text):
        total[c.kind] = total.get(c.kind, Traffic()) + Traffic(c.times, c.bytes * c.times)
    return total


def device_groups(text: str, devices: int) -> list[list[int]]:
    """The device groups of one collective instruction: its replica groups (explicit, XLA's
    iota form ``[groups,size]<=[dims]T(perm)``, or its mesh form ``mesh['axis_0'=4,...],
    device_ids=([dims]T(perm)) {'axis_0'}``: the devices along the braced axes of that
    mesh), or its permute's source-target pairs; all ``devices`` in one group where it
    lists none."""
    on_mesh = _GROUP_MESH.search(text)
    if on_mesh:
        axes, dims, perm, over = on_mesh.groups()
        sizes = [(name, int(size)) for name, size in re.findall(r"'(\w+)'=(\d+)", axes)]
        shape = [size for _, size in sizes]
        ids = np.arange(int(np.prod(shape)))
        if dims:
            ids = ids.reshape([int(x) for x in dims.split(",")])
            if perm:
                ids = ids.transpose([int(x) for x in perm.split(",")])
        ids = ids.reshape(shape)
        grouped = [i for i, (name, _) in enumerate(sizes) if f"'{name}'" in over]
        kept = [i for i in range(len(shape)) if i not in grouped]
        group_size = int(np.prod([shape[i] for i in grouped]))
        return ids.transpose(kept + grouped).reshape(-1, group_size).tolist()
    iota = _GROUP_IOTA.search(text)
    if iota:
        shape, dims, perm = (
            [int(x) for x in part.split(",")] if part else None for part in iota.groups()
        )
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if perm is not None:
            ids = ids.transpose(perm)
        return ids.reshape(shape).tolist()
    listed = _GROUP_LIST.search(text)
    if listed and listed.group(1):
        return [
            [int(x) for x in group.split(",") if x]
            for group in re.findall(r"\{([\d,]*)\}", listed.group(1))
        ]
    return [list(range(devices))]


@dataclasses.dataclass(frozen=True)
class Link:
    """Where collectives run: over which mesh axes, and whether across slices."""

    kind: str
    axes: tuple[str, ...]
    across_slices: bool

    def describe(self) -> str:
        """``all-reduce over dp_dcn x dp_ici``."""
        return f"{self.kind} over {' x '.join(self.axes) or 'none'}"


def links(
    hlo_text: str,
    axis_names: tuple[str, ...],
    slice_indices: np.ndarray,
    branch_runs: BranchRuns | None = None,
) -> dict[Link, Traffic]:
    """`collective_traffic` of the SPMD program ``hlo_text`` by `Link`: for each collective,
    the mesh axes (of a mesh with ``axis_names`` and the shape of ``slice_indices``, each
    device's slice) along which its groups' devices differ, and whether a group holds
    devices of two slices; conditionals counted as `collectives` counts them."""
    shape = slice_indices.shape
    slice_of = slice_indices.reshape(-1)
    total: dict[Link, Traffic] = {}
    for c in collectives(hlo_text, branch_runs):
        groups = device_groups(c.text, slice_of.size)
        coordinates = [np.stack(np.unravel_index(group, shape)) for group in groups if group]
        axes = tuple(
            name
            for index, name in enumerate(axis_names)
            if any(len(set(coords[index])) > 1 for coords in coordinates)
        )
        across = any(len(set(slice_of[group])) > 1 for group in groups if group)
        link = Link(c.kind, axes, across)
        total[link] = total.get(link, Traffic()) + Traffic(c.times, c.bytes * c.times)
    return total


_OP_NAME = re.compile(r'op_name="([^"]*)"')


def permutes_in_branches(hlo_text: str) -> list[str]:
    """The collective-permutes of the program ``hlo_text`` (optimized HLO) that run inside a
    ``conditional``'s branch, by their ``op_name`` (the JAX source path; the instruction's
    name where it has none).

    XLA:CPU runs a collective-permute as a rendezvous of every device of the program: one
    that devices reach only in some branch (a pipeline stage busy while another idles in a
    bubble) waits for devices that never come, and the program aborts.
    """
    computations, entry = _parse(hlo_text)
    in_branch: set[str] = set()

    def visit(name: str, inside: bool, seen: set[tuple[str, bool]]) -> None:
        if (name, inside) in seen:
            return
        seen.add((name, inside))
        if inside:
            in_branch.add(name)
        for line in computations.get(name, ()):
            instruction = _INSTRUCTION.match(line)
            if instruction is None:
                continue
            _, opcode, rest = instruction.groups()
            for listed, single in _BRANCHES.findall(rest) if opcode == "conditional" else ():
                for branch in listed.split(",") if listed else [single]:
                    visit(branch.strip().lstrip("%"), True, seen)
            for called in _CALLED.findall(rest):
                visit(called, inside, seen)

    visit(entry, False, set())
    found = []
    for name in sorted(in_branch):
        for line in computations[name]:
            instruction = _INSTRUCTION.match(line)
            if instruction and _kind(instruction.group(2)) == "collective-permute":
                op_name = _OP_NAME.search(line)
                found.append(op_name.group(1) if op_name else line.split("=")[0].strip())
    return found


def traffic_table(traffic: Mapping[str, Traffic]) -> str:
    """``kind: count x, bytes`` lines, one per kind, and a total."""
    lines = [
        f"{kind}: {t.count} ops, {t.bytes / 2**20:.2f} MiB" for kind, t in sorted(traffic.items())
    ]
    total = sum(t.bytes for t in traffic.values())
    return "\n".join([*lines, f"total: {total / 2**20:.2f} MiB"])
