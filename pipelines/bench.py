"""The project benchmark: everything measured side by side in one run, reported as ratios.

    python -m pipelines.bench [--json FILE] [--repeats N] [--only PART ...] [--quick]

1. training tokens/s of the reference model on one device, as model FLOP/s over the FLOP/s
   of a plain jitted 2048x2048 fp32 matmul timed in the same process;
2. pipeline efficiency on 8 simulated devices: tokens/s of dp=2 x pp=4 (M=8) over dp=8 on
   the same global batch, for GPipe and circular;
3. compile time of the train step for 4, 16 and 64 layers;
4. per-device memory of the compiled step for pp in {1, 2, 4};
5. with torch installed, the same model in PyTorch eager: our FLOP/s over PyTorch's;
6. the data loader over the prepared stdlib corpus: tokens/s of `eqxzoo.data.train_batches`
   (global batches on configs/tiny.toml's mesh) next to a plain numpy memmap reader of the
   same token stream, and next to the tokens/s that tiny.toml's train step consumes;
7. the five pipeline schedules at P = 4 (dp=2 x pp=4, 8 layers, B sequences per
   microbatch): per-device temporary bytes of the compiled step for M in 8, 16, 32
   (``schedule_activation_bytes``), tokens/s at M = 8 (``schedule_tokens_per_s``) and the
   modelled bubble at M = 8 (``schedule_bubble_fraction``, the lockstep model of
   `eqxzoo.parallel.Schedule`).
8. MoE at the cost of its active FLOPs, on one device: tokens/s of a top-2 dropless MoE train
   step over that of a dense model with the same active FLOPs (same attention and layers,
   SwiGLU MLP of width ``top_k * expert_mlp_dim``), at 8 experts of width 512 and 64
   fine-grained experts of width ``d_model / 2`` (OLMoE's ratio) (``moe_vs_dense_active``);
   the same for capacity routing (``moe_capacity_vs_dense_active``) and the dropless path's
   padding (``moe_padding_fraction``).
9. Expert dispatch: the collectives of a compiled pipelined 64-expert MoE step on
   dp2 x pp2 x ep2, by kind, and the bytes they move per step (``moe_dispatch_collectives``).
10. The loss at big vocabularies: compiled temporary bytes per device of the train step at
   T = 4096, d_model 512, 4 layers, vocabularies of 32k and 152k, with the plain loss (whole
   logits) and the fused chunked one (``loss_temp_bytes``: {"plain" | "chunked": {vocab:
   bytes}}).
11. Attention alone, forward and backward, q/k/v of (1, T, 8 heads, 64) in fp32, causal and
   with a 1024 window: the blockwise kernel, the dense one and PyTorch's
   ``F.scaled_dot_product_attention`` on CPU, timed in turn (``attention_fwd_bwd_s``:
   {kernel: {"causal" | "window": {T: seconds}}}), and our kernels' compiled temporary bytes
   (``attention_temp_bytes``).
12. The reference model's train step at T in {256, 1024, 2048} with B x T = 2048 against
   PyTorch eager (SDPA) side by side (``step_vs_pytorch_by_seq``: {T: ours / PyTorch's
   tokens/s}).

The pipeline efficiency (2.) times the dp8 and the pipelined steps in turn and reports the
median ratio and its spread over the rounds (``pp_efficiency_spread``: {schedule: [min,
max]}); the comparisons with PyTorch (5., 12.) also run both steps in turn and report the
median of the rounds' ratios.

Absolute times on a shared machine are noise; the ratios, measured in one run, are the result.
``--quick`` runs every part on a toy model with the fewest points of each sweep: it checks the
command and its JSON (the test suite runs it), not speed.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import models  # noqa: E402
from eqxzoo.nn import RoutingMode  # noqa: E402
from eqxzoo.nn.attention import DEFAULT_BLOCK_SIZE  # noqa: E402
from eqxzoo.optim import OptimizerConfig  # noqa: E402
from eqxzoo.parallel import MeshConfig, Schedule, make_mesh  # noqa: E402
from eqxzoo.parallel.collectives import collective_traffic  # noqa: E402
from eqxzoo.train.loss_terms import LossConfig  # noqa: E402
from eqxzoo.train.report import measured_matmul_flops, median_seconds  # noqa: E402
from eqxzoo.train.settings import StepConfig  # noqa: E402
from eqxzoo.train.state import abstract_train_state, init_train_state  # noqa: E402
from eqxzoo.train.step import batch_sharding, make_train_step  # noqa: E402

REFERENCE = dict(vocab_size=1024, d_model=256, n_layers=4, n_heads=4, mlp_dim=1024)
BATCH, SEQ = 8, 256
# --quick: the same measurements on a toy model and the fewest points of each sweep, to check
# the command and its JSON in tests.
QUICK = dict(vocab_size=64, d_model=32, n_layers=4, n_heads=4, mlp_dim=128)
QUICK_BATCH, QUICK_SEQ = 2, 16
COMPILE_LAYERS, QUICK_COMPILE_LAYERS = (4, 16, 64), (2, 8)
MEMORY_PP, QUICK_MEMORY_PP = (1, 2, 4), (1, 2)


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
    ):
        devices = jax.devices()[: mesh_config.size]
        self.mesh = make_mesh(mesh_config, devices)
        self.config = StepConfig(
            schedule=schedule,
            optimizer=OptimizerConfig(warmup_steps=10, decay_steps=1000),
            remat_stages=remat_stages,
            loss=LossConfig(chunk_size=loss_chunk_size),
        )
        make_model = models.model_factory(model_config)
        if compile_only:
            self.state = abstract_train_state(make_model, config=self.config, mesh=self.mesh)
            ids = jax.ShapeDtypeStruct(batch_shape, jnp.int32, sharding=batch_sharding(self.mesh))
            self.batch = {"tokens": ids, "targets": ids}
        else:
            self.state = init_train_state(
                make_model, jax.random.key(0), config=self.config, mesh=self.mesh
            )
            self.batch = jax.device_put(
                make_batch(batch_shape, model_config.vocab_size), batch_sharding(self.mesh)
            )
        self.step_fn = make_train_step(self.config, self.mesh)
        start = time.perf_counter()
        self.compiled = self.step_fn.lower(self.state, self.batch).compile()
        self.compile_seconds = time.perf_counter() - start
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


def _sizes(quick: bool) -> tuple[int, int]:
    return (QUICK_BATCH, QUICK_SEQ) if quick else (BATCH, SEQ)


def single_device(repeats: int, quick: bool, versus_pytorch: bool = False) -> dict:
    """The reference model on one device; one tick, so no stage rematerialisation. With
    ``versus_pytorch`` (and torch installed), PyTorch eager's step of the same model runs in
    turn with ours, round after round (`interleaved_times`): ``vs_pytorch`` is the median of
    the rounds' ratios."""
    batch, seq = _sizes(quick)
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


def median_ratio(numerators: list[float], denominators: list[float]) -> float:
    """The median over rounds of ``numerator / denominator`` (times of the same round)."""
    return statistics.median(n / d for n, d in zip(numerators, denominators, strict=True))


def pipeline_efficiency(repeats: int, quick: bool) -> dict:
    """dp=2 x pp=4 (M=8 microbatches of B) against dp=8 on the same 8B sequences.

    Both sides run the same step configuration (stage rematerialisation on), 8 layers. The
    three steps run in turn, round after round, so that a slow spell of the shared machine
    slows them alike; each round gives a ratio, and the median and the spread of the ratios
    are reported (at least 5 rounds).
    """
    batch, seq = _sizes(quick)
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
    batch, seq = _sizes(quick)
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
    batch, seq = _sizes(quick)
    config = reference_config(n_layers=8, quick=quick)
    return {
        str(pp): StepRunner(
            config, MeshConfig(pp=pp), Schedule("gpipe", pp, 8, 1), (1, 8, batch, seq)
        ).memory_bytes()
        for pp in (QUICK_MEMORY_PP if quick else MEMORY_PP)
    }


def pytorch_step(quick: bool, batch: int, seq: int) -> Callable[[], None] | None:
    """PyTorch eager's train step of the reference model (None without torch)."""
    try:
        from pipelines.torch_reference import torch_train_step
    except ImportError:
        return None
    return torch_train_step(**(QUICK if quick else REFERENCE), batch=batch, seq_len=seq)


def loader_throughput(repeats: int, quick: bool) -> dict:
    """configs/tiny.toml's loader, a numpy memmap reader of the same tokens, and its step."""
    import tempfile
    from pathlib import Path

    import numpy as np

    from eqxzoo.data import TokenStream, open_split, train_batches
    from eqxzoo.run.config import load_config, step_config
    from eqxzoo.run.loop import batch_shape, data_directory

    quick_overrides = (
        "model.d_model=32",
        "model.moe.expert_mlp_dim=32",
        "model.moe.shared_mlp_dim=32",
        "data.seq_len=32",
        "data.batch_size=4",
    )
    config = load_config(
        Path(__file__).resolve().parents[1] / "configs" / "tiny.toml",
        quick_overrides if quick else (),
    )
    shape = batch_shape(config)
    documents = open_split(data_directory(config), "train")
    mesh = make_mesh(config.mesh, jax.devices()[: config.mesh.size])
    sharding = batch_sharding(mesh, config.sharding.rules)
    steps = 5 if quick else 200
    tokens_per_step = config.tokens_per_step

    batches = train_batches(
        documents,
        shape,
        sharding,
        seed=0,
        prefetch=config.data.prefetch,
        num_threads=config.data.num_threads,
    )
    jax.block_until_ready(next(batches))
    start = time.perf_counter()
    for _ in range(steps):
        jax.block_until_ready(next(batches))
    loader = steps * tokens_per_step / (time.perf_counter() - start)
    batches.close()

    window_tokens = shape.windows * shape.window_tokens
    stream = TokenStream(documents, seed=0, shuffle=True).read(0, (steps + 1) * window_tokens)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "tokens.npy"
        np.save(path, stream.astype(np.int32))
        memmap = np.load(path, mmap_mode="r")
        start = time.perf_counter()
        for step in range(steps):
            windows = np.asarray(memmap[step * window_tokens : (step + 1) * window_tokens])
            windows = windows.reshape(*shape.shape[:3], shape.window_tokens)
            for part in (windows[..., :-1], windows[..., 1:]):
                jax.block_until_ready(
                    jax.make_array_from_process_local_data(sharding, part, shape.shape)
                )
        memmap_rate = steps * tokens_per_step / (time.perf_counter() - start)

    train_config = step_config(config)
    make_model = models.model_factory(config.model)
    state = init_train_state(make_model, jax.random.key(0), config=train_config, mesh=mesh)
    step_fn = make_train_step(train_config, mesh)
    batches = train_batches(documents, shape, sharding, seed=0)
    batch = next(batches)
    batches.close()

    def step():
        nonlocal state
        state, metrics = step_fn(state, batch)
        return metrics["loss"]

    consumed = tokens_per_step / median_seconds(step, repeats=repeats)
    return {
        "loader_tokens_per_s": loader,
        "memmap_tokens_per_s": memmap_rate,
        "tiny_step_tokens_per_s": consumed,
        "loader_vs_memmap": loader / memmap_rate,
        "loader_vs_tiny_step": loader / consumed,
    }


MOE_EXPERTS = {8: 512, 64: 128}  # n_experts: expert_mlp_dim at d_model 256; top-2
QUICK_MOE_EXPERTS = {8: 16}


def moe_configs(
    n_experts: int, routing: RoutingMode, *, quick: bool
) -> tuple[models.DecoderConfig, models.DecoderConfig]:
    """A top-2 Mixtral-style MoE with ``n_experts`` experts and the dense SwiGLU model of
    the same active FLOPs (the reference sizes, RMSNorm; 2 layers with --quick)."""
    sizes = {**(QUICK if quick else REFERENCE), **({"n_layers": 2} if quick else {})}
    expert_mlp_dim = (QUICK_MOE_EXPERTS if quick else MOE_EXPERTS)[n_experts]
    moe = models.MoEConfig(
        n_experts=n_experts, top_k=2, expert_mlp_dim=expert_mlp_dim, routing=routing
    )
    dense = models.LlamaConfig(**{**sizes, "mlp_dim": moe.top_k * expert_mlp_dim})
    return models.MixtralConfig(**{**sizes, "moe": moe}), dense


def moe_figures(repeats: int, quick: bool) -> dict:
    """Dropless and capacity MoE train steps over the dense step of equal active FLOPs,
    their steps timed in turn (round-robin) so that a slow spell of a shared machine slows
    all three alike; and the dropless step's padding fraction."""
    batch, seq = _sizes(quick)
    result: dict[str, dict[str, float]] = {
        "moe_vs_dense_active": {},
        "moe_capacity_vs_dense_active": {},
        "moe_padding_fraction": {},
    }

    def one_device(config) -> StepRunner:
        shape = (1, 1, batch, seq)
        return StepRunner(
            config, MeshConfig(), Schedule("gpipe", 1, 1, 1), shape, remat_stages=False
        )

    dense_runner: tuple[models.DecoderConfig, StepRunner] | None = None
    for n_experts in QUICK_MOE_EXPERTS if quick else MOE_EXPERTS:
        dropless, dense = moe_configs(n_experts, "dropless", quick=quick)
        capacity, _ = moe_configs(n_experts, "capacity", quick=quick)
        if dense_runner is None or dense_runner[0] != dense:
            dense_runner = None  # frees the previous dense model before the next is built
            dense_runner = (dense, one_device(dense))
        steps = {
            "dense": dense_runner[1],
            "dropless": one_device(dropless),
            "capacity": one_device(capacity),
        }
        seconds = interleaved_seconds({name: r.step for name, r in steps.items()}, repeats)
        key = str(n_experts)
        result["moe_vs_dense_active"][key] = seconds["dense"] / seconds["dropless"]
        result["moe_capacity_vs_dense_active"][key] = seconds["dense"] / seconds["capacity"]
        result["moe_padding_fraction"][key] = float(steps["dropless"].metrics["padding_fraction"])
    return result


DISPATCH_MESH = MeshConfig(dp=2, pp=2, ep=2)
DISPATCH_EXPERTS, QUICK_DISPATCH_EXPERTS = 64, 8


def dispatch_figures(quick: bool) -> dict:
    """The collectives of a compiled pipelined train step of a top-2 dropless MoE with 64
    experts (width 128, the reference sizes otherwise) on dp2 x pp2 x ep2, GPipe over 4
    microbatches: counts and buffer bytes per step by kind (`eqxzoo.parallel.collectives`).
    Compiled only, not run."""
    sizes = QUICK if quick else REFERENCE
    batch, seq = _sizes(quick)
    n_experts = QUICK_DISPATCH_EXPERTS if quick else DISPATCH_EXPERTS
    moe = models.MoEConfig(n_experts=n_experts, top_k=2, expert_mlp_dim=128)
    runner = StepRunner(
        models.MixtralConfig(**sizes, moe=moe),
        DISPATCH_MESH,
        Schedule("gpipe", DISPATCH_MESH.pp, 4, 1),
        (1, 4, batch, seq),
    )
    traffic = collective_traffic(runner.compiled.as_text())
    return {
        "moe_dispatch_collectives": {
            **{kind: dataclasses.asdict(t) for kind, t in sorted(traffic.items())},
            "total_bytes": sum(t.bytes for t in traffic.values()),
        }
    }


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


SCHEDULES = (("gpipe", 1), ("circular", 2), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1))
# --quick's M = 8: gpipe's and circular's steps are pipeline_efficiency's (compiled once).
SCHEDULE_MICROBATCHES, QUICK_SCHEDULE_MICROBATCHES = (8, 16, 32), (8,)


def schedule_figures(repeats: int, quick: bool) -> dict:
    """Every schedule on dp=2 x pp=4 with the same global batch per M: activation bytes by
    M, tokens/s and the modelled bubble at M = 8 (stage remat on, as the runs default to)."""
    batch, seq = _sizes(quick)
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


LOSS_VOCABS = (32768, 152064)
LOSS_SEQ = 4096
QUICK_LOSS = dict(vocabs=(512,), seq=64, d_model=32, n_heads=4, mlp_dim=64)


def loss_memory(quick: bool) -> dict:
    """Compiled temporary bytes per device of the one-device train step at ``LOSS_SEQ``
    tokens, d_model 512, 4 layers, by vocabulary: the plain loss (``chunk_size = 0``: the
    whole logits) and the fused chunked one (the default). Compiled only, not run."""
    sizes = QUICK_LOSS if quick else dict(seq=LOSS_SEQ, d_model=512, n_heads=8, mlp_dim=1408)
    figures: dict[str, dict[str, int]] = {"plain": {}, "chunked": {}}
    for vocab in QUICK_LOSS["vocabs"] if quick else LOSS_VOCABS:
        config = models.LlamaConfig(
            vocab_size=vocab,
            d_model=sizes["d_model"],
            n_layers=4,
            n_heads=sizes["n_heads"],
            mlp_dim=sizes["mlp_dim"],
        )
        for name, chunk in (("plain", 0), ("chunked", LossConfig.chunk_size)):
            runner = StepRunner(
                config,
                MeshConfig(),
                Schedule("gpipe", 1, 1, 1),
                (1, 1, 1, sizes["seq"]),
                remat_stages=False,
                loss_chunk_size=chunk,
                compile_only=True,
            )
            temp = runner.compiled.memory_analysis().temp_size_in_bytes
            figures[name][str(vocab)] = int(temp)
    return {"loss_temp_bytes": figures}


ATTENTION_SEQS = (1024, 4096, 8192)
BLOCKWISE_ONLY_SEQS = (16384,)
ATTENTION_WINDOW = 1024
ATTENTION_HEADS, ATTENTION_HEAD_DIM = 8, 64
QUICK_ATTENTION = dict(seqs=(64,), blockwise_only=(128,), window=32, block_size=32)


def attention_figures(repeats: int, quick: bool) -> dict:
    """Attention alone, forward and backward (the gradient of ``sum(out * cotangent)`` with
    respect to q, k and v), for each sequence length and mask: our blockwise and dense
    kernels and PyTorch's ``F.scaled_dot_product_attention`` (causal: ``is_causal``; window:
    a boolean mask, as torch has no window argument), timed in turn. Temporary bytes of our
    compiled kernels alongside."""
    from eqxzoo.nn import attend

    seqs = QUICK_ATTENTION["seqs"] if quick else ATTENTION_SEQS
    long_seqs = QUICK_ATTENTION["blockwise_only"] if quick else BLOCKWISE_ONLY_SEQS
    window = QUICK_ATTENTION["window"] if quick else ATTENTION_WINDOW
    block_size = QUICK_ATTENTION["block_size"] if quick else DEFAULT_BLOCK_SIZE
    seconds: dict[str, dict[str, dict[str, float]]] = {
        kernel: {"causal": {}, "window": {}} for kernel in ("blockwise", "dense", "pytorch")
    }
    temp_bytes: dict[str, dict[str, dict[str, int]]] = {
        kernel: {"causal": {}, "window": {}} for kernel in ("blockwise", "dense")
    }
    for seq in (*seqs, *long_seqs):
        shape = (1, seq, ATTENTION_HEADS, ATTENTION_HEAD_DIM)
        q, k, v, cotangent = (
            jax.random.normal(jax.random.key(i), shape, jnp.float32) for i in range(4)
        )
        positions = jnp.arange(seq)
        for mask, mask_window in (("causal", 0), ("window", window)):
            steps = {}
            kernels = ("blockwise",) if seq in long_seqs else ("blockwise", "dense")
            for kernel in kernels:

                def loss(
                    q, k, v, kernel=kernel, window=mask_window, positions=positions, dy=cotangent
                ):
                    out = attend(
                        q,
                        k,
                        v,
                        positions,
                        positions,
                        window=window,
                        scale=ATTENTION_HEAD_DIM**-0.5,
                        kernel=kernel,
                        block_size=block_size,
                    )
                    return jnp.sum(out * dy)

                compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
                temp_bytes[kernel][mask][str(seq)] = int(
                    compiled.memory_analysis().temp_size_in_bytes
                )
                steps[kernel] = functools.partial(compiled, q, k, v)
            if seq not in long_seqs:
                steps["pytorch"] = torch_attention_step(seq, 0 if mask == "causal" else window)
            for kernel, value in interleaved_seconds(steps, repeats).items():
                seconds[kernel][mask][str(seq)] = value
    return {"attention_fwd_bwd_s": seconds, "attention_temp_bytes": temp_bytes}


def torch_attention_step(seq: int, window: int) -> Callable[[], None]:
    """PyTorch's forward and backward of ``scaled_dot_product_attention`` on ``(1, 8, seq,
    64)`` fp32 tensors (causal, or causal within ``window`` by a boolean mask)."""
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    shape = (1, ATTENTION_HEADS, seq, ATTENTION_HEAD_DIM)
    q, k, v = (torch.randn(shape, generator=generator, requires_grad=True) for _ in range(3))
    cotangent = torch.randn(shape, generator=generator)
    mask = None
    if window:
        offsets = torch.arange(seq)[:, None] - torch.arange(seq)[None, :]
        mask = (offsets >= 0) & (offsets < window)

    def step() -> None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        out.backward(cotangent)
        q.grad = k.grad = v.grad = None

    return step


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


PARTS = (
    "single",
    "pipeline",
    "compile",
    "memory",
    "torch",
    "loader",
    "schedules",
    "moe",
    "dispatch",
    "loss",
    "attention",
    "seq",
)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m pipelines.bench", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--json", metavar="FILE", help="also write the figures as one JSON object")
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed steps per measurement (median)"
    )
    parser.add_argument(
        "--only",
        choices=list(PARTS),
        action="append",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a toy model: checks the command, not speed"
    )
    args = parser.parse_args(argv)
    parts = set(args.only or PARTS)

    figures: dict = {}
    peak = measured_matmul_flops(repeats=args.repeats, size=256 if args.quick else 2048)
    figures["matmul_peak_flops"] = peak
    if "single" in parts or "torch" in parts:
        figures.update(single_device(args.repeats, args.quick, versus_pytorch="torch" in parts))
        figures["mfu_vs_matmul"] = figures["model_flops_per_s"] / peak
        print(
            f"single device: {figures['tokens_per_s']:.0f} tokens/s, {figures['mfu_vs_matmul']:.2f} of matmul peak ({peak / 1e9:.1f} GFLOP/s)"
        )
    if "torch" in parts:
        if figures["vs_pytorch"] is None:
            print("pytorch: not installed")
        else:
            print(
                f"pytorch eager: {figures['pytorch_tokens_per_s']:.0f} tokens/s; ours / pytorch "
                f"(median of interleaved rounds) = {figures['vs_pytorch']:.2f}"
            )
    if "pipeline" in parts:
        figures.update(pipeline_efficiency(args.repeats, args.quick))
        spread = figures["pp_efficiency_spread"]
        print(
            "pipeline efficiency (dp2 x pp4 / dp8), median [min, max] over rounds: "
            + ", ".join(
                f"{name} {figures[f'pp_efficiency_{name}']:.2f} "
                f"[{spread[name][0]:.2f}, {spread[name][1]:.2f}]"
                for name in ("gpipe", "circular")
            )
        )
    if "compile" in parts:
        figures["compile_s_by_layers"] = compile_times(args.quick)
        print(
            "compile seconds by layers:",
            {k: round(v, 2) for k, v in figures["compile_s_by_layers"].items()},
        )
    if "memory" in parts:
        figures["memory_bytes_by_pp"] = memory_by_pp(args.quick)
        print("per-device bytes by pp:", figures["memory_bytes_by_pp"])
    if "loader" in parts:
        figures.update(loader_throughput(args.repeats, args.quick))
        print(
            f"data loader (tiny.toml batches): {figures['loader_tokens_per_s']:,.0f} tokens/s; "
            f"numpy memmap {figures['memmap_tokens_per_s']:,.0f}; tiny.toml's step consumes "
            f"{figures['tiny_step_tokens_per_s']:,.0f}: loader / step = {figures['loader_vs_tiny_step']:.0f}x"
        )
    if "schedules" in parts:
        figures.update(schedule_figures(args.repeats, args.quick))
        gpipe_rate = figures["schedule_tokens_per_s"]["gpipe"]
        for name, by_count in figures["schedule_activation_bytes"].items():
            first, last = min(by_count, key=int), max(by_count, key=int)
            print(
                f"schedule {name}: activation MB at M={'/'.join(by_count)} "
                + "/".join(f"{count / 1e6:.1f}" for count in by_count.values())
                + f" (M={last} / M={first} = {by_count[last] / by_count[first]:.2f}); "
                f"tokens/s at M={first} / gpipe's = "
                f"{figures['schedule_tokens_per_s'][name] / gpipe_rate:.2f}; modelled bubble "
                f"{figures['schedule_bubble_fraction'][name]:.3f}"
            )
    if "moe" in parts:
        figures.update(moe_figures(args.repeats, args.quick))
        for name, label in (
            ("moe_vs_dense_active", "dropless"),
            ("moe_capacity_vs_dense_active", "capacity"),
        ):
            print(
                f"moe {label} / dense of equal active FLOPs, by experts: "
                + ", ".join(f"{n}: {ratio:.2f}" for n, ratio in figures[name].items())
            )
        print(
            "moe dropless padding fraction, by experts: "
            + ", ".join(f"{n}: {value:.3f}" for n, value in figures["moe_padding_fraction"].items())
        )
    if "dispatch" in parts:
        figures.update(dispatch_figures(args.quick))
        by_kind = figures["moe_dispatch_collectives"]
        print(
            "moe expert dispatch (64 experts, dp2 x pp2 x ep2): "
            + ", ".join(
                f"{kind} {t['count']} ops {t['bytes'] / 2**20:.1f} MiB"
                for kind, t in by_kind.items()
                if kind != "total_bytes"
            )
            + f"; total {by_kind['total_bytes'] / 2**20:.1f} MiB per step"
        )
    if "loss" in parts:
        figures.update(loss_memory(args.quick))
        by_loss = figures["loss_temp_bytes"]
        for name, by_vocab in by_loss.items():
            print(
                f"loss {name}: train-step temp MB by vocab "
                + ", ".join(f"{vocab}: {size / 1e6:.0f}" for vocab, size in by_vocab.items())
            )
        largest = max(by_loss["plain"], key=int)
        smallest = min(by_loss["plain"], key=int)
        print(
            f"loss: plain / chunked temp at vocab {largest} = "
            f"{by_loss['plain'][largest] / by_loss['chunked'][largest]:.1f}x; chunked temp at "
            f"{largest} / at {smallest} = "
            f"{by_loss['chunked'][largest] / by_loss['chunked'][smallest]:.2f}"
        )
    if "attention" in parts:
        figures.update(attention_figures(args.repeats, args.quick))
        for mask in ("causal", "window"):
            for kernel, by_mask in figures["attention_fwd_bwd_s"].items():
                print(
                    f"attention fwd+bwd {mask} {kernel}: seconds by T "
                    + ", ".join(f"{seq}: {value:.3f}" for seq, value in by_mask[mask].items())
                )
            for kernel, by_mask in figures["attention_temp_bytes"].items():
                print(
                    f"attention fwd+bwd {mask} {kernel}: temp MB by T "
                    + ", ".join(f"{seq}: {value / 1e6:.0f}" for seq, value in by_mask[mask].items())
                )
    if "seq" in parts:
        figures.update(step_by_seq(args.repeats, args.quick))
        by_seq = figures["step_vs_pytorch_by_seq"]
        print(
            "train step ours / pytorch eager tokens/s by T (B x T fixed): "
            + (
                "not measured"
                if by_seq is None
                else ", ".join(f"{seq}: {r:.2f}" for seq, r in by_seq.items())
            )
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return figures


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)
    main()
