"""How the suite compiles, in its own process and in every process it starts (imports no JAX:
conftest reads it before JAX starts).

- `XLA_FLAGS`: XLA:CPU without LLVM's optimisation passes and with its classic emitters
  compiles the suite's programs in about half the time (a pipelined step of a tiny MoE: 48 s
  -> 26 s of compiling; the shrunk tiny.toml run: 55 s -> 25 s); the programs compute the
  same functions, which is what the tests compare. Speed is the benchmark's business, and it
  runs with XLA's defaults.
- `CACHE_DIR`: JAX's persistent compilation cache inside the clone, shared by the xdist
  workers, by the runs the end-to-end tests start (``run.compilation_cache_dir``) and by the
  next run of the suite: a program compiled once is loaded everywhere else.
- ``GLIBC_TUNABLES``: the processes the suite starts run on huge pages from the start
  (`eqxzoo.allocator`), so that no command runs itself again.
- No ``PYTHONDONTWRITEBYTECODE``: the processes the suite starts write the bytecode of what
  they import, and the next one loads it. Where the environment sets it (this project's
  development machines do), every run, launch and export compiled the source of JAX,
  Equinox, orbax and the project again: about 5.5 s of each start (an export's error path:
  9.1 s -> 3.5 s).
"""

from pathlib import Path

from eqxzoo.allocator import HUGE_PAGES, TUNABLES_ENV

ROOT = Path(__file__).resolve().parents[1]
XLA_FLAGS = " ".join(
    (
        "--xla_backend_optimization_level=0",
        "--xla_llvm_disable_expensive_passes=true",
        "--xla_cpu_use_fusion_emitters=false",
    )
)
CACHE_DIR = ROOT / ".cache" / "jax-compilation"


def environment(base: dict[str, str], xla_flags: str = XLA_FLAGS) -> dict[str, str]:
    """``base`` for a process the suite starts: on the CPU, the suite's compiler flags (and no
    inherited device count: each command sets its own), and this checkout importable.
    ``xla_flags=""`` keeps XLA's defaults, for a process that trains long enough for the
    optimised code to repay its compile (README's SFT run: 100 steps, 66 s -> 49 s)."""
    env = {k: v for k, v in base.items() if k not in ("XLA_FLAGS", "PYTHONDONTWRITEBYTECODE")}
    return env | {
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT),
        "XLA_FLAGS": xla_flags,
        TUNABLES_ENV: HUGE_PAGES,
    }
