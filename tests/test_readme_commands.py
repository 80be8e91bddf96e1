"""README's shell commands, verbatim: each ```bash block is copied out of README.md (as `.ci/run`
copies the test command) and run in a scratch copy of the repository, from its root, with
step counts lowered by ``--steps`` only. A README edit that breaks a command fails here.

Which blocks run is decided by their content, not their position (`BLOCKS`): every block
is either run or named with the reason it is not (the install, the test command, SLURM
lines, the two-slice launches that `test_launch.py` runs shrunk, and the two 1B-parameter
configs' blocks, whose steps take minutes and all of this
machine's memory: ``EQXZOO_README_HEAVY=1`` runs them too).
"""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from compiling import XLA_FLAGS, environment

from eqxzoo.train.report import read_metrics

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
HEAVY = os.environ.get("EQXZOO_README_HEAVY") == "1"
# How a block is recognised (its first command), and what is done with it.
BLOCKS = {
    "python -m venv .venv": "skip: the install; .ci/run installs the same way before this runs",
    "ruff check .": "skip: the test command; it is what runs this",
    "srun ": "skip: needs a SLURM cluster",
    "python -m pipelines.launch --processes 2 configs/tiny.toml --set mesh.dcn": (
        "skip: two slices; test_launch.py runs these on a shrunk tiny.toml against one process"
    ),
    "python -m pipelines.run configs/tiny.toml": "train",
    "python -m pipelines.run configs/moe_1b.toml --set": "heavy",
    "python -m pipelines.run configs/deepseek_small.toml --set": "heavy",
    "W=/tmp/eqxzoo-finetune": "finetune",
    "W=/tmp/eqxzoo-sft": "sft",
    "python -m pipelines.prepare --stdlib": "prepare",
}
FINETUNE_DIR = Path("/tmp/eqxzoo-finetune")
SFT_DIR = Path("/tmp/eqxzoo-sft")


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def kind_of(block: str) -> str:
    kinds = [kind for start, kind in BLOCKS.items() if block.startswith(start)]
    assert len(kinds) == 1, f"a README block this test does not know: {block[:80]!r}"
    return kinds[0]


def test_every_block_is_known():
    blocks = bash_blocks(README.read_text())
    kinds = [kind_of(block) for block in blocks]
    assert sorted(set(kinds)) == sorted(set(BLOCKS.values())), "every entry still matches"


def block(kind: str) -> str:
    (found,) = [b for b in bash_blocks(README.read_text()) if kind_of(b) == kind]
    return found


def lowered(command: str, steps: int) -> str:
    """``command`` with ``--steps`` when it trains (a ``pipelines.run`` or ``launch`` line
    without ``--dry-run``); README's text otherwise unchanged."""
    trains = re.match(r"python -m pipelines\.(run|launch) ", command) and "--dry-run" not in command
    if not trains:
        return command
    code, _, comment = command.partition("  #")
    return f"{code.rstrip()} --steps {steps}" + (f"  #{comment}" if comment else "")


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A copy of the repository's tracked files, as a fresh clone has them."""
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    copy = tmp_path_factory.mktemp("clone")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, copy / name)
    return copy


def run_lines(
    lines: list[str], cwd: Path, timeout: int = 900, xla_flags: str = XLA_FLAGS
) -> list[str]:
    """Run each line with bash from ``cwd`` (under `compiling.environment`'s ``xla_flags``);
    each must exit 0. Their standard outputs."""
    env = environment(dict(os.environ), xla_flags) | {"PYTHONPATH": str(cwd)}
    outputs = []
    for line in lines:
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", line],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert result.returncode == 0, f"{line}\n{result.stderr[-3000:]}"
        outputs.append(result.stdout)
    return outputs


def test_the_train_block(scratch: Path):
    """A run, a dry run, the same run resumed on two processes, a sample and an export that
    transformers loads, all under relative paths from the repository's root."""
    lines = [line for line in block("train").splitlines() if line.strip()]
    assert [line.split("#")[0].split()[:3] for line in lines] == [
        ["python", "-m", "pipelines.run"],
        ["python", "-m", "pipelines.run"],
        ["python", "-m", "pipelines.launch"],
        ["python", "-m", "pipelines.generate"],
        ["python", "-m", "pipelines.export"],
    ]
    run_steps = {0: 2, 2: 3}  # the launch resumes the run for one more step
    commands = [lowered(line, run_steps.get(number, 0)) for number, line in enumerate(lines)]
    outputs = run_lines(commands, scratch)
    run_dir = scratch / "runs" / "tiny"
    assert (run_dir / "checkpoints" / "3").is_dir()
    assert "resumed from the checkpoint at step 2" in outputs[2]
    assert outputs[3].startswith("(step 3) def __init__(self")
    transformers = pytest.importorskip("transformers")
    export = scratch / "runs" / "tiny-hf"
    model = transformers.AutoModelForCausalLM.from_pretrained(export)
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    assert type(model).__name__ == "Qwen2MoeForCausalLM"
    assert tokenizer.decode(tokenizer("def __init__(self")["input_ids"]) == "def __init__(self"


def test_the_finetune_block(scratch: Path):
    """README's whole fine-tuning road, as one script: it writes under /tmp/eqxzoo-finetune."""
    shutil.rmtree(FINETUNE_DIR, ignore_errors=True)
    script = "\n".join(lowered(line, 2) for line in block("finetune").splitlines())
    (output,) = run_lines([script], scratch)
    assert "initialised from the Hugging Face checkpoint /tmp/eqxzoo-finetune/hf" in output
    assert output.splitlines()[-1].startswith("LlamaForCausalLM 410176 'def get_payload(self")
    exported = json.loads((FINETUNE_DIR / "export" / "config.json").read_text())
    assert exported["architectures"] == ["LlamaForCausalLM"]
    shutil.rmtree(FINETUNE_DIR, ignore_errors=True)


def test_the_sft_block(scratch: Path):
    """README's chat fine-tuning with LoRA, as one script and in full (its point is the
    trained answer): chat data with its assistant turns as the only targets (each step
    reports the masked fraction) and documents kept apart (on by default for chat data: the
    compiled step takes the batches' segments and positions). It writes under
    /tmp/eqxzoo-sft. Under XLA's default flags: its 100 steps repay the optimised compile."""
    shutil.rmtree(SFT_DIR, ignore_errors=True)
    (output,) = run_lines([block("sft")], scratch, xla_flags="")
    lines = output.splitlines()
    assert "  formats: chat" in lines
    assert "LoRA: training 32,768 of 246,336 parameters (13.30%)" in output
    records = read_metrics(SFT_DIR / "run" / "metrics.jsonl")
    fractions = [record["masked_fraction"] for record in records if "masked_fraction" in record]
    assert len(fractions) >= 10 and all(0.3 < f < 0.9 for f in fractions), fractions
    assert "(step 100) Each stage passes its activations to the next one." in lines
    answer = "'A byte-level BPE with an end of document token.'"
    assert lines[-2:] == [f"LlamaForCausalLM {answer}", f"PeftModelForCausalLM {answer}"]
    shutil.rmtree(SFT_DIR, ignore_errors=True)


@pytest.mark.skipif(not HEAVY, reason="the 1B configs: EQXZOO_README_HEAVY=1 runs them")
def test_the_big_configs_blocks(scratch: Path):
    """The 1B configs' blocks: a training step each, and their dry runs (moe_1b's dry run,
    as configured, is in the train block)."""
    for kind_block in (b for b in bash_blocks(README.read_text()) if kind_of(b) == "heavy"):
        lines = [line for line in kind_block.splitlines() if line.strip()]
        outputs = run_lines([lowered(line, 1) for line in lines], scratch, timeout=1800)
        assert any("memory:" in output for output in outputs), outputs


def test_the_prepare_block(scratch: Path):
    (line,) = block("prepare").splitlines()
    run_lines([line], scratch)
    manifest = json.loads((scratch / "data" / "stdlib" / "manifest.json").read_text())
    assert manifest["tokenizer"]["vocab_size"] == 4096
