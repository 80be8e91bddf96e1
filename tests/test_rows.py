"""`eqxzoo.nn.rows`: the row maximum is ``jnp.max``'s bit for bit, without the windowed
reduction XLA:CPU makes of ``jnp.max``; the softmax over rows is `jax.nn.softmax`."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiling import ROOT, environment

from eqxzoo.nn.rows import row_max, softmax_rows
from eqxzoo.runtime import FAST_CPU_FLAGS


@pytest.mark.parametrize("width", [1, 32, 48, 96, 256, 1000])
def test_the_row_maximum_is_jnp_max_bit_for_bit(width):
    x = jax.random.normal(jax.random.key(width), (3, 5, width)).at[0, 0].set(-jnp.inf)
    got, want = jax.jit(row_max)(x), jnp.max(x, axis=-1)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


WINDOWED = """
import jax, jax.numpy as jnp
from eqxzoo.nn.rows import row_max
x = jax.ShapeDtypeStruct((8, 4, 256, 256), jnp.float32)
for f in (lambda x: x.max(-1), row_max):
    print("reduce-window" in jax.jit(f).lower(x).compile().as_text())
"""


def test_the_row_maximum_needs_no_windowed_reduction():
    # Under the flags runs compile with: the suite's own (`compiling.XLA_FLAGS`) skip the
    # rewrite, and XLA's defaults give reductions to YNNPACK instead.
    flags = " ".join(f"{flag}={value}" for flag, value in FAST_CPU_FLAGS.items())
    result = subprocess.run(
        [sys.executable, "-c", WINDOWED],
        env=environment(dict(os.environ), xla_flags=flags),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert result.stdout.split() == ["True", "False"], "jnp.max windows, row_max does not"


def test_the_softmax_over_rows_and_its_gradient_are_jax_nn_softmax():
    x = 4 * jax.random.normal(jax.random.key(0), (2, 3, 64, 128))
    weights = jax.random.normal(jax.random.key(1), x.shape)

    def loss(softmax, x):
        return jnp.sum(softmax(x) * weights)

    ours = jax.value_and_grad(lambda x: loss(softmax_rows, x))(x)
    reference = jax.value_and_grad(lambda x: loss(lambda y: jax.nn.softmax(y, -1), x))(x)
    np.testing.assert_allclose(softmax_rows(x), jax.nn.softmax(x, -1), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ours[0], reference[0], rtol=1e-6)
    np.testing.assert_allclose(ours[1], reference[1], rtol=1e-5, atol=1e-7)
