"""Test setup: 8 simulated CPU devices, float32 matmuls and the suite's compiler settings
(`compiling`), before any JAX computation; the tiny models, random batches and tolerance
checks the test files share."""

import fcntl
import gc
import os
import shutil
from pathlib import Path

from compiling import CACHE_DIR, XLA_FLAGS

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {XLA_FLAGS}".strip()

import jax  # noqa: E402

from eqxzoo.runtime import (  # noqa: E402
    MEMORY_MINIMIZING_CPU_FLAGS,
    use_collective_threads,
    use_cpu_flags,
)

DEVICES = 8
jax.config.update("jax_num_cpu_devices", DEVICES)
use_collective_threads(DEVICES)
# Steps compiled here are scheduled as a run's are, so that their memory analysis is the one
# the planner's model is fitted to.
use_cpu_flags(MEMORY_MINIMIZING_CPU_FLAGS)
jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_compilation_cache_dir", str(CACHE_DIR))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from runs import records, run  # noqa: E402

from models import registry  # noqa: E402

VOCAB = registry.TINY_SHAPES["vocab_size"]


@pytest.fixture
def tiny_config():
    """``tiny_config(family, n_layers=...)``: the family's tiny example (`models.registry.
    tiny_config`: a d_model-32, 4-head (2 kv heads) model with what its family file's
    `Family.tiny` adds) with ``n_layers`` blocks, over a vocabulary of `VOCAB` tokens."""
    return registry.tiny_config


def _random_batch(shape: tuple[int, ...], seed: int = 0) -> dict[str, jax.Array]:
    tokens_key, targets_key = jax.random.split(jax.random.key(seed))
    return {
        "tokens": jax.random.randint(tokens_key, shape, 0, VOCAB),
        "targets": jax.random.randint(targets_key, shape, 0, VOCAB),
    }


@pytest.fixture
def random_batch():
    """``random_batch(shape, seed=0)``: ``{"tokens", "targets"}`` of uniform ids < `VOCAB`."""
    return _random_batch


def _assert_trees_close(actual, expected, rtol: float = 1e-5, atol: float = 0.0) -> None:
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = np.asarray(a), np.asarray(e)
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol + rtol * np.max(np.abs(e)))


@pytest.fixture
def assert_trees_close():
    """``assert_trees_close(actual, expected, rtol=1e-5)``: every leaf equal within ``rtol``
    of the leaf's own scale (fp32 rounding, not a loose match)."""
    return _assert_trees_close


# The maps the kernel lets one process hold (vm.max_map_count, 65,530 by default).
MEMORY_MAPS_BEFORE_RELEASE = 20_000


def _memory_maps() -> int:
    with open("/proc/self/maps", "rb") as maps:
        return sum(1 for _ in maps)


@pytest.fixture(autouse=True)
def release_compiled_programs():
    """Drop JAX's compiled programs once this process holds many memory maps.

    XLA:CPU maps every compiled program's code separately (a pipelined step and its
    reference take ~1,000 maps), and the suite compiles enough programs in one process to
    pass the kernel's limit, which crashes the next compilation with a segmentation fault.
    Clearing JAX's caches unmaps them; doing it only past a threshold keeps the programs
    that neighbouring tests share.
    """
    yield
    if os.path.exists("/proc/self/maps") and _memory_maps() > MEMORY_MAPS_BEFORE_RELEASE:
        jax.clear_caches()
        gc.collect()


# --- end-to-end runs of pipelines.run (tests/runs.py) ----------------------------------


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    """The suite's persistent compilation cache (`compiling.CACHE_DIR`), for the runs."""
    return CACHE_DIR


@pytest.fixture(scope="session")
def reference_dir(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    """An uninterrupted run of 6 steps, traced at steps 2..3; run once for all xdist workers
    (in the directory their temporary directories share, under a lock) and only read: tests
    that resume it resume a copy (`runs.stopped_copy`)."""
    shared = tmp_path_factory.getbasetemp().parent
    run_dir = shared / "reference"
    with open(shared / "reference.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (shared / "reference.done").exists():
            shutil.rmtree(run_dir, ignore_errors=True)
            result = run(run_dir, cache_dir, extra=("--profile", "2:3"))
            assert "done: steps 1..6" in result.stdout
            (shared / "reference.done").touch()
    assert (run_dir / "config.toml").exists()
    assert list((run_dir / "profile").rglob("*.xplane.pb")), "the --profile trace"
    return run_dir


@pytest.fixture(scope="session")
def reference(reference_dir: Path) -> list[dict]:
    return records(reference_dir)
