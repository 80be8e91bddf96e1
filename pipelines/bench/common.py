"""What every part of the benchmark shares: the reference model, its batches, a compiled
step to time (`StepRunner`), PyTorch's step of the same model, and timing in turn."""

import dataclasses
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

import models
from eqxzoo.optim import OptimizerConfig
from eqxzoo.parallel import MeshConfig, Schedule, make_mesh
from eqxzoo.parallel.rules import ShardingConfig
from eqxzoo.run.config import model_config_for_mesh
from eqxzoo.train.loss_terms import LossConfig
from eqxzoo.train.report import median_seconds
from eqxzoo.train.settings import StepConfig
from eqxzoo.train.state import abstract_train_state, init_train_state
from eqxzoo.train.step import batch_sharding, check_no_permutes_in_branches, make_train_step

REFERENCE = dict(vocab_size=1024, d_model=256, n_layers=4, n_heads=4, mlp_dim=1024)


BATCH, SEQ = 8, 256


# --quick: the same measurements on a toy model and the fewest points of each sweep, to check
# the command and its JSON in tests.
QUICK = dict(vocab_size=64, d_model=32, n_layers=4, n_heads=4, mlp_dim=128)


QUICK_BATCH, QUICK_SEQ = 2, 16


def reference_config(n_layers: int = 4, *, quick: bool = False) -> models.LlamaConfig:
    """4 layers, d_model 256, 4 heads, GELU MLP 1024, LayerNorm, untied head, vocab 1024."""
    sizes = QUICK if quick else REFERENCE
    return models.LlamaConfig(
        **{**sizes, "n_layers": n_layers}, activation="gelu", norm="layer", norm_eps=1e-5
    )


def make_batch(shape: tuple[int, ...], vocab: int) -> dict[str, jax.Array]:
    tokens = jax.random.randint(jax.random.key(0), shape, 0, vocab)
    return {"tokens": tokens, "targets": jnp.roll(tokens, -1, axis=-1)}


class StepRunner:
    """A sharded train state and its compiled step on ``mesh_config``, for timing."""

    def __init__(
        self,
        model_config,
        mesh_config: MeshConfig,
        schedule: Schedule,
        batch_shape,
        *,
        remat_stages=True,
        loss_chunk_size: int = LossConfig.chunk_size,
        compile_only: bool = False,
        sharding: ShardingConfig | None = None,
        split_experts: bool = True,
    ):
        devices = jax.devices()[: mesh_config.size]
        self.mesh = make_mesh(mesh_config, devices)
        self.config = StepConfig(
            schedule=schedule,
            optimizer=OptimizerConfig(warmup_steps=10, decay_steps=1000),
            remat_stages=remat_stages,
            loss=LossConfig(chunk_size=loss_chunk_size),
            **({} if sharding is None else {"sharding": sharding}),
        )
        model_config = model_config_for_mesh(model_config, mesh_config)
        if not split_experts:
            model_config = dataclasses.replace(model_config, expert_axis=None)
        make_model = models.model_factory(model_config)
        batches = batch_sharding(self.mesh, self.config.rules)
        if compile_only:
            self.state = abstract_train_state(make_model, config=self.config, mesh=self.mesh)
            ids = jax.ShapeDtypeStruct(batch_shape, jnp.int32, sharding=batches)
            self.batch = {"tokens": ids, "targets": ids}
        else:
            self.state = init_train_state(
                make_model, jax.random.key(0), config=self.config, mesh=self.mesh
            )
            self.batch = jax.device_put(make_batch(batch_shape, model_config.vocab_size), batches)
        self.step_fn = make_train_step(self.config, self.mesh)
        start = time.perf_counter()
        self.compiled = self.step_fn.lower(self.state, self.batch).compile()
        self.compile_seconds = time.perf_counter() - start
        if not compile_only:
            # A step the run would refuse as one XLA:CPU hangs in is refused here too.
            check_no_permutes_in_branches(self.compiled, self.mesh)
        self.tokens = self.batch["tokens"].size

    def step(self):
        self.state, self.metrics = self.compiled(self.state, self.batch)
        return self.metrics["loss"]

    def tokens_per_second(self, repeats: int) -> float:
        return self.tokens / median_seconds(self.step, repeats=repeats)

    def memory_bytes(self) -> int:
        """Per-device bytes: arguments + outputs + temporaries of the compiled step."""
        analysis = self.compiled.memory_analysis()
        return int(
            analysis.argument_size_in_bytes
            + analysis.output_size_in_bytes
            + analysis.temp_size_in_bytes
            - analysis.alias_size_in_bytes
        )


def batch_and_seq(quick: bool) -> tuple[int, int]:
    return (QUICK_BATCH, QUICK_SEQ) if quick else (BATCH, SEQ)


def median_ratio(numerators: list[float], denominators: list[float]) -> float:
    """The median over rounds of ``numerator / denominator`` (times of the same round)."""
    return statistics.median(n / d for n, d in zip(numerators, denominators, strict=True))


def pytorch_step(quick: bool, batch: int, seq: int) -> Callable[[], None] | None:
    """PyTorch eager's train step of the reference model (None without torch)."""
    try:
        from pipelines.torch_reference import torch_train_step
    except ImportError:
        return None
    return torch_train_step(**(QUICK if quick else REFERENCE), batch=batch, seq_len=seq)


def interleaved_times(
    steps: dict[str, Callable[[], object]], repeats: int
) -> dict[str, list[float]]:
    """Wall times of each step, the steps run in turn ``repeats`` times (after one warm-up
    call each): round ``i`` of every step ran side by side."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(repeats + 1):
        for name, step in steps.items():
            start = time.perf_counter()
            jax.block_until_ready(step())
            if round_:
                times[name].append(time.perf_counter() - start)
    return times


def interleaved_seconds(steps: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median wall time of each step of `interleaved_times`."""
    times = interleaved_times(steps, repeats)
    return {name: statistics.median(values) for name, values in times.items()}
