"""LoRA: adapters on the zoo's projections (`eqxzoo.nn.lora`), trained through the pipeline
with the base frozen, exported merged (transformers loads it) and as PEFT adapters (peft
loads them onto the base checkpoint), with the same logits as the adapted model."""

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from runs import TINY

import models
from eqxzoo.nn.lora import FROZEN_BESIDE_ADAPTERS, merge_adapters
from eqxzoo.optim import trainable_mask
from eqxzoo.typed_config import ConfigError
from models import registry
from models.config import LoraConfig


def test_adapters_start_at_the_base_and_merge_to_what_they_compute():
    """``lora_b`` starts at zero (the adapted model computes its base's logits); trained,
    the low-rank path (never the merged weight) equals the merged model's logits; only the
    adapters are trainable."""
    config = registry.tiny_config("deepseek_v3", n_layers=3)
    adapted_config = dataclasses.replace(
        config, lora=LoraConfig(rank=4, targets=tuple(config.projection_sizes()))
    )
    base = models.DecoderLM(config, key=jax.random.key(0))
    adapted = models.DecoderLM(adapted_config, key=jax.random.key(0))
    tokens = jnp.arange(11) % config.vocab_size
    np.testing.assert_allclose(adapted(tokens)[0], base(tokens)[0], rtol=1e-5, atol=1e-6)

    def trained(path, leaf):
        if jax.tree_util.keystr(path).endswith(".lora_b"):
            return leaf + 0.01 * jax.random.normal(jax.random.key(1), leaf.shape)
        return leaf

    adapted = jax.tree_util.tree_map_with_path(trained, adapted)
    logits = adapted(tokens)[0]
    np.testing.assert_allclose(merge_adapters(adapted)(tokens)[0], logits, rtol=1e-5, atol=1e-6)
    assert not np.allclose(logits, base(tokens)[0], atol=1e-3)
    mask = trainable_mask(adapted, (FROZEN_BESIDE_ADAPTERS,))
    paths = [
        jax.tree_util.keystr(path)
        for path, keep in jax.tree_util.tree_leaves_with_path(mask)
        if keep is True
    ]
    assert paths and all(path.endswith((".lora_a", ".lora_b")) for path in paths)
    assert any(".prefix." in path for path in paths)  # the dense prefix's layers too


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        (dict(targets=("wq_a",)), r"^lora\.targets: 'wq_a' name\(s\) no projection of this"),
        (dict(targets=("q_proj",)), r"^targets: 'q_proj' name\(s\) no projection of the zoo"),
        (dict(rank=20), r"^lora\.rank: 20 is larger than projection 'wk' \(16 wide\)"),
        (dict(targets=()), r"^targets: names no projection"),
    ],
)
def test_lora_targets_and_rank_are_checked(lora, message):
    config = registry.tiny_config("llama", n_layers=2)
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(config, lora=LoraConfig(**lora))


def test_base_weights_keep_the_params_dtype_and_adapters_train_in_float32():
    """With ``precision.params = "bfloat16"`` the frozen base weights are bfloat16; the
    adapters, and the optimizer state (theirs only), are float32."""
    from eqxzoo.optim import OptimizerConfig
    from eqxzoo.parallel import MeshConfig, Schedule, make_mesh
    from eqxzoo.train.settings import Precision, StepConfig
    from eqxzoo.train.state import abstract_train_state

    model_config = dataclasses.replace(
        registry.tiny_config("llama", n_layers=2), lora=LoraConfig(rank=4, targets=("wq", "up"))
    )
    optimizer = OptimizerConfig(freeze=(FROZEN_BESIDE_ADAPTERS,))
    config = StepConfig(
        schedule=Schedule("gpipe", 1, 1, 1),
        optimizer=optimizer,
        precision=Precision(params="bfloat16"),
    )
    state = abstract_train_state(
        models.model_factory(model_config),
        config=config,
        mesh=make_mesh(MeshConfig(), jax.devices()[:1]),
    )
    dtypes = {
        jax.tree_util.keystr(path): leaf.dtype
        for path, leaf in jax.tree_util.tree_leaves_with_path(state.model)
        if jnp.issubdtype(leaf.dtype, jnp.floating)
    }
    adapters = {
        path: dtype for path, dtype in dtypes.items() if path.endswith(("lora_a", "lora_b"))
    }
    assert len(adapters) == 4 and set(adapters.values()) == {jnp.dtype("float32")}
    assert {dtypes[path] for path in dtypes if path not in adapters} == {jnp.dtype("bfloat16")}
    moments = [leaf for leaf in jax.tree.leaves(state.opt_state) if leaf.ndim > 0]
    adapter_sizes = [
        leaf.size
        for path, leaf in jax.tree_util.tree_leaves_with_path(state.model)
        if jax.tree_util.keystr(path).endswith(("lora_a", "lora_b"))
    ]
    assert sorted(m.size for m in moments) == sorted(2 * adapter_sizes)  # AdamW's mu and nu
    assert all(m.dtype == jnp.float32 for m in moments)


def test_lora_without_a_checkpoint_says_what_it_adapts():
    """``[lora]`` with ``model.init_from_hf`` empty is allowed: adapters over the seed's
    random weights (a test or a from-scratch experiment), and the run says so."""
    from eqxzoo.run.config import config_to_toml, load_config, lora_line

    config = load_config(TINY, ["lora.rank=4", "lora.targets=['wq', 'wv']"])
    assert lora_line(config) == (
        "LoRA: training 5,376 of 1,718,496 parameters (0.31%): rank 4, alpha 16 on wq, wv; "
        "the base weights frozen at the seed's random initialisation (model.init_from_hf is "
        "empty: no pretrained model is adapted)"
    )
    assert "[lora]" in config_to_toml(config)
    assert "[lora]" not in config_to_toml(load_config(TINY))


LORA_CASES = [
    ("llama", "circular", "dp2,pp2,tp2", "M=P", "plain"),
    ("deepseek_v3", "1f1b", "pp2,tp2,ep2", "M=2P+1", "plain"),
    ("qwen_moe", "zb_h1", "dp2,pp2,ep2", "M=P", "no-remat"),
]


@pytest.mark.parametrize("case", LORA_CASES, ids=lambda case: "-".join(case[:3]))
def test_adapted_models_train_through_the_pipeline_as_on_one_device(
    case, tiny_config, random_batch, assert_trees_close
):
    """Adapters on every projection (a dense prefix's too) through the autodiff, fused and
    split executors on dp, tp and ep: the loss, aux values and every gradient (the
    adapters', which the run trains, among them) of one device (fp32, rtol 1e-5); the
    adapters shard like their weights' input and output axes."""
    from test_pipeline import FACTORS, loss_and_grads

    case = dict(zip(FACTORS, case, strict=True))
    lora = LoraConfig(rank=4, alpha=8.0, targets=("wq", "wk", "wv", "wo", "up", "down"))
    if case["family"] == "deepseek_v3":
        lora = dataclasses.replace(lora, targets=("wq_a", "wq_b", "wkv_a", "wkv_b", "wo", "up"))
    ((loss, aux), grads), ((pp_loss, pp_aux), pp_grads) = loss_and_grads(
        tiny_config, random_batch, case, lora=lora
    )
    np.testing.assert_allclose(pp_loss, loss, rtol=1e-5)
    assert_trees_close(pp_aux, aux)
    assert_trees_close(pp_grads, grads)
    adapter = grads.blocks.layers.attention.wo
    assert min(np.abs(np.asarray(a)).max() for a in (adapter.lora_a, adapter.lora_b)) > 0


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from hf_models import hf_config, randomize  # noqa: E402
from runs import losses, run_command  # noqa: E402

VOCAB = 2048  # the stdlib corpus's


def lora_config(hf_dir: Path, cache_dir: Path) -> str:
    return f"""
[run]
name = "lora"
steps = 4
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
schedule = "1f1b"
microbatches = 2

[optimizer]
learning_rate = 1e-2
warmup_steps = 1

[data]
vocab_size = {VOCAB}
seq_len = 32
batch_size = 4

[checkpoint]
every = 4

[lora]
rank = 4
alpha = 8.0
targets = ["wq", "wk", "wv", "wo", "gate", "up", "down"]
"""


@pytest.mark.slow
def test_lora_trains_through_the_pipeline_and_exports_merged_and_as_peft(
    tmp_path: Path, cache_dir: Path
):
    """A Llama checkpoint fine-tuned with LoRA on dp2 x pp2 x tp2 (1F1B): the run reports
    what it trains; the merged export loads in transformers and the PEFT export in peft onto
    the base checkpoint (the base weights stayed the checkpoint's), both with the adapted
    model's logits (1e-4). A resume continues the adapters; one that changes them is
    refused."""
    torch.manual_seed(0)
    architecture = hf_config(
        "LlamaForCausalLM",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
    )
    hf_dir = tmp_path / "hf"
    randomize(transformers.LlamaForCausalLM(architecture)).save_pretrained(hf_dir)
    config_file = tmp_path / "lora.toml"
    config_file.write_text(lora_config(hf_dir, cache_dir))
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "pipelines.run", str(config_file), "--run-dir", str(run_dir)]
    result = run_command(command)
    assert "LoRA: training 8,192 of 176,416 parameters (4.64%)" in result.stdout, result.stdout
    assert len(losses(run_dir)) == 4 and np.isfinite(losses(run_dir)).all()
    resumed = run_command([*command, "--set", "run.steps=5"])
    assert "resumed from the checkpoint at step 4" in resumed.stdout
    refused = run_command([*command, "--set", "run.steps=6", "--set", "lora.rank=2"], expect=2)
    assert "lora.rank" in refused.stderr, refused.stderr

    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    export = [sys.executable, "-m", "pipelines.export", str(run_dir)]
    run_command([*export, "--out", str(merged), "--dtype", "float32"])
    run_command([*export, "--out", str(adapter), "--adapter"])

    from eqxzoo.run.rundir import read_run_config
    from eqxzoo.train.checkpoint import finished_steps
    from pipelines.export import saved_model

    config = read_run_config(run_dir, None)
    step = finished_steps(run_dir / "checkpoints")[-1]
    assert step == 5
    _, ours = saved_model(config, run_dir / "checkpoints" / str(step))
    ours = jax.tree.map(lambda saved: np.asarray(saved[()]), ours)
    tokens = np.arange(3, 40) % VOCAB
    expected = np.asarray(jax.jit(lambda m, t: m(t)[0])(ours, jnp.asarray(tokens)))

    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        ids = torch.tensor(tokens)[None]
        before = base(ids).logits[0].numpy()
        peft_logits = peft.PeftModel.from_pretrained(base, adapter)(ids).logits[0].numpy()
        merged_model = transformers.AutoModelForCausalLM.from_pretrained(merged)
        merged_logits = merged_model(ids).logits[0].numpy()
    assert not np.allclose(expected, before, atol=1e-3), "the adapters changed the model"
    np.testing.assert_allclose(merged_logits, expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(peft_logits, expected, rtol=1e-4, atol=1e-4)
