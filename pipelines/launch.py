"""Start a run as several cooperating local processes on one global mesh.

    python -m pipelines.launch --processes N CONFIG.toml [pipelines.run arguments ...]
    python -m pipelines.launch --processes N --module pipelines.export RUN_DIR --out DIR ...

Each process runs ``python -m pipelines.run CONFIG ...`` (or the ``--module`` given) with
the environment that
`eqxzoo.runtime` reads (``EQXZOO_NUM_PROCESSES``, ``EQXZOO_PROCESS_ID`` and
``JAX_COORDINATOR_ADDRESS`` on a free loopback port; everything binds to 127.0.0.1 only),
calls `jax.distributed.initialize` and simulates its share of the mesh's devices on the CPU
(gloo collectives). Only process 0 prints progress and writes metrics. The launcher
forwards SIGINT/SIGTERM to every process, and when one process fails it gives the others
``--grace`` seconds to notice (they exit on their own, naming the lost peer) before it
stops them; its exit code is the first failure's.

On a cluster, start ``python -m pipelines.run`` once per host under SLURM (``srun``) or any
launcher that sets JAX's distributed environment; see README.
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

from eqxzoo.allocator import rerun_with_huge_pages
from eqxzoo.errors import run_command
from eqxzoo.runtime import HEARTBEAT_ENV, LOOPBACK, NUM_PROCESSES_ENV, PROCESS_ID_ENV

MODULES = ("pipelines.run", "pipelines.export")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


def process_environment(index: int, count: int, port: int) -> dict[str, str]:
    """The environment of local process ``index`` of ``count``."""
    address = f"{LOOPBACK}:{port}"
    return os.environ | {
        NUM_PROCESSES_ENV: str(count),
        PROCESS_ID_ENV: str(index),
        "JAX_COORDINATOR_ADDRESS": address,
        "JAX_COORDINATOR_BIND_ADDRESS": address,
    }


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m pipelines.launch", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--processes", type=int, required=True, help="local processes to start")
    parser.add_argument(
        "--grace",
        type=float,
        default=60.0,
        help="seconds the others get to exit after one process fails (default 60)",
    )
    parser.add_argument(
        "--heartbeat",
        type=int,
        default=30,
        help="seconds without a heartbeat before JAX declares a process lost (default 30)",
    )
    parser.add_argument(
        "--module",
        choices=MODULES,
        default=MODULES[0],
        help="the command every process runs (default pipelines.run)",
    )
    args, run_args = parser.parse_known_args(argv)
    if args.processes < 1:
        parser.error(f"--processes must be >= 1, got {args.processes}")
    if not run_args:
        parser.error(f"give the arguments of {args.module} after the options")
    return args, run_args


def main(argv: list[str] | None = None) -> int:
    args, run_args = parse_args(argv)
    return run_command(lambda: launch(args, run_args))


def launch(args: argparse.Namespace, run_args: list[str]) -> int:
    port = free_port()
    command = [sys.executable, "-m", args.module, *run_args]
    processes = []
    for index in range(args.processes):
        env = process_environment(index, args.processes, port) | {
            HEARTBEAT_ENV: str(args.heartbeat)
        }
        processes.append(subprocess.Popen(command, env=env))

    def forward(signum, frame):
        for process in processes:
            if process.poll() is None:
                process.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)

    first_failure: tuple[int, int] | None = None
    failed_at = None
    while any(process.poll() is None for process in processes):
        for index, process in enumerate(processes):
            code = process.poll()
            if code not in (None, 0) and first_failure is None:
                first_failure, failed_at = (index, code), time.monotonic()
                print(
                    f"launch: process {index} exited with code {code}; the others get "
                    f"{args.grace:.0f} s to stop",
                    file=sys.stderr,
                    flush=True,
                )
        if failed_at is not None and time.monotonic() - failed_at > args.grace:
            for process in processes:
                if process.poll() is None:
                    process.kill()
        time.sleep(0.2)
    if first_failure is None:
        codes = [process.returncode for process in processes]
        return next((code for code in codes if code), 0)
    index, code = first_failure
    print(
        f"launch: the run failed: process {index} was lost first ({describe_exit(code)}); "
        + ", ".join(f"process {i}: {describe_exit(p.returncode)}" for i, p in enumerate(processes)),
        file=sys.stderr,
        flush=True,
    )
    return code if code > 0 else 1


def describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


if __name__ == "__main__":
    # Once here, so that the processes it starts inherit the allocator and none re-runs.
    rerun_with_huge_pages("pipelines.launch")
    sys.exit(main())
