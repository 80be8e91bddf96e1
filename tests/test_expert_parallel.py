"""Expert parallelism by all-to-all (`eqxzoo.nn.expert_parallel`): a `MoE` whose experts
are split over 4 devices, each holding its own sequences, computes what the whole layer does
on one device (output, every aux value, every gradient; fp32, rtol 1e-5) for every routing
mode, with a balanced router (the exchange at `pair_capacity`) and one that sends every
token to one device (the worst-case exchange)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from eqxzoo.nn import MoE
from eqxzoo.nn.expert_parallel import ExpertSplit, distinct_devices, pair_capacity

D_MODEL, MLP, N_EXPERTS, SEQ, SEQUENCES_PER_DEVICE, DEVICES = 16, 8, 8, 16, 2, 4


def _moe(split: bool, routing_mode: str, top_k: int, kernel: str, skewed: bool) -> MoE:
    moe = MoE(
        D_MODEL,
        MLP,
        N_EXPERTS,
        top_k,
        routing_mode=routing_mode,
        capacity_factor=1.0,
        experts={"dropless_kernel": kernel},
        shared_mlp_dim=8,
        expert_split=ExpertSplit("ep") if split else None,
        key=jax.random.key(0),
    )
    if skewed:  # with `_inputs`' offset, every token prefers experts 0 and 1 (device 0)
        bias = jnp.zeros((D_MODEL, N_EXPERTS)).at[:, :2].set(1.0)
        moe = eqx.tree_at(lambda m: m.router.weight, moe, moe.router.weight + bias)
    return moe


def _inputs(skewed: bool, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.normal(jax.random.key(1), shape) + (3.0 if skewed else 0.0)


def _loss(output, aux, probe):
    scalars = aux["load_balance_loss"] + aux["router_z_loss"] + aux["dropped_fraction"]
    return jnp.sum(output * probe) + scalars


CASES = [
    ("dropless", 2, "slotted", False),
    ("dropless", 2, "slotted", True),
    ("dropless", 3, "sorted", False),
    ("dropless", 3, "sorted", True),
    ("capacity", 2, "slotted", False),
    ("dense", 2, "slotted", False),
]


@pytest.mark.parametrize(("routing_mode", "top_k", "kernel", "skewed"), CASES)
def test_split_experts_equal_one_device(routing_mode, top_k, kernel, skewed):
    mesh = jax.make_mesh(
        (DEVICES,), ("ep",), axis_types=(AxisType.Auto,), devices=jax.devices()[:DEVICES]
    )
    whole, split = (_moe(s, routing_mode, top_k, kernel, skewed) for s in (False, True))
    shape = (DEVICES * SEQUENCES_PER_DEVICE, SEQ, D_MODEL)
    x = _inputs(skewed, shape)
    probe = jax.random.normal(jax.random.key(2), shape)

    def one_device(moe, x):
        output, aux = moe(x)
        return _loss(output, aux, probe), (output, aux)

    expert_spec = eqx.tree_at(
        lambda m: (m.experts.gate, m.experts.up, m.experts.down),
        jax.tree.map(lambda _: P(), split),
        (P("ep"),) * 3,
    )

    def on_devices(moe, x):
        output, aux = jax.shard_map(
            lambda m, h: m(h),
            mesh=mesh,
            in_specs=(expert_spec, P("ep")),
            out_specs=(P("ep"), P()),
            check_vma=True,
        )(moe, x)
        return _loss(output, aux, probe), (output, aux)

    (expected, (output, aux)), grads = jax.jit(
        jax.value_and_grad(one_device, (0, 1), has_aux=True)
    )(whole, x)
    (got, (split_output, split_aux)), split_grads = jax.jit(
        jax.value_and_grad(on_devices, (0, 1), has_aux=True)
    )(split, x)
    device_load = split_aux.pop("device_load")
    # How much of what its kernel computes is padding: a property of each device's layout.
    split_aux.pop("padding_fraction"), aux.pop("padding_fraction")
    assert device_load.shape == (DEVICES,)
    assert (float(device_load.max()) > 1.5) == skewed or routing_mode == "dense"
    for actual, wanted in (
        (got, expected),
        (split_output, output),
        (split_aux, aux),
        (split_grads, grads),
    ):
        for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(wanted), strict=True):
            np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(e))))


def test_pair_capacity_is_the_balanced_mean_with_a_margin():
    # 64 experts top-6 over 8 devices: a token reaches 4.54 devices on average.
    assert distinct_devices(6, 8, 8) == pytest.approx(4.5355, abs=1e-3)
    assert pair_capacity(4096, 6, 8, 8) == 3488  # 4096 * 4.5355 / 8 * 1.5, to a multiple of 8
    assert pair_capacity(16, 2, 4, 2) == 16  # never past every token
