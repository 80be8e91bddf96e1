"""``python -m pipelines.bench``: the benchmark on 8 simulated devices where there is no
accelerator (`pipelines.bench.main`; ``EQXZOO_BENCH_DEVICES``: another count)."""

import os

from eqxzoo.allocator import rerun_with_huge_pages

rerun_with_huge_pages("pipelines.bench")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from eqxzoo.runtime import FAST_CPU_FLAGS, use_cpu_flags  # noqa: E402
from pipelines.bench import DEVICES_ENV, main  # noqa: E402

use_cpu_flags(FAST_CPU_FLAGS)

jax.config.update("jax_num_cpu_devices", int(os.environ.get(DEVICES_ENV, 8)))
main()
