"""End to end through the commands: ``pipelines.run`` with ``[model] init_from_hf`` on two
processes (each reading only its half of the checkpoint), a resume that never reads the
Hugging Face weights again, and ``pipelines.export`` on two processes giving the same files
as on one.
"""

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import safetensors.numpy  # noqa: E402
from hf_models import hf_config, randomize  # noqa: E402
from runs import launch, losses, run_command  # noqa: E402

pytestmark = pytest.mark.slow

VOCAB = 2048  # the stdlib corpus's, as in configs/tiny.toml


def finetune_config(hf_dir: Path, cache_dir: Path) -> str:
    return f"""
[run]
name = "finetune"
steps = 2
log_every = 1
eval_every = 0
tensorboard = false
plot = false
compilation_cache_dir = "{cache_dir}"

[model]
init_from_hf = "{hf_dir}"

[mesh]
dp = 2
pp = 2
tp = 2

[pipeline]
schedule = "circular"
microbatches = 2
repeats = 2

[optimizer]
learning_rate = 1e-3
warmup_steps = 1

[data]
vocab_size = {VOCAB}
seq_len = 32
batch_size = 4

[checkpoint]
every = 2
"""


def read_per_process(output: str) -> tuple[float, list[float]]:
    """The checkpoint's size and the MB each process read, from the run's log line."""
    line = next(line for line in output.splitlines() if "initialised from the Hugging" in line)
    total = float(line.split("(")[1].split(" MB")[0].replace(",", ""))
    read = [float(n.replace(",", "")) for n in line.split("per process ")[1].split(", ")]
    return total, read


def tensors(directory: Path) -> dict[str, np.ndarray]:
    found = {}
    for file in sorted(directory.glob("*.safetensors")):
        found.update(safetensors.numpy.load_file(str(file)))
    return found


def test_two_processes_load_their_halves_resume_without_the_weights_and_export(
    tmp_path: Path, cache_dir: Path
):
    torch.manual_seed(0)
    architecture_config = hf_config(
        "LlamaForCausalLM",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
    )
    hf_dir = tmp_path / "hf"
    randomize(transformers.LlamaForCausalLM(architecture_config)).save_pretrained(hf_dir)
    config = tmp_path / "finetune.toml"
    config.write_text(finetune_config(hf_dir, cache_dir))
    run_dir = tmp_path / "run"

    log = tmp_path / "launch.log"
    process = launch(["--processes", "2", str(config), "--run-dir", str(run_dir)], log)
    assert process.wait(timeout=600) == 0, log.read_text()[-3000:]
    total, read = read_per_process(log.read_text())
    assert len(read) == 2
    # dp splits every array of this model in two, and dp is what the processes split:
    # each reads its half, nothing more, and together they read the checkpoint once.
    for megabytes in read:
        assert megabytes == pytest.approx(total / 2, abs=0.011), read
    assert losses(run_dir) and len(losses(run_dir)) == 2

    (hf_dir / "model.safetensors").unlink()  # a resume must not read the weights again
    resumed = run_command(
        [
            sys.executable,
            "-m",
            "pipelines.run",
            str(run_dir / "config.toml"),
            "--run-dir",
            str(run_dir),
            "--set",
            "run.steps=3",
        ]
    )
    assert "resumed from the checkpoint at step 2" in resumed.stdout
    assert "initialised from the Hugging Face" not in resumed.stdout
    assert len(losses(run_dir)) == 3

    one = tmp_path / "export-1"
    run_command([sys.executable, "-m", "pipelines.export", str(run_dir), "--out", str(one)])
    two = tmp_path / "export-2"
    export_log = tmp_path / "export.log"
    exporting = launch(
        [
            "--processes",
            "2",
            "--module",
            "pipelines.export",
            str(run_dir),
            "--out",
            str(two),
            "--max-shard-size",
            "0.00005",
        ],
        export_log,
    )
    assert exporting.wait(timeout=600) == 0, export_log.read_text()[-3000:]
    assert "exported step 3 of" in export_log.read_text()
    assert len(list(two.glob("model-*-of-*.safetensors"))) > 2
    single, sharded = tensors(one), tensors(two)
    assert sorted(single) == sorted(sharded)
    for name in single:
        np.testing.assert_array_equal(single[name], sharded[name], err_msg=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(two)
    tokenizer = transformers.AutoTokenizer.from_pretrained(two)
    prompt = tokenizer("def main(", return_tensors="pt").input_ids
    assert model.generate(prompt, max_new_tokens=4, do_sample=False).shape[1] == prompt.shape[1] + 4
