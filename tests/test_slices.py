"""Meshes across slices (`[mesh.dcn]`): the hybrid layout, what a slice is, the rules' names for
the part of dp within a slice, and the collectives the dry run says cross slices."""

from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from runs import SMALL

from eqxzoo.nn import Axes
from eqxzoo.parallel import MeshConfig, make_mesh
from eqxzoo.parallel.collectives import Traffic, device_groups
from eqxzoo.parallel.mesh import DcnConfig, MeshError, device_slices
from eqxzoo.parallel.rules import ShardingConfig, tree_shardings
from eqxzoo.run.config import RunConfig, load_config, model_config_for_mesh, step_config
from eqxzoo.run.loop import batch_shape
from eqxzoo.run.plan import collectives_report, dry_run
from eqxzoo.train.state import abstract_train_state
from eqxzoo.train.step import compile_train_step_for
from models import model_factory

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"


@pytest.mark.parametrize(
    "config",
    [
        MeshConfig(dp=4, pp=2, dcn=DcnConfig(dp=2)),
        MeshConfig(dp=2, pp=2, tp=2, dcn=DcnConfig(pp=2)),
        MeshConfig(dp=2, pp=4, dcn=DcnConfig(dp=2, pp=2)),
    ],
    ids=lambda config: config.describe(),
)
def test_a_slice_is_a_contiguous_block_of_every_axis(config):
    """Simulated devices in one process: slice k is devices 8k/S .. 8(k+1)/S - 1, and holds
    one block of each axis that spans slices (its index is that axis's major part)."""
    mesh = make_mesh(config)
    assert mesh.axis_names == config.axis_names
    slices = config.slice_indices()
    ids = np.vectorize(lambda device: device.id)(mesh.devices)
    np.testing.assert_array_equal(slices, ids // (8 // config.dcn.slices))
    full = slices.reshape(config.shape)
    for k in range(config.dcn.slices):
        where = np.argwhere(full == k)
        assert len(where) == np.prod(config.ici_shape)
        assert tuple(where.max(axis=0) - where.min(axis=0) + 1) == config.ici_shape


def test_the_slices_are_processes_or_tpu_slices_and_must_number_as_dcn_says():
    processes = [SimpleNamespace(id=i, process_index=i // 4) for i in range(8)]
    groups = device_slices(processes, DcnConfig(dp=2))
    assert [[d.id for d in g] for g in groups] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(MeshError) as refused:
        device_slices(processes, DcnConfig(dp=2, pp=2))
    assert str(refused.value) == (
        "mesh.dcn.dp=2 x mesh.dcn.pp=2 = 4 slice(s), but the 8 devices form 2 processes: "
        "make the product of mesh.dcn's sizes 2"
    )
    tpus = [SimpleNamespace(id=i, process_index=i // 2, slice_index=i // 4) for i in range(8)]
    assert [[d.id for d in g] for g in device_slices(tpus, DcnConfig(pp=2))][1] == [4, 5, 6, 7]
    with pytest.raises(MeshError, match=r"^mesh\.dcn\.dp=3 = 3 slice\(s\) do not divide the 8 "):
        device_slices(jax.devices(), DcnConfig(dp=3))


def test_set_mesh_dcn_and_the_rules_name_the_part_of_dp_within_a_slice():
    config = load_config(TINY, ["mesh.dp=4", "mesh.tp=1", "mesh.dcn.dp=2"])
    assert config.mesh.dcn == DcnConfig(dp=2)
    rules = step_config(config).rules
    assert rules["batch"] == ("dp_dcn", "dp_ici", "ep")
    assert rules["embed"] == ("dp_dcn", "dp_ici", "ep")
    within = ShardingConfig(embed=("dp_ici", "ep"))
    assert within.rules_on(config.mesh.axis_names)["embed"] == ("dp_ici", "ep")
    assert within.rules["embed"] == ("dp", "ep")  # one slice: dp_ici is all of dp
    mesh = make_mesh(config.mesh)
    shape = jax.ShapeDtypeStruct((8, 4), np.float32)
    with pytest.raises(
        MeshError, match=r"^the sharding rules name mesh axes \['dp'\] that the mesh"
    ):
        tree_shardings(shape, Axes(("embed", None)), mesh, ShardingConfig().rules)


def test_device_groups_read_every_form_of_replica_groups():
    assert device_groups("all-reduce(x), replica_groups={{0,2},{1,3}}, to_apply=f", 4) == [
        [0, 2],
        [1, 3],
    ]
    assert device_groups("replica_groups=[4,2]<=[2,2,2]T(1,0,2), use", 8) == [
        [0, 1],
        [4, 5],
        [2, 3],
        [6, 7],
    ]
    on_mesh = "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,2,2]T(2,1,0)) {'axis_0'}, x"
    assert device_groups(on_mesh, 8) == [[0, 2, 1, 3], [4, 6, 5, 7]]
    plain_mesh = "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, dimensions={1}"
    assert device_groups(plain_mesh, 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert device_groups("collective-permute(x), source_target_pairs={{0,1},{1,0}}", 2) == [
        [0, 1],
        [1, 0],
    ]
    assert device_groups("all-reduce(x), replica_groups={}, to_apply=f", 3) == [[0, 1, 2]]


def two_slices(*overrides: str) -> RunConfig:
    return load_config(TINY, [*SMALL, "mesh.dp=4", "mesh.tp=1", "mesh.dcn.dp=2", *overrides])


def across_slices(*overrides: str) -> tuple[dict[str, Traffic], list[str]]:
    """The compiled step's traffic across slices by link, and the dry run's collectives
    lines (`collectives_report`, without the rest of the dry run)."""
    config = two_slices(*overrides)
    mesh = make_mesh(config.mesh)
    step = step_config(config)
    make_model = model_factory(model_config_for_mesh(config.model, config.mesh))
    state = abstract_train_state(make_model, config=step, mesh=mesh)
    compiled, _ = compile_train_step_for(step, mesh, state, batch_shape(config).shape)
    lines, by_link = collectives_report(compiled.as_text(), config.mesh)
    crossing = {link.describe(): t for link, t in by_link.items() if link.across_slices}
    return crossing, lines


@pytest.mark.slow
def test_only_the_gradient_reduction_crosses_slices_once_a_step():
    """dp = 4 over 2 slices, FSDP within a slice: the only collectives across slices are
    all-reduces over dp_dcn, and they move the same bytes (the gradients', once) with 2
    microbatches, with 4 microbatches in each of 2 accumulation steps, and with 1F1B's
    executor: the gradients cross once a step, not once per accumulation step, microbatch,
    tick or loss chunk (besides them: the step's metrics and the MoE's router statistics,
    averaged over the slices, a sliver). FSDP over the whole of dp moves the weights across
    too, and the dry run says so (a bf16 step: the slices' bf16 weights)."""
    lines = []
    dry_run(two_slices("precision.compute=bfloat16"), say=lines.append)
    (line,) = [line for line in lines if line.startswith("collectives:")]
    assert " across 2 slices (" in line, line
    assert any(line.startswith("note: FSDP over the whole of dp moves") for line in lines)
    within = 'sharding.embed=["dp_ici", "ep"]'
    crossing_bytes = []
    for extra in (
        ("pipeline.microbatches=2",),
        ("pipeline.microbatches=4", "data.grad_accum=2"),
        ("pipeline.microbatches=4", "pipeline.schedule=1f1b", "pipeline.repeats=1"),
    ):
        crossing, lines = across_slices(within, *extra)
        assert list(crossing) == ["all-reduce over dp_dcn"], crossing
        assert not any(line.startswith("note: FSDP") for line in lines)
        crossing_bytes.append(crossing["all-reduce over dp_dcn"].bytes)
    gradients = crossing_bytes[0]
    assert gradients > 100_000  # the tiny MoE's 48k float32 parameters
    np.testing.assert_allclose(crossing_bytes, gradients, atol=8192)
