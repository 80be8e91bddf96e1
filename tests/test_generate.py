"""KV-cache generation: cached logits equal full recomputation; sampling and its filters."""

import dataclasses
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from grids import dense_and_one_moe, every_family, slow_except

import models
from eqxzoo.data import load_tokenizer
from eqxzoo.data.manifest import TOKENIZER_FILE
from eqxzoo.data.tokenizer import train_byte_level_bpe
from eqxzoo.run.config import config_to_toml, load_config
from eqxzoo.run.rundir import CONFIG_FILE
from eqxzoo.train import memory
from pipelines.generate import main as generate_main

SMALL = {"vocab_size": 97, "d_model": 32, "n_layers": 2, "n_heads": 4, "mlp_dim": 48}
MOE = models.MoEConfig(n_experts=4, top_k=2, expert_mlp_dim=24)
LATENT = models.LatentAttentionConfig(
    q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6
)

CONFIGS = every_family(
    {
        "llama_gqa": models.LlamaConfig(**SMALL, n_kv_heads=2),
        "mixtral": models.MixtralConfig(**SMALL, n_kv_heads=1, moe=MOE),
        "qwen_moe_shared": models.QwenMoeConfig(
            **SMALL,
            n_kv_heads=2,
            qk_norm=True,
            moe=dataclasses.replace(MOE, normalize_topk=False, shared_mlp_dim=40, shared_gate=True),
        ),
        # Every layer windowed: a ring cache of 3 slots for 11 positions (the second prefill
        # chunk, 4 tokens, is longer than the ring).
        "mistral_window": models.MistralConfig(**SMALL, n_kv_heads=2, sliding_window=3),
        "gemma2_local_global_softcapped": models.Gemma2Config(
            **SMALL, n_kv_heads=2, sliding_window=3, attention_softcap=1.5, final_softcap=2.0
        ),
        "gemma3_local_rope": models.Gemma3Config(
            **SMALL, layer_types=("full_attention", "sliding_attention"), sliding_window=4
        ),
        "qwen3_moe_llama3_rope": models.Qwen3MoeConfig(
            **SMALL,
            head_dim=16,
            rope_scaling=models.RopeScaling("llama3", 4.0, original_max_positions=16),
            moe=MOE,
        ),
        "olmo2": models.Olmo2Config(**SMALL),
        "olmoe_clipped": models.OlmoeConfig(**SMALL, clip_qkv=1.0, moe=MOE),
        "gpt2": models.GPT2Config(**SMALL, max_positions=16),
        # Latent attention (the cache holds the latent and the RoPE key), a dense prefix layer,
        # YaRN past its original context; V2-Lite without query compression.
        "deepseek_v3_yarn": models.DeepseekV3Config(
            **{**SMALL, "n_layers": 3},
            moe=dataclasses.replace(
                MOE,
                shared_mlp_dim=24,
                scoring="sigmoid",
                n_groups=2,
                topk_groups=1,
                routed_scaling=2.5,
                selection_bias=True,
            ),
            latent_attention=LATENT,
            rope_scaling=models.RopeScaling(
                "yarn", 4.0, original_max_positions=4, mscale=1.0, mscale_all_dim=1.0
            ),
        ),
        "deepseek_v2_lite": models.DeepseekV2Config(
            **{**SMALL, "n_layers": 3},
            moe=dataclasses.replace(MOE, normalize_topk=False, shared_mlp_dim=48),
            latent_attention=dataclasses.replace(LATENT, q_lora_rank=None),
        ),
        # Sliding and full layers alternating, attention sinks, biased clamped experts.
        "gpt_oss": models.GptOssConfig(
            **SMALL,
            n_kv_heads=2,
            sliding_window=3,
            moe=dataclasses.replace(
                models.GptOssConfig().moe, n_experts=4, top_k=2, expert_mlp_dim=24
            ),
        ),
    },
    vocab_size=SMALL["vocab_size"],
)

PROMPT_LEN, NEW = 6, 5
SAMPLING = {"max_new_tokens": 6, "temperature": 1.0, "top_k": 50, "top_p": 0.95}


def build(config, seed=0):
    """A model with every parameter perturbed, so that biases, norms and attention matter."""
    model = models.DecoderLM(config, key=jax.random.key(seed))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    rng = np.random.default_rng(seed)
    params = jax.tree.map(
        lambda p: jnp.asarray(np.asarray(p) + 0.2 * rng.standard_normal(p.shape, np.float32)),
        params,
    )
    return eqx.combine(params, static)


def prompt(n=PROMPT_LEN, seed=3):
    return jax.random.randint(jax.random.key(seed), (n,), 0, SMALL["vocab_size"])


@eqx.filter_jit
def cached_and_full_logits(model):
    """Greedy tokens after `prompt`, and the logits of prompt + tokens computed two ways.

    Full recomputation, and with the cache: the prompt prefilled in two chunks (the second
    starts mid-cache), then one `decode_step` per generated token.
    """
    start = prompt()
    new_tokens = models.generate(
        model, start, max_new_tokens=NEW, temperature=0.0, key=jax.random.key(0)
    )
    full_logits, _ = model(jnp.concatenate([start, new_tokens]))

    cache = model.init_cache(PROMPT_LEN + NEW)
    first_logits, cache = models.prefill(model, start[:2], cache)
    rest_logits, cache = models.prefill(model, start[2:], cache)

    def step(cache, token):
        logits, cache = models.decode_step(model, token, cache)
        return cache, logits

    cache, step_logits = jax.lax.scan(step, cache, new_tokens)
    return new_tokens, full_logits, jnp.concatenate([first_logits, rest_logits, step_logits]), cache


@pytest.mark.parametrize("name", dense_and_one_moe(CONFIGS))
def test_cached_logits_equal_full_recompute(name):
    model = build(CONFIGS[name])
    new_tokens, full, cached, cache = cached_and_full_logits(model)
    assert int(cache.position) == PROMPT_LEN + NEW
    assert cache.slots == (3 if name == "mistral_window" else PROMPT_LEN + NEW)
    np.testing.assert_allclose(cached, full, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(new_tokens, jnp.argmax(full[PROMPT_LEN - 1 : -1], axis=-1))
    latent = CONFIGS[name].latent_attention
    if latent is not None:  # the compressed latent and the RoPE key, for prefix and blocks
        slots = PROMPT_LEN + NEW
        assert [a.shape for a in cache.layers] == [
            (2, slots, latent.kv_lora_rank),
            (2, slots, latent.qk_rope_head_dim),
        ]
        assert [a.shape[:2] for a in cache.prefix_layers] == [(1, slots)] * 2


@pytest.mark.parametrize(
    "name",
    slow_except(
        ["mistral_window", "gpt_oss", "deepseek_v3_yarn"], lambda name: name == "mistral_window"
    ),
)
def test_blockwise_kernel_decodes_like_the_dense_one(name):
    """The KV cache through the blockwise kernel in blocks of 2: a ring of 3 slots (empty
    slots at negative positions, keys out of order), sinks, latent attention."""
    dense = build(dataclasses.replace(CONFIGS[name], attention_kernel="dense"))
    blockwise = build(
        dataclasses.replace(CONFIGS[name], attention_kernel="blockwise", attention_block_size=2)
    )
    dense_tokens, dense_full, dense_cached, _ = cached_and_full_logits(dense)
    new_tokens, full, cached, _ = cached_and_full_logits(blockwise)
    np.testing.assert_allclose(cached, full, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cached, dense_cached, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(new_tokens, dense_tokens)


def test_capacity_routing_decodes_dropless():
    """A token-dropping capacity config decodes like its dropless twin: nothing is dropped."""
    capacity = dataclasses.replace(
        CONFIGS["mixtral"], moe=dataclasses.replace(MOE, routing="capacity", capacity_factor=0.5)
    )

    @eqx.filter_jit
    def run(dropping, dropless, tokens):
        cached, _ = dropping.cached_forward(tokens, dropping.init_cache(tokens.shape[0]))
        return dropping(tokens)[1]["dropped_fraction"], cached, dropless(tokens)[0]

    dropped_fraction, cached, dropless_logits = run(
        build(capacity), build(CONFIGS["mixtral"]), prompt(10)
    )
    assert float(dropped_fraction) > 0
    np.testing.assert_allclose(cached, dropless_logits, rtol=1e-5, atol=1e-5)


def test_greedy_is_deterministic_and_top_k_1_is_greedy():
    model = build(CONFIGS["llama_gqa"])
    start = prompt()
    first, second = (
        models.generate(model, start, max_new_tokens=NEW, temperature=0.0, key=jax.random.key(seed))
        for seed in (0, 1)
    )
    np.testing.assert_array_equal(first, second)
    top_1 = models.generate(
        model, start, max_new_tokens=NEW, temperature=1.5, top_k=1, key=jax.random.key(7)
    )
    np.testing.assert_array_equal(top_1, first)


def test_same_key_same_sample_stop_token_and_vmap():
    model = build(CONFIGS["llama_gqa"])
    start = prompt()

    def sample(key, stop_token=None):
        return models.generate(model, start, **SAMPLING, stop_token=stop_token, key=key)

    tokens = sample(jax.random.key(1))
    assert tokens.shape == (SAMPLING["max_new_tokens"],) and tokens.dtype == jnp.int32
    np.testing.assert_array_equal(tokens, sample(jax.random.key(1)))
    other = sample(jax.random.key(2))
    assert not np.array_equal(tokens, other)

    stop = int(tokens[2])
    first_stop = int(np.flatnonzero(np.asarray(tokens) == stop)[0])
    stopped = sample(jax.random.key(1), stop_token=stop)
    np.testing.assert_array_equal(stopped[: first_stop + 1], tokens[: first_stop + 1])
    assert (np.asarray(stopped[first_stop:]) == stop).all()

    batched = jax.vmap(sample)(jnp.stack([jax.random.key(1), jax.random.key(2)]))
    np.testing.assert_array_equal(batched, jnp.stack([tokens, other]))


def test_generate_compiles_once():
    """The whole loop is one jitted program; new prompt values and keys reuse it."""
    model = build(CONFIGS["llama_gqa"])
    traces = []

    @jax.jit
    def run(model, tokens, key):
        traces.append(None)
        return models.generate(model, tokens, **SAMPLING, key=key)

    first = run(model, prompt(seed=3), jax.random.key(0))
    run(model, prompt(seed=4), jax.random.key(1))
    assert len(traces) == 1
    assert "while" in run.lower(model, prompt(), jax.random.key(0)).as_text()
    np.testing.assert_array_equal(
        first, models.generate(model, prompt(seed=3), **SAMPLING, key=jax.random.key(0))
    )


def test_top_p_keeps_the_smallest_set_with_enough_mass():
    probs = jnp.array([0.05, 0.3, 0.5, 0.15])
    logits = jnp.log(probs)
    for p, expected in [
        (0.4, {2}),
        (0.75, {1, 2}),
        (0.85, {1, 2, 3}),
        (0.97, {0, 1, 2, 3}),
        (1.0, {0, 1, 2, 3}),
    ]:
        kept = set(np.flatnonzero(np.isfinite(np.asarray(models.top_p_filter(logits, p)))).tolist())
        assert kept == expected, (p, kept)
        assert np.asarray(probs)[sorted(kept)].sum() >= p - 1e-6
    filtered = models.top_p_filter(logits, 0.75)
    np.testing.assert_allclose(filtered[jnp.array([1, 2])], logits[jnp.array([1, 2])])

    random_logits = jax.random.normal(jax.random.key(0), (50,)) * 3
    random_probs = np.asarray(jax.nn.softmax(random_logits))
    for p in (0.1, 0.5, 0.9):
        kept = np.isfinite(np.asarray(models.top_p_filter(random_logits, p)))
        assert random_probs[kept].sum() >= p
        assert random_probs[kept].sum() - random_probs[kept].min() < p
        assert random_probs[kept].min() >= random_probs[~kept].max()


def test_top_k_filter_and_sampling_errors():
    logits = jnp.array([0.1, 2.0, -1.0, 1.5, 0.3])
    kept = np.flatnonzero(np.isfinite(np.asarray(models.top_k_filter(logits, 2))))
    np.testing.assert_array_equal(kept, [1, 3])
    key = jax.random.key(0)
    samples = jax.vmap(lambda k: models.sample_token(logits, k, temperature=1.0, top_k=2))(
        jax.random.split(key, 64)
    )
    assert set(np.asarray(samples).tolist()) == {1, 3}
    assert int(models.sample_token(logits, key, temperature=0.0)) == 1
    for settings, message in [
        ({"temperature": -1.0}, "^temperature: must be a finite number >= 0"),
        ({"temperature": 1.0, "top_k": 0}, "^top_k: must be >= 1"),
        ({"temperature": 1.0, "top_p": 0.0}, r"^top_p: must be in \(0, 1\]"),
    ]:
        with pytest.raises(ValueError, match=message):
            models.sample_token(logits, key, **settings)


def test_cache_overflow_is_an_error():
    model = build(CONFIGS["llama_gqa"])
    with pytest.raises(Exception, match="KVCache overflow"):
        model.cached_forward(prompt(6), model.init_cache(4))


# --- python -m pipelines.generate: its options are checked before anything is loaded -----

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.toml")
GIB = 2**30


@pytest.fixture
def run_without_checkpoint(tmp_path: Path) -> Path:
    """A run directory as `pipelines.run` starts it (configs/tiny.toml, whose KV cache takes
    1.5 KiB a position) over a corpus of just a tokenizer, before its first checkpoint."""
    data = tmp_path / "data"
    data.mkdir()
    train_byte_level_bpe(["def main(): return 0\n"], 300).save(str(data / TOKENIZER_FILE))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = load_config(TINY, [f"data.path={data}"])
    (run_dir / CONFIG_FILE).write_text(config_to_toml(config), encoding="utf-8")
    return run_dir


def generate_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = generate_main(argv)
    return code, capsys.readouterr().err


BAD_OPTIONS = {
    "temperature nan": (
        ["--temperature", "nan"],
        "--temperature must be a finite number >= 0 (0: greedy), got nan",
    ),
    "temperature -1": (
        ["--temperature", "-1"],
        "--temperature must be a finite number >= 0 (0: greedy), got -1.0",
    ),
    "temperature inf": (
        ["--temperature", "inf"],
        "--temperature must be a finite number >= 0 (0: greedy), got inf",
    ),
    "top-p 0": (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    "top-p 1.5": (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    "top-p nan": (["--top-p", "nan"], "--top-p must be in (0, 1], got nan"),
    "top-k 0": (["--top-k", "0"], "--top-k must be >= 1, got 0"),
    # The shell's bytes as Python keeps them where they are not UTF-8 (Latin-1 "café!").
    "prompt not UTF-8": (
        ["--prompt", b"caf\xe9!".decode("utf-8", "surrogateescape")],
        "--prompt is not UTF-8 text (byte 0xe9 at byte 3): give the prompt in UTF-8",
    ),
    "max-new-tokens 0": (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    "seed 2**64": (
        ["--seed", str(2**64)],
        f"--seed must fit in 64 bits (-2**63 to 2**63 - 1), got {2**64}",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_OPTIONS))
def test_bad_option_is_one_line_before_the_run_is_read(case, tmp_path: Path, capsys):
    options, message = BAD_OPTIONS[case]
    code, stderr = generate_cli([str(tmp_path), "--prompt", "x", *options], capsys)
    assert code == 2
    assert stderr == f"error: {message}\n"


def test_empty_run_dir_is_refused(tmp_path: Path, monkeypatch, capsys):
    """An unset shell variable must not mean the current directory, even a run directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / CONFIG_FILE).write_text("", encoding="utf-8")
    code, stderr = generate_cli(["", "--prompt", "x"], capsys)
    assert code == 2
    assert (
        stderr == "error: RUN_DIR is empty (an unset variable?): give a pipelines.run directory\n"
    )


def prompt_tokens(run_dir: Path, prompt: str) -> int:
    tokenizer = load_tokenizer(run_dir.parent / "data" / TOKENIZER_FILE)
    return len(tokenizer.encode(prompt).ids)


def test_max_new_tokens_must_fit_the_memory(run_without_checkpoint: Path, monkeypatch, capsys):
    monkeypatch.setattr(memory, "host_memory_available", lambda: 8 * GIB)
    run_dir = run_without_checkpoint
    positions = prompt_tokens(run_dir, "def main(") + 100_000_000 - 1
    argv = [str(run_dir), "--prompt", "def main(", "--max-new-tokens", "100000000"]
    code, stderr = generate_cli(argv, capsys)
    assert code == 2
    assert stderr == (
        f"error: --max-new-tokens 100000000 needs a KV cache of 143.1 GiB ({positions} "
        "positions x 1.5 KiB), more than the 8.0 GiB of host RAM available; lower "
        "--max-new-tokens\n"
    )

    code, stderr = generate_cli([*argv[:-1], "3000000000"], capsys)
    assert code == 2
    assert stderr == (
        "error: --max-new-tokens 3000000000 with a prompt of "
        f"{prompt_tokens(run_dir, 'def main(')} tokens exceeds the KV cache's limit of "
        "2147483647 positions; lower --max-new-tokens\n"
    )

    code, stderr = generate_cli([*argv[:-1], "64"], capsys)  # fits: on to the checkpoint
    assert code == 2
    assert stderr == f"error: {run_dir / 'checkpoints'} holds no checkpoint yet\n"
