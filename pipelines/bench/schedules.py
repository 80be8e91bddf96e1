"""The pipeline schedules side by side: activation memory by M, tokens/s, modelled bubble."""

from eqxzoo.parallel import MeshConfig, Schedule
from pipelines.bench.common import (
    StepRunner,
    batch_and_seq,
    reference_config,
)

SCHEDULES = (("gpipe", 1), ("circular", 2), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1))


# --quick's M = 8: gpipe's and circular's steps are pipeline_efficiency's (compiled once).
SCHEDULE_MICROBATCHES, QUICK_SCHEDULE_MICROBATCHES = (8, 16, 32), (8,)


def schedule_figures(repeats: int, quick: bool) -> dict:
    """Every schedule on dp=2 x pp=4 with the same global batch per M: activation bytes by
    M, tokens/s and the modelled bubble at M = 8 (stage remat on, as the runs default to)."""
    batch, seq = batch_and_seq(quick)
    config = reference_config(n_layers=8, quick=quick)
    stages, counts = 4, QUICK_SCHEDULE_MICROBATCHES if quick else SCHEDULE_MICROBATCHES
    activation_bytes: dict[str, dict[str, int]] = {}
    tokens_per_s: dict[str, float] = {}
    bubble: dict[str, float] = {}
    for name, repeats_of_layers in SCHEDULES:
        activation_bytes[name] = {}
        for microbatches in counts:
            schedule = Schedule(name, stages, microbatches, repeats_of_layers)
            runner = StepRunner(
                config, MeshConfig(dp=2, pp=stages), schedule, (1, microbatches, batch, seq)
            )
            analysis = runner.compiled.memory_analysis()
            activation_bytes[name][str(microbatches)] = int(analysis.temp_size_in_bytes)
            if microbatches == counts[0]:
                tokens_per_s[name] = runner.tokens_per_second(repeats)
                bubble[name] = schedule.bubble_fraction()
            del runner
    return {
        "schedule_activation_bytes": activation_bytes,
        "schedule_tokens_per_s": tokens_per_s,
        "schedule_bubble_fraction": bubble,
    }
