"""Process start-up for a run, before the first JAX computation: the persistent compilation
cache, joining a multi-process run (`jax.distributed.initialize`), and simulated CPU devices
when there is no accelerator."""

import functools
import os
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from eqxzoo.errors import UserError

# Set by `pipelines.launch` for each local process it starts.
NUM_PROCESSES_ENV = "EQXZOO_NUM_PROCESSES"
PROCESS_ID_ENV = "EQXZOO_PROCESS_ID"
HEARTBEAT_ENV = "EQXZOO_HEARTBEAT_SECONDS"
LOOPBACK = "127.0.0.1"
CLUSTER_ENVS = ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


class RuntimeSetupError(UserError, RuntimeError):
    """The process could not join its run (bad launcher environment, coordinator unreachable)."""


def enable_compilation_cache(directory: str) -> Path | None:
    """JAX's persistent compilation cache in ``directory`` ("" disables it): a rerun of the
    same config loads its executables instead of compiling them."""
    if not directory:
        return None
    path = Path(directory).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path


def _launched_processes() -> tuple[int, int] | None:
    """``(process id, process count)`` from `pipelines.launch`'s environment, if set."""
    if NUM_PROCESSES_ENV not in os.environ:
        return None
    try:
        count = int(os.environ[NUM_PROCESSES_ENV])
        index = int(os.environ[PROCESS_ID_ENV])
    except (KeyError, ValueError):
        raise RuntimeSetupError(
            f"{NUM_PROCESSES_ENV} is set, so {PROCESS_ID_ENV} must be an integer too"
        ) from None
    return index, count


def _cluster_processes() -> bool:
    """Whether a cluster launcher started several processes (JAX auto-detects the rest)."""
    if "JAX_COORDINATOR_ADDRESS" in os.environ:
        return True
    return any(int(os.environ.get(name, "1") or 1) > 1 for name in CLUSTER_ENVS[1:])


def _gloo_on_loopback() -> None:
    """Local processes (`pipelines.launch`) talk over 127.0.0.1 only: JAX creates gloo's TCP
    transport without a host name, which would listen on the machine's external address."""
    from jax._src import xla_bridge

    make_collectives = xla_bridge._jax.make_gloo_tcp_collectives
    if not isinstance(make_collectives, functools.partial):
        xla_bridge._jax.make_gloo_tcp_collectives = functools.partial(
            make_collectives, hostname=LOOPBACK
        )


def join_processes() -> int:
    """Join the other processes of the run, if any; the number of processes."""
    launched = _launched_processes()
    if launched is None and not _cluster_processes():
        return 1
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if launched is not None:
        _gloo_on_loopback()
    heartbeat = int(os.environ.get(HEARTBEAT_ENV, "100"))
    try:
        if launched is None:
            jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat)
        else:
            index, count = launched
            jax.distributed.initialize(
                num_processes=count,
                process_id=index,
                heartbeat_timeout_seconds=heartbeat,
                initialization_timeout=120,
            )
    except (RuntimeError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        raise RuntimeSetupError(f"cannot join the run's processes: {first_line}") from None
    from jax._src import distributed

    return distributed.global_state.num_processes  # jax.process_count() would start backends


def setup_runtime(*, compilation_cache_dir: str, devices: int) -> None:
    """Everything that must happen before the first JAX computation of a run whose mesh
    spans ``devices`` devices (`eqxzoo.run.config.devices_needed`)."""
    use_cpu_flags(FAST_CPU_FLAGS | MEMORY_MINIMIZING_CPU_FLAGS)
    enable_compilation_cache(compilation_cache_dir)
    processes = join_processes()
    local_devices = max(1, devices // processes)
    use_collective_threads(local_devices)
    if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # Only the CPU client reads this: on accelerators the mesh uses the real devices.
        jax.config.update("jax_num_cpu_devices", local_devices)


# XLA:CPU runs each collective on a thread of its client's pool, blocked until every device of
# the group has arrived. The pool holds max(cores, devices) threads, and the runtime starts
# independent collectives at once (a cp all-to-all beside a tp all-reduce): with more
# collectives under way than threads, the devices yet to arrive wait for a thread that none
# frees, a deadlock XLA aborts after 40 s ("Termination timeout for `all reduce ...`"). On 2
# cores it ended 3 of 4 runs of the context-parallel tests (cp4 x tp2). XLA counts the cores
# as NPROC where that is set.
COLLECTIVE_THREADS_PER_DEVICE = 4


def use_collective_threads(local_devices: int) -> None:
    """Give XLA:CPU's pool enough threads for the collectives of ``local_devices`` simulated
    devices (before the CPU client starts; an explicit ``NPROC`` is kept, one device has no
    collectives)."""
    if local_devices > 1:
        threads = max(os.cpu_count() or 1, COLLECTIVE_THREADS_PER_DEVICE * local_devices)
        os.environ.setdefault("NPROC", str(threads))


# XLA:CPU reads these only from XLA_FLAGS (not from per-jit compiler options), before the first
# compilation; other backends ignore them.
MEMORY_MINIMIZING_CPU_FLAGS = {
    # The default, concurrency-optimised scheduler starts independent work as early as it can:
    # zeroed gradient accumulators and optimizer-state copies are made before the forward pass
    # and live through it.
    "--xla_cpu_enable_concurrency_optimized_scheduler": "false",
    # Without region analysis, copy insertion cannot see that the in-place (donated) update
    # of Adam's moments may follow the parameter update that still reads them, and copies
    # every moment at the start of the step.
    "--xla_cpu_copy_insertion_use_region_analysis": "true",
}


# XLA:CPU's YNNPACK fusions, its default for dots and some reductions, ran the reference
# step's softmax reductions and its matmuls of transposed weights on one of the machine's
# threads: without them XLA's own kernels and Eigen's threaded matmuls make that step 13%
# faster (T 256), the same at T 1024 and 2048, at 10-25% more compile time.
FAST_CPU_FLAGS = {"--xla_cpu_experimental_ynn_fusion_type": ""}


def use_cpu_flags(cpu_flags: dict[str, str]) -> None:
    """Add ``cpu_flags`` to ``XLA_FLAGS`` before the first compilation: the memory-minimising
    ones because simulated devices share the host's memory (moe_1b on 8 simulated devices:
    4.3 -> 2.6 GiB per device, with the layout fixes), the fast ones for a long run's steps.
    An explicit setting in ``XLA_FLAGS`` is kept."""
    flags = os.environ.get("XLA_FLAGS", "")
    for flag, value in cpu_flags.items():
        if flag not in flags:
            flags = f"{flags} {flag}={value}"
    os.environ["XLA_FLAGS"] = flags.strip()


def lost_processes_message(error: BaseException) -> str:
    """One line for a failure in a multi-process run, naming the processes that are gone
    (asked of JAX's coordination service; if that is gone too, the coordinator was lost)."""
    from jax._src import distributed

    count = jax.process_count()
    client = distributed.global_state.client
    try:
        live = set(client.get_live_nodes(list(range(count))))
        lost = [index for index in range(count) if index not in live]
        peers = ", ".join(map(str, lost)) if lost else "none reported yet"
        who = f"lost process(es) {peers} of {count}"
    except Exception:  # noqa: BLE001 (the service lives in process 0)
        who = f"lost the coordinator (process 0 of {count})"
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
    return f"{who}; this is process {jax.process_index()}: {first_line[:300]}"


def on_every_process(ok: bool) -> bool:
    """True if ``ok`` holds on every process (all of them take the same branch)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.asarray(ok))))


def counts_of_every_process(counts: np.ndarray) -> np.ndarray:
    """``counts`` (non-negative integers below 2^64) of every process, stacked on a leading
    process axis, as Python integers. They travel as uint32 halves: JAX without x64 has no
    64-bit integers, and a byte count passes 2^31 at 2 GB."""
    counts = np.asarray(counts, dtype=object)
    halves = np.stack([counts % 2**32, counts // 2**32]).astype(np.uint32)
    if jax.process_count() > 1:
        halves = np.asarray(multihost_utils.process_allgather(halves))
    else:
        halves = halves[None]
    return halves[:, 0].astype(object) + (halves[:, 1].astype(object) << 32)
