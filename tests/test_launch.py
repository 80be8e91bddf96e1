"""Multi-process runs on one machine: 2 processes x 4 devices equal 1 process x 8, resume
with another process count, a lost peer ends the run, everything on 127.0.0.1."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_run import SMALL, environment, losses, records

from pipelines.launch import free_port, process_environment

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.toml")
LOST_PEER_BOUND_S = 90

pytestmark = pytest.mark.slow


def run_args(run_dir: Path, cache_dir: Path, *extra: str) -> list[str]:
    sets = [f"run.compilation_cache_dir={cache_dir}", *SMALL, "run.eval_every=0"]
    return [TINY, "--run-dir", str(run_dir), *[a for s in sets for a in ("--set", s)], *extra]


def wait_for_step(run_dir: Path, step: int, processes: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + 600
    while not any(r.get("step", 0) >= step for r in records(run_dir)):
        for process in processes:
            assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)


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


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("compilation-cache")


def test_two_processes_equal_one_and_resume_as_one(tmp_path: Path, cache_dir: Path):
    single = tmp_path / "single"
    subprocess.run(
        [sys.executable, "-m", "pipelines.run", *run_args(single, cache_dir)],
        env=environment(),
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=600,
    )
    expected = losses(single)
    assert len(expected) == 6

    multi = tmp_path / "multi"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "pipelines.launch", "--processes", "2"] + run_args(multi, cache_dir),
        env=environment() | {"XLA_FLAGS": ""},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    wait_for_step(multi, 1, [launcher])
    workers = [
        int(pid)
        for pid in subprocess.run(
            ["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True
        ).stdout.split()
    ]
    assert len(workers) == 2
    for pid in workers:
        assert listening_addresses(pid) <= LOOPBACK_HEX, listening_addresses(pid)
    wait_for_step(multi, 5, [launcher])
    os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait()
    before = losses(multi)
    np.testing.assert_allclose(before, expected[: len(before)], rtol=1e-5)
    data_states = list((multi / "checkpoints").glob("*/data/process_*-of-2.json"))
    assert len(data_states) >= 2, "each process wrote its iterator state"

    resumed = subprocess.run(
        [sys.executable, "-m", "pipelines.run", *run_args(multi, cache_dir)],
        env=environment(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from the checkpoint at step 4" in resumed.stdout
    np.testing.assert_allclose(losses(multi), expected, rtol=1e-5)


def test_a_lost_peer_ends_the_run_with_a_message_naming_it(tmp_path: Path, cache_dir: Path):
    port = free_port()
    args = run_args(tmp_path, cache_dir, "--set", "run.steps=1000")
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "pipelines.run", *args],
            env=environment()
            | process_environment(index, 2, port)
            | {"EQXZOO_HEARTBEAT_SECONDS": "10", "XLA_FLAGS": ""},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for index in range(2)
    ]
    wait_for_step(tmp_path, 2, workers)
    workers[1].kill()
    killed_at = time.monotonic()
    _, err = workers[0].communicate(timeout=LOST_PEER_BOUND_S + 60)
    elapsed = time.monotonic() - killed_at
    assert workers[0].returncode != 0
    assert elapsed < LOST_PEER_BOUND_S, elapsed
    named = re.search(r"lost process\(es\) 1 of 2", err) or re.search(
        r"stopped sending heartbeats\):\s*1\b", err
    )
    assert named, err[-3000:]
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1
