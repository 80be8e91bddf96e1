"""``--dry-run``: plan a mesh before renting it. Builds the mesh and the compiled step from
shapes alone (nothing is initialised), then reports parameter counts, each parameter's
sharding and the compiled step's per-device memory."""

import math
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from eqxzoo.config import RunConfig, step_config
from eqxzoo.parallel import make_mesh
from eqxzoo.train.loop import batch_shape
from eqxzoo.train.report import flops_per_token, parameter_counts
from eqxzoo.train.state import abstract_train_state
from eqxzoo.train.step import batch_sharding, make_train_step
from models import model_factory


def format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    raise AssertionError


def sharding_table(state) -> list[tuple[str, str, str, str, str]]:
    """``(parameter, shape, dtype, PartitionSpec, bytes per device)`` for every model array."""
    rows = []
    leaves, _ = jax.tree_util.tree_flatten_with_path(state.model)
    for path, leaf in leaves:
        shard_shape = leaf.sharding.shard_shape(leaf.shape)
        per_device = math.prod(shard_shape) * jnp.dtype(leaf.dtype).itemsize
        rows.append(
            (
                jax.tree_util.keystr(path).lstrip("."),
                "x".join(map(str, leaf.shape)),
                jnp.dtype(leaf.dtype).name,
                str(tuple(leaf.sharding.spec)),
                format_bytes(per_device),
            )
        )
    return rows


def dry_run(config: RunConfig, say: Callable[[str], None] = print) -> dict[str, float]:
    """Print the plan of ``config``'s run; returns its figures (for tests and scripts)."""
    mesh = make_mesh(config.mesh)
    config_for_step = step_config(config)
    target = abstract_train_state(model_factory(config.model), config=config_for_step, mesh=mesh)
    counts = parameter_counts(config.model)
    shape = batch_shape(config)
    batch = {
        name: jax.ShapeDtypeStruct(
            shape.shape, jnp.int32, sharding=batch_sharding(mesh, config_for_step.rules)
        )
        for name in ("tokens", "targets")
    }
    start = time.perf_counter()
    compiled = make_train_step(config_for_step, mesh).lower(target, batch).compile()
    compile_seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()

    say(
        f"config {config.run.name}: mesh {dict(mesh.shape)} on {mesh.devices.size} {mesh.devices.flat[0].platform} devices"
    )
    say(
        f"parameters: {counts.total:,} total, {counts.active:,} active per token "
        f"({counts.embedding:,} in the input embedding)"
    )
    say(
        f"batch per step: {shape.windows} sequences x {shape.seq_len} tokens "
        f"(G={shape.grad_accum}, M={shape.microbatches}, B={shape.batch_size}); "
        f"{flops_per_token(config.model, shape.seq_len) * config.tokens_per_step:.3g} "
        "training FLOPs per step"
    )
    rows = [("parameter", "shape", "dtype", "sharding", "per device")] + sharding_table(target)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        say("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)))
    figures = {
        "parameters": counts.total,
        "active_parameters": counts.active,
        "compile_seconds": compile_seconds,
    }
    if memory is not None:
        figures |= {
            "argument_bytes": memory.argument_size_in_bytes,
            "output_bytes": memory.output_size_in_bytes,
            "alias_bytes": memory.alias_size_in_bytes,
            "temp_bytes": memory.temp_size_in_bytes,
        }
        total = (
            memory.argument_size_in_bytes
            + memory.output_size_in_bytes
            - memory.alias_size_in_bytes
            + memory.temp_size_in_bytes
        )
        figures["device_bytes"] = total
        say(
            f"per-device memory of the compiled step: {format_bytes(total)} = arguments "
            f"{format_bytes(memory.argument_size_in_bytes)} + outputs "
            f"{format_bytes(memory.output_size_in_bytes)} - donated "
            f"{format_bytes(memory.alias_size_in_bytes)} + temporaries "
            f"{format_bytes(memory.temp_size_in_bytes)}"
        )
    say(f"compiled the train step in {compile_seconds:.1f} s; dry run: nothing was trained")
    return figures
