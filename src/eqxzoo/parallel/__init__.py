"""Meshes, logical-axis sharding rules and pipeline schedules."""

from eqxzoo.parallel.lowering import drop_open_sharding_constraints
from eqxzoo.parallel.mesh import (
    MESH_AXES,
    MeshConfig,
    MeshError,
    check_layers_fit,
    check_model_fits,
    make_mesh,
)
from eqxzoo.parallel.pipeline import run_pipeline, stage_layers, staged_axes, unstage_layers
from eqxzoo.parallel.pipeline_grad import pipeline_value_and_grad
from eqxzoo.parallel.rules import (
    DEFAULT_RULES,
    MeshAxes,
    ShardingConfig,
    activation_sharding,
    activation_spec,
    partition_spec,
    tree_shardings,
)
from eqxzoo.parallel.schedule import Schedule, ScheduleError, ScheduleName

drop_open_sharding_constraints()

__all__ = [
    "DEFAULT_RULES",
    "MESH_AXES",
    "MeshAxes",
    "MeshConfig",
    "MeshError",
    "Schedule",
    "ScheduleError",
    "ScheduleName",
    "ShardingConfig",
    "activation_sharding",
    "activation_spec",
    "check_layers_fit",
    "check_model_fits",
    "make_mesh",
    "partition_spec",
    "pipeline_value_and_grad",
    "run_pipeline",
    "stage_layers",
    "staged_axes",
    "tree_shardings",
    "unstage_layers",
]
