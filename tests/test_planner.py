"""The planner (`eqxzoo.run.planner`, `python -m pipelines.plan`): its candidates are the run's
own, the exact parts of its figures (the state and batch bytes, the pipeline's sends) are the
compiled step's, and the best plan it writes runs."""

import functools
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from grids import full_grids_only
from runs import environment

from eqxzoo.parallel.mesh import MeshConfig
from eqxzoo.run import planner
from eqxzoo.run.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parent.parent


def calibration_config(index: int, *overrides: str):
    """`planner.CALIBRATION`'s config ``index``, with ``overrides`` set after its own."""
    path, own = planner.CALIBRATION[index]
    return load_config(ROOT / path, [*own, *overrides])


# Each config's step compiled once a worker: tests of the memory, the data traffic and the
# FLOPs read the same steps (configs compare and hash by their fields).
compiled_step = functools.cache(planner.compile_plan)


def test_candidates_are_the_ones_the_run_accepts():
    base = load_config(ROOT / "configs/tiny.toml")
    found = list(planner.candidates(base, 8, 1))
    plans = [c for c in found if isinstance(c, planner.Plan)]
    refused = [c for c in found if isinstance(c, planner.Refused)]
    assert plans and refused
    for plan in plans[:: max(1, len(plans) // 40)]:
        config = plan.run_config()
        assert config.mesh.size == 8
        assert config.global_batch_size == base.global_batch_size
    reasons = {r.reason.split(":")[0] for r in refused}
    # tiny.toml has 4 heads over 2 kv heads, 4 layers, 8 experts: each rule shows up.
    assert {"mesh.tp", "mesh.pp", "data.batch_size"} <= reasons
    meshes = {p.config.mesh.shape for p in plans}
    assert (1, 1, 1, 8, 1) in meshes and (8, 1, 1, 1, 1) in meshes


def test_slices_put_dp_or_pp_across_them():
    base = load_config(ROOT / "configs/tiny.toml")
    spans = {(m.dcn.dp, m.dcn.pp) for m in planner.meshes(base, 8, 2) if isinstance(m, MeshConfig)}
    assert spans == {(1, 2), (2, 1)}
    with pytest.raises(ConfigError, match="--slices: 3 slices do not divide 8 devices"):
        list(planner.meshes(base, 8, 3))


@pytest.mark.parametrize("accumulated", [1, 2])
def test_the_pipeline_sends_and_data_traffic_are_those_of_the_compiled_step(accumulated):
    """The 1F1B family sends one activation up and one cotangent down a tick, on two stages
    in one collective-permute, in float32 (`transport_dtype`) where the layers compute in
    bfloat16: the planner's bytes over pp are the compiled HLO's, to the byte. Its region
    gathers the stage's and the outer weights over dp once and sums their gradients once:
    the compiled reductions over dp within 3% (per tick, as they were while dp was the
    compiler's, they are 2.5x and 25x as many). The gathers also take each stage's token ids
    and targets tick by tick, whole over dp (0.5 MiB: 2.4% of them, which the model had left
    out): to 0.1%. Over two accumulation steps the gradients are summed each step and the
    weights gathered once, out of the accumulation loop (counted each step, 1.9x the
    compiled gathers), and the ids each step."""
    config = calibration_config(1, f"data.grad_accum={accumulated}")
    facts = planner.ModelFacts.of(config)
    compiled = compiled_step(config)
    predicted = planner.collective_bytes(facts, planner.plan_of(config))
    measured = planner.compiled_bytes_by_axis(compiled, config.mesh)
    assert predicted[("collective-permute", "pp")] == measured["collective-permute over pp"]
    assert predicted[("all-reduce", "dp")] == pytest.approx(
        measured["all-reduce over dp"], rel=0.03
    )
    gathered = measured["all-gather over dp"]
    assert predicted[("all-gather", "dp")] == pytest.approx(gathered, rel=1e-3)
    exact, _ = planner.memory_terms(facts, planner.plan_of(config))
    assert exact == compiled.memory.arguments


@pytest.mark.parametrize(
    ("row", "schedule"),
    [
        pytest.param(2, None, id="gpipe-dp2,pp2,tp2"),
        pytest.param(3, None, id="circular-dp2,pp4"),
        full_grids_only(15, None, id="deepseek-gpipe-dp2,ep4"),
        pytest.param(5, "zb_h1", id="fsdp-zb_h1-dp8"),
        pytest.param(5, "gpipe", id="fsdp-gpipe-dp8"),
    ],
)
def test_the_data_traffic_outside_a_pipelines_region_is_the_compiled_steps(row, schedule):
    """Where the embedding and head run outside the pipeline's region (GPipe), the
    gradients summed over the data axes are the compiled all-reduces over them to 0.1%:
    the head's vocabulary is split over pp there too (llama's tied table, on pp2: half the
    region's bytes), and the partitioner looks an untied embedding's rows up where they
    are, never summing its gradient (DeepSeek's, 128 MiB); the gathers within 1%: each
    use of the table outside gathers a device's vocabulary share, the loss's columns and a
    tied table's lookup (on pp4, half the tied table: with the table whole the model read
    1.35x). Without the outer weights the model read 0.79x and 0.89x; with them whole,
    1.21x and 1.04x.
    FSDP on one stage of dp8, two microbatches: the 1F1B family reduces the gradients each
    microbatch, GPipe its layers' at each tick and the rest once, and each run of the loss
    gathers the head's columns twice; the compiled reductions (XLA:CPU's all-reduces where
    the model prices reduce-scatters, the same buffers) to 0.1%, the gathers within 1%.
    Counted once a step and without the head, the reductions read 2x and 1.8x, the gathers
    1.18x and 1.09x."""
    extra = () if schedule is None else (f"pipeline.schedule={schedule}",)
    config = calibration_config(row, *extra)
    facts, plan = planner.ModelFacts.of(config), planner.plan_of(config)
    compiled = compiled_step(config)
    predicted = planner.collective_bytes(facts, plan)
    measured = planner.data_axes_traffic(
        planner.compiled_bytes_by_axis(compiled, config.mesh, plan.schedule)
    )
    kinds = ("all-reduce", "reduce-scatter")
    reduced = sum(predicted.get((kind, "dp"), 0.0) for kind in kinds)
    compiled_reduced = sum(measured.get(f"{kind} over dp", 0.0) for kind in kinds)
    assert reduced == pytest.approx(compiled_reduced, rel=1e-3)
    gathered = predicted[("all-gather", "dp")]
    assert gathered == pytest.approx(measured["all-gather over dp"], rel=0.01)


def test_the_gradients_are_summed_over_a_context_split():
    """cp splits the tokens and no weight: each device sums its gradients with the rest of
    its context split, also where no data axis is wider than 1 (a region's once a step),
    and outside the region the embedding's table again, apart from the head's (circular
    on pp2 x cp4, untied: the half of the table a device holds over pp). The planner had
    no traffic there (0 against 23 MiB compiled), then no embedding's sum (19 MiB)."""
    mesh = ("mesh.dp=1", "mesh.pp=2", "mesh.cp=4")
    schedule = ("pipeline.schedule=circular", "pipeline.repeats=2")
    config = calibration_config(0, *mesh, *schedule, "model.tie_embeddings=false")
    facts, plan = planner.ModelFacts.of(config), planner.plan_of(config)
    compiled = compiled_step(config)
    measured = planner.data_axes_traffic(
        planner.compiled_bytes_by_axis(compiled, config.mesh, plan.schedule)
    )
    predicted = planner.collective_bytes(facts, plan)
    assert measured["all-reduce over dp"] > 0
    assert predicted[("all-reduce", "dp")] == pytest.approx(
        measured["all-reduce over dp"], rel=0.01
    )


@pytest.mark.parametrize(
    ("row", "remat"),
    [
        pytest.param(18, None, id="tiny-zb_h1-ep2"),
        pytest.param(18, "full", id="tiny-zb_h1-ep2-full"),
        full_grids_only(13, None, id="deepseek-1f1b-ep4-dots"),
    ],
)
def test_the_experts_exchanges_are_the_compiled_steps(row, remat):
    """Expert parallelism's all-to-alls (the forward, the backward and stage remat's
    forward exchange a MoE layer's tokens each way; a layer's own remat runs the dispatch
    once more, not the combine) against the compiled step's over ep, each action's
    conditional counted as often as the schedule runs it, within 5% (at every tick, they
    read 3.5x; "full" read 1.12x while its remat counted the combine too). XLA:CPU runs a
    16-bit all-to-all in float32, twice the accelerator's buffer the planner prices."""
    config = calibration_config(row, *(() if remat is None else (f"model.remat={remat}",)))
    facts, plan = planner.ModelFacts.of(config), planner.plan_of(config)
    compiled = compiled_step(config)
    widened = 4 / facts.compute_bytes
    predicted = planner.collective_bytes(facts, plan)[("all-to-all", "ep")] * widened
    measured = planner.compiled_bytes_by_axis(compiled, config.mesh, plan.schedule)
    assert predicted == pytest.approx(measured["all-to-all over ep"], rel=0.05)


@pytest.mark.parametrize("remat", ["dots", full_grids_only("none")])
def test_the_context_rings_shifts_are_the_compiled_steps(remat):
    """Context parallelism's ring (tiny, interleaved 1F1B on dp2 x pp2 x cp2, float32): each
    forward, stage and layer remat's runs included, shifts the keys, values and positions
    ``cp`` times, the backward them and the keys' and values' gradients; the compiled
    step's all-to-alls over cp within 1% of that times ``cp`` (XLA:CPU runs each shift as
    an all-to-all of ``cp`` slots, `eqxzoo.nn.context`). The model had counted ``cp - 1``
    shifts of the keys and values a pass: 10x under on llama's dp2 x pp2 x cp2."""
    config = calibration_config(20, f"model.remat={remat}", "precision.compute=float32")
    facts, plan = planner.ModelFacts.of(config), planner.plan_of(config)
    compiled = compiled_step(config)
    predicted = planner.collective_bytes(facts, plan)[("collective-permute", "cp")]
    measured = planner.compiled_bytes_by_axis(compiled, config.mesh, plan.schedule)
    assert predicted * config.mesh.cp == pytest.approx(measured["all-to-all over cp"], rel=0.01)


@pytest.mark.parametrize("remat", ["none", "full"])
def test_the_step_flops_and_tensor_reductions_are_the_compiled_steps(remat):
    """On one stage (no bubble ticks, whose conditionals would count as working ones) of dp2 x
    tp4, in float32 (XLA:CPU reduces a bfloat16 matmul's output in float32): a dense model's
    FLOPs per device with its layer remat's recompute are the compiled step's matrix FLOPs,
    each loop iteration counted (`matmul_flops`), within 10%; its all-reduces over tp are the
    compiled HLO's to 0.1% (those of the loss's statistics are left out)."""
    config = calibration_config(
        6,
        "pipeline.schedule=gpipe",
        "model.n_layers=4",
        f"model.remat={remat}",
        "precision.compute=float32",
    )
    facts, plan = planner.ModelFacts.of(config), planner.plan_of(config)
    compiled = compiled_step(config)
    predicted = planner.step_flops(facts, plan)[1]
    assert 0.9 < compiled.flops / predicted < 1.1, (compiled.flops, predicted)
    reduced = planner.collective_bytes(facts, plan)[("all-reduce", "tp")]
    measured = planner.compiled_bytes_by_axis(compiled, config.mesh)["all-reduce over tp"]
    assert reduced == pytest.approx(measured, rel=1e-3)


@pytest.mark.parametrize("row", [3, 4], ids=["circular-dp2,pp4", "interleaved_1f1b-pp4,tp2"])
def test_a_pipelined_steps_flops_count_each_branch_as_often_as_the_schedule_runs_it(row):
    """On four stages, with autodiff of circular's forward table (its stage's conditional,
    layers rematerialised whole) and with interleaved 1F1B's own actions (a conditional each,
    the head's inside F): the compiled step's matrix FLOPs per device, each pipeline branch
    counted as often as the table runs it (`executed_branches`), are the model's within 10%,
    where every tick counted at its dearest branches is 1.15x to 6x over. The sends over pp
    are the compiled collective-permutes to the byte: interleaved 1F1B's up and down the
    ring a tick (one shift on two stages), circular's up a tick and its transpose down,
    and the last stage's outputs to every stage and back (counted as two sends a tick,
    circular read 0.73x)."""
    from eqxzoo.parallel.collectives import matmul_flops

    config = calibration_config(row)
    facts, plan = planner.ModelFacts.of(config), planner.plan_of(config)
    compiled = compiled_step(config)
    predicted = planner.step_flops(facts, plan)[1]
    assert 0.9 < compiled.flops / predicted < 1.1, (compiled.flops, predicted)
    assert matmul_flops(compiled.hlo) / predicted > 1.15
    sends = planner.collective_bytes(facts, plan)[("collective-permute", "pp")]
    assert (
        sends == planner.compiled_bytes_by_axis(compiled, config.mesh)["collective-permute over pp"]
    )


@pytest.mark.parametrize("remat", ["dots", full_grids_only("none"), "full"])
def test_causal_attention_and_remat_are_counted_as_the_step_runs_them(remat):
    """At 4,096 tokens (16 key blocks) the blockwise kernel computes the block pairs that
    may hold a visible key, 0.53 of the scores, in loops whose length is data: counted at
    the trips its block plan gives for the run's positions (`attention_loop_trips`), the
    compiled step's matrix FLOPs per device are the model's within 1%, its backward's five
    matmuls a pair and ``dots`` remat's second forward counted. PaLM's count of attention
    (every score) read 0.86 (``dots``) and 0.77 (``none``); the loops counted once, 0.55 to
    0.58. With stage remat over a scan of two ``"full"`` layers the stage's recompute runs
    both (counted as the first only: 1.07), and a layer's own skips its last projection."""
    from eqxzoo.parallel.collectives import matmul_flops

    config = calibration_config(
        5,
        "data.seq_len=4096",
        "model.n_layers=2",
        "model.vocab_size=2048",
        "pipeline.microbatches=1",
        f"model.remat={remat}",
        "precision.compute=float32",
    )
    facts, plan = planner.ModelFacts.of(config), planner.plan_of(config)
    assert planner.attention_share(config.model, 4096) == pytest.approx(0.53125)
    compiled = compiled_step(config)
    predicted = planner.step_flops(facts, plan)[1]
    assert compiled.flops == pytest.approx(predicted, rel=0.01)
    once = matmul_flops(compiled.hlo, planner.executed_branches(plan.schedule))
    assert once / predicted < 0.9


def test_the_chunked_losss_head_recompute_is_counted():
    """At llama3_1b's own widths (a 128k vocabulary: the head is a sixth of a 4-layer
    model's FLOPs) on dp8: the compiled step's matrix FLOPs per device are the model's
    within 5%, the head's logits counted again for the chunked loss's backward (1.14x
    without them)."""
    config = calibration_config(24, "precision.compute=float32")
    facts, plan = planner.ModelFacts.of(config), planner.plan_of(config)
    compiled = compiled_step(config)
    predicted = planner.step_flops(facts, plan)[1]
    assert 0.95 < compiled.flops / predicted < 1.05, (compiled.flops, predicted)


@pytest.mark.parametrize(
    "row",
    [
        pytest.param(0, id="zb_h1-dp4,pp2"),
        pytest.param(2, id="gpipe-dp2,pp2,tp2"),
        pytest.param(5, id="zb_h1-dp8,pp1"),
        full_grids_only(15, id="deepseek-gpipe-dp2,ep4"),
    ],
)
def test_each_data_parallel_device_runs_its_own_sequences(row):
    """Both executors on several stages (the region manual over dp too), the 1F1B executor
    on one stage (its layers' inputs constrained to the batch's split) and DeepSeek's dense
    prefix over dp x ep (its region manual over both): the compiled step's matrix FLOPs per
    device are the model's within 10%. Left to the partitioner, every data-parallel device
    ran each stage on the whole microbatch (1.46x, 1.21x, 1.76x), and the prefix's backward
    on the whole batch (1.28x)."""
    config = calibration_config(row)
    facts, plan = planner.ModelFacts.of(config), planner.plan_of(config)
    compiled = compiled_step(config)
    assert compiled.skips_bubbles
    predicted = planner.step_flops(facts, plan)[1]
    assert 0.9 < compiled.flops / predicted < 1.1, (compiled.flops, predicted)


def test_the_fused_executors_loss_on_one_stage_moves_the_head_once_a_pass():
    """ZB-H1 on one stage of dp8, dense: the executor has no region, and its chunked loss
    is the partitioner's, as outside a pipeline (`eqxzoo.train.loss.gathered_columns`):
    a microbatch's loss gathers the head's columns over dp in its forward and again in its
    backward, and sums their gradient over dp once. Run as inside a region, the loss
    all-reduced 4x the head's gradient a microbatch (64 MiB a step against 16)."""
    from eqxzoo.parallel.collectives import collectives

    config = calibration_config(5, "precision.compute=float32")
    compiled = compiled_step(config)
    moved: dict[str, float] = {}
    runs = planner.executed_branches(planner.plan_of(config).schedule)
    for c in collectives(compiled.hlo, runs):
        if "fused_cross_entropy" in c.text:
            moved[c.kind] = moved.get(c.kind, 0) + c.bytes * c.times
    head = config.model.vocab_size * config.model.d_model * 4
    microbatches = config.pipeline.microbatches
    assert moved == {"all-gather": 2 * microbatches * head, "all-reduce": microbatches * head}


def test_experts_on_one_stage_dispatch_each_devices_own_tokens():
    """tiny (a dropless MoE) on one stage over dp8: its region is manual over dp
    (`eqxzoo.parallel.pipeline.pools_one_stage`), so each device sorts its own tokens'
    assignments, and the memory model, which knows it, holds. Left to the partitioner, the
    compiled step had 810 arrays of the whole batch's assignments (B x T x top_k rows) and
    took 274 MiB a device, where the model predicted 72."""
    config = calibration_config(21)
    facts, plan = planner.ModelFacts.of(config), planner.plan_of(config)
    compiled = compiled_step(config)
    whole_batch = str(config.data.batch_size * config.data.seq_len * config.model.moe.top_k)
    shapes = re.findall(r"\[([\d,]+)\]", compiled.hlo)
    assert not [shape for shape in shapes if whole_batch in shape.split(",")]
    assert planner.predicted_memory(facts, plan) == pytest.approx(compiled.memory.total, rel=0.1)


@pytest.mark.parametrize(
    "row",
    [
        pytest.param(0, id="zb_h1-dp4,pp2"),
        pytest.param(18, id="tiny-zb_h1-dp2,pp2,ep2"),
        pytest.param(23, id="zb_h1-dcn.pp2"),
        pytest.param(4, id="interleaved_1f1b-pp4,tp2"),
        full_grids_only(26, id="zb_h1-wide-dp2,pp2,tp2"),
        full_grids_only(37, id="circular-R4-full-dp4,pp2"),
        pytest.param(31, id="none-wide-dp8"),
    ],
)
def test_the_memory_model_is_the_compiled_steps_within_10_percent(row):
    """`MEMORY_MODEL`'s prediction against the compiled step's memory analysis, on
    calibration configs it is fitted to within 10% (README, "Plan a run", has them all;
    two of these rows, 30 s each to compile, run with ``EQXZOO_FULL_GRIDS=1``).
    The one without layer remat read -21% while its layers' residuals counted only the
    matmuls' outputs at the 4 bytes XLA:CPU keeps (`WIDENS_COMPUTE`; DeepSeek's, -24%,
    is in `--calibrate`'s table). Interleaved 1F1B on pp4 x tp2 read +17% while the model
    counted its gradients beside the region's sum of them, where no data axis shards them and
    that sum is the gradient."""
    config = calibration_config(row)
    facts, plan = planner.ModelFacts.of(config), planner.plan_of(config)
    compiled = compiled_step(config)
    predicted = planner.predicted_memory(facts, plan)
    assert predicted == pytest.approx(compiled.memory.total, rel=0.1)


def test_the_memory_fit_counts_each_configs_error_past_the_tolerance_only():
    """Rows whose compiled bytes are their terms at known weights, and one row no weights
    explain (its compiled bytes 0.3 of that, so its error is large and positive): least
    squares of the relative errors spends the weights on it and leaves 19 of the 38 others
    beyond 10%; the fit, which counts each error past `FIT_TOLERANCE` only and linearly,
    leaves 3. Without the outlier, each row is predicted from the others (held out)."""
    rng = np.random.default_rng(0)
    truth = rng.uniform(0.5, 2.0, len(planner.MEMORY_TERMS))
    rows = []
    for index in range(3 * len(planner.MEMORY_TERMS)):
        values = rng.uniform(0, 1e8, truth.size)
        terms = {name: float(v) for name, v in zip(planner.MEMORY_TERMS, values, strict=True)}
        compiled = int((1e7 + truth @ values) * (0.3 if index == 0 else 1))
        rows.append(
            planner.CalibrationRow(
                str(index), int(1e7), terms, compiled, 0, {}, {}, 0.0, 0.0, False
            )
        )
    model = planner.fit_memory_model(rows)
    errors = [planner.weighed(r.exact, r.terms, model) / r.compiled - 1 for r in rows]
    assert errors[0] > 0.5
    assert sum(abs(e) > 0.1 for e in errors[1:]) <= 5
    assert max(abs(e) for e in planner.held_out_errors(rows[1:])) < 1e-3


def test_unknown_accelerators_and_meshes_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="--accelerator: unknown accelerator 'H300'; known: H100"):
        planner.accelerator_named("H300")
    assert planner.accelerator_named("tpu v5p", peak_tflops=400.0).peak_flops == 400e12
    with pytest.raises(ConfigError, match="--explain: unknown mesh axis 'xp'"):
        planner.parse_mesh("dp=2,xp=4")
    assert planner.parse_mesh("dp8 pp2 dcn.dp=2") == {"dp": 8, "pp": 2, "dcn.dp": 2}


def test_measuring_needs_the_plan_on_this_hosts_devices():
    with pytest.raises(
        ConfigError,
        match="--measure: times the best plan on this host's devices: plan for the 8 it has, not 2",
    ):
        planner.plan_run(
            load_config(ROOT / "configs/tiny.toml"),
            devices=2,
            slices=1,
            accelerator=planner.accelerator_named("H100"),
            memory_gib=1.0,
            top=1,
            explain=None,
            say=print,
            measure=3,
        )


def test_the_best_plan_written_runs_its_dry_run_and_fits(tmp_path, cache_dir):
    """The plan `--out` writes runs, and `--measure` times its step here. The search's counts
    add up: a plan over the memory (some of tiny's at 0.1 GiB) is priced, then refused, and
    counted once."""
    best = tmp_path / "best.toml"
    common = [sys.executable, "-m"]
    # The suite's compiler flags and its cache: the dry run loads the step the plan compiled.
    env = environment() | {
        "JAX_COMPILATION_CACHE_DIR": str(cache_dir),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    planned = subprocess.run(
        [
            *common,
            "pipelines.plan",
            "configs/tiny.toml",
            "--devices",
            "8",
            "--device-memory",
            "0.1",
            "--accelerator",
            "A100",
            "--top",
            "1",
            "--out",
            str(best),
            "--explain",
            "dp=2,pp=2,tp=2",
            "--measure",
            "1",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert planned.returncode == 0, planned.stdout + planned.stderr
    out = planned.stdout
    counts = re.search(
        r"searched ([\d,]+) plans: ([\d,]+) refused by the run's rules, ([\d,]+) priced, "
        r"([\d,]+) of them over the memory",
        out,
    )
    searched, by_rules, priced, over = (int(n.replace(",", "")) for n in counts.groups())
    assert searched == by_rules + priced and 0 < over < priced
    assert "--explain {'dp': 2, 'pp': 2, 'tp': 2}" in out
    assert "predicted" in out and f"wrote the best plan to {best}" in out
    measured = re.search(
        r"measured (.+) on 8 x cpu: ([\d.]+) s a step \(median of 1\), predicted", out
    )
    assert measured and float(measured[2]) > 0
    dry = subprocess.run(
        [*common, "pipelines.run", str(best), "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "memory: host RAM" in dry.stdout and ": fits" in dry.stdout
