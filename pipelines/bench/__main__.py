"""``python -m pipelines.bench``: the benchmark on 8 simulated devices where there is no
accelerator (`pipelines.bench.main`)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from pipelines.bench import main  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
main()
