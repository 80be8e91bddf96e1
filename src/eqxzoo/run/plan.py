"""``--dry-run``: plan a mesh before renting it. Builds the mesh and the compiled step from
shapes alone (nothing is initialised), then reports parameter counts, each parameter's
sharding, the schedule's modelled bubble (with unit and with measured action costs), the
bytes its collectives move within and across slices, and the compiled step's per-device
memory."""

import dataclasses
import math
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.extend import core
from jax.sharding import Mesh

from eqxzoo.parallel import MeshConfig, Schedule, make_mesh
from eqxzoo.parallel.action_costs import (
    measured_action_flops,
    measured_bubble_fraction,
    measured_step_time,
    pricing_schedule,
)
from eqxzoo.parallel.collectives import Link, Traffic, links
from eqxzoo.parallel.mesh import DP_ACROSS_SLICES
from eqxzoo.run.config import (
    RunConfig,
    check_kernel_platform,
    lora_line,
    run_model_config,
    step_config,
)
from eqxzoo.run.loop import batch_shape, run_memory_checks
from eqxzoo.run.provenance import batches_carry_documents
from eqxzoo.train.memory import StepMemory, format_bytes
from eqxzoo.train.settings import StepConfig
from eqxzoo.train.state import ModelFactory, TrainState, abstract_train_state
from eqxzoo.train.step import (
    batch_sharding,
    bubble_verdicts,
    compile_train_step_for,
    make_train_step,
)
from models import flops_per_token, model_factory, parameter_counts
from models.hf import open_hf


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


def mib(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:,.2f} MiB"


def collectives_report(hlo_text: str, mesh: MeshConfig) -> tuple[list[str], dict[Link, Traffic]]:
    """The ``collectives:`` line (bytes per step within and across slices, and the axes
    each cross-slice collective runs over), a note where FSDP gathers weights across
    slices; and the traffic by `Link`."""
    by_link = links(hlo_text, mesh.axis_names, mesh.slice_indices())
    within = sum(t.bytes for link, t in by_link.items() if not link.across_slices)
    across = sorted(
        ((link, t) for link, t in by_link.items() if link.across_slices),
        key=lambda item: -item[1].bytes,
    )
    if mesh.dcn.slices == 1:
        return [
            f"collectives: {mib(within)} per step, within one slice ([mesh.dcn] spans none)"
        ], by_link
    parts = [f"{link.describe()}: {t.count} ops, {mib(t.bytes)}" for link, t in across]
    lines = [
        f"collectives: {mib(within)} per step within slices, "
        f"{mib(sum(t.bytes for _, t in across))} across {mesh.dcn.slices} slices"
        + (f" ({'; '.join(parts)})" if parts else "")
    ]
    gathers = sum(
        t.bytes
        for link, t in across
        if link.kind in ("all-gather", "reduce-scatter") and DP_ACROSS_SLICES in link.axes
    )
    if gathers:
        lines.append(
            f"note: FSDP over the whole of dp moves every layer's weights across slices "
            f"({mib(gathers)} of all-gathers and reduce-scatters over {DP_ACROSS_SLICES} per "
            'step): sharding.embed = ["dp_ici", "ep"] keeps FSDP within a slice, so that only '
            "the gradient reduction crosses"
        )
    return lines, by_link


def step_tracer(
    config: StepConfig,
    mesh: Mesh,
    make_model: ModelFactory,
    state: TrainState,
    batch_shape: tuple[int, int, int, int],
) -> Callable[[Schedule], core.ClosedJaxpr]:
    """``trace(schedule)``: the train step of ``config`` run with ``schedule``, traced on
    abstract arrays and ``(G, M, B, T)`` batches, nothing compiled: what prices the
    schedule's actions (`eqxzoo.parallel.action_costs`). ``state`` is the abstract state of
    ``config``'s own schedule; another (a forward schedule's 1F1B) gets its own layout."""
    ids = jax.ShapeDtypeStruct(batch_shape, jnp.int32, sharding=batch_sharding(mesh, config.rules))

    def trace(schedule: Schedule) -> core.ClosedJaxpr:
        step_config = dataclasses.replace(config, schedule=schedule)
        if schedule != config.schedule:
            state_for = abstract_train_state(make_model, config=step_config, mesh=mesh)
        else:
            state_for = state
        step = make_train_step(step_config, mesh)
        return step.trace(state_for, {"tokens": ids, "targets": ids}).jaxpr

    return trace


def dry_run(config: RunConfig, say: Callable[[str], None] = print) -> dict[str, object]:
    """Print the plan of ``config``'s run; returns its figures (for tests and scripts)."""
    checkpoint = open_hf(config.init_from_hf) if config.init_from_hf else None
    mesh = make_mesh(config.mesh)
    check_kernel_platform(config, mesh.devices.flat[0].platform)
    config_for_step = step_config(config)
    make_model = model_factory(run_model_config(config))
    target = abstract_train_state(make_model, config=config_for_step, mesh=mesh)
    counts = parameter_counts(config.adapted_model)
    shape = batch_shape(config)
    start = time.perf_counter()
    documents = batches_carry_documents(config)
    compiled, config_for_step = compile_train_step_for(
        config_for_step,
        mesh,
        target,
        shape.shape,
        documents=documents,
        verdicts=bubble_verdicts(),
    )
    compile_seconds = time.perf_counter() - start
    memory = StepMemory.of(compiled)
    schedule = config.schedule
    action_flops = measured_action_flops(
        schedule, step_tracer(config_for_step, mesh, make_model, target, shape.shape)
    )

    say(
        f"config {config.run.name}: mesh {dict(mesh.shape)} on {mesh.devices.size} {mesh.devices.flat[0].platform} devices"
    )
    say(
        f"parameters: {counts.total:,} total, {counts.active:,} active per token "
        f"({counts.embedding:,} in the input embedding)"
    )
    if lora_line(config) is not None:
        say(lora_line(config))
    if checkpoint is not None:
        files = checkpoint.files
        say(
            f"parameters from the Hugging Face checkpoint {checkpoint.directory}: "
            f"{len(files.names())} tensors, {files.total_bytes / 1e6:,.2f} MB, names, shapes "
            "and dtypes checked (a dry run reads no weights)"
        )
    context = config.mesh.cp
    say(
        f"batch per step: {shape.windows} sequences x {shape.seq_len} tokens "
        f"(G={shape.grad_accum}, M={shape.microbatches}, B={shape.batch_size}"
        + (
            ""
            if context == 1
            else f"; each sequence split over cp={context}, {shape.seq_len // context} tokens "
            f"per device, {config.model.context_parallel} attention across them"
        )
        + ("; packed documents kept apart" if documents else "")
        + f"); {flops_per_token(config.model, shape.seq_len) * config.tokens_per_step:.3g} "
        "training FLOPs per step"
    )
    measured_by = pricing_schedule(schedule)
    measured = (
        f"{measured_bubble_fraction(schedule, action_flops):.1%} (measured action FLOPs"
        + ("" if measured_by == schedule else f" of the {measured_by.name} step")
        + f", {action_flops.ratio()}: a step of "
        f"{measured_step_time(schedule, action_flops):.3g} stage forwards)"
    )
    say(
        f"schedule {schedule.name}: P={schedule.stages} stages, M={schedule.microbatches} "
        f"microbatches, R={schedule.repeats} repeats; modelled bubble "
        f"{schedule.bubble_fraction():.1%} (lockstep, F = B = W = 1: a step of "
        f"{schedule.modelled_time():g} stage forwards for {schedule.modelled_work():g} of "
        f"work), {measured}; at most {schedule.in_flight()} microbatch "
        + ("chunks" if schedule.repeats > 1 else "inputs")
        + " in flight per stage"
        + (
            ""
            if memory is None
            else f"; activation memory {format_bytes(memory.temporaries)} per device"
            + ("" if context == 1 else f" (holding 1/{context} of each sequence)")
        )
    )
    collective_lines, by_link = collectives_report(compiled.as_text(), config.mesh)
    for line in collective_lines:
        say(line)
    if not config_for_step.skip_bubbles:
        say(
            "the stages compute through their bubbles: XLA:CPU cannot skip them in this "
            "program (collective-permutes in the stage)"
        )
    rows = [("parameter", "shape", "dtype", "sharding", "per device")] + sharding_table(target)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        say("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)))
    figures = {
        "bubble_fraction": schedule.bubble_fraction(),
        "bubble_fraction_measured": measured_bubble_fraction(schedule, action_flops),
        "action_costs": action_flops.relative(),
        "action_flops": action_flops.by_action(),
        "in_flight": schedule.in_flight(),
        "parameters": counts.total,
        "active_parameters": counts.active,
        "compile_seconds": compile_seconds,
        "skip_bubbles": config_for_step.skip_bubbles,
        "collectives": {
            link.describe() + (" across slices" if link.across_slices else ""): dataclasses.asdict(
                t
            )
            for link, t in by_link.items()
        },
    }
    if memory is not None:
        figures |= {
            "argument_bytes": memory.arguments,
            "output_bytes": memory.outputs,
            "alias_bytes": memory.donated,
            "temp_bytes": memory.temporaries,
            "device_bytes": memory.total,
        }
        say(f"per-device memory of the compiled step: {memory.describe()}")
        checks = run_memory_checks(memory, config, mesh.local_devices)
        for check in checks:
            say(f"memory: {check}")
        figures["fits"] = all(check.fits for check in checks)
    say(f"compiled the train step in {compile_seconds:.1f} s; dry run: nothing was trained")
    return figures
