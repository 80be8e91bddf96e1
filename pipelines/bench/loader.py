"""The data loader's throughput next to a plain memmap reader and the step it feeds."""

import time

import jax

import models
from eqxzoo.parallel import make_mesh
from eqxzoo.train.report import median_seconds
from eqxzoo.train.state import init_train_state
from eqxzoo.train.step import batch_sharding, make_train_step


def loader_throughput(repeats: int, quick: bool) -> dict:
    """configs/tiny.toml's loader, a numpy memmap reader of the same tokens, and its step."""
    import tempfile
    from pathlib import Path

    import numpy as np

    from eqxzoo.data import TokenStream, open_split, train_batches
    from eqxzoo.run.config import load_config, step_config
    from eqxzoo.run.loop import batch_shape
    from eqxzoo.run.provenance import data_directory

    quick_overrides = (
        "model.d_model=32",
        "model.moe.expert_mlp_dim=32",
        "model.moe.shared_mlp_dim=32",
        "data.seq_len=32",
        "data.batch_size=4",
    )
    config = load_config(
        Path(__file__).resolve().parents[2] / "configs" / "tiny.toml",
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
