"""The run config: every shipped file loads, overrides apply, each bad input is one clear line."""

import dataclasses
import json
import math
import re
from pathlib import Path

import equinox as eqx
import jax
import pytest

import models
from eqxzoo.nn.attention import CausalSelfAttention
from eqxzoo.nn.mla import LatentAttention
from eqxzoo.nn.moe import MoE
from eqxzoo.nn.router import Router
from eqxzoo.optim import trainable_mask
from eqxzoo.parallel import MeshConfig, Schedule
from eqxzoo.run.config import (
    ConfigError,
    RunConfig,
    config_from_dict,
    config_to_dict,
    config_to_toml,
    devices_needed,
    load_config,
    mesh_config,
    step_config,
)
from eqxzoo.train.settings import StepConfig
from eqxzoo.typed_config import read_toml

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
CONFIG_FILES = sorted(CONFIGS.glob("*.toml"))
TINY = CONFIGS / "tiny.toml"


def test_the_shipped_configs_exist():
    assert {"tiny.toml", "moe_1b.toml", "dense_125m.toml", "llama3_1b.toml"} <= {
        path.name for path in CONFIG_FILES
    }


def load_shipped(path: Path, tmp_path: Path) -> RunConfig:
    """``load_config(path)``; a config that starts from a Hugging Face checkpoint
    (``init_from_hf``) gets one in ``tmp_path`` of the architecture its ``[model]`` states."""
    if not read_toml(path).get("model", {}).get("init_from_hf"):
        return load_config(path)
    architecture = load_config(path, ["model.init_from_hf="]).model
    models.save_hf(models.DecoderLM(architecture, key=jax.random.key(0)), tmp_path / "hf")
    return load_config(path, [f"model.init_from_hf={tmp_path / 'hf'}"])


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda path: path.name)
def test_every_config_file_loads(path, tmp_path):
    config = load_shipped(path, tmp_path)
    assert isinstance(config, RunConfig)
    assert devices_needed(config) == 8
    assert mesh_config(config) == config.mesh
    assert isinstance(step_config(config), StepConfig)
    assert config.global_batch_size % config.mesh.dp == 0


def parameter_counts(model_config: models.DecoderConfig) -> tuple[int, int]:
    """(total, active per token): active leaves out the experts a token is not routed to;
    buffers (DeepSeek-V3's balancing biases) are not parameters."""
    shape = eqx.filter_eval_shape(models.DecoderLM, model_config, key=jax.random.key(0))
    shape, _ = eqx.partition(shape, trainable_mask(shape))
    total = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(shape))
    if model_config.moe is None:
        return total, total
    experts = sum(
        math.prod(leaf.shape) for leaf in jax.tree.leaves(shape.blocks.layers.mlp.experts)
    )
    moe = model_config.moe
    return total, total - experts * (moe.n_experts - moe.top_k) // moe.n_experts


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda path: path.name)
def test_parameter_counts_in_the_header_are_right(path, tmp_path):
    header = re.search(r"# Parameters: ([\d,]+) total, ([\d,]+) active", path.read_text())
    assert header, f"{path.name} has no '# Parameters: N total, M active' line"
    stated = tuple(int(number.replace(",", "")) for number in header.groups())
    assert parameter_counts(load_shipped(path, tmp_path).model) == stated


def test_tiny_is_the_cpu_demo():
    config = load_config(TINY)
    assert isinstance(config.model, models.QwenMoeConfig)
    assert config.model.n_layers == 4 and config.model.moe.top_k == 2
    assert (config.mesh.dp, config.mesh.pp, config.mesh.tp, config.mesh.ep) == (2, 2, 2, 1)
    assert config.data.is_stdlib and config.data.vocab_size == config.model.vocab_size
    assert config.schedule == Schedule("circular", stages=2, microbatches=2, repeats=2)
    assert config.optimizer.decay_steps == config.run.steps  # follows run.steps when unset


def test_step_config_carries_every_section():
    config = load_config(TINY, ["loss.router_z_weight=0.5", "pipeline.remat_stages=true"])
    step = step_config(config)
    assert step.schedule == config.schedule
    assert step.optimizer is config.optimizer and step.precision is config.precision
    assert step.loss == config.loss and step.loss.router_z_weight == 0.5
    assert step.remat_stages


def test_overrides_apply():
    config = load_config(
        TINY,
        [
            "mesh.dp=4",  # int
            "data.batch_size=16",
            "optimizer.learning_rate=1e-3",  # float
            "optimizer.weight_decay=0",  # TOML int for a float field
            "data.path=/tmp/corpus",  # not TOML: a plain string
            'run.name="quoted name"',  # TOML string
            "run.wandb=true",  # bool
            "model.moe.n_experts=4",  # nested table
            "pipeline.schedule=gpipe",
            "pipeline.repeats=1",
            "optimizer.freeze=['embedding']",  # array -> tuple
        ],
    )
    assert config.mesh.dp == 4 and config.data.batch_size == 16
    assert config.optimizer.learning_rate == 1e-3
    assert config.optimizer.weight_decay == 0.0 and isinstance(config.optimizer.weight_decay, float)
    assert config.data.path == "/tmp/corpus" and not config.data.is_stdlib
    assert config.run.name == "quoted name" and config.run.wandb is True
    assert (
        config.model.moe.n_experts == 4 and config.model.moe.shared_gate
    )  # rest of [model.moe] kept
    assert config.schedule == Schedule("gpipe", stages=2, microbatches=2, repeats=1)
    assert config.optimizer.freeze == ("embedding",)
    assert devices_needed(config) == 16


def test_overrides_apply_in_order_and_decay_follows_steps():
    config = load_config(TINY, ["run.steps=10", "run.steps=20", "optimizer.warmup_steps=5"])
    assert config.run.steps == 20 and config.optimizer.decay_steps == 20
    explicit = load_config(TINY, ["optimizer.decay_steps=1000", "run.steps=20"])
    assert explicit.optimizer.decay_steps == 1000


def test_missing_sections_take_defaults(tmp_path):
    path = tmp_path / "minimal.toml"
    path.write_text('[run]\nname = "minimal"\n')
    config = load_config(path)
    assert config == RunConfig(
        run=dataclasses.replace(RunConfig().run, name="minimal"),
        optimizer=dataclasses.replace(RunConfig().optimizer, decay_steps=RunConfig().run.steps),
    )
    assert config.global_batch_size == config.data.batch_size
    assert load_config(path, ["model.moe.n_experts=4"]).model.moe == models.MoEConfig(n_experts=4)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda path: path.name)
def test_round_trip_through_dict_json_and_toml(path, tmp_path):
    config = load_shipped(path, tmp_path)
    document = config_to_dict(config)
    assert config_from_dict(document) == config
    assert config_from_dict(json.loads(json.dumps(document))) == config
    written = tmp_path / "written.toml"
    written.write_text(config_to_toml(config))
    assert load_config(written) == config


def test_round_trip_keeps_unusual_values(tmp_path):
    config = load_config(
        TINY,
        [
            'run.name="tab\there \\"quoted\\" é"',
            "optimizer.freeze=['^embedding', 'norm$']",
            "model.head_dim=16",
        ],
    )
    written = tmp_path / "written.toml"
    written.write_text(config_to_toml(config))
    assert load_config(written) == config


def error_for(overrides, path=TINY) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["stray.key=1"], r"^stray: unknown section; valid sections are \['checkpoint', 'data', "),
        (["run.stesp=3"], r"^run\.stesp: unknown key; valid keys are \['compilation_cache_dir', "),
        (["model.d_modle=3"], r"^model\.d_modle: unknown key; valid keys are"),
        (["model.moe.experts=3"], r"^model\.moe\.experts: unknown key; valid keys are"),
        (["mesh.dp=two"], r"^mesh\.dp: expected int, got 'two'$"),
        (["data.seq_len=1.5"], r"^data\.seq_len: expected int, got 1\.5$"),
        (["run.wandb=yes"], r"^run\.wandb: expected bool, got 'yes'$"),
        (["data.path=3"], r"^data\.path: expected str, got 3$"),
        (
            ["pipeline.schedule=pipedream"],
            r"^pipeline\.schedule: expected 'gpipe' or 'circular' or '1f1b' or "
            r"'interleaved_1f1b' or 'zb_h1' or 'zb_v', got 'pipedream'$",
        ),
        (["optimizer.freeze=[1]"], r"^optimizer\.freeze: expected a list of str, got \[1\]$"),
        (["mesh.dp=0"], r"^mesh\.dp: must be >= 1, got 0$"),
        (["data.batch_size=0"], r"^data\.batch_size: must be >= 1, got 0$"),
        (["data.seq_len=-1"], r"^data\.seq_len: must be >= 1, got -1$"),
        (["pipeline.microbatches=0"], r"^pipeline\.microbatches: must be >= 1, got 0$"),
        (["run.steps=0"], r"^run\.steps: must be >= 1, got 0$"),
        (["run.eval_every=-1"], r"^run\.eval_every: must be >= 0, got -1$"),
        (["checkpoint.keep=0"], r"^checkpoint\.keep: must be >= 1, got 0$"),
        (["checkpoint.every=0"], r"^checkpoint\.every: must be >= 1, got 0$"),
        (["data.vocab_size=100"], r"^data\.vocab_size: must be >= 257, got 100$"),
        (
            ["loss.router_z_weight=-1"],
            r"^loss\.router_z_weight: must be >= 0, got -1\.0$",
        ),
        (["run.name=''"], r"^run\.name: must not be empty$"),
        (
            ["data.seq_len=100000000"],
            r"^data\.seq_len: must be <= 4,194,304, got 100,000,000 \(far longer windows "
            r"overflow the compiler's array sizes\)$",
        ),
        (
            ["optimizer.learning_rate=nan"],
            r"^optimizer\.learning_rate: must be a finite number, got nan$",
        ),
        (["optimizer.clip_norm=inf"], r"^optimizer\.clip_norm: must be a finite number, got inf$"),
        (["model.rope_theta=-inf"], r"^model\.rope_theta: must be a finite number, got -inf$"),
        (
            ["loss.load_balance_weight=nan"],
            r"^loss\.load_balance_weight: must be a finite number, got nan$",
        ),
        (
            ["run.wandb=true", "run.wandb_project=''"],
            r"^run\.wandb_project: must not be empty when wandb",
        ),
        (["optimizer.learning_rate=0"], r"^optimizer\.learning_rate: must be > 0, got 0\.0$"),
        (
            ["optimizer.warmup_steps=300"],
            r"^optimizer\.warmup_steps: must be in \[0, decay_steps=300\), got 300 \(decay_steps defaults to run\.steps\)$",
        ),
        (
            ["optimizer.decay_steps=10"],
            r"^optimizer\.warmup_steps: must be in \[0, decay_steps=10\), got 30$",
        ),
        (
            ["precision.compute=fp8"],
            r"^precision\.compute: expected 'float32' or 'bfloat16' or 'float16', got 'fp8'$",
        ),
        (["model.moe.top_k=9"], r"^model\.moe\.top_k: must be between 1 and n_experts=8, got 9$"),
        (
            ["model.family=llama"],
            r"^model\.moe: llama is dense: use family 'mixtral' or 'qwen_moe'",
        ),
        (
            ["model.family=gpt_oss", "model.moe.shared_mlp_dim=0", "model.moe.shared_gate=false"],
            r"^model\.moe\.scoring: GPT-OSS's router and experts need 'softmax_topk', got "
            r"'softmax'$",
        ),
        (["model.family=gpt_oss"], r"^model\.moe\.shared_mlp_dim: GPT-OSS has no shared experts$"),
        (["model.moe.swiglu_limit=0"], r"^model\.moe\.swiglu_limit: must be > 0, got 0\.0$"),
        (
            ["mesh.pp=4", "pipeline.microbatches=4"],
            r"^mesh\.pp: n_layers=4 is not divisible by pp \* repeats = 4 \* 2; choose mesh\.pp and ",
        ),
        (
            [
                "model.family=deepseek_v3",
                "model.n_layers=5",
                "model.first_dense_layers=2",
                "model.moe.scoring=sigmoid",
                "model.moe.selection_bias=true",
                "model.moe.shared_gate=false",
            ],
            r"^mesh\.pp: n_layers=3 is not divisible by pp \* repeats = 2 \* 2; choose mesh\.pp "
            r"and pipeline\.repeats whose product divides the 3 pipelined layers "
            r"\(model\.n_layers=5 less model\.first_dense_layers=2\)$",
        ),
        (
            ["mesh.tp=8", "data.batch_size=2", "mesh.dp=1"],
            r"^mesh\.tp: n_heads=4 is not divisible by tp=8; choose a mesh\.tp that divides",
        ),
        (
            ["model.n_heads=12", "model.n_kv_heads=6", "mesh.tp=4"],
            r"^mesh\.tp: model\.n_kv_heads=6 must be a multiple of tp=4 \(kv heads split over tp\) or divide it",
        ),
        (
            ["mesh.ep=3"],
            r"^mesh\.ep: n_experts=8 is not divisible by ep=3; choose a mesh\.ep that divides",
        ),
        (
            ["pipeline.schedule=gpipe"],
            r"^pipeline\.repeats: the gpipe schedule has one repeat per stage, got repeats=2: use schedule 'circular'",
        ),
        (
            ["pipeline.microbatches=1"],
            (
                r"^pipeline\.microbatches: the circular schedule needs microbatches >= stages, got "
                r"microbatches=1 < stages=2 \(stages = mesh\.pp\)"
            ),
        ),
        (
            ["data.batch_size=7"],
            r"^data\.batch_size: 7 sequences per microbatch cannot be split evenly over mesh\.dp=2; use a multiple of 2$",
        ),
        (
            ["mesh.ep=2", "data.batch_size=2"],
            r"^data\.batch_size: 2 sequences per microbatch cannot be split evenly over mesh\.dp x "
            r"mesh\.ep = 2 x 2 \(each expert-parallel device holds its own sequences\); use a "
            r"multiple of 4$",
        ),
        (
            ["data.vocab_size=4096"],
            r"^data\.vocab_size: the stdlib corpus would have 4096 token ids but model\.vocab_size=2048; ",
        ),
        (
            ["sharding.embed=['dp', 'xp']"],
            r"^sharding\.embed: \['xp'\] are not mesh axes; choose from \['dp', 'pp', 'tp', 'ep', 'cp', 'dp_ici'\]$",
        ),
        (["sharding.mlp=['tp', 'tp']"], r"^sharding\.mlp: \['tp', 'tp'\] names a mesh axis twice$"),
        (
            ["sharding.embed=['dp', 'dp_ici']"],
            r"^sharding\.embed: \['dp', 'dp_ici'\] names a mesh axis twice$",
        ),
        (
            ["mesh.dcn.dp=3"],
            r"^mesh\.dcn\.dp: 3 slices do not divide mesh\.dp=2: choose a divisor of 2$",
        ),
        (
            ["mesh.dp=1", "mesh.cp=2", "data.seq_len=126"],
            r"^data\.seq_len: 126 tokens do not split into 2 x mesh\.cp = 4 equal chunks .*; use "
            r"a multiple of 4$",
        ),
        (
            ["mesh.dp=1", "mesh.cp=2", "model.moe.routing=capacity"],
            r"^model\.moe\.routing: 'capacity' ranks each sequence's assignments in order, which "
            r"a sequence split over mesh\.cp cannot: route 'dropless' \(or set mesh\.cp = 1\)$",
        ),
        (
            ["mesh.dp=1", "mesh.cp=2", "mesh.dcn.cp=2"],
            r"^mesh\.dcn\.cp: context parallelism passes keys and values round its axis in every "
            r"attention layer, too often for the network between slices",
        ),
        (
            ["mesh.tp=1", "mesh.cp=2", "mesh.dcn.dp=2"],
            r"^mesh\.cp: context parallelism does not yet compose with dp across slices",
        ),
        (
            ["model.context_axis=cp"],
            r"^model\.context_axis: is set by the trainer from mesh\.cp .*; leave it unset and "
            r"set mesh\.cp$",
        ),
        (
            ["model.expert_axis=ep"],
            r"^model\.expert_axis: is set by the trainer from mesh\.ep \(the MoE layers then split "
            r"their experts over it\); leave it unset and set mesh\.ep$",
        ),
        (
            ["model.context_parallel=ulysses"],
            r"^model\.context_parallel: expected 'ring' or 'all_gather', got 'ulysses'$",
        ),
        (
            ["sharding.stages=['dp']"],
            r"^sharding\.stages: must be \['pp'\] \(fixed by the trainer\), got \['dp'\]$",
        ),
        (
            ["sharding.microbatches=['dp']"],
            r"^sharding\.microbatches: must be \[\] \(fixed by the trainer\), got \['dp'\]$",
        ),
        (["sharding.vocab='tp'"], r"^sharding\.vocab: expected a list of str, got 'tp'$"),
        (["mesh.dp"], r"^--set 'mesh\.dp': expected section\.key=value, e\.g\. mesh\.dp=4$"),
        (["mesh..dp=2"], r"^--set 'mesh\.\.dp=2': expected section\.key=value"),
        (["steps=3"], r"^--set 'steps=3': name the section too, e\.g\. run\.steps=3$"),
        (["run.name.first=3"], r"^run\.name: is 'tiny', not a table: cannot set run\.name\.first$"),
    ],
)
def test_bad_values_are_one_line_naming_the_key(overrides, message):
    assert re.search(message, error_for(overrides)), error_for(overrides)


def test_a_dense_model_cannot_use_expert_parallelism():
    message = error_for(["mesh.ep=2"], CONFIGS / "dense_125m.toml")
    assert message.startswith("mesh.ep: ep=2 needs a MoE model, but the model has no experts")


def test_a_prepared_corpus_is_not_checked_against_the_stdlib_vocab_size():
    config = load_config(TINY, ["data.vocab_size=4096", "data.path=data/prepared"])
    assert config.data.vocab_size == 4096  # the corpus's own tokenizer is checked when loading it


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"mesh": 3}, r"^mesh: must be a table, got int$"),
        ({"model": [1]}, r"^model: must be a table, got list$"),
        ({"optimizer": "fast"}, r"^optimizer: must be a table, got str$"),
        ({"model": {"family": "gpt5"}}, r"^model\.family: unknown family 'gpt5'; choose one of"),
    ],
)
def test_sections_must_be_tables(document, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(document)


def test_a_missing_config_file_is_one_line(tmp_path):
    assert error_for([], tmp_path / "nope.toml") == f"{tmp_path / 'nope.toml'}: no such config file"
    assert error_for([], tmp_path) == f"{tmp_path}: is a directory, not a TOML config file"


def test_a_malformed_config_file_is_one_line(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[run]\nsteps = \n")
    assert re.match(rf"^{re.escape(str(path))}: not valid TOML: .*line 2", error_for([], path))
    path.write_bytes(b"[run]\nname = '\xff'\n")
    assert error_for([], path) == f"{path}: not valid TOML: the file is not UTF-8 text"


def test_a_run_config_built_in_python_is_validated_too():
    with pytest.raises(ConfigError, match=r"^data\.batch_size: 3 sequences per microbatch"):
        RunConfig(mesh=MeshConfig(dp=2), data=dataclasses.replace(RunConfig().data, batch_size=3))


def test_sharding_rules_are_a_config_section_that_decides_the_shardings():
    """``[sharding]`` overrides a rule; the parameters' shardings follow it."""
    import functools

    from eqxzoo.parallel import make_mesh
    from eqxzoo.train.state import abstract_train_state

    def embedding_spec(overrides):
        config = load_config(TINY, overrides)
        target = abstract_train_state(
            functools.partial(models.DecoderLM, config.model),
            config=step_config(config),
            mesh=make_mesh(config.mesh),
        )
        return tuple(target.model.embedding.weight.sharding.spec)

    assert load_config(TINY).sharding.rules["embed"] == ("dp", "ep")
    assert embedding_spec([]) == (("tp", "pp"), "dp")
    assert embedding_spec(["sharding.embed=[]", "sharding.vocab=['tp']"]) == ("tp", None)


def test_the_typed_config_machinery_imports_no_jax():
    import subprocess
    import sys

    code = "import sys, eqxzoo.typed_config, eqxzoo.errors; print('jax' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "False", result.stderr


def test_learned_positions_bound_the_sequence_length():
    document = {
        "model": {
            "family": "gpt2",
            "vocab_size": 2048,
            "d_model": 32,
            "n_layers": 4,
            "n_heads": 4,
            "mlp_dim": 64,
            "max_positions": 128,
        },
        "mesh": {"dp": 2, "pp": 2, "tp": 2},
        "data": {"seq_len": 256, "batch_size": 2, "vocab_size": 2048},
    }
    with pytest.raises(
        ConfigError,
        match=r"^data\.seq_len: 256 tokens per sequence, but the model learns 128 positions "
        r"\(model\.max_positions\); set data\.seq_len <= 128$",
    ):
        config_from_dict(document)
    document["data"]["seq_len"] = 128
    assert config_from_dict(document).model.max_positions == 128


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["model.moe.top_k=9"], "model.moe.top_k"),
        (["pipeline.microbatches=1"], "pipeline.microbatches"),
        (["pipeline.schedule=gpipe"], "pipeline.repeats"),
        (["optimizer.warmup_steps=5000"], "optimizer.warmup_steps"),
        (["mesh.tp=3"], "mesh.tp"),
        (["model.n_kv_heads=3"], "model.n_kv_heads"),
    ],
)
def test_errors_carry_the_field_they_are_about(overrides, field):
    """The key is a property of the error (`UserError.field`), and the message starts with it."""
    with pytest.raises(ConfigError) as refused:
        load_config(TINY, overrides)
    assert refused.value.field == field
    assert str(refused.value) == f"{field}: {refused.value.problem}"


def test_each_rule_has_one_checker_for_the_config_and_the_layers():
    """The config and `eqxzoo.nn`'s layers refuse the same option with the same error."""
    key = jax.random.key(0)
    pairs = [
        (
            lambda: models.MoEConfig(n_experts=4, top_k=5),
            lambda: Router(8, 4, 5, normalize_topk=True, key=key),
        ),
        (
            lambda: models.MoEConfig(shared_gate=True),
            lambda: MoE(8, 8, 4, 2, shared_gate=True, key=key),
        ),
        (
            lambda: models.LlamaConfig(d_model=64, n_heads=4, n_kv_heads=3),
            lambda: CausalSelfAttention(64, 4, 3, 16, key=key),
        ),
        (
            lambda: models.LatentAttentionConfig(qk_rope_head_dim=3),
            lambda: LatentAttention(
                64,
                4,
                q_lora_rank=None,
                kv_lora_rank=8,
                qk_nope_head_dim=8,
                qk_rope_head_dim=3,
                v_head_dim=8,
                key=key,
            ),
        ),
    ]
    for from_config, from_layer in pairs:
        with pytest.raises(ConfigError) as config_error:
            from_config()
        with pytest.raises(ConfigError) as layer_error:
            from_layer()
        assert str(config_error.value) == str(layer_error.value)


def test_document_mask_is_unset_by_default_and_part_of_what_the_run_is(tmp_path):
    """Unset (None: decided by the data), settable both ways, written back, and not among
    the keys a resume may change."""
    from eqxzoo.run.config import RESUMABLE_KEYS

    assert load_config(TINY).data.document_mask is None
    for value in (True, False):
        config = load_config(TINY, [f"data.document_mask={str(value).lower()}"])
        assert config.data.document_mask is value
        written = tmp_path / "written.toml"
        written.write_text(config_to_toml(config))
        assert load_config(written) == config
    assert "data.document_mask" not in RESUMABLE_KEYS
    assert error_for(["data.document_mask=2"]) == "data.document_mask: expected bool or none, got 2"
