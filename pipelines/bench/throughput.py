"""Training throughput: one device (and against PyTorch eager), pipeline efficiency, the
step by sequence length; compile time by depth and memory by pipeline stages."""

import statistics

import models
from eqxzoo.parallel import MeshConfig, Schedule
from pipelines.bench.common import (
    QUICK_BATCH,
    QUICK_SEQ,
    StepRunner,
    batch_and_seq,
    interleaved_times,
    median_ratio,
    pytorch_step,
    reference_config,
)

COMPILE_LAYERS, QUICK_COMPILE_LAYERS = (4, 16, 64), (2, 8)


MEMORY_PP, QUICK_MEMORY_PP = (1, 2, 4), (1, 2)


def single_device(repeats: int, quick: bool, versus_pytorch: bool = False) -> dict:
    """The reference model on one device; one tick, so no stage rematerialisation. With
    ``versus_pytorch`` (and torch installed), PyTorch eager's step of the same model runs in
    turn with ours, round after round (`interleaved_times`): ``vs_pytorch`` is the median of
    the rounds' ratios."""
    batch, seq = batch_and_seq(quick)
    config = reference_config(quick=quick)
    runner = StepRunner(
        config, MeshConfig(), Schedule("gpipe", 1, 1, 1), (1, 1, batch, seq), remat_stages=False
    )
    torch_step = pytorch_step(quick, batch, seq) if versus_pytorch else None
    if torch_step is None:
        tokens_per_s = runner.tokens_per_second(repeats)
        comparison = {"vs_pytorch": None} if versus_pytorch else {}
    else:
        times = interleaved_times({"ours": runner.step, "pytorch": torch_step}, repeats)
        tokens_per_s = runner.tokens / statistics.median(times["ours"])
        comparison = {
            "pytorch_tokens_per_s": runner.tokens / statistics.median(times["pytorch"]),
            "vs_pytorch": median_ratio(times["pytorch"], times["ours"]),
        }
    return {
        "tokens_per_s": tokens_per_s,
        "model_flops_per_token": models.flops_per_token(config, seq),
        "model_flops_per_s": tokens_per_s * models.flops_per_token(config, seq),
        **comparison,
    }


def pipeline_efficiency(repeats: int, quick: bool) -> dict:
    """dp=2 x pp=4 (M=8 microbatches of B) against dp=8 on the same 8B sequences.

    Both sides run the same step configuration (stage rematerialisation on), 8 layers. The
    three steps run in turn, round after round, so that a slow spell of the shared machine
    slows them alike; each round gives a ratio, and the median and the spread of the ratios
    are reported (at least 5 rounds).
    """
    batch, seq = batch_and_seq(quick)
    config = reference_config(n_layers=8, quick=quick)
    runners = {
        "dp8": StepRunner(
            config, MeshConfig(dp=8), Schedule("gpipe", 1, 1, 1), (1, 1, 8 * batch, seq)
        ),
        "gpipe": StepRunner(
            config, MeshConfig(dp=2, pp=4), Schedule("gpipe", 4, 8, 1), (1, 8, batch, seq)
        ),
        "circular": StepRunner(
            config, MeshConfig(dp=2, pp=4), Schedule("circular", 4, 8, 2), (1, 8, batch, seq)
        ),
    }
    times = interleaved_times({name: r.step for name, r in runners.items()}, max(repeats, 5))
    tokens = runners["dp8"].tokens
    result: dict = {
        "dp8_tokens_per_s": tokens / statistics.median(times["dp8"]),
        "pp_efficiency_spread": {},
    }
    for name in ("gpipe", "circular"):
        ratios = [base / piped for base, piped in zip(times["dp8"], times[name], strict=True)]
        result[f"pp_efficiency_{name}"] = statistics.median(ratios)
        result["pp_efficiency_spread"][name] = [min(ratios), max(ratios)]
    return result


def compile_times(quick: bool) -> dict[str, float]:
    batch, seq = batch_and_seq(quick)
    return {
        str(layers): StepRunner(
            reference_config(n_layers=layers, quick=quick),
            MeshConfig(),
            Schedule("gpipe", 1, 1, 1),
            (1, 1, batch, seq),
        ).compile_seconds
        for layers in (QUICK_COMPILE_LAYERS if quick else COMPILE_LAYERS)
    }


def memory_by_pp(quick: bool) -> dict[str, int]:
    batch, seq = batch_and_seq(quick)
    config = reference_config(n_layers=8, quick=quick)
    return {
        str(pp): StepRunner(
            config, MeshConfig(pp=pp), Schedule("gpipe", pp, 8, 1), (1, 8, batch, seq)
        ).memory_bytes()
        for pp in (QUICK_MEMORY_PP if quick else MEMORY_PP)
    }


STEP_SEQS = (256, 1024, 2048)


STEP_TOKENS = 2048


QUICK_STEP_SEQS, QUICK_STEP_TOKENS = (QUICK_SEQ,), QUICK_BATCH * QUICK_SEQ


def step_by_seq(repeats: int, quick: bool) -> dict:
    """The reference model's one-device train step at each sequence length with ``B x T`` =
    ``STEP_TOKENS``, ours and PyTorch eager's run in turn round after round per length
    (`interleaved_times`): the median ratio of ours to PyTorch's tokens/s, by T."""
    tokens = QUICK_STEP_TOKENS if quick else STEP_TOKENS
    ratios = {}
    for seq in QUICK_STEP_SEQS if quick else STEP_SEQS:
        batch = tokens // seq
        torch_step = pytorch_step(quick, batch, seq)
        if torch_step is None:
            return {"step_vs_pytorch_by_seq": None}
        runner = StepRunner(
            reference_config(quick=quick),
            MeshConfig(),
            Schedule("gpipe", 1, 1, 1),
            (1, 1, batch, seq),
            remat_stages=False,
        )
        times = interleaved_times({"ours": runner.step, "pytorch": torch_step}, repeats)
        ratios[str(seq)] = median_ratio(times["pytorch"], times["ours"])
        del runner, torch_step
    return {"step_vs_pytorch_by_seq": ratios}
