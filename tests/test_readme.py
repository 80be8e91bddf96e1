"""README's Python examples run as written (each in a fresh interpreter)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import compiling
import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)

pytestmark = pytest.mark.slow


def test_readme_has_examples():
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("code", EXAMPLES, ids=lambda code: code.splitlines()[-1][:40])
def test_readme_example_runs(code):
    env = compiling.environment(dict(os.environ))
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
