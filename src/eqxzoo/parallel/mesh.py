"""Device meshes with the axes ``dp`` (data/FSDP), ``pp`` (pipeline), ``tp`` (tensor), ``ep`` (experts)
and ``cp`` (context: each sequence's tokens split over it, `eqxzoo.nn.context_attend`).

Beyond one slice (a TPU slice, a GPU node: devices joined by a fast network, ICI or NVLink),
slices are joined by a slower data-centre network (DCN). ``[mesh.dcn]`` says how much of
each axis spans slices (`DcnConfig`); `make_mesh` then lays the devices out so that each
slice is a contiguous block of every axis (the slice's index is the major part of each axis
it spans, `jax.experimental.mesh_utils.create_hybrid_device_mesh`). What a slice is
(`device_slices`): on TPU the devices' ``slice_index``; elsewhere one process (one host, or
one `pipelines.launch` process); in one process of simulated devices, equal groups of
consecutive devices.

Where ``dp`` spans slices, the mesh has two axes for it, ``dp_dcn`` (across slices, major)
and ``dp_ici`` (within a slice), so that a sharding rule can name the part within a slice
(`eqxzoo.parallel.rules`: FSDP inside a slice is ``embed = ["dp_ici", "ep"]``); the rules'
``dp`` names both. The other axes keep one mesh axis each.
"""

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AbstractMesh, AxisType, Mesh
from jaxtyping import PyTree

from eqxzoo.errors import UserError
from eqxzoo.nn.moe import has_data_dependent_loops
from eqxzoo.typed_config import check_fields, refuse, require_at_least, runtime_field

MESH_AXES = ("dp", "pp", "tp", "ep", "cp")
# The mesh axes of ``dp`` where it spans slices: across them, then within one.
DP_ACROSS_SLICES, DP_WITHIN_SLICE = "dp_dcn", "dp_ici"


class MeshError(UserError, ValueError):
    """A mesh that does not fit the devices or the model; the message names the numbers."""


@dataclasses.dataclass(frozen=True)
class AxisSizes:
    """A size for each of `MESH_AXES` (at least 1), in that order as `shape`."""

    dp: int = runtime_field(1)
    pp: int = runtime_field(1)
    tp: int = runtime_field(1)
    ep: int = runtime_field(1)
    cp: int = runtime_field(1)

    def __post_init__(self):
        check_fields(self)
        require_at_least(self, 1, *MESH_AXES)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, axis) for axis in MESH_AXES)


@dataclasses.dataclass(frozen=True)
class DcnConfig(AxisSizes):
    """``[mesh.dcn]``: how many slices each axis spans (1: the axis stays within a slice).
    ``[mesh]`` keeps each axis's total size: ``dp = 4`` with ``dcn.dp = 2`` is two slices of
    ``dp = 2`` each. Data parallelism and pipeline stages tolerate the slow network; tensor
    and expert parallelism exchange activations every layer and do not; nor does context
    parallelism (keys and values go round its ring in every attention layer): ``cp`` is
    refused here."""

    def __post_init__(self):
        super().__post_init__()
        if self.cp > 1:
            refuse(
                "cp",
                "context parallelism passes keys and values round its axis in every attention "
                "layer, too often for the network between slices: keep mesh.cp within a slice "
                "(mesh.dcn.cp = 1)",
            )

    @property
    def slices(self) -> int:
        return math.prod(self.shape)

    def describe(self) -> str:
        """``mesh.dcn.dp=2 x mesh.dcn.pp=2 = 4 slices``: the keys that span slices."""
        spanning = [f"mesh.dcn.{a}={n}" for a, n in zip(MESH_AXES, self.shape) if n > 1]
        return f"{' x '.join(spanning) or 'mesh.dcn'} = {self.slices} slice(s)"


@dataclasses.dataclass(frozen=True)
class MeshConfig(AxisSizes):
    """``[mesh]``: each axis's total size, and (``[mesh.dcn]``) how much of it spans slices."""

    dcn: DcnConfig = dataclasses.field(default_factory=DcnConfig)

    def __post_init__(self):
        super().__post_init__()
        for axis in MESH_AXES:
            across, total = getattr(self.dcn, axis), getattr(self, axis)
            if total % across != 0:
                refuse(
                    f"dcn.{axis}",
                    f"{across} slices do not divide mesh.{axis}={total}: choose a divisor of "
                    f"{total}",
                )
        if self.cp > 1 and self.dp_spans_slices:
            refuse(
                "cp",
                "context parallelism does not yet compose with dp across slices (the step's "
                "per-slice region around the pipeline's region over cp crashes XLA's "
                "partitioner): set mesh.dcn.dp = 1, or split slices over mesh.dcn.pp",
            )

    @property
    def ici_shape(self) -> tuple[int, ...]:
        """Each axis's size within one slice."""
        return tuple(total // across for total, across in zip(self.shape, self.dcn.shape))

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def dp_spans_slices(self) -> bool:
        return self.dcn.dp > 1

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The mesh's axes: `MESH_AXES`, with ``dp`` as ``dp_dcn x dp_ici`` where it spans
        slices."""
        if not self.dp_spans_slices:
            return MESH_AXES
        return (DP_ACROSS_SLICES, DP_WITHIN_SLICE, *MESH_AXES[1:])

    @property
    def axis_shape(self) -> tuple[int, ...]:
        """The sizes of `axis_names`."""
        if not self.dp_spans_slices:
            return self.shape
        return (self.dcn.dp, self.dp // self.dcn.dp, *self.shape[1:])

    def describe(self) -> str:
        axes = " x ".join(f"{axis}={getattr(self, axis)}" for axis in MESH_AXES)
        return axes + (f" ({self.dcn.describe()})" if self.dcn.slices > 1 else "")

    def slice_indices(self) -> np.ndarray:
        """The slice of each device of `make_mesh`'s mesh (an int array of `axis_shape`):
        the slice's index is the major part of each axis it spans."""
        coordinates = np.indices(self.shape)
        ici = np.reshape(self.ici_shape, (-1,) + (1,) * len(self.shape))
        slices = np.ravel_multi_index(tuple(coordinates // ici), self.dcn.shape)
        return slices.reshape(self.axis_shape)


SLICE_ATTRIBUTES = {"slice_index": "TPU slices", "process_index": "processes"}


@runtime_checkable
class Placed(Protocol):
    """What tells devices' slices apart: a `jax.Device`'s id and process (and, on TPU, its
    ``slice_index``)."""

    id: int
    process_index: int


def slice_attribute(devices: Sequence[Placed]) -> str | None:
    """The device attribute whose values are the slices of ``devices``: ``slice_index``
    where the devices span several TPU slices, else ``process_index`` where they span
    several processes; None in one process on one slice."""
    for attribute in SLICE_ATTRIBUTES:
        if len({getattr(device, attribute, 0) for device in devices}) > 1:
            return attribute
    return None


def device_slices(devices: Sequence[Placed], dcn: DcnConfig) -> list[list[Placed]]:
    """``devices`` grouped into ``dcn``'s slices (see the module doc), each in device order;
    refuses a ``dcn`` whose slices the devices do not form."""
    attribute = slice_attribute(devices)
    if attribute is not None:
        keys = sorted({getattr(device, attribute) for device in devices})
        if len(keys) != dcn.slices:
            raise MeshError(
                f"{dcn.describe()}, but the {len(devices)} devices form {len(keys)} "
                f"{SLICE_ATTRIBUTES[attribute]}: make the product of mesh.dcn's sizes {len(keys)}"
            )
        return [[d for d in devices if getattr(d, attribute) == key] for key in keys]
    if len(devices) % dcn.slices != 0:
        raise MeshError(f"{dcn.describe()} do not divide the {len(devices)} devices")
    ordered = sorted(devices, key=lambda device: device.id)
    size = len(devices) // dcn.slices
    return [ordered[i * size : (i + 1) * size] for i in range(dcn.slices)]


def hybrid_devices(config: MeshConfig, devices: Sequence[jax.Device]) -> np.ndarray:
    """``devices`` as an array of ``config.shape`` in which each slice (`device_slices`) is
    a contiguous ``config.ici_shape`` block, the blocks laid out in ``config.dcn.shape``."""
    groups = device_slices(devices, config.dcn)
    attribute = slice_attribute(devices)
    if attribute is not None:
        return mesh_utils.create_hybrid_device_mesh(
            config.ici_shape,
            config.dcn.shape,
            [device for group in groups for device in group],
            process_is_granule=attribute == "process_index",
        )
    # One process of simulated devices: the same layout, the slices being groups of devices.
    blocks = np.empty(config.dcn.slices, dtype=object)
    for index, group in enumerate(groups):
        blocks[index] = mesh_utils.create_device_mesh(config.ici_shape, group)
    return np.block(blocks.reshape(config.dcn.shape).tolist())


def make_mesh(config: MeshConfig, devices: list | None = None) -> Mesh:
    """An Auto-axis (GSPMD) mesh of exactly ``config.size`` devices (all devices by default),
    its axes `MeshConfig.axis_names`; a hybrid (ICI x DCN) layout where ``config.dcn`` spans
    slices."""
    devices = jax.devices() if devices is None else list(devices)
    if config.size != len(devices):
        raise MeshError(
            f"mesh {config.describe()} needs {config.size} devices, but {len(devices)} are available"
        )
    axis_types = (AxisType.Auto,) * len(config.axis_names)
    if config.dcn.slices == 1:
        return jax.make_mesh(config.shape, MESH_AXES, axis_types=axis_types, devices=devices)
    layout = hybrid_devices(config, devices).reshape(config.axis_shape)
    return Mesh(layout, config.axis_names, axis_types=axis_types)


def partitions_stages(mesh_shape: Mapping[str, int]) -> bool:
    """Whether a pipeline stage on this mesh is split over more devices by XLA's partitioner
    (``pp > 1`` and another axis of more than one device): the stage's program then holds
    collectives that every stage must reach the same number of times."""
    return mesh_shape["pp"] > 1 and any(
        size > 1 for name, size in mesh_shape.items() if name != "pp"
    )


def check_stage_loops(layers: PyTree, mesh: Mesh | AbstractMesh) -> None:
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
