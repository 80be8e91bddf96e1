"""Runs that fail safely, through `python -m pipelines.run` (subprocesses of the shrunk
`configs/tiny.toml` of `tests/runs.py`): one run per directory, resume only the same run,
a full disk loses nothing, a plan that cannot fit is refused, and no error exit shows a
traceback."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from runs import (
    ROOT,
    command,
    environment,
    losses,
    records,
    reference_losses,
    run,
    run_command,
    spawn,
    stopped_copy,
    wait_for_step,
)

pytestmark = pytest.mark.slow


def assert_no_traceback(*outputs: str) -> None:
    for output in outputs:
        assert "Traceback" not in output, output[-3000:]


def test_a_second_run_on_the_directory_is_refused_at_once_and_the_first_goes_on(
    tmp_path: Path, cache_dir: Path
):
    """The first run is endless until SIGTERM (a save, then exit 0) once the second one has
    been refused: each of its steps is in ``metrics.jsonl`` exactly once."""
    run_dir = tmp_path / "run"
    log = tmp_path / "first.log"
    first = spawn(command(run_dir, cache_dir, ("run.steps=100000",)), log)
    try:
        wait_for_step(run_dir, 1, [first], log)
        started = time.monotonic()
        second = run(run_dir, cache_dir, ("run.steps=100000",), expect=2)
        refused_after = time.monotonic() - started
        assert first.poll() is None, log.read_text()[-3000:]
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=600) == 0, log.read_text()[-3000:]
    finally:
        first.kill()
    assert re.fullmatch(
        rf"error: --run-dir {run_dir} is in use by another run \(pid {first.pid} on "
        rf"{re.escape(socket.gethostname())}, started [-0-9T:+]+\); wait for it to end or stop "
        r"it, or give this run another --run-dir\n",
        second.stderr,
    ), second.stderr
    assert second.stdout == ""
    assert refused_after < 30, refused_after
    steps = [r["step"] for r in records(run_dir) if "loss" in r]
    assert steps == list(range(1, len(steps) + 1)), "each step exactly once"
    assert_no_traceback(log.read_text(), second.stderr)


REFUSED_RESUMES = {
    "architecture": (
        ("model.d_model=48", "model.n_layers=8"),
        "model.d_model = 32 in the run, 48 now; model.n_layers = 4 in the run, 8 now",
    ),
    "data order": (
        ("data.seed=1", "data.seq_len=16"),
        "data.seed = 0 in the run, 1 now; data.seq_len = 32 in the run, 16 now",
    ),
}


def test_a_resume_that_changes_what_the_run_is_is_refused(
    tmp_path: Path, cache_dir: Path, reference_dir: Path
):
    """Another architecture, another data order: refused naming every changed key; then
    checkpoints that cannot be read (an error once the checkpointer is open) exit with one
    line too."""
    tmp_path = stopped_copy(reference_dir, tmp_path / "run", last_step=4)
    config_file = tmp_path / "config.toml"
    saved = config_file.read_text()

    def refusal(changes: str) -> str:
        return (
            f"error: --run-dir {tmp_path} holds another run (its checkpoint of step 4): "
            f"{changes}. Resume it with its own config ({config_file}; if that was edited or "
            f"lost, rewrite it with python -m pipelines.run --run-dir {tmp_path} "
            "--repair-config), or start this one in a new --run-dir\n"
        )

    for overrides, changes in REFUSED_RESUMES.values():
        refused = run(tmp_path, cache_dir, overrides=overrides, expect=2)
        assert refused.stderr == refusal(changes)
        assert config_file.read_text() == saved
        assert_no_traceback(refused.stdout, refused.stderr)

    # The checkpoint is the truth, whatever config.toml says or whether it exists.
    config_file.write_text(saved.replace("rope_theta = 10000.0", "rope_theta = 50.0"))
    rope_change = "model.rope_theta = 10000.0 in the run, 50.0 now"
    edited = run(tmp_path, cache_dir, config=config_file, expect=2)
    assert edited.stderr == refusal(rope_change)
    sampled = run_command(
        [sys.executable, "-m", "pipelines.generate", str(tmp_path), "--prompt", "a"], expect=2
    )
    exported = run_command(
        [sys.executable, "-m", "pipelines.export", str(tmp_path), "--out", str(tmp_path / "hf")],
        expect=2,
    )
    for refused in (sampled, exported):
        assert refused.stderr == (
            f"error: {config_file} is not the config of the checkpoint of step 4: "
            f"{rope_change}. Rewrite it from the checkpoint with python -m pipelines.run "
            f"--run-dir {tmp_path} --repair-config\n"
        )
    assert not (tmp_path / "hf").exists()
    config_file.unlink()
    lost = run(tmp_path, cache_dir, overrides=REFUSED_RESUMES["architecture"][0], expect=2)
    assert lost.stderr == refusal(REFUSED_RESUMES["architecture"][1])
    assert not config_file.exists(), "a refused run writes no config.toml"
    repaired = run_command(
        [sys.executable, "-m", "pipelines.run", "--run-dir", str(tmp_path), "--repair-config"]
    )
    assert repaired.stdout == (f"wrote {config_file} from the config of the checkpoint of step 4\n")
    assert config_file.read_text() == saved

    for checkpoint in (tmp_path / "checkpoints").iterdir():
        (checkpoint / "state" / "_METADATA").unlink()
    result = run(tmp_path, cache_dir, expect=2)
    assert result.stderr.splitlines()[-1] == (
        f"error: no usable checkpoint in {tmp_path / 'checkpoints'}: step 4: state: its index "
        "file _METADATA is missing (each moved aside to damaged-STEP)"
    ), result.stderr
    assert_no_traceback(result.stdout, result.stderr)


def test_what_may_change_on_resume_resumes(
    tmp_path: Path, cache_dir: Path, reference_dir: Path, reference: list[dict]
):
    """Mesh, sharding, cadences and reporting changed: the same losses as the uninterrupted
    run. Then steps, batch shape, schedule, learning rate and loss weights changed: it
    resumes."""
    tmp_path = stopped_copy(reference_dir, tmp_path / "run", last_step=4)
    same_losses = (
        "mesh.dp=4",
        "mesh.pp=1",
        "run.log_every=2",
        "run.max_nonfinite=5",
        "run.name=renamed",
        "checkpoint.every=3",
        "checkpoint.keep=3",
        "data.prefetch=1",
        "sharding.embed=[]",
    )
    result = run(tmp_path, cache_dir, overrides=same_losses)
    assert "resumed from the checkpoint at step 4" in result.stdout
    np.testing.assert_allclose(losses(tmp_path), reference_losses(reference), rtol=1e-5)
    other_training = (
        *same_losses,
        "run.steps=8",
        "data.batch_size=8",
        "pipeline.schedule=gpipe",
        "pipeline.repeats=1",
        "pipeline.microbatches=4",
        "optimizer.learning_rate=1e-3",
        "optimizer.decay_steps=8",
        "loss.load_balance_weight=0.02",
    )
    result = run(tmp_path, cache_dir, overrides=other_training)
    assert "resumed from the checkpoint at step 6" in result.stdout
    assert "done: steps 7..8" in result.stdout
    assert [r["step"] for r in records(tmp_path) if "loss" in r] == list(range(1, 9))


def can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
        capture_output=True,
    )
    return probe.returncode == 0


DISK_FULL_SCRIPT = """
set -u
mkdir -p "$OUT/first" "$OUT/second"
mount -t tmpfs -o size=64m tmpfs "$MOUNT"
"$@" --steps 4 > "$OUT/start.log" 2>&1; echo $? > "$OUT/start.rc"
used=$(df --output=used -k "$MOUNT" | tail -n 1)
mount -o remount,size=$((used + MARGIN_KIB))k "$MOUNT"
"$@" > "$OUT/first.log" 2>&1; echo $? > "$OUT/first.rc"
ls -A "$MOUNT/run/checkpoints" > "$OUT/first.ls"
cp "$MOUNT/run/metrics.jsonl" "$OUT/first/"
mount -o remount,size=64m "$MOUNT"
"$@" > "$OUT/second.log" 2>&1; echo $? > "$OUT/second.rc"
cp "$MOUNT/run/metrics.jsonl" "$OUT/second/"
"""


@pytest.mark.skipif(
    not can_mount_tmpfs(), reason="needs `unshare -rm` to mount a small tmpfs (not permitted)"
)
def test_a_full_disk_loses_nothing_and_the_rerun_resumes_exactly(
    tmp_path: Path, cache_dir: Path, reference_dir: Path, reference: list[dict]
):
    """A run stopped after step 4 leaves its checkpoints of steps 2 and 4 on a tmpfs, which is
    then shrunk to what it holds and a quarter of a checkpoint (as large as the reference
    run's): resumed, the run cannot save step 6. Once the tmpfs is grown, the rerun resumes
    from step 4. (A tmpfs of 2.5 checkpoints from the start did not always fail at step 6: the
    same checkpoint takes 2.2 to 3.4 MiB, by how many commits TensorStore happened to batch
    its writes into.)"""
    mount, out = tmp_path / "mount", tmp_path / "out"
    mount.mkdir()
    out.mkdir()
    run_dir = mount / "run"
    script = ["unshare", "-rm", "bash", "-c", DISK_FULL_SCRIPT, "disk-full"]
    checkpoint_bytes = sum(
        path.stat().st_blocks * 512 for path in (reference_dir / "checkpoints" / "6").rglob("*")
    )
    margin_kib = str(checkpoint_bytes // 4 // 1024)
    env = environment() | {"MOUNT": str(mount), "OUT": str(out), "MARGIN_KIB": margin_kib}
    subprocess.run(
        [*script, *command(run_dir, cache_dir)], env=env, cwd=ROOT, check=True, timeout=900
    )
    start, first, second = (
        (out / f"{name}.log").read_text() for name in ("start", "first", "second")
    )
    assert (out / "start.rc").read_text().strip() == "0", start[-3000:]
    assert (out / "first.rc").read_text().strip() == "2", first[-3000:]
    assert first.splitlines()[-1] == (
        f"error: checkpoint of step 6 not written: no space left on device at "
        f"{run_dir / 'checkpoints'}; the newest good checkpoint is step 4"
    )
    assert re.search(
        rf"warning: [0-9.]+ MiB free at {run_dir / 'checkpoints'}, less than the last "
        r"checkpoint \(step 4, [0-9.]+ MiB\): the checkpoint of step 6 may not fit",
        first,
    ), first[-3000:]
    assert (out / "first.ls").read_text().split() == ["2", "4"], "the partial step 6 is removed"
    first_losses = [r["loss"] for r in records(out / "first") if "loss" in r]
    assert first_losses == reference_losses(reference), "metrics.jsonl is intact"
    assert (out / "second.rc").read_text().strip() == "0", second[-3000:]
    assert "resumed from the checkpoint at step 4" in second
    assert losses(out / "second") == reference_losses(reference)
    assert_no_traceback(start, first, second)


FAILING_SAVE = """
import errno, sys
import failing_writes
failing_writes.install_failing_array_writes(errno.ENOSPC, step=4)
from pipelines.run import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_save_that_fails_on_a_background_thread_ends_the_run_with_one_last_line(
    tmp_path: Path, cache_dir: Path
):
    """The array writes of step 4 fail as a full disk fails them (tests/failing_writes.py:
    one at once on orbax's writer thread, the others delivered as that thread's event loop
    ends, the race CI lost): the run's last line is the error and nothing of TensorStore's
    error shows, then or at exit."""
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    args = [sys.executable, "-c", FAILING_SAVE, *command(run_dir, cache_dir)[3:]]
    env = environment() | {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    process = spawn(args, log, env)
    try:
        assert process.wait(timeout=600) == 2, log.read_text()[-3000:]
    finally:
        process.kill()
    output = log.read_text()
    assert output.splitlines()[-1] == (
        f"error: checkpoint of step 4 not written: no space left on device at "
        f"{run_dir / 'checkpoints'}; the newest good checkpoint is step 2"
    ), output[-3000:]
    assert "os_error_code" not in output, output[-3000:]
    assert_no_traceback(output)
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == ["2"]
    assert [r["step"] for r in records(run_dir) if "loss" in r] == [1, 2, 3, 4]


MEM_TOTAL = int(Path("/proc/meminfo").read_text().split()[1]) * 1024


@pytest.mark.skipif(MEM_TOTAL > 256 * 2**30, reason="this host may have the RAM moe_1b needs")
def test_moe_1b_as_configured_is_refused_on_this_host_before_it_starts(
    tmp_path: Path, cache_dir: Path
):
    """The mission's own command on a CPU host: about 350 GiB of step memory for 8 simulated
    devices, refused right after compiling, before anything is initialised."""
    started = time.monotonic()
    result = run_command(
        [
            *command(tmp_path, cache_dir)[:3],
            str(ROOT / "configs" / "moe_1b.toml"),
            "--run-dir",
            str(tmp_path),
            "--set",
            f"run.compilation_cache_dir={cache_dir}",
        ],
        expect=2,
    )
    seconds = time.monotonic() - started
    assert re.fullmatch(
        r"error: this plan does not fit: host RAM: needs [0-9.]+ GiB \(8 devices x [0-9.]+ GiB "
        r"\+ host buffers [0-9.]+ GiB\), [0-9.]+ GiB available: does not fit; per device the "
        r"step takes .*; activations dominate: lower data\.batch_size, data\.seq_len or "
        r"pipeline\.microbatches \(python -m pipelines\.run CONFIG --dry-run shows the plan\)",
        result.stderr.splitlines()[-1],
    ), result.stderr
    assert "training steps" not in result.stdout
    assert not (tmp_path / "checkpoints").exists()
    assert seconds < 180, seconds
    assert_no_traceback(result.stdout, result.stderr)
