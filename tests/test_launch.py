"""Multi-process runs on one machine: 2 processes x 4 devices equal 1 process x 8, a lost peer
ends the run, resume with another process count, everything on 127.0.0.1."""

import os
import re
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from runs import SMALL, child_pids, kill_all, launch, losses, run_command, wait_for_step

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.toml")
LOST_PEER_BOUND_S = 90

pytestmark = pytest.mark.slow


def run_args(run_dir: Path, cache_dir: Path, *extra: str) -> list[str]:
    sets = [f"run.compilation_cache_dir={cache_dir}", *SMALL, "run.eval_every=0"]
    return [TINY, "--run-dir", str(run_dir), *[a for s in sets for a in ("--set", s)], *extra]


def listening_addresses(pid: int) -> set[str]:
    """Local addresses of the TCP sockets ``pid`` listens on (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            match = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(fd))
        except OSError:
            continue
        if match:
            inodes.add(match.group(1))
    addresses = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A = LISTEN
                addresses.add(fields[1].split(":")[0])
    return addresses


# 127.0.0.1, ::1, ::ffff:127.0.0.1 as /proc/net/tcp{,6} write them.
LOOPBACK_HEX = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_two_processes_equal_one_survive_a_lost_peer_and_resume_as_one(
    tmp_path: Path, cache_dir: Path, reference: list[dict]
):
    """1 process x 8 devices (the reference run); then 2 processes x 4 devices until process 1
    is killed (process 0 must exit on its own, naming it); then the run resumed as 1 process.
    Same losses."""
    same_schedule = ("--set", "optimizer.decay_steps=6")  # the reference's run.steps
    expected = [r["loss"] for r in reference if "loss" in r]
    assert len(expected) == 6

    multi = tmp_path / "multi"
    endless = run_args(multi, cache_dir, *same_schedule, "--set", "run.steps=1000")
    log = tmp_path / "launch.log"
    launcher = launch(["--processes", "2", "--heartbeat", "10", "--grace", "300", *endless], log)
    workers = []
    try:
        wait_for_step(multi, 1, [launcher], log)
        workers = child_pids(launcher.pid)
        assert len(workers) == 2
        for pid in workers:
            assert listening_addresses(pid) <= LOOPBACK_HEX, listening_addresses(pid)
        wait_for_step(multi, 3, [launcher], log)
        os.kill(workers[1], signal.SIGKILL)
        killed_at = time.monotonic()
        while alive(workers[0]) and time.monotonic() - killed_at < LOST_PEER_BOUND_S:
            time.sleep(0.2)
        elapsed = time.monotonic() - killed_at
        launcher.wait(timeout=60)
    finally:
        kill_all([launcher.pid, *workers])
        launcher.wait()
    output = log.read_text()
    assert elapsed < LOST_PEER_BOUND_S, output[-3000:]
    assert launcher.returncode != 0
    assert "launch: the run failed: process 1 was lost first (killed by SIGKILL)" in output
    named = re.search(r"lost process\(es\) 1 of 2", output) or re.search(
        r"stopped sending heartbeats\):\s*1\b", output
    )
    assert named, output[-3000:]
    before = losses(multi)
    np.testing.assert_allclose(before, expected[: len(before)], rtol=1e-5)
    assert len(list((multi / "checkpoints").glob("*/data/process_*-of-2.json"))) >= 2

    resumed = run_command([sys.executable, "-m", "pipelines.run", *endless, "--steps", "6"])
    assert re.search(r"resumed from the checkpoint at step [24]\b", resumed.stdout), resumed.stdout
    np.testing.assert_allclose(losses(multi), expected, rtol=1e-5)


def test_two_slices_as_two_processes_give_the_one_process_losses(
    tmp_path: Path, cache_dir: Path, reference: list[dict]
):
    """Two processes as two slices (`[mesh.dcn]`): dp across them for 2 steps, then the run
    resumed with pp across them instead, gives the reference run's losses (1 process, no
    slices): the layout and the per-slice gradients change nothing computed."""
    expected = [r["loss"] for r in reference if "loss" in r][:4]
    run_dir = tmp_path / "slices"
    outputs = []
    for across, steps in (("mesh.dcn.dp=2", 2), ("mesh.dcn.pp=2", 4)):
        args = run_args(run_dir, cache_dir, "--set", "optimizer.decay_steps=6", "--set", across)
        launched = [sys.executable, "-m", "pipelines.launch", "--processes", "2", *args]
        outputs.append(run_command([*launched, "--steps", str(steps)]).stdout)
    assert "mesh.dcn.dp=2 = 2 slice(s)" in outputs[0], outputs[0]
    assert "resumed from the checkpoint at step 2" in outputs[1], outputs[1]
    assert "mesh.dcn.pp=2 = 2 slice(s)" in outputs[1], outputs[1]
    np.testing.assert_allclose(losses(run_dir), expected, rtol=1e-5)
