"""The run configuration: typed sections, TOML loading, ``--set`` overrides, validation.

``python -m pipelines.run CONFIG.toml [--set section.key=value ...]`` reads one TOML file:

    [run]         name, seed, steps, log_every, eval_every, eval_batches, max_nonfinite,
                  compilation_cache_dir, tensorboard, wandb, wandb_project, plot
    [model]       family and sizes (`models.config_from_table`), with a [model.moe] table;
                  or init_from_hf = "DIR": architecture and weights from a Hugging Face
                  checkpoint (`models.hf.config_with_hf`)
    [mesh]        dp, pp, tp, ep (`eqxzoo.parallel.MeshConfig`)
    [pipeline]    schedule ("gpipe", "circular", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v"),
                  microbatches (M), repeats (R), remat_stages
    [optimizer]   `eqxzoo.optim.OptimizerConfig` (decay_steps defaults to run.steps)
    [precision]   params, compute, output (`eqxzoo.train.settings.Precision`)
    [loss]        the loss terms' weights, chunk_size, bias_update_rate
                  (`eqxzoo.train.loss_terms.LossConfig`)
    [data]        path, vocab_size, seq_len (T), batch_size (B), grad_accum (G), seed,
                  prefetch, num_threads, document_mask
    [checkpoint]  every, keep, async_save
    [sharding]    mesh axes per logical axis (`eqxzoo.parallel.ShardingConfig`)
    [lora]        rank, alpha, targets: train low-rank adapters only (`models.LoraConfig`)

The typed-TOML machinery (reading, ``--set``, type checks, writing) is
`eqxzoo.typed_config`; this module declares the sections and the rules that span several.
Missing sections and keys take their defaults. One optimizer step sees ``G * M * B``
sequences of ``T`` tokens. Everything is checked here, before any JAX work: unknown
sections or keys, wrongly typed values, non-positive sizes and combinations the mesh, the
schedule or the model cannot run each raise a `ConfigError` whose message is one line that
names the key (``mesh.dp: expected int, got 'two'``).
"""

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from eqxzoo.data.tokenizer import DEFAULT_VOCAB_SIZE, MIN_VOCAB_SIZE
from eqxzoo.nn.grouped import resolve_implementation
from eqxzoo.nn.kernels import cudnn_runs
from eqxzoo.nn.lora import FROZEN_BESIDE_ADAPTERS
from eqxzoo.optim import OptimizerConfig
from eqxzoo.parallel.mesh import (
    MESH_AXES,
    MeshConfig,
    MeshError,
    check_model_fits,
    partitions_stages,
)
from eqxzoo.parallel.pipeline import CONTEXT_AXIS, EXPERT_AXIS
from eqxzoo.parallel.rules import ShardingConfig
from eqxzoo.parallel.schedule import Schedule, ScheduleError, ScheduleName
from eqxzoo.train.loss_terms import LossConfig
from eqxzoo.train.settings import Precision, StepConfig
from eqxzoo.typed_config import (
    ConfigError,
    apply_overrides,
    build_dataclass,
    check_fields,
    dataclass_to_table,
    identity_field,
    keys_with_role,
    read_toml,
    refuse,
    require_at_least,
    runtime_field,
    toml_text,
)
from models.config import DecoderConfig, LoraConfig
from models.hf import config_with_hf
from models.registry import config_from_table

__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "LossConfig",
    "PipelineConfig",
    "Precision",
    "RESUMABLE_KEYS",
    "SWITCHED_OFF_BY_ZERO",
    "RunConfig",
    "RunSettings",
    "ShardingConfig",
    "check_kernel_platform",
    "config_from_dict",
    "config_to_dict",
    "config_to_toml",
    "devices_needed",
    "load_config",
    "mesh_config",
    "step_config",
]

DEFAULT_COMPILATION_CACHE_DIR = "~/.cache/eqxzoo/jax-compilation-cache"
STDLIB_DATA = "stdlib"


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """``[run]``: how long to train and what to log.

    ``eval_every = 0`` never evaluates; ``max_nonfinite`` stops the run after that many
    non-finite steps in a row; ``compilation_cache_dir = ""`` disables JAX's persistent
    compilation cache (``~`` is expanded by the run loop).
    """

    name: str = runtime_field("run")
    seed: int = identity_field(0)
    steps: int = runtime_field(1000)
    log_every: int = runtime_field(10)
    eval_every: int = runtime_field(500)
    eval_batches: int = runtime_field(8)
    max_nonfinite: int = runtime_field(3)
    compilation_cache_dir: str = runtime_field(DEFAULT_COMPILATION_CACHE_DIR)
    tensorboard: bool = runtime_field(True)
    wandb: bool = runtime_field(False)
    wandb_project: str = runtime_field("eqxzoo")
    plot: bool = runtime_field(True)

    def __post_init__(self):
        check_fields(self)
        if not self.name.strip():
            refuse("name", "must not be empty")
        require_at_least(self, 1, "steps", "log_every", "eval_batches", "max_nonfinite")
        require_at_least(self, 0, "eval_every")
        if self.wandb and not self.wandb_project.strip():
            refuse("wandb_project", "must not be empty when wandb = true")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """``[pipeline]``: the schedule over the ``mesh.pp`` stages (see `eqxzoo.parallel.Schedule`).

    ``gpipe`` runs each stage's layers once per microbatch (``repeats = 1``); ``circular``
    splits the layers into ``repeats`` rounds over the stages (needs ``microbatches >= pp``).
    ``1f1b``, ``interleaved_1f1b`` (``repeats > 1``), ``zb_h1`` and ``zb_v`` (``repeats = 2``,
    chunks placed in a V) run the backward in the same scan and keep at most ~``pp``
    microbatches of activations. ``remat_stages``
    recomputes each stage's activations in the backward pass.
    """

    schedule: ScheduleName = runtime_field("gpipe")
    microbatches: int = runtime_field(1)
    repeats: int = runtime_field(1)
    remat_stages: bool = runtime_field(True)

    def __post_init__(self):
        check_fields(self)
        require_at_least(self, 1, "microbatches", "repeats")


MAX_SEQ_LEN = 2**22


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """``[data]``: where the tokens come from and the ``(G, M, B, T)`` batch they form.

    ``path = "stdlib"`` is the built-in corpus (this Python's standard library), prepared
    on first use with a byte-level BPE of ``vocab_size`` tokens; any other path is a
    directory written by ``python -m pipelines.prepare`` (whose tokenizer decides the
    vocabulary; write ``./stdlib`` for a directory of that name). ``batch_size`` is the
    global number of sequences per microbatch, split over ``mesh.dp``; ``prefetch`` batches
    are read ahead on ``num_threads`` threads.

    ``document_mask`` keeps the documents packed into a window apart: batches carry segment
    ids and per-document positions, so attention stays within a document and positions
    restart at each (`eqxzoo.data.loader`). Unset, it is on for chat and prompt-completion
    data, where each record is one example that must not see the others, and off for plain
    text, the usual pretraining packing (a window reads across document boundaries, and the
    end-of-document token teaches where one ends).
    """

    path: str = identity_field(STDLIB_DATA)
    vocab_size: int = identity_field(DEFAULT_VOCAB_SIZE)
    seq_len: int = identity_field(1024)
    batch_size: int = runtime_field(8)
    grad_accum: int = runtime_field(1)
    seed: int = identity_field(0)
    prefetch: int = runtime_field(2)
    num_threads: int = runtime_field(2)
    document_mask: bool | None = identity_field(None)

    def __post_init__(self):
        check_fields(self)
        if not self.path.strip():
            refuse("path", f"must name a prepared data directory or {STDLIB_DATA!r}")
        require_at_least(self, MIN_VOCAB_SIZE, "vocab_size")
        require_at_least(self, 1, "seq_len", "batch_size", "grad_accum", "num_threads")
        if self.seq_len > MAX_SEQ_LEN:
            refuse(
                "seq_len",
                f"must be <= {MAX_SEQ_LEN:,}, got {self.seq_len:,} (far longer windows "
                "overflow the compiler's array sizes)",
            )
        require_at_least(self, 0, "prefetch")

    @property
    def is_stdlib(self) -> bool:
        return self.path == STDLIB_DATA


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """``[checkpoint]``: save every ``every`` steps (and at the end), keep the newest ``keep``."""

    every: int = runtime_field(1000)
    keep: int = runtime_field(3)
    async_save: bool = runtime_field(True)

    def __post_init__(self):
        check_fields(self)
        require_at_least(self, 1, "every", "keep")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A whole training run; construction checks every combination the sections allow.

    ``init_from_hf`` (``[model] init_from_hf`` in TOML; ``""``: none) is a Hugging Face
    checkpoint directory a fresh run loads its parameters from; ``model`` is then that
    checkpoint's architecture. The checks that involve several sections (schedule vs. mesh, model vs. mesh, batch vs.
    mesh, corpus vocabulary vs. model) reuse `Schedule` and `check_model_fits`, and name the
    key a user would change.
    """

    run: RunSettings = dataclasses.field(default_factory=RunSettings)
    model: DecoderConfig = dataclasses.field(default_factory=DecoderConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    precision: Precision = dataclasses.field(default_factory=Precision)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    sharding: ShardingConfig = dataclasses.field(default_factory=ShardingConfig)
    lora: LoraConfig | None = None
    init_from_hf: str = runtime_field("")

    def __post_init__(self):
        self._check_schedule()
        self._check_model_fits_mesh()
        self._check_batch_and_vocab()
        self._check_context_split()
        self._check_attention_kernel()
        if self.lora is not None:
            _ = self.adapted_model

    @property
    def adapted_model(self) -> DecoderConfig:
        """``model`` with the run's LoRA adapters (``[lora]``), or as it is without them."""
        return self.model if self.lora is None else dataclasses.replace(self.model, lora=self.lora)

    @property
    def schedule(self) -> Schedule:
        """The pipeline schedule: ``mesh.pp`` stages, ``pipeline.microbatches``, ``repeats``,
        with R actions where ``pipeline.remat_stages`` asks for them."""
        return Schedule(
            self.pipeline.schedule,
            stages=self.mesh.pp,
            microbatches=self.pipeline.microbatches,
            repeats=self.pipeline.repeats,
        ).for_stage_remat(self.pipeline.remat_stages)

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step: ``G * M * B``."""
        return self.data.grad_accum * self.pipeline.microbatches * self.data.batch_size

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.data.seq_len

    def _check_schedule(self) -> None:
        try:
            _ = self.schedule
        except ScheduleError as error:
            # PipelineConfig already checked the name and the sizes: what is left is a
            # repeats the schedule does not take, or too few microbatches for the stages.
            note = ""
            if error.field == "microbatches":
                note = " (stages = mesh.pp): raise pipeline.microbatches or lower mesh.pp"
            raise ConfigError(error.problem + note, field=f"pipeline.{error.field}") from None

    def _check_model_fits_mesh(self) -> None:
        model, mesh = self.model, self.mesh
        n_experts = None if model.moe is None else model.moe.n_experts
        pipelined = "model.n_layers"
        if model.first_dense_layers:
            pipelined = (
                f"the {model.n_blocks} pipelined layers (model.n_layers={model.n_layers} less "
                f"model.first_dense_layers={model.first_dense_layers})"
            )
        # One mesh axis at a time, so the message names the axis that does not fit.
        for key, axis_only, fix in (
            (
                "mesh.pp",
                MeshConfig(pp=mesh.pp),
                f"choose mesh.pp and pipeline.repeats whose product divides {pipelined}",
            ),
            ("mesh.tp", MeshConfig(tp=mesh.tp), "choose a mesh.tp that divides model.n_heads"),
            (
                "mesh.ep",
                MeshConfig(ep=mesh.ep),
                "choose a mesh.ep that divides model.moe.n_experts (1 for a dense model)",
            ),
        ):
            try:
                check_model_fits(
                    axis_only,
                    n_layers=model.n_blocks,
                    n_heads=model.n_heads,
                    n_experts=n_experts,
                    repeats=self.pipeline.repeats,
                )
            except MeshError as error:
                raise ConfigError(f"{error}; {fix}", field=key) from None
        kv_heads = model.kv_heads
        if kv_heads % mesh.tp != 0 and mesh.tp % kv_heads != 0:
            refuse(
                "mesh.tp",
                f"model.n_kv_heads={kv_heads} must be a multiple of tp={mesh.tp} (kv heads split "
                "over tp) or divide it (kv heads replicated over tp groups)",
            )

    def _check_batch_and_vocab(self) -> None:
        data, mesh = self.data, self.mesh
        data_devices = mesh.dp * mesh.ep
        if data.batch_size % data_devices != 0:
            over = (
                f"mesh.dp={mesh.dp}"
                if mesh.ep == 1
                else f"mesh.dp x mesh.ep = {mesh.dp} x {mesh.ep} (each expert-parallel device "
                "holds its own sequences)"
            )
            refuse(
                "data.batch_size",
                f"{data.batch_size} sequences per microbatch cannot be split evenly over "
                f"{over}; use a multiple of {data_devices}",
            )
        positions = self.model.max_positions
        if self.model.positions == "learned" and data.seq_len > positions:
            refuse(
                "data.seq_len",
                f"{data.seq_len} tokens per sequence, but the model learns {positions} "
                f"positions (model.max_positions); set data.seq_len <= {positions}",
            )
        if data.is_stdlib and data.vocab_size > self.model.vocab_size:
            refuse(
                "data.vocab_size",
                f"the stdlib corpus would have {data.vocab_size} token ids but "
                f"model.vocab_size={self.model.vocab_size}; set data.vocab_size <= "
                f"{self.model.vocab_size} or model.vocab_size >= {data.vocab_size}",
            )

    def _check_context_split(self) -> None:
        """``mesh.cp`` splits each sequence into ``2 cp`` equal chunks (`eqxzoo.nn.balanced_order`)."""
        cp, seq_len = self.mesh.cp, self.data.seq_len
        if self.model.context_axis is not None:
            refuse(
                "model.context_axis",
                "is set by the trainer from mesh.cp (the layers then split each sequence over "
                "it); leave it unset and set mesh.cp",
            )
        if self.model.expert_axis is not None:
            refuse(
                "model.expert_axis",
                "is set by the trainer from mesh.ep (the MoE layers then split their experts "
                "over it); leave it unset and set mesh.ep",
            )
        if cp == 1:
            return
        if seq_len % (2 * cp) != 0:
            refuse(
                "data.seq_len",
                f"{seq_len} tokens do not split into 2 x mesh.cp = {2 * cp} equal chunks (each "
                f"cp shard holds a chunk from the front and its mirror from the back); use a "
                f"multiple of {2 * cp}",
            )
        if self.model.moe is not None and self.model.moe.routing == "capacity":
            refuse(
                "model.moe.routing",
                "'capacity' ranks each sequence's assignments in order, which a sequence split "
                "over mesh.cp cannot: route 'dropless' (or set mesh.cp = 1)",
            )

    def _check_attention_kernel(self) -> None:
        """``"cudnn"`` needs the compute dtype cuDNN's fused attention takes; the model's own
        attention is its config's to check, the platform `check_kernel_platform`'s."""
        if self.model.attention_kernel != "cudnn":
            return
        runs = cudnn_runs(dtype=self.precision.compute)
        if runs is not True:
            refuse(
                "model.attention_kernel",
                f"'cudnn' cannot run with precision.compute = {self.precision.compute!r}: "
                f"cuDNN's fused attention {runs}, on an NVIDIA GPU; use 'auto', 'blockwise' or "
                "'dense', or set precision.compute = 'bfloat16'",
            )


def check_kernel_platform(config: RunConfig, platform: str) -> None:
    """Refuse ``model.attention_kernel = "cudnn"`` on devices of a ``platform`` cuDNN does not
    run on (``"cpu"``): known only once the run has its devices, and checked then, before
    anything compiles (the step would otherwise fail while tracing)."""
    if config.model.attention_kernel != "cudnn":
        return
    runs = cudnn_runs(platform=platform)
    if runs is not True:
        refuse(
            "model.attention_kernel",
            f"'cudnn' cannot run here: cuDNN's fused attention {runs} (with bfloat16 or "
            "float16 compute); use 'auto', 'blockwise' or 'dense'",
        )


# ----------------------------------------------------------------------------- reading

SECTIONS: dict[str, type] = {
    field.name: field.type
    for field in dataclasses.fields(RunConfig)
    if field.name not in ("init_from_hf", "lora")  # a key of [model]; a section of its own
} | {"lora": LoraConfig}
# Sections a config may leave out to leave their feature off (not written then).
OPTIONAL_SECTIONS = ("lora",)


# The config's paths (``section.key``), each made absolute as a config is read
# (``run.compilation_cache_dir``, whose default is under ``~``, where it is used).
PATH_KEYS = ("data.path", "model.init_from_hf")


def config_from_dict(document: Mapping[str, Any]) -> RunConfig:
    """A validated `RunConfig` from a parsed TOML (or JSON) document, as `config_to_dict`
    writes, with its paths absolute (`with_absolute_paths`)."""
    if not isinstance(document, Mapping):
        raise ConfigError(f"config: must be a table of sections, got {type(document).__name__}")
    document = with_absolute_paths(document)
    for name in document:
        if name not in SECTIONS:
            refuse(str(name), f"unknown section; valid sections are {sorted(SECTIONS)}")
    run = build_dataclass(RunSettings, document.get("run", {}), "run")
    sections: dict[str, Any] = {"run": run}
    for name, cls in SECTIONS.items():
        table = document.get(name, {})
        if name == "run":
            continue
        if name in OPTIONAL_SECTIONS and name not in document:
            continue
        if name == "model":
            sections[name], sections["init_from_hf"] = _model_section(table)
        elif name == "optimizer" and isinstance(table, Mapping) and "decay_steps" not in table:
            try:
                sections[name] = build_dataclass(cls, {**table, "decay_steps": run.steps}, name)
            except ConfigError as error:
                if error.field == "optimizer.warmup_steps":
                    note = " (decay_steps defaults to run.steps)"
                    raise ConfigError(error.problem + note, field=error.field) from None
                raise
        else:
            sections[name] = build_dataclass(cls, table, name)
    return RunConfig(**sections)


def with_absolute_paths(document: Mapping[str, Any]) -> dict[str, Any]:
    """``document`` with each of `PATH_KEYS` that holds a path (not ``""``, not the built-in
    ``"stdlib"`` corpus) made absolute: ``~`` expanded, relative to the working directory,
    through symlinks. Read once here, a config's paths mean the same to every part of a run
    (orbax takes only absolute ones) and to a later command run from elsewhere."""
    document = {
        name: dict(table) if isinstance(table, Mapping) else table
        for name, table in document.items()
    }
    for key in PATH_KEYS:
        section, name = key.split(".")
        table = document.get(section)
        value = table.get(name) if isinstance(table, Mapping) else None
        if isinstance(value, str) and value.strip() and value != STDLIB_DATA:
            table[name] = str(Path(value).expanduser().resolve())
    return document


def _model_section(table: Any) -> tuple[DecoderConfig, str]:
    """``[model]``: the family config and ``init_from_hf`` (``""`` when not given)."""
    if not isinstance(table, Mapping) or "init_from_hf" not in table:
        return config_from_table(table, where="model"), ""
    table = dict(table)
    directory = table.pop("init_from_hf")
    if not isinstance(directory, str):
        refuse("model.init_from_hf", f"expected a directory path, got {directory!r}")
    if not directory.strip():
        return config_from_table(table, where="model"), ""
    return config_with_hf(table, directory, where="model"), directory


def load_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> RunConfig:
    """Read the TOML run config at ``path``, apply ``--set`` ``overrides``, validate.

    Each override is ``section.key=value`` (nested tables: ``model.moe.n_experts=8``); the
    value is read as a TOML value and, when it is not one, as a plain string, so
    ``data.path=/tmp/x`` and ``pipeline.schedule=circular`` need no quotes.
    """
    if isinstance(overrides, str):
        overrides = (overrides,)
    return config_from_dict(apply_overrides(read_toml(path), overrides))


# ----------------------------------------------------------------------------- writing


def config_to_dict(config: RunConfig) -> dict[str, Any]:
    """Every section with every key (JSON- and TOML-able); `config_from_dict` rebuilds ``config``."""
    document = {
        name: dataclass_to_table(getattr(config, name))
        for name in SECTIONS
        if getattr(config, name) is not None
    }
    document["model"] = {
        "family": config.model.family,
        "init_from_hf": config.init_from_hf,
        **document["model"],
    }
    return document


def config_to_toml(config: RunConfig) -> str:
    """``config`` as TOML text that `load_config` reads back to an equal config."""
    return toml_text(config_to_dict(config))


# ----------------------------------------------------------------------------- views


def step_config(config: RunConfig) -> StepConfig:
    """What `eqxzoo.train` needs: schedule, optimizer, precision, loss weights, remat, rules.
    With ``[lora]`` the optimizer freezes every parameter but the adapters."""
    optimizer = config.optimizer
    if config.lora is not None:
        freeze = (*optimizer.freeze, FROZEN_BESIDE_ADAPTERS)
        optimizer = dataclasses.replace(optimizer, freeze=freeze)
    return StepConfig(
        schedule=config.schedule,
        optimizer=optimizer,
        precision=config.precision,
        loss=config.loss,
        remat_stages=config.pipeline.remat_stages,
        sharding=config.sharding,
        mesh_axes=config.mesh.axis_names,
    )


def lora_line(config: RunConfig) -> str | None:
    """What ``[lora]`` trains, for the run's and the dry run's first lines (None without it)."""
    if config.lora is None:
        return None
    from models import parameter_counts

    counts, lora = parameter_counts(config.adapted_model), config.lora
    base = (
        f"the base weights of {config.init_from_hf} frozen"
        if config.init_from_hf
        else "the base weights frozen at the seed's random initialisation (model.init_from_hf "
        "is empty: no pretrained model is adapted)"
    )
    return (
        f"LoRA: training {counts.trainable:,} of {counts.total:,} parameters "
        f"({counts.trainable / counts.total:.2%}): rank {lora.rank}, alpha {lora.alpha:g} on "
        f"{', '.join(lora.targets)}; {base}"
    )


def run_model_config(config: RunConfig) -> DecoderConfig:
    """The model a run builds: `RunConfig.adapted_model` on its mesh (`model_config_for_mesh`)."""
    return model_config_for_mesh(config.adapted_model, config.mesh)


def model_config_for_mesh(model: DecoderConfig, mesh: MeshConfig) -> DecoderConfig:
    """``model`` as a run builds it on ``mesh``: its layers split each sequence over ``cp``
    where ``mesh.cp > 1`` (``context_axis``), a MoE model's experts over ``ep`` where
    ``mesh.ep > 1`` (``expert_axis``; a dense model is refused ``ep > 1``); MoE experts
    whose ``dropless_kernel`` is
    ``"auto"`` run ``"slotted"`` where `jax.lax.ragged_dot` is not native and the mesh
    neither splits pipeline stages over more axes (`eqxzoo.parallel.mesh.partitions_stages`:
    the slotted kernel's data-dependent loop cannot run there) nor splits the sequences (each
    cp shard would loop as often as its own tokens overflow), else ``"sorted"``."""
    if mesh.cp > 1:
        model = dataclasses.replace(model, context_axis=CONTEXT_AXIS)
    if mesh.ep > 1 and model.moe is not None:
        model = dataclasses.replace(model, expert_axis=EXPERT_AXIS)
    if model.moe is None or model.moe.dropless_kernel != "auto":
        return model
    mesh_shape = dict(zip(MESH_AXES, mesh.shape, strict=True))
    native = resolve_implementation("auto") == "ragged_dot"
    sorted_only = partitions_stages(mesh_shape) or mesh.cp > 1
    kernel = "sorted" if native or sorted_only else "slotted"
    return dataclasses.replace(model, moe=dataclasses.replace(model.moe, dropless_kernel=kernel))


def document_key(key: str) -> str:
    """A `RunConfig` leaf's dotted key in the config document (``init_from_hf`` is a key of
    ``[model]``)."""
    return f"model.{key}" if key == "init_from_hf" else key


# The keys a resume may change (declared `runtime_field`), and those among them whose 0 turns
# a transformation off, and with it its optimizer state (a resume may not cross 0).
RESUMABLE_KEYS = tuple(map(document_key, keys_with_role(RunConfig, "runtime")))
SWITCHED_OFF_BY_ZERO = tuple(
    map(document_key, keys_with_role(RunConfig, "runtime", off_at_zero=True))
)


def mesh_config(config: RunConfig) -> MeshConfig:
    return config.mesh


def devices_needed(config: RunConfig) -> int:
    """``dp * pp * tp * ep``: the devices the mesh spans."""
    return config.mesh.size
