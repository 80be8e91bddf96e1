"""`python -m pipelines.run` end to end: exact resume after SIGKILL/SIGTERM, resume on another
mesh, the same losses for pp = 1, 2, 4, non-finite stops, dry run, config errors.

Runs `configs/tiny.toml` shrunk by ``--set`` overrides, as subprocesses (each with its own 8
simulated CPU devices) sharing one compilation cache.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pipelines.run import main

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

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("compilation-cache")


def command(run_dir: Path, cache_dir: Path, overrides=(), extra=()) -> list[str]:
    sets = [f"run.compilation_cache_dir={cache_dir}", *SMALL, *overrides]
    args = [sys.executable, "-m", "pipelines.run", TINY, "--run-dir", str(run_dir)]
    return args + [part for item in sets for part in ("--set", item)] + list(extra)


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return env | {"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}


def run_command(args: list[str], expect: int = 0) -> subprocess.CompletedProcess:
    """Run ``args`` to the end; its exit code must be ``expect``."""
    result = subprocess.run(
        args, env=environment(), cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == expect, result.stderr[-3000:]
    return result


def run(
    run_dir: Path, cache_dir: Path, overrides=(), extra=(), expect: int = 0
) -> subprocess.CompletedProcess:
    return run_command(command(run_dir, cache_dir, overrides, extra), expect)


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


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


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    """An uninterrupted run of 6 steps, traced at steps 2..3."""
    run_dir = tmp_path_factory.mktemp("reference")
    result = run(run_dir, cache_dir, extra=("--profile", "2:3"))
    assert "done: steps 1..6" in result.stdout
    assert (run_dir / "config.toml").exists()
    assert list((run_dir / "profile").rglob("*.xplane.pb")), "the --profile trace"
    return run_dir


@pytest.fixture(scope="module")
def reference(reference_dir: Path) -> list[dict]:
    return records(reference_dir)


def test_reference_run_reports_every_step(reference: list[dict]):
    steps = [r for r in reference if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for name in ("loss", "grad_norm", "lr", "tokens_per_s", "skipped", "expert_load", "mfu"):
        assert all(name in r for r in steps), name
    assert [r["step"] for r in reference if "val_loss" in r] == [3, 6]


def test_sigkill_then_rerun_reproduces_the_losses_exactly(
    reference: list[dict], tmp_path: Path, cache_dir: Path
):
    kill_after = random.Random(os.getpid()).randint(3, 5)
    code, _ = start_and_signal(tmp_path / "run", cache_dir, kill_after, signal.SIGKILL)
    assert code == -signal.SIGKILL
    result = run(tmp_path / "run", cache_dir)
    assert "resumed from the checkpoint at step" in result.stdout
    assert losses(tmp_path / "run") == [r["loss"] for r in reference if "loss" in r]


def test_sigterm_saves_and_exits_cleanly_then_resumes_exactly(
    reference: list[dict], tmp_path: Path, cache_dir: Path
):
    code, output = start_and_signal(tmp_path / "run", cache_dir, 3, signal.SIGTERM)
    assert code == 0, output[-3000:]
    assert "stopped by a signal: checkpoint saved at step" in output
    run(tmp_path / "run", cache_dir)
    assert losses(tmp_path / "run") == [r["loss"] for r in reference if "loss" in r]


def test_resume_on_another_mesh(reference: list[dict], tmp_path: Path, cache_dir: Path):
    """Saved on dp2 x pp2 x tp2 (circular, R=2), resumed on dp4 x pp1 x tp2."""
    run(tmp_path, cache_dir, extra=("--steps", "4"))
    result = run(tmp_path, cache_dir, overrides=("mesh.dp=4", "mesh.pp=1"))
    assert "resumed from the checkpoint at step 4" in result.stdout
    expected = [r["loss"] for r in reference if "loss" in r]
    np.testing.assert_allclose(losses(tmp_path), expected, rtol=1e-5)


def test_pp_1_2_4_give_the_same_losses(reference: list[dict], tmp_path: Path, cache_dir: Path):
    """pp=2 is the reference run (circular, R=2); pp=1 and pp=4 run GPipe on the same batch."""
    expected = [r["loss"] for r in reference if "loss" in r][:4]
    for pp, tp in ((1, 2), (4, 1)):
        run_dir = tmp_path / f"pp{pp}"
        overrides = (*GPIPE, f"mesh.pp={pp}", f"mesh.tp={tp}", "run.eval_every=0")
        run(run_dir, cache_dir, overrides=overrides, extra=("--steps", "4"))
        np.testing.assert_allclose(losses(run_dir), expected, rtol=1e-5)


def test_non_finite_steps_are_skipped_then_the_run_stops(tmp_path: Path, cache_dir: Path):
    overrides = ("optimizer.learning_rate=1e30", "optimizer.warmup_steps=0", "run.max_nonfinite=2")
    result = run(tmp_path, cache_dir, overrides, expect=3)
    assert "error: stopped: 2 steps in a row (up to step" in result.stderr
    assert "had a non-finite loss or gradient and were skipped" in result.stderr
    skipped = [r["skipped"] for r in records(tmp_path) if "loss" in r]
    assert skipped[-2:] == [1, 1]


def test_dry_run_plans_without_training(tmp_path: Path, cache_dir: Path):
    result = run(tmp_path / "dry", cache_dir, extra=("--dry-run",))
    assert "total" in result.stdout and "active per token" in result.stdout
    assert "per-device memory of the compiled step" in result.stdout
    assert "blocks.layers.attention.wq" in result.stdout
    assert not (tmp_path / "dry" / "checkpoints").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "mesh.dp=two"], "error: mesh.dp: expected int, got 'two'"),
        (["--set", "model.bogus=1"], "error: model.bogus: unknown key"),
        (["--set", "nothing"], "error: --set 'nothing': expected section.key=value"),
    ],
)
def test_config_errors_exit_2_with_one_line(args, message, capsys):
    assert main([TINY, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message), err
    assert len(err.strip().splitlines()) == 1


def test_missing_config_file(capsys, tmp_path: Path):
    assert main([str(tmp_path / "nope.toml")]) == 2
    assert "nope.toml" in capsys.readouterr().err


def test_generate_samples_from_the_latest_checkpoint(reference_dir: Path):
    command = [sys.executable, "-m", "pipelines.generate", str(reference_dir)]
    options = ["--prompt", "def main(", "--max-new-tokens", "8", "--temperature", "0"]
    results = [run_command(command + options) for _ in range(2)]
    assert results[0].stdout.startswith("(step 6) def main(")
    assert results[0].stdout == results[1].stdout, "greedy decoding is deterministic"


def test_generate_needs_a_run_directory(tmp_path: Path):
    result = run_command(
        [sys.executable, "-m", "pipelines.generate", str(tmp_path), "--prompt", "x"], expect=2
    )
    assert result.stderr == f"error: {tmp_path} has no config.toml: not a pipelines.run directory\n"


def test_run_dir_that_is_a_file_is_one_line(tmp_path: Path, cache_dir: Path):
    run_dir = tmp_path / "not-a-directory"
    run_dir.write_text("someone's notes\n")
    result = run(run_dir, cache_dir, expect=2)
    assert result.stderr == f"error: --run-dir {run_dir}: exists and is not a directory\n"
    assert run_dir.read_text() == "someone's notes\n"
