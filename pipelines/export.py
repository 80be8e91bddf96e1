"""Write a run's checkpoint as a Hugging Face checkpoint directory.

    python -m pipelines.export RUN_DIR --out DIR [--step N] [--dtype bfloat16|float32]
        [--max-shard-size GB] [--force] [--adapter]

Reads ``RUN_DIR/config.toml`` and the newest (or step ``N``'s) checkpoint and writes, in
``DIR``, what ``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads:
``config.json`` and safetensors shards in the parameters' dtype (``--dtype`` to choose),
plus the run's ``tokenizer.json`` and a ``tokenizer_config.json`` when its data has one, so
``AutoTokenizer.from_pretrained(DIR)`` works too. A run with LoRA adapters (``[lora]``)
exports its merged model (each adapted weight ``base + alpha / rank * A @ B``), or with
``--adapter`` only the adapters in PEFT's format (``adapter_config.json`` and
``adapter_model.safetensors``, for ``peft.PeftModel.from_pretrained(base, DIR)``).

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
from pipelines.cli import absolute_path

DTYPES = ("bfloat16", "float32")
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"


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
    parser.add_argument(
        "--adapter", action="store_true", help="only the LoRA adapters, in PEFT's format"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_command(lambda: export(args))


def check_out(out: Path, force: bool) -> None:
    """Refuse an ``--out`` that is a file, or a non-empty directory without ``--force``."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(
            f"--out {out} is not empty; give an empty or new directory, or --force to "
            "replace its checkpoint files"
        )


def check_out_apart(out: Path, kept: dict[str, Path]) -> None:
    """Refuse an ``--out`` inside one of the ``kept`` directories (the run's, its data's), or
    holding one: an export never writes among the files it reads, nor replaces them."""
    target = out  # already absolute, through symlinks (`pipelines.cli.absolute_path`)
    for what, directory in kept.items():
        directory = directory.resolve()
        if target == directory or directory in target.parents:
            raise UserError(f"--out {out} is inside {what} {directory}: export elsewhere")
        if target in directory.parents:
            raise UserError(f"--out {out} holds {what} {directory}: export elsewhere")


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
    from eqxzoo.run.provenance import data_directory, run_tokenizer_file
    from eqxzoo.run.rundir import CHECKPOINT_DIR, read_run_config

    if not args.run_dir:
        raise UserError("RUN_DIR is empty (an unset variable?): give a pipelines.run directory")
    if not args.out:
        raise UserError("--out is empty (an unset variable?): give a directory to write")
    run_dir, out = absolute_path(args.run_dir), absolute_path(args.out)
    if not (args.max_shard_size > 0 and math.isfinite(args.max_shard_size)):
        raise UserError(f"--max-shard-size must be a number of GB > 0, got {args.max_shard_size}")
    config = read_run_config(run_dir, args.step)
    from models.hf import config_to_hf

    dtype = args.dtype or config.precision.params
    config_to_hf(config.model, dtype)  # a family with no Hugging Face counterpart fails here
    if args.adapter and config.lora is None:
        raise UserError(f"--adapter: {run_dir} trains no LoRA adapters (its config has no [lora])")
    step = checkpoint_step(run_dir / CHECKPOINT_DIR, args.step)
    check_out(out, args.force)
    check_out_apart(
        out,
        {"the run directory": run_dir, "its data directory": data_directory(config, prepare=False)},
    )
    tokenizer = run_tokenizer_file(run_dir, config)

    from eqxzoo.runtime import join_processes

    join_processes()
    written = write_export(config, run_dir, step, tokenizer, out, args, dtype)
    import jax

    if jax.process_index() == 0:
        print(f"exported step {step} of {run_dir} to {out}: {written}")
    return 0


def write_export(
    config, run_dir: Path, step: int, tokenizer: Path, out: Path, args, dtype: str
) -> str:
    """Write the step's model, its configs and tokenizer into a staging directory beside
    ``out``, and move them into ``out`` only once every array has been read and verified
    against its checksums: any failure leaves ``out`` as it was. A one-line summary."""
    import jax

    from eqxzoo.run.rundir import CHECKPOINT_DIR
    from eqxzoo.train.checkpoint.damage import is_damage

    index = jax.process_index()
    staging = out.parent / f".{out.name}.exporting"
    if index == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    sync("export: staging directory ready")
    try:
        step_directory = run_dir / CHECKPOINT_DIR / str(step)
        if args.adapter:
            checked = write_adapter(config, run_dir, step, staging, write=index == 0)
            sync("export: every file staged")
            if index == 0:
                publish(staging, out)
            sync("export: published")
            return f"the LoRA adapters in PEFT's format, {checked} arrays verified"
        checked = write_model(config, step_directory, staging, args, dtype)
        if index == 0:
            hf_config = exported_hf_config(config, run_dir, dtype, tokenizer)
            write_configs(hf_config, run_dir, staging)
            write_tokenizer(config, run_dir, tokenizer, hf_config, staging)
        sync("export: every file staged")
    except BaseException as error:
        if index == 0:
            shutil.rmtree(staging, ignore_errors=True)
        if is_damage(error):
            raise UserError(
                f"step {step} of {run_dir} is damaged ({error}); nothing was written to "
                f"{out}: export another --step"
            ) from None
        raise
    shards = sorted(staging.glob("model*.safetensors"))
    size = sum(shard.stat().st_size for shard in shards) if index == 0 else 0
    if index == 0:
        publish(staging, out)
    sync("export: published")
    return (
        f"{len(shards)} safetensors file(s), {size / 1e6:,.1f} MB in {dtype}, "
        f"{checked} arrays verified against their checksums"
    )


def sync(name: str) -> None:
    """Wait for every process of a multi-process export."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def write_model(config, step_directory: Path, directory: Path, args, dtype: str) -> int:
    """Write the step's model as safetensors shards (this process's share) into
    ``directory``; how many arrays were verified against their checksums."""
    import equinox as eqx
    import jax
    import numpy as np

    from eqxzoo.nn.lora import merge_adapters
    from eqxzoo.train.saved_arrays import recorded_checksums, verify_reads
    from models import model_factory
    from models.hf import write_hf

    arrays, model = saved_model(config, step_directory)
    if config.lora is not None:  # the merged weights, in the plain model's structure
        merged = merge_adapters(model, read=lambda saved: np.asarray(saved[()]))
        plain = eqx.filter_eval_shape(model_factory(config.model), key=jax.random.key(0))
        model = jax.tree.unflatten(jax.tree.structure(plain), jax.tree.leaves(merged))
    write_hf(
        model,
        directory,
        dtype=dtype,
        max_shard_bytes=int(args.max_shard_size * 1e9),
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        write_config=False,
    )
    return verify_reads(arrays.values(), recorded_checksums(step_directory))


def saved_model(config, step_directory: Path) -> tuple[dict, object]:
    """The step's saved arrays by name, and the run's model (adapters included) made of them
    (lazy readers: nothing is read until an array is indexed)."""
    import equinox as eqx
    import jax

    from eqxzoo.train.saved_arrays import saved_arrays
    from models import model_factory

    arrays = saved_arrays(step_directory)
    skeleton = eqx.filter_eval_shape(model_factory(config.adapted_model), key=jax.random.key(0))

    def saved(path, leaf):
        name = "model" + jax.tree_util.keystr(path)
        array = arrays.get(name)
        if array is None or array.shape != tuple(leaf.shape):
            raise UserError(f"{step_directory}: holds no array {name} of shape {leaf.shape}")
        return array

    return arrays, jax.tree_util.tree_map_with_path(saved, skeleton)


def write_adapter(config, run_dir: Path, step: int, directory: Path, *, write: bool) -> int:
    """Write (where ``write``: process 0) the LoRA adapters of the run's step in PEFT's format
    into ``directory``: its ``adapter_config.json`` (rank, alpha, the torch modules adapted,
    the checkpoint the run started from) and ``adapter_model.safetensors`` (float32); how
    many arrays were verified (every process reads them all and verifies)."""
    import tomllib

    from safetensors.numpy import save_file

    from eqxzoo.nn.lora import is_adapter_path
    from eqxzoo.run.rundir import CHECKPOINT_DIR, CONFIG_FILE
    from eqxzoo.train.saved_arrays import recorded_checksums, verify_reads
    from models.hf import peft_adapters

    step_directory = run_dir / CHECKPOINT_DIR / str(step)
    arrays, model = saved_model(config, step_directory)
    tensors, modules = peft_adapters(model)
    adapters = [array for name, array in arrays.items() if is_adapter_path(name)]
    checked = verify_reads(adapters, recorded_checksums(step_directory))
    if not write:
        return checked
    save_file(
        {name: value.astype("float32") for name, value in tensors.items()},
        str(directory / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        # The run's own config keeps where it started (`read_run_config` drops it).
        "base_model_name_or_path": tomllib.loads((run_dir / CONFIG_FILE).read_text())["model"].get(
            "init_from_hf"
        )
        or None,
        "r": config.lora.rank,
        "lora_alpha": config.lora.alpha,
        "lora_dropout": 0.0,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
    }
    (directory / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    return checked


def exported_hf_config(config, run_dir: Path, dtype: str, tokenizer: Path) -> dict:
    """The exported ``config.json``: a run from a Hugging Face checkpoint gives back the
    source's own (every field it had: positions, special token ids, rope scaling as
    written) with the export's dtype, and the zoo's fields over it should the architecture
    differ; a run from scratch the zoo's fields with the positions it trained on and its
    end-of-document token as the start and end of a sequence."""
    from eqxzoo.data import EOD_TOKEN, load_tokenizer
    from eqxzoo.run.provenance import hf_source_dir
    from models.hf import CONFIG_NAME, config_from_hf, config_to_hf

    ours = config_to_hf(config.model, dtype)
    source_dir = hf_source_dir(run_dir)
    if source_dir is None:
        eod = load_tokenizer(tokenizer).token_to_id(EOD_TOKEN)
        used = {"max_position_embeddings": config.data.seq_len}
        if eod is not None:
            used |= {"bos_token_id": eod, "eos_token_id": eod}
        return {**used, **ours}
    source = json.loads((source_dir / CONFIG_NAME).read_text())
    if config_to_hf(config_from_hf(source), dtype) != ours:
        return {**source, **ours}
    dtype_keys = [key for key in ("dtype", "torch_dtype") if key in source] or ["dtype"]
    return {**source, **dict.fromkeys(dtype_keys, dtype)}


def write_configs(hf_config: dict, run_dir: Path, directory: Path) -> None:
    """``config.json`` and ``generation_config.json``: the source's generation config where
    a run from Hugging Face kept one, else the special token ids of ``hf_config``."""
    from eqxzoo.run.provenance import hf_source_dir
    from models.hf import CONFIG_NAME

    (directory / CONFIG_NAME).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    source_dir = hf_source_dir(run_dir)
    if source_dir is not None and (source_dir / GENERATION_CONFIG_FILE).is_file():
        shutil.copyfile(source_dir / GENERATION_CONFIG_FILE, directory / GENERATION_CONFIG_FILE)
        return
    ids = ("bos_token_id", "eos_token_id", "pad_token_id")
    generation = {name: hf_config[name] for name in ids if hf_config.get(name) is not None}
    generation["_from_model_config"] = True
    text = json.dumps(generation, indent=2, sort_keys=True) + "\n"
    (directory / GENERATION_CONFIG_FILE).write_text(text)


def write_tokenizer(
    config, run_dir: Path, tokenizer: Path, hf_config: dict, directory: Path
) -> None:
    """The tokenizer files ``AutoTokenizer`` loads: the source checkpoint's own where a run
    from Hugging Face kept them, else the run's ``tokenizer.json`` with a
    ``tokenizer_config.json`` naming its end-of-document token."""
    from eqxzoo.data import EOD_TOKEN
    from eqxzoo.data.prepare import TOKENIZER_FILE
    from eqxzoo.run.provenance import HF_SOURCE_FILES, hf_source_dir

    source_dir = hf_source_dir(run_dir)
    if source_dir is not None and (source_dir / TOKENIZER_FILE).is_file():
        for name in HF_SOURCE_FILES:
            if name.startswith("tokenizer") or name == "special_tokens_map.json":
                if (source_dir / name).is_file():
                    shutil.copyfile(source_dir / name, directory / name)
        return
    shutil.copyfile(tokenizer, directory / TOKENIZER_FILE)
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOD_TOKEN,
        "eos_token": EOD_TOKEN,
        "model_max_length": hf_config.get("max_position_embeddings", config.data.seq_len),
    }
    (directory / TOKENIZER_CONFIG_FILE).write_text(json.dumps(settings, indent=2) + "\n")


def publish(staging: Path, out: Path) -> None:
    """Move the staged export into ``out``: a rename where ``out`` does not exist; else
    (``--force``) its old checkpoint files removed and each staged file renamed in."""
    from models.tensor_files import WEIGHTS_INDEX_NAME

    if not out.exists():
        staging.rename(out)
        return
    for stale in [*out.glob("model*.safetensors"), out / WEIGHTS_INDEX_NAME]:
        stale.unlink(missing_ok=True)
    for staged in sorted(staging.iterdir()):
        staged.replace(out / staged.name)
    staging.rmdir()


if __name__ == "__main__":
    sys.exit(main())
