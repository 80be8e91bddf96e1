"""Sample text from a run's latest checkpoint.

    python -m pipelines.generate RUN_DIR --prompt TEXT [--max-new-tokens 64]
        [--temperature 0.8] [--top-k 50] [--top-p 0.95] [--seed 0] [--stop-at-eod]

Reads ``RUN_DIR/config.toml`` (written by `pipelines.run`), the corpus tokenizer and the
newest usable checkpoint, then decodes with a KV cache (`models.generate`) on one device.
Prints the prompt followed by the continuation. Problems are one ``error:`` line, exit 2.
"""

import argparse
import dataclasses
import sys
from pathlib import Path

from eqxzoo.errors import ConfigError, UserError, run_command


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m pipelines.generate", description=__doc__.split("\n")[0]
    )
    parser.add_argument("run_dir", type=Path, help="a pipelines.run output directory")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--stop-at-eod", action="store_true", help="stop at the end-of-document token"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_command(lambda: generate_from_run(args))


def generate_from_run(args: argparse.Namespace) -> int:
    from eqxzoo.config import load_config
    from eqxzoo.train.rundir import CHECKPOINT_DIR, CONFIG_FILE

    config_file = args.run_dir / CONFIG_FILE
    if not config_file.is_file():
        raise UserError(f"{args.run_dir} has no {CONFIG_FILE}: not a pipelines.run directory")
    try:
        config = load_config(config_file)
    except ConfigError as error:
        raise ConfigError(f"{config_file}: {error}") from None

    import jax
    import jax.numpy as jnp

    from eqxzoo.config import step_config
    from eqxzoo.data import EOD_TOKEN, load_tokenizer
    from eqxzoo.data.prepare import TOKENIZER_FILE
    from eqxzoo.parallel import MeshConfig, make_mesh
    from eqxzoo.train.checkpoint import Checkpointer
    from eqxzoo.train.layout import abstract_checkpoint_state
    from eqxzoo.train.loop import data_directory
    from models import generate, model_factory

    one_device = dataclasses.replace(
        config,
        mesh=MeshConfig(),
        pipeline=dataclasses.replace(config.pipeline, schedule="gpipe", repeats=1),
    )
    mesh = make_mesh(one_device.mesh, jax.devices()[:1])
    target = abstract_checkpoint_state(
        model_factory(config.model), config=step_config(one_device), mesh=mesh
    )
    tokenizer = load_tokenizer(data_directory(config) / TOKENIZER_FILE)
    with Checkpointer(args.run_dir / CHECKPOINT_DIR, every=1, keep=1) as checkpointer:
        restored = checkpointer.restore_latest(target, None)
    if restored is None:
        raise UserError(f"{args.run_dir / CHECKPOINT_DIR} holds no checkpoint yet")
    model = restored.state.model  # the checkpoint layout is the plain model

    prompt = tokenizer.encode(args.prompt).ids
    if not prompt:
        raise UserError("--prompt encodes to no tokens")
    eod = tokenizer.token_to_id(EOD_TOKEN)
    try:
        new_tokens = generate(
            model,
            jnp.asarray(prompt, jnp.int32),
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            stop_token=eod if args.stop_at_eod else None,
            key=jax.random.key(args.seed),
        )
    except ValueError as error:
        raise UserError(str(error)) from None
    new_tokens = [int(t) for t in jax.device_get(new_tokens)]
    if args.stop_at_eod and eod in new_tokens:
        new_tokens = new_tokens[: new_tokens.index(eod)]
    print(f"(step {restored.step}) " + args.prompt + tokenizer.decode(new_tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
