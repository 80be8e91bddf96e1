"""What the train step needs besides the model: `StepConfig` (schedule, optimizer, precision,
loss weights, stage remat, sharding rules) and the `Precision` policy.

The run config (`eqxzoo.run.config`) declares `Precision` as its ``[precision]`` section and
derives a `StepConfig` from a run (`eqxzoo.run.config.step_config`); this module imports nothing
of the zoo, so the trainer depends on models only through the model contract.
"""

import dataclasses
from collections.abc import Mapping
from typing import Literal

from eqxzoo.optim import OptimizerConfig
from eqxzoo.parallel.mesh import DP_ACROSS_SLICES, MESH_AXES
from eqxzoo.parallel.rules import MeshAxes, ShardingConfig
from eqxzoo.parallel.schedule import Schedule
from eqxzoo.train.loss_terms import LossConfig
from eqxzoo.typed_config import check_fields, identity_field, refuse, runtime_field

DType = Literal["float32", "bfloat16", "float16"]


@dataclasses.dataclass(frozen=True)
class Precision:
    """``[precision]``: parameters are stored in ``params`` (fp32 master weights), cast to
    ``compute`` for the forward and backward pass, and the logits/loss are taken in ``output``."""

    params: DType = identity_field("float32")
    compute: DType = runtime_field("float32")
    output: DType = runtime_field("float32")

    def __post_init__(self):
        check_fields(self)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Everything the train step needs besides the model: schedule, optimizer, precision,
    the loss (`LossConfig`: its terms' weights, vocabulary chunk and the balancing biases'
    update rate), stage remat and the sharding rules (`step_config` derives it from a run). ``bubble_fill`` and ``skip_bubbles`` are the
    pipeline's (`eqxzoo.parallel.run_pipeline`); the run sets ``skip_bubbles`` from what the
    compiled step needs (`eqxzoo.train.step.compile_train_step_for`). ``mesh_axes`` are the
    axes of the mesh the step runs on (`eqxzoo.parallel.MeshConfig.axis_names`: ``dp`` is
    two axes where it spans slices), which the rules are mapped onto."""

    schedule: Schedule
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    precision: Precision = dataclasses.field(default_factory=Precision)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    remat_stages: bool = True
    bubble_fill: float = 0.0
    skip_bubbles: bool = True
    sharding: ShardingConfig = dataclasses.field(default_factory=ShardingConfig)
    mesh_axes: tuple[str, ...] = MESH_AXES

    def __post_init__(self):
        # The schedule as the executor runs it: with R actions where stage remat asks for
        # them (`Schedule.for_stage_remat`), so that what prices it prices what runs.
        object.__setattr__(self, "schedule", self.schedule.for_stage_remat(self.remat_stages))
        pooled = self.loss.load_balance_pooling == "microbatch"
        if pooled and self.schedule.fuses_backward and DP_ACROSS_SLICES in self.mesh_axes:
            refuse(
                "loss.load_balance_pooling",
                f'"microbatch" pools the router statistics of all a microbatch\'s tokens, which '
                f"sit in several slices where mesh.dcn.dp > 1; the {self.schedule.name} schedule "
                'differentiates each slice\'s part on its own: use "layer", or gpipe or circular',
            )

    @property
    def rules(self) -> Mapping[str, MeshAxes]:
        return self.sharding.rules_on(self.mesh_axes)

    @property
    def slice_axes(self) -> tuple[str, ...]:
        """The mesh axes across slices that each slice's part of the step leaves out
        (`within_slice`): ``dp``'s part across slices, where it has one."""
        return tuple(axis for axis in self.mesh_axes if axis == DP_ACROSS_SLICES)

    def within_slice(self) -> "StepConfig":
        """This config as each slice's own part of the step sees the mesh: without
        `slice_axes` (manual there), so ``dp`` is its part within the slice."""
        kept = tuple(axis for axis in self.mesh_axes if axis not in self.slice_axes)
        return dataclasses.replace(self, mesh_axes=kept)
