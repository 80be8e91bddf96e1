"""A long-running command runs itself again on glibc malloc with transparent huge pages
(`eqxzoo.allocator`), says so first, and leaves a user's choice alone."""

import os
import subprocess
import sys

import pytest
from compiling import ROOT

from eqxzoo.allocator import HUGE_PAGES, OPT_OUT_ENV, TUNABLES_ENV, huge_pages_on_request

PROBE = (
    "from eqxzoo.allocator import rerun_with_huge_pages; rerun_with_huge_pages('probe'); "
    "import os; print('tunables:', os.environ.get('GLIBC_TUNABLES'))"
)


def run_python(args: list[str], **env: str) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k not in (TUNABLES_ENV, OPT_OUT_ENV)}
    result = subprocess.run(
        [sys.executable, *args],
        env=base | {"PYTHONPATH": str(ROOT)} | env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return result.stdout.splitlines()


@pytest.mark.skipif(
    not huge_pages_on_request(), reason="huge pages are not given on madvise, or glibc < 2.35"
)
def test_a_command_runs_itself_again_on_huge_pages_and_says_so_first():
    first, *rest = run_python(["-c", PROBE])
    assert first == (
        f"probe: running again on glibc malloc with transparent huge pages "
        f"({TUNABLES_ENV}={HUGE_PAGES}; {OPT_OUT_ENV}=system runs without)"
    )
    assert rest == [f"tunables: {HUGE_PAGES}"]
    for command in ("pipelines.run", "pipelines.launch"):
        first, second, *_ = run_python(["-m", command, "--help"])
        assert first.startswith(f"{command}: running again on glibc malloc")
        assert second.startswith("usage: ")


def test_a_command_keeps_the_allocator_the_user_chose():
    assert run_python(["-c", PROBE], **{OPT_OUT_ENV: "system"}) == ["tunables: None"]
    mine = "glibc.malloc.arena_max=2"
    assert run_python(["-c", PROBE], **{TUNABLES_ENV: mine}) == [f"tunables: {mine}"]
