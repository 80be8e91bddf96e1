"""Will the run fit? The compiled step's memory against what the machine has, before step 1.

A compiled step knows, per device, the bytes of its arguments, outputs and temporaries
(XLA's memory analysis; donated arguments are counted once). Devices that share a memory
share the bill:

- **CPU devices** (simulated or not) all live in the host's RAM: the need is the sum over
  the host's devices (this process's, times the processes on the same host), plus the
  host-side buffers (read-ahead batches, the checkpoint writer's staging). The availability
  is the host's available RAM (``MemAvailable``, capped by the cgroup's limit).
- **Accelerators** each have their own memory: each device's need against what its
  allocator can still hand out; the host-side buffers are checked against the host's RAM.

The figures are an estimate on the safe side (replicated state counted on every device
that holds it, the host buffers at their largest), meant to refuse a plan that cannot fit
rather than to promise that one will. A plan that does not fit is refused with one line: the
need, the availability and what to change.
"""

import dataclasses
import socket
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from eqxzoo.errors import UserError
from eqxzoo.train.checkpoint import SYNC_SAVE_GB

MEMINFO = Path("/proc/meminfo")
CGROUP_FILES = (  # (limit, usage, stat) of this cgroup: v2, then v1
    ("memory.max", "memory.current", "memory.stat", "inactive_file"),
    (
        "memory/memory.limit_in_bytes",
        "memory/memory.usage_in_bytes",
        "memory/memory.stat",
        "total_inactive_file",
    ),
)
CGROUP_ROOT = Path("/sys/fs/cgroup")
GIB = 2**30


class PlanDoesNotFit(UserError, MemoryError):
    """The compiled step needs more memory than the machine has."""


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """The compiled step's memory per device, from XLA's memory analysis (bytes)."""

    arguments: int
    outputs: int
    donated: int
    temporaries: int

    @property
    def total(self) -> int:
        return self.arguments + self.outputs - self.donated + self.temporaries

    @classmethod
    def of(cls, compiled: jax.stages.Compiled) -> "StepMemory | None":
        analysis = compiled.memory_analysis()
        if analysis is None:
            return None
        return cls(
            arguments=analysis.argument_size_in_bytes,
            outputs=analysis.output_size_in_bytes,
            donated=analysis.alias_size_in_bytes,
            temporaries=analysis.temp_size_in_bytes,
        )

    def describe(self) -> str:
        return (
            f"{format_bytes(self.total)} = arguments {format_bytes(self.arguments)} + outputs "
            f"{format_bytes(self.outputs)} - donated {format_bytes(self.donated)} + temporaries "
            f"{format_bytes(self.temporaries)}"
        )


@dataclasses.dataclass(frozen=True)
class MemoryCheck:
    """One memory (``where``) and the bytes the run needs of it and has in it."""

    where: str
    need: int
    available: int
    breakdown: str

    @property
    def fits(self) -> bool:
        return self.need <= self.available

    def __str__(self) -> str:
        verdict = "fits" if self.fits else "does not fit"
        return (
            f"{self.where}: needs {format_bytes(self.need)} ({self.breakdown}), {format_bytes(self.available)} "
            f"available: {verdict}"
        )


def format_bytes(count: int | float) -> str:
    """``512 B``, ``1.5 KiB``, ... ``348.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    raise AssertionError


def host_memory_available() -> int:
    """Bytes of RAM this host can still give: ``MemAvailable``, capped by the room left under
    the cgroup's limit (its usage less the page cache it may drop, ``inactive_file``)."""
    fields = dict(line.split(":", 1) for line in MEMINFO.read_text().splitlines())
    available = int(fields["MemAvailable"].split()[0]) * 1024
    for limit_file, usage_file, stat_file, reclaimable in CGROUP_FILES:
        try:
            limit = (CGROUP_ROOT / limit_file).read_text().strip()
            usage = int((CGROUP_ROOT / usage_file).read_text())
            stat = dict(line.split() for line in (CGROUP_ROOT / stat_file).read_text().splitlines())
        except (OSError, ValueError):
            continue
        if limit.isdigit():
            usage -= int(stat.get(reclaimable, 0))
            available = min(available, int(limit) - usage)
        break
    return available


def processes_on_this_host() -> int:
    """How many processes of this run share this host (and its RAM)."""
    if jax.process_count() == 1:
        return 1
    name = np.frombuffer(socket.gethostname().encode()[:64].ljust(64), dtype=np.uint8)
    names = np.asarray(multihost_utils.process_allgather(name))
    return int(np.sum(np.all(names == name, axis=-1)))


def memory_checks(
    step: StepMemory, devices: list[jax.Device], *, host_buffers: int
) -> list[MemoryCheck]:
    """What the run needs of each memory it uses, against what that memory has.

    ``devices`` are this process's devices; ``host_buffers`` the bytes this process holds
    on the host besides the devices' memory.
    """
    processes = processes_on_this_host()
    if devices[0].platform == "cpu":
        count = len(devices) * processes
        need = count * step.total + processes * host_buffers
        breakdown = (
            f"{count} devices x {format_bytes(step.total)} + host buffers "
            f"{format_bytes(processes * host_buffers)}"
        )
        return [MemoryCheck("host RAM", need, host_memory_available(), breakdown)]
    checks = [
        MemoryCheck(
            "host RAM",
            processes * host_buffers,
            host_memory_available(),
            f"host buffers of {processes} processes",
        )
    ]
    for device in devices:
        where, available = memory_available(device)
        if available is not None:
            checks.append(MemoryCheck(where, step.total, available, "the compiled step"))
    return checks


def memory_available(device: jax.Device) -> tuple[str, int | None]:
    """The memory ``device``'s arrays live in and the bytes it can still give: the host's RAM
    for a CPU device, else what the device's allocator has left (None where it does not say)."""
    if device.platform == "cpu":
        return "host RAM", host_memory_available()
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return str(device), None
    return str(device), stats["bytes_limit"] - stats.get("bytes_in_use", 0)


def check_fits(checks: list[MemoryCheck], step: StepMemory, *, remat_stages: bool) -> None:
    """Raise `PlanDoesNotFit` naming the first memory that is too small and what to change."""
    for check in checks:
        if check.fits:
            continue
        if step.temporaries >= step.arguments:
            remat = "" if remat_stages else ", or set pipeline.remat_stages = true"
            advice = (
                "activations dominate: lower data.batch_size, data.seq_len or "
                f"pipeline.microbatches{remat}"
            )
        else:
            advice = (
                "the parameters and optimizer state dominate: shard them over more devices "
                "(mesh.pp, mesh.tp, mesh.ep) or train a smaller model"
            )
        raise PlanDoesNotFit(
            f"this plan does not fit: {check}; per device the step takes {step.describe()}; "
            f"{advice} (python -m pipelines.run CONFIG --dry-run shows the plan)"
        )


def host_buffer_bytes(
    step: StepMemory, devices: int, *, batch_tokens: int, prefetch: int, async_save: bool
) -> int:
    """Bytes a process holds on the host besides its devices' memory: the batches read ahead
    (tokens and targets, int32) and the checkpoint writer's staging copy of the state (all
    of it for an asynchronous save, at most ``SYNC_SAVE_GB`` at a time for a synchronous one)."""
    batches = (prefetch + 1) * 2 * batch_tokens * np.dtype(np.int32).itemsize
    state = step.arguments * devices
    return batches + (state if async_save else min(state, SYNC_SAVE_GB * GIB))
