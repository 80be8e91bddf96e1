"""Helpers for the end-to-end tests of `python -m pipelines.run`: `configs/tiny.toml` shrunk
by ``--set`` overrides, run as subprocesses (each with its own 8 simulated CPU devices)
sharing one compilation cache (conftest's ``cache_dir``; its ``reference`` is an
uninterrupted run of 6 steps).
"""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import compiling

from eqxzoo.train.report import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.toml")
SMALL = (
    "model.d_model=32",
    "model.moe.expert_mlp_dim=32",
    "model.moe.shared_mlp_dim=32",
    "data.seq_len=32",
    "data.batch_size=4",
    "pipeline.microbatches=2",
    "run.steps=6",
    "optimizer.warmup_steps=2",
    "run.eval_every=3",
    "run.eval_batches=1",
    "run.log_every=1",
    "run.tensorboard=false",
    "run.plot=false",
    "checkpoint.every=2",
    "checkpoint.keep=2",
)
GPIPE = ("pipeline.schedule=gpipe", "pipeline.repeats=1")


def command(
    run_dir: Path, cache_dir: Path, overrides=(), extra=(), config: str | Path = TINY
) -> list[str]:
    sets = [f"run.compilation_cache_dir={cache_dir}", *SMALL, *overrides]
    args = [sys.executable, "-m", "pipelines.run", str(config), "--run-dir", str(run_dir)]
    return args + [part for item in sets for part in ("--set", item)] + list(extra)


def environment() -> dict[str, str]:
    return compiling.environment(dict(os.environ))


def run_command(args: list[str], expect: int = 0) -> subprocess.CompletedProcess:
    """Run ``args`` to the end; its exit code must be ``expect``."""
    result = subprocess.run(
        args, env=environment(), cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == expect, result.stderr[-3000:]
    return result


def run(
    run_dir: Path, cache_dir: Path, overrides=(), extra=(), expect: int = 0, config=TINY
) -> subprocess.CompletedProcess:
    return run_command(command(run_dir, cache_dir, overrides, extra, config), expect)


def records(run_dir: Path) -> list[dict]:
    """The run's ``metrics.jsonl`` records (none before its first line is written)."""
    return read_metrics(run_dir / "metrics.jsonl")


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in records(run_dir) if "loss" in r]


def spawn(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``args`` with stdout and stderr going to ``log`` (a pipe nobody reads while the
    test waits could fill up and stall the run)."""
    with open(log, "w") as out:
        return subprocess.Popen(
            args, env=env or environment(), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
        )


def wait_for_step(run_dir: Path, step: int, processes: list[subprocess.Popen], log: Path):
    deadline = time.monotonic() + 600
    while not any(r.get("step", 0) >= step for r in records(run_dir)):
        for process in processes:
            assert process.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)


def start_and_signal(run_dir: Path, cache_dir: Path, after_step: int, signum: int):
    """Start a run, send ``signum`` once step ``after_step`` is logged; its exit code and output."""
    log = run_dir.parent / f"{run_dir.name}.log"
    process = spawn(command(run_dir, cache_dir), log)
    try:
        wait_for_step(run_dir, after_step, [process], log)
        process.send_signal(signum)
        process.wait(timeout=600)
    finally:
        process.kill()
    return process.returncode, log.read_text()


def stopped_copy(run_dir: Path, destination: Path, *, last_step: int) -> Path:
    """A copy of a finished run's directory with its checkpoints after ``last_step`` removed:
    the run as if it had been stopped there (its resume rewrites the later metrics), so a
    test resumes a shared run instead of training its own first steps."""
    shutil.copytree(run_dir, destination, ignore=shutil.ignore_patterns("profile"))
    for step in (destination / "checkpoints").iterdir():
        if int(step.name) > last_step:
            shutil.rmtree(step)
    return destination


def reference_losses(reference: list[dict]) -> list[float]:
    """The losses of the conftest ``reference`` run's records."""
    return [r["loss"] for r in reference if "loss" in r]


def launch(args: list[str], log: Path) -> subprocess.Popen:
    """Start ``python -m pipelines.launch ARGS`` (its processes simulate their own devices)."""
    return spawn(
        [sys.executable, "-m", "pipelines.launch", *args],
        log,
        env=environment(),
    )


def child_pids(parent: int) -> list[int]:
    listing = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True)
    return [int(pid) for pid in listing.stdout.split()]


def kill_all(pids: list[int]) -> None:
    """SIGKILL whichever of ``pids`` are still alive (a test's clean-up)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
