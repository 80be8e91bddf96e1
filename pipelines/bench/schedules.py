"""The pipeline schedules side by side: activation memory by M, tokens/s in interleaved rounds,
the modelled bubble with unit and with measured action costs."""

import statistics

from eqxzoo.parallel import MeshConfig, Schedule
from eqxzoo.parallel.action_costs import (
    ActionFlops,
    action_flops,
    measured_bubble_fraction,
    pricing_schedule,
)
from pipelines.bench.common import (
    StepRunner,
    batch_and_seq,
    interleaved_times,
    reference_config,
)

SCHEDULES = (
    ("gpipe", 1),
    ("circular", 2),
    ("1f1b", 1),
    ("interleaved_1f1b", 2),
    ("zb_h1", 1),
    ("zb_v", 2),
)


# --quick's M = 8: gpipe's and circular's steps are pipeline_efficiency's (compiled once).
SCHEDULE_MICROBATCHES, QUICK_SCHEDULE_MICROBATCHES = (8, 16, 32), (8,)
# --quick's schedules: one per executor path (autodiff of a forward table, the fused BW,
# the split B and W in a V), 1f1b the baseline of the ratios.
QUICK_SCHEDULES = ("gpipe", "1f1b", "zb_v")


# What the tokens/s of every schedule is compared with, round by round.
BASELINE = "1f1b"


def schedule_figures(repeats: int, quick: bool) -> dict:
    """Every schedule on dp=2 x pp=4 with the same global batch per M (stage remat on, as the
    runs default to): activation bytes by M; at M = 8 tokens/s, the steps run in turn round
    after round (`interleaved_times`, at least 5 rounds) with each round's ratio to 1F1B's
    (median and [min, max]), and the modelled bubble with unit costs and with the costs
    measured on the step's own program (`eqxzoo.parallel.action_costs`; a forward schedule's
    from the 1F1B step at the same M). ``quick``: `QUICK_SCHEDULES` at M = 8 only."""
    batch, seq = batch_and_seq(quick)
    config = reference_config(n_layers=8, quick=quick)
    stages, counts = 4, QUICK_SCHEDULE_MICROBATCHES if quick else SCHEDULE_MICROBATCHES
    activation_bytes: dict[str, dict[str, int]] = {}
    timed: dict[str, StepRunner] = {}
    schedules: dict[str, Schedule] = {}
    measured: dict[Schedule, ActionFlops] = {}
    for name, repeats_of_layers in SCHEDULES:
        if quick and name not in QUICK_SCHEDULES:
            continue
        activation_bytes[name] = {}
        for microbatches in counts:
            schedule = Schedule(name, stages, microbatches, repeats_of_layers)
            runner = StepRunner(
                config, MeshConfig(dp=2, pp=stages), schedule, (1, microbatches, batch, seq)
            )
            analysis = runner.compiled.memory_analysis()
            activation_bytes[name][str(microbatches)] = int(analysis.temp_size_in_bytes)
            if microbatches == counts[0]:
                # The schedule as run: with R actions where it splits the backward.
                timed[name], schedules[name] = runner, runner.config.schedule
                if schedule.fuses_backward:
                    traced = runner.step_fn.trace(runner.state, runner.batch)
                    measured[runner.config.schedule] = action_flops(traced.jaxpr)
            del runner
    times = interleaved_times(
        {name: runner.step for name, runner in timed.items()}, max(repeats, 5)
    )
    ratios = {
        name: [base / time for base, time in zip(times[BASELINE], times[name], strict=True)]
        for name in timed
    }
    priced_by = {name: measured[pricing_schedule(schedule)] for name, schedule in schedules.items()}
    return {
        "schedule_activation_bytes": activation_bytes,
        "schedule_tokens_per_s": {
            name: runner.tokens / statistics.median(times[name]) for name, runner in timed.items()
        },
        "schedule_tokens_per_s_vs_1f1b": {
            name: statistics.median(values) for name, values in ratios.items()
        },
        "schedule_tokens_per_s_vs_1f1b_spread": {
            name: [min(values), max(values)] for name, values in ratios.items()
        },
        "schedule_bubble_fraction": {
            name: schedule.bubble_fraction() for name, schedule in schedules.items()
        },
        "schedule_bubble_fraction_measured": {
            name: measured_bubble_fraction(schedule, priced_by[name])
            for name, schedule in schedules.items()
        },
        "schedule_action_costs": {name: flops.relative() for name, flops in priced_by.items()},
    }
