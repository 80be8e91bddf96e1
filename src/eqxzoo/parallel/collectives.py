"""What a compiled program communicates: its collectives, counted and sized from the HLO.

`collective_traffic` reads the optimized HLO text of a compiled step (``compiled.as_text()``)
and returns, for each kind of collective, how many run per execution of the program and the
bytes of the buffers they exchange. Collectives inside a ``while`` loop count once per
iteration (XLA's ``known_trip_count``); of a ``conditional``'s branches the costliest counts
(a device runs one branch per visit). A collective's bytes are those of its larger side, the
whole buffer (the gathered result of an all-gather, the operand of a reduce-scatter, the
reduced buffer of an all-reduce): a measure to compare programs by, not wire bytes, which
depend on the algorithm and the topology.
"""

import dataclasses
import re
from collections.abc import Mapping

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
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLED = re.compile(r"\b(?:body|to_apply|calls)=%?([\w.\-]+)")
_BRANCHES = re.compile(
    r"(?:branch_computations=\{([^}]*)\}|(?:true|false)_computation=%?([\w.\-]+))"
)


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Collectives of one kind per execution: how many, and the bytes of their buffers."""

    count: int = 0
    bytes: int = 0

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


def collective_traffic(hlo_text: str) -> dict[str, Traffic]:
    """``{kind: Traffic}`` of the program ``hlo_text`` (optimized HLO), for every kind in
    `COLLECTIVES` that it runs."""
    computations, entry = _parse(hlo_text)
    memo: dict[str, dict[str, Traffic]] = {}

    def add(into: dict[str, Traffic], part: Mapping[str, Traffic], times: int = 1) -> None:
        for kind, traffic in part.items():
            into[kind] = into.get(kind, Traffic()) + traffic * times

    def traffic_of(name: str) -> dict[str, Traffic]:
        if name in memo:
            return memo[name]
        memo[name] = {}
        total: dict[str, Traffic] = {}
        for line in computations.get(name, ()):
            instruction = _INSTRUCTION.match(line)
            if instruction is None:
                continue
            result, opcode, rest = instruction.groups()
            kind = _kind(opcode)
            if kind is not None:
                operands = rest.split("), ")[0]
                size = max(_shape_bytes(result), _shape_bytes(operands))
                add(total, {kind: Traffic(1, size)})
                continue
            branches = _BRANCHES.findall(rest)
            if opcode == "conditional" and branches:
                names = [
                    branch.strip().lstrip("%")
                    for listed, single in branches
                    for branch in (listed.split(",") if listed else [single])
                ]
                costliest = max(
                    (traffic_of(branch) for branch in names),
                    key=lambda t: sum(x.bytes for x in t.values()),
                )
                add(total, costliest)
                continue
            trip = _TRIP_COUNT.search(rest)
            times = int(trip.group(1)) if opcode == "while" and trip else 1
            for called in _CALLED.findall(rest):
                add(total, traffic_of(called), times)
        memo[name] = total
        return total

    return traffic_of(entry)


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
