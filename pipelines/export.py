"""Write a run's checkpoint as a Hugging Face checkpoint directory.

    python -m pipelines.export RUN_DIR --out DIR [--step N] [--dtype bfloat16|float32]
        [--max-shard-size GB] [--force]

Reads ``RUN_DIR/config.toml`` and the newest (or step ``N``'s) checkpoint and writes, in
``DIR``, what ``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads:
``config.json`` and safetensors shards in the parameters' dtype (``--dtype`` to choose),
plus the run's ``tokenizer.json`` and a ``tokenizer_config.json`` when its data has one, so
``AutoTokenizer.from_pretrained(DIR)`` works too.

The checkpoint is read one layer of one array at a time (`eqxzoo.train.saved_arrays`) and
written one shard at a time (`models.hf.write_hf`): a checkpoint larger than host memory
exports. What is read is checked against the checksums recorded at save time. Started as
several processes (JAX's distributed environment, as `pipelines.run` under a cluster
launcher, or ``python -m pipelines.launch --processes N --module pipelines.export ...``),
each writes its share of the shards. Problems are one ``error:`` line, exit 2.
"""

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

from eqxzoo.errors import UserError, run_command

DTYPES = ("bfloat16", "float32")
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m pipelines.export", description=__doc__.split("\n")[0]
    )
    parser.add_argument("run_dir", help="a pipelines.run output directory")
    parser.add_argument("--out", required=True, help="the Hugging Face checkpoint directory")
    parser.add_argument("--step", type=int, help="the checkpoint's step (default: the newest)")
    parser.add_argument("--dtype", choices=DTYPES, help="default: the run's precision.params")
    parser.add_argument(
        "--max-shard-size", type=float, default=2.0, help="GB per safetensors shard (2)"
    )
    parser.add_argument("--force", action="store_true", help="write into a non-empty --out")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_command(lambda: export(args))


def check_out(out: Path, force: bool) -> None:
    """Refuse an ``--out`` that is a file, or a non-empty directory without ``--force``."""
    if not str(out):
        raise UserError("--out is empty (an unset variable?): give a directory to write")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(
            f"--out {out} is not empty; give an empty or new directory, or --force to "
            "replace its checkpoint files"
        )


def checkpoint_step(checkpoints: Path, step: int | None) -> int:
    """The step to export: ``step``, or the newest finished checkpoint."""
    from eqxzoo.train.checkpoint import finished_steps

    steps = finished_steps(checkpoints) if checkpoints.is_dir() else []
    if not steps:
        raise UserError(f"{checkpoints} holds no checkpoint yet")
    if step is None:
        return steps[-1]
    if step not in steps:
        listed = ", ".join(str(s) for s in steps)
        raise UserError(f"--step {step}: {checkpoints} has no such checkpoint; it has {listed}")
    return step


def export(args: argparse.Namespace) -> int:
    from eqxzoo.run.rundir import CHECKPOINT_DIR, read_run_config

    if not args.run_dir:
        raise UserError("RUN_DIR is empty (an unset variable?): give a pipelines.run directory")
    run_dir, out = Path(args.run_dir), Path(args.out)
    if not (args.max_shard_size > 0 and math.isfinite(args.max_shard_size)):
        raise UserError(f"--max-shard-size must be a number of GB > 0, got {args.max_shard_size}")
    config = read_run_config(run_dir, args.step)
    from models.hf import config_to_hf

    dtype = args.dtype or config.precision.params
    config_to_hf(config.model, dtype)  # a family with no Hugging Face counterpart fails here
    step = checkpoint_step(run_dir / CHECKPOINT_DIR, args.step)
    check_out(out, args.force)

    from eqxzoo.runtime import join_processes

    join_processes()
    written = write_checkpoint(config, run_dir / CHECKPOINT_DIR / str(step), out, args, dtype)
    import jax

    if jax.process_index() == 0:
        print(f"exported step {step} of {run_dir} to {out}: {written}")
    return 0


def write_checkpoint(config, step_directory: Path, out: Path, args, dtype: str) -> str:
    """Write the step's model to ``out``; a one-line summary of what was written."""
    import equinox as eqx
    import jax

    from eqxzoo.train.saved_arrays import recorded_checksums, saved_arrays, verify_reads
    from models import model_factory
    from models.hf import write_hf
    from models.tensor_files import WEIGHTS_INDEX_NAME

    arrays = saved_arrays(step_directory)
    skeleton = eqx.filter_eval_shape(model_factory(config.model), key=jax.random.key(0))

    def saved(path, leaf):
        name = "model" + jax.tree_util.keystr(path)
        array = arrays.get(name)
        if array is None or array.shape != tuple(leaf.shape):
            raise UserError(f"{step_directory}: holds no array {name} of shape {leaf.shape}")
        return array

    model = jax.tree_util.tree_map_with_path(saved, skeleton)
    index, count = jax.process_index(), jax.process_count()
    out.mkdir(parents=True, exist_ok=True)
    if index == 0:
        for stale in [*out.glob("model*.safetensors"), out / WEIGHTS_INDEX_NAME]:
            stale.unlink(missing_ok=True)
    if count > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("export: --out cleared")
    write_hf(
        model,
        out,
        dtype=dtype,
        max_shard_bytes=int(args.max_shard_size * 1e9),
        process_index=index,
        process_count=count,
    )
    checked = verify_reads(arrays.values(), recorded_checksums(step_directory))
    if index == 0:
        copy_tokenizer(config, out)
    shards = sorted(out.glob("model*.safetensors"))
    size = sum(shard.stat().st_size for shard in shards) if index == 0 else 0
    return (
        f"{len(shards)} safetensors file(s), {size / 1e6:,.1f} MB in {dtype}, "
        f"{checked} arrays verified against their checksums"
    )


def copy_tokenizer(config, out: Path) -> bool:
    """Copy the run's ``tokenizer.json`` (if its prepared data has one) and write the
    ``tokenizer_config.json`` that makes ``AutoTokenizer`` load it; whether it did."""
    from eqxzoo.data import EOD_TOKEN
    from eqxzoo.data.prepare import TOKENIZER_FILE
    from eqxzoo.run.loop import data_directory

    tokenizer = data_directory(config, prepare=False) / TOKENIZER_FILE
    if not tokenizer.is_file():
        return False
    shutil.copyfile(tokenizer, out / TOKENIZER_FILE)
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOD_TOKEN,
        "model_max_length": config.data.seq_len,
    }
    (out / TOKENIZER_CONFIG_FILE).write_text(json.dumps(settings, indent=2) + "\n")
    return True


if __name__ == "__main__":
    sys.exit(main())
