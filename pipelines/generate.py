"""Sample text from a run's latest checkpoint.

    python -m pipelines.generate RUN_DIR --prompt TEXT [--max-new-tokens 64]
        [--temperature 0.8] [--top-k 50] [--top-p 0.95] [--seed 0] [--stop-at-eod] [--chat]

Reads ``RUN_DIR/config.toml`` (written by `pipelines.run`), the run's tokenizer
(`eqxzoo.run.provenance`) and the newest usable checkpoint, then decodes with a KV cache (`models.generate`) on one device.
Prints the prompt followed by the continuation. With ``--chat`` the prompt is a user's
message, rendered with the chat template of the checkpoint the run started from (kept in
``RUN_DIR/hf_source/``) with the assistant's turn opened, and the reply (up to the template's
end-of-turn token, its ``eos_token``) is printed. Problems are one ``error:`` line, exit 2.

Every option is checked before anything is read (`check_options`), and the length asked for
before the checkpoint is restored (`check_cache_fits`): the KV cache `models.generate`
allocates must fit the memory of the device it runs on.
"""

import argparse
import dataclasses
import sys

from eqxzoo.errors import ConfigError, UserError, run_command
from pipelines.cli import absolute_path

SEED_BOUNDS = (-(2**63), 2**63 - 1)  # what jax.random.key takes
MAX_CACHE_POSITIONS = 2**31 - 1  # the KV cache's position counter is int32


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m pipelines.generate", description=__doc__.split("\n")[0]
    )
    parser.add_argument("run_dir", help="a pipelines.run output directory")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--stop-at-eod", action="store_true", help="stop at the end-of-document token"
    )
    parser.add_argument(
        "--chat", action="store_true", help="the prompt is a user message (chat template)"
    )
    return parser.parse_args(argv)


def check_options(args: argparse.Namespace) -> None:
    """Raise a `UserError` naming the first option out of range, before anything is loaded:
    the sampling options by `models.generate.check_sampling` (reported as the options), the
    rest here (an empty RUN_DIR is an unset variable, not the current directory)."""
    from models.generate import check_sampling

    if not args.run_dir:
        raise UserError("RUN_DIR is empty (an unset variable?): give a pipelines.run directory")
    try:
        check_sampling(args.temperature, args.top_k, args.top_p, args.max_new_tokens)
    except ConfigError as error:
        option = "--" + error.field.replace("_", "-")
        raise UserError(f"{option} {error.problem}") from None
    low, high = SEED_BOUNDS
    if not low <= args.seed <= high:
        raise UserError(f"--seed must fit in 64 bits (-2**63 to 2**63 - 1), got {args.seed}")


def kv_cache_bytes_per_position(model_config, dtype: str) -> int:
    """Bytes of one position of the KV cache `models.generate` allocates in ``dtype``
    (`models.DecoderLM.init_cache`: keys and values for every layer, or latent attention's
    compressed latent and RoPE key), from the cache's shapes (nothing is allocated)."""
    import equinox as eqx
    import jax

    from models import model_factory

    def one_slot_cache():
        cache = model_factory(model_config)(key=jax.random.key(0)).init_cache(1, dtype)
        return cache.layers, cache.prefix_layers

    shapes = eqx.filter_eval_shape(one_slot_cache)
    return sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(shapes))


def check_cache_fits(
    *,
    prompt_tokens: int,
    max_new_tokens: int,
    bytes_per_position: int,
    memory: str,
    available: int | None,
) -> None:
    """Refuse a generation whose KV cache cannot exist: `models.generate` allocates one of
    ``prompt_tokens + max_new_tokens - 1`` positions.

    The rule: at most `MAX_CACHE_POSITIONS`, and the cache alone no larger than the memory
    ``available`` now (not checked where that is unknown). No config defines a maximum
    context (RoPE positions are unbounded), so memory is the bound, and the cache is the
    bulk of what grows with ``max_new_tokens``. Counting the cache alone never turns away
    a generation that would fit; one it lets through can still run short with a long
    prompt (prefill's attention scores grow with prompt x positions) or a large model.
    """
    from eqxzoo.train.memory import format_bytes

    positions = prompt_tokens + max_new_tokens - 1
    if positions > MAX_CACHE_POSITIONS:
        raise UserError(
            f"--max-new-tokens {max_new_tokens} with a prompt of {prompt_tokens} tokens exceeds "
            f"the KV cache's limit of {MAX_CACHE_POSITIONS} positions; lower --max-new-tokens"
        )
    need = positions * bytes_per_position
    if available is not None and need > available:
        raise UserError(
            f"--max-new-tokens {max_new_tokens} needs a KV cache of {format_bytes(need)} "
            f"({positions} positions x {format_bytes(bytes_per_position)}), more than the "
            f"{format_bytes(available)} of {memory} available; lower --max-new-tokens"
        )


def prompt_text(prompt: str) -> str:
    """The prompt as text: the command line's bytes (which Python keeps as surrogate escapes
    where they are not UTF-8) must be UTF-8, else a `UserError` naming the first bad byte."""
    raw = prompt.encode("utf-8", "surrogateescape")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        bad = raw[error.start : error.start + 1].hex()
        raise UserError(
            f"--prompt is not UTF-8 text (byte 0x{bad} at byte {error.start}): give the prompt "
            "in UTF-8"
        ) from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_command(lambda: generate_from_run(args))


def generate_from_run(args: argparse.Namespace) -> int:
    check_options(args)
    text = prompt_text(args.prompt)
    from eqxzoo.run.rundir import CHECKPOINT_DIR, read_run_config

    run_dir = absolute_path(args.run_dir)
    config = read_run_config(run_dir)

    import jax
    import jax.numpy as jnp

    from eqxzoo.data import EOD_TOKEN, load_tokenizer
    from eqxzoo.parallel import MeshConfig, make_mesh
    from eqxzoo.run.config import step_config
    from eqxzoo.run.provenance import run_tokenizer_file
    from eqxzoo.train.checkpoint import Checkpointer
    from eqxzoo.train.layout import abstract_checkpoint_state
    from eqxzoo.train.memory import memory_available
    from models import generate, model_factory

    if args.chat:
        text, tokenizer, stop = chat_prompt(run_dir, text)
        prompt = tokenizer.encode(text, add_special_tokens=False).ids
    else:
        tokenizer = load_tokenizer(run_tokenizer_file(run_dir, config))
        prompt = tokenizer.encode(text).ids
        stop = tokenizer.token_to_id(EOD_TOKEN) if args.stop_at_eod else None
    if not prompt:
        raise UserError("--prompt encodes to no tokens")
    device = jax.devices()[0]
    memory, available = memory_available(device)
    bytes_per_position = kv_cache_bytes_per_position(config.model, config.precision.params)
    check_cache_fits(
        prompt_tokens=len(prompt),
        max_new_tokens=args.max_new_tokens,
        bytes_per_position=bytes_per_position,
        memory=memory,
        available=available,
    )

    one_device = dataclasses.replace(
        config,
        mesh=MeshConfig(),
        pipeline=dataclasses.replace(config.pipeline, schedule="gpipe", repeats=1),
    )
    mesh = make_mesh(one_device.mesh, [device])
    target = abstract_checkpoint_state(
        model_factory(config.adapted_model), config=step_config(one_device), mesh=mesh
    )
    with Checkpointer(run_dir / CHECKPOINT_DIR, every=1, keep=1) as checkpointer:
        restored = checkpointer.restore_latest(target, None)
    if restored is None:
        raise UserError(f"{run_dir / CHECKPOINT_DIR} holds no checkpoint yet")
    model = restored.state.model  # the checkpoint layout is the plain model

    try:
        new_tokens = generate(
            model,
            jnp.asarray(prompt, jnp.int32),
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            stop_token=stop,
            key=jax.random.key(args.seed),
        )
    except ValueError as error:
        raise UserError(str(error)) from None
    new_tokens = [int(t) for t in jax.device_get(new_tokens)]
    if stop is not None and stop in new_tokens:
        new_tokens = new_tokens[: new_tokens.index(stop)]
    reply = tokenizer.decode(new_tokens)
    print(f"(step {restored.step}) " + (reply if args.chat else text + reply))
    return 0


def chat_prompt(run_dir, message: str):
    """``message`` as a user's turn rendered with the chat template of the checkpoint the run
    started from, the assistant's turn opened; that checkpoint's tokenizer; and the token
    that ends a turn (its ``eos_token``; None if it names none)."""
    from eqxzoo.data.instructions import Fit, InstructionEncoder, RecordError
    from eqxzoo.data.tokenizer import open_tokenizer
    from eqxzoo.run.provenance import hf_source_dir

    source_dir = hf_source_dir(run_dir)
    source = None if source_dir is None else open_tokenizer(source_dir)
    if source is None or source.chat_template is None:
        raise UserError(
            f"--chat: {run_dir} keeps no chat template (a run from a Hugging Face checkpoint "
            "keeps its tokenizer_config.json in RUN_DIR/hf_source/, and this run's has no "
            "chat_template): give the prompt as plain text, without --chat"
        )
    try:
        rendered = InstructionEncoder(source, "all", Fit()).render(
            [{"role": "user", "content": message}], generation_prompt=True
        )
    except RecordError as error:
        raise UserError(f"--chat: {error}") from None
    eos = source.special_token("eos_token")
    return rendered, source.tokenizer, None if eos is None else source.tokenizer.token_to_id(eos)


if __name__ == "__main__":
    sys.exit(main())
