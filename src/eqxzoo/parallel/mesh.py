"""Device meshes with the axes ``dp`` (data/FSDP), ``pp`` (pipeline), ``tp`` (tensor), ``ep`` (experts)."""

import dataclasses
from collections.abc import Mapping

import jax
from jax.sharding import AxisType, Mesh
from jaxtyping import PyTree

from eqxzoo.errors import UserError
from eqxzoo.nn.moe import has_data_dependent_loops
from eqxzoo.typed_config import check_fields, require_at_least, runtime_field

MESH_AXES = ("dp", "pp", "tp", "ep")


class MeshError(UserError, ValueError):
    """A mesh that does not fit the devices or the model; the message names the numbers."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    dp: int = runtime_field(1)
    pp: int = runtime_field(1)
    tp: int = runtime_field(1)
    ep: int = runtime_field(1)

    def __post_init__(self):
        check_fields(self)
        require_at_least(self, 1, *MESH_AXES)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, axis) for axis in MESH_AXES)

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp * self.ep

    def describe(self) -> str:
        return " x ".join(f"{axis}={getattr(self, axis)}" for axis in MESH_AXES)


def make_mesh(config: MeshConfig, devices: list | None = None) -> Mesh:
    """An Auto-axis (GSPMD) mesh of exactly ``config.size`` devices (all devices by default)."""
    devices = jax.devices() if devices is None else list(devices)
    if config.size != len(devices):
        raise MeshError(
            f"mesh {config.describe()} needs {config.size} devices, but {len(devices)} are available"
        )
    return jax.make_mesh(
        config.shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices
    )


def partitions_stages(mesh_shape: Mapping[str, int]) -> bool:
    """Whether a pipeline stage on this mesh is split over more devices by XLA's partitioner
    (``pp > 1`` and another axis of more than one device): the stage's program then holds
    collectives that every stage must reach the same number of times."""
    return mesh_shape["pp"] > 1 and any(
        size > 1 for name, size in mesh_shape.items() if name != "pp"
    )


def check_stage_loops(layers: PyTree, mesh: Mesh) -> None:
    """Refuse ``layers`` whose stage runs a data-dependent number of loop iterations
    (`eqxzoo.nn.moe.has_data_dependent_loops`) on a mesh that `partitions_stages`: stages
    holding different layers would reach the loop's collectives different numbers of times,
    and XLA:CPU deadlocks."""
    if partitions_stages(dict(mesh.shape)) and has_data_dependent_loops(layers):
        raise MeshError(
            f"mesh {dict(mesh.shape)} splits pipeline stages over more axes, which the slotted "
            "dropless experts cannot run: set model.moe.dropless_kernel = 'sorted' (or 'auto')"
        )


def check_layers_fit(n_layers: int, *, stages: int, repeats: int) -> None:
    """Raise `MeshError` unless the ``stages * repeats`` pipeline rounds divide the layers."""
    if n_layers % (stages * repeats) != 0:
        raise MeshError(
            f"n_layers={n_layers} is not divisible by pp * repeats = {stages} * {repeats}"
        )


def check_model_fits(
    mesh: MeshConfig, *, n_layers: int, n_heads: int, n_experts: int | None, repeats: int = 1
) -> None:
    """Raise `MeshError` naming the numbers when the model cannot be split over ``mesh``."""
    check_layers_fit(n_layers, stages=mesh.pp, repeats=repeats)
    if n_heads % mesh.tp != 0:
        raise MeshError(f"n_heads={n_heads} is not divisible by tp={mesh.tp}")
    if n_experts is None:
        if mesh.ep != 1:
            raise MeshError(f"ep={mesh.ep} needs a MoE model, but the model has no experts")
    elif n_experts % mesh.ep != 0:
        raise MeshError(f"n_experts={n_experts} is not divisible by ep={mesh.ep}")
