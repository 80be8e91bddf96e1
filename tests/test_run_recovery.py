"""Nothing lost, nothing trusted blindly, through `python -m pipelines.run` and
`pipelines.launch` (subprocesses of the shrunk `configs/tiny.toml` of `tests/runs.py`): a
damaged newest checkpoint falls back, a kill right after a save loses no metrics line,
Ctrl-C saves and exits 0 under the launcher, and the values that used to fail late or
silently are refused up front."""

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from damaging import flip_a_byte
from runs import (
    child_pids,
    command,
    environment,
    kill_all,
    launch,
    losses,
    records,
    reference_losses,
    run,
    spawn,
    wait_for_step,
)

from eqxzoo.train.checkpoint import STEP_METADATA_FILE, finished_steps

pytestmark = pytest.mark.slow


def test_a_damaged_newest_checkpoint_falls_back_and_the_run_goes_on_exactly(
    tmp_path: Path, cache_dir: Path, reference_dir: Path, reference: list[dict]
):
    run_dir = tmp_path / "run"
    shutil.copytree(reference_dir, run_dir, ignore=shutil.ignore_patterns("profile"))
    flip_a_byte(run_dir / "checkpoints" / "6")
    result = run(run_dir, cache_dir)
    assert "warning: checkpoint at step 6 is damaged (state: " in result.stdout
    assert (
        f"does not match its checksum: the files were damaged after they were written); moved to {run_dir}/checkpoints/damaged-6; trying an older one"
        in result.stdout
    )
    assert "resumed from the checkpoint at step 4" in result.stdout
    assert losses(run_dir) == reference_losses(reference)
    assert [r["step"] for r in records(run_dir) if "loss" in r] == list(range(1, 7))


def test_a_run_restored_at_its_last_step_says_there_is_nothing_to_do(
    tmp_path: Path, cache_dir: Path, reference_dir: Path
):
    """Checkpoints of steps 4 and 6, ``run.steps = 6``: the newest might be damaged, so the
    run restores before it knows; restored at step 6, it trains and writes nothing."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference_dir, run_dir, ignore=shutil.ignore_patterns("profile"))
    before = (run_dir / "metrics.jsonl").read_text()
    result = run(run_dir, cache_dir)
    assert (
        result.stdout.splitlines()[-1] == "the run is at step 6; run.steps = 6 leaves nothing to do"
    )
    assert "resumed from the checkpoint at step 6" in result.stdout
    assert (run_dir / "metrics.jsonl").read_text() == before
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == ["4", "6"]


def test_a_kill_right_after_a_checkpoint_loses_no_metrics_line(tmp_path: Path, cache_dir: Path):
    """SIGKILL as soon as the checkpoint of step 4 is committed: its metrics line is there,
    and the resumed run writes every step exactly once."""
    run_dir = tmp_path / "run"
    log = tmp_path / "run.log"
    process = spawn(command(run_dir, cache_dir, ("run.steps=100000",)), log)
    committed = run_dir / "checkpoints" / "4" / STEP_METADATA_FILE
    try:
        deadline = time.monotonic() + 600
        while not committed.exists():
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.01)
        process.kill()
        process.wait(timeout=60)
    finally:
        process.kill()
    assert 4 in [r["step"] for r in records(run_dir) if "loss" in r]
    run(run_dir, cache_dir, extra=("--steps", "6"))
    assert [r["step"] for r in records(run_dir) if "loss" in r] == [1, 2, 3, 4, 5, 6]


def test_ctrl_c_under_the_launcher_saves_exits_0_and_resumes_exactly(
    tmp_path: Path, cache_dir: Path, reference: list[dict]
):
    """SIGINT to the launcher (which passes it on) and to its processes (a terminal's Ctrl-C
    reaches the whole process group): every process stops at the same step, saved."""
    run_dir = tmp_path / "run"
    endless = ("run.steps=100000", "optimizer.decay_steps=6", "run.eval_every=0")
    run_args = command(run_dir, cache_dir, endless)[3:]
    log = tmp_path / "launch.log"
    launcher = launch(["--processes", "2", *run_args], log)
    workers = []
    try:
        wait_for_step(run_dir, 2, [launcher], log)
        workers = child_pids(launcher.pid)
        for pid in [launcher.pid, *workers]:
            os.kill(pid, signal.SIGINT)
        assert launcher.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        kill_all([launcher.pid, *workers])
        launcher.wait()
    output = log.read_text()
    stopped = re.findall(r"stopped by a signal: checkpoint saved at step (\d+)", output)
    assert len(stopped) == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    step = int(stopped[0])
    # Every process saved that step: each wrote its own data state there, at one position,
    # and no process got further.
    checkpoints = run_dir / "checkpoints"
    assert max(finished_steps(checkpoints)) == step
    data_states = sorted((checkpoints / str(step) / "data").glob("process_*-of-2.json"))
    assert [path.name for path in data_states] == ["process_0-of-2.json", "process_1-of-2.json"]
    assert data_states[0].read_text() == data_states[1].read_text()
    assert [r["step"] for r in records(run_dir) if "loss" in r] == list(range(1, step + 1))
    assert step < 6, "stopped before the rerun's last step"

    rerun = run(run_dir, cache_dir, endless, extra=("--steps", "6"))
    assert f"resumed from the checkpoint at step {step}\n" in rerun.stdout
    assert [r["step"] for r in records(run_dir) if "loss" in r] == list(range(1, 7))
    np.testing.assert_allclose(losses(run_dir), reference_losses(reference), rtol=1e-5)


@pytest.mark.parametrize(
    ("overrides", "extra", "message"),
    [
        (
            (),
            ("--steps", "2", "--profile", "1:5"),
            "error: --profile 1:5: the run ends at step 2, so the trace would never be written",
        ),
        ((), ("--run-dir", ""), "argument --run-dir: must not be empty"),
    ],
    ids=["profile past the end", "empty run dir"],
)
def test_values_that_failed_late_or_silently_are_refused_up_front(
    tmp_path: Path, cache_dir: Path, overrides, extra, message
):
    args = [*command(tmp_path / "run", cache_dir, overrides), *extra]
    result = subprocess.run(
        args, env=environment(), cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1].endswith(message), result.stderr
    assert not (tmp_path / "config.toml").exists(), "nothing written in the current directory"


def test_checkpoints_that_is_a_file_is_one_line_and_metrics_stay(tmp_path: Path, cache_dir: Path):
    (tmp_path / "checkpoints").write_text("not a directory\n")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    result = run(tmp_path, cache_dir, expect=2)
    assert (
        result.stderr == f"error: --run-dir {tmp_path}: checkpoints exists and is not a directory\n"
    )
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'
