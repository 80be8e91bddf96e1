"""Memory at big vocabularies (plain vs chunked loss), at long sequences split over cp, and
attention alone (blockwise, dense, PyTorch's SDPA): time and temporary bytes."""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

import models
from eqxzoo.nn.kernels import DEFAULT_BLOCK_SIZE
from eqxzoo.parallel import MeshConfig, Schedule
from eqxzoo.train.loss_terms import LossConfig
from pipelines.bench.common import (
    StepRunner,
    interleaved_seconds,
)

LOSS_VOCABS = (32768, 152064)


LOSS_SEQ = 4096


QUICK_LOSS = dict(vocabs=(512,), seq=64, d_model=32, n_heads=4, mlp_dim=64)


def loss_memory(quick: bool) -> dict:
    """Compiled temporary bytes per device of the one-device train step at ``LOSS_SEQ``
    tokens, d_model 512, 4 layers, by vocabulary: the plain loss (``chunk_size = 0``: the
    whole logits) and the fused chunked one (the default). Compiled only, not run."""
    sizes = QUICK_LOSS if quick else dict(seq=LOSS_SEQ, d_model=512, n_heads=8, mlp_dim=1408)
    figures: dict[str, dict[str, int]] = {"plain": {}, "chunked": {}}
    for vocab in QUICK_LOSS["vocabs"] if quick else LOSS_VOCABS:
        config = models.LlamaConfig(
            vocab_size=vocab,
            d_model=sizes["d_model"],
            n_layers=4,
            n_heads=sizes["n_heads"],
            mlp_dim=sizes["mlp_dim"],
        )
        for name, chunk in (("plain", 0), ("chunked", LossConfig.chunk_size)):
            runner = StepRunner(
                config,
                MeshConfig(),
                Schedule("gpipe", 1, 1, 1),
                (1, 1, 1, sizes["seq"]),
                remat_stages=False,
                loss_chunk_size=chunk,
                compile_only=True,
            )
            temp = runner.compiled.memory_analysis().temp_size_in_bytes
            figures[name][str(vocab)] = int(temp)
    return {"loss_temp_bytes": figures}


CONTEXT_SEQ, CONTEXT_SHARDS = 16384, (1, 2, 4)


QUICK_CONTEXT = dict(seq=256, d_model=32, n_heads=4, mlp_dim=64, vocab=512)


def context_memory(quick: bool) -> dict:
    """Compiled temporary bytes per device of the train step of a dense model (d_model 512,
    4 layers, vocabulary 32k, ring attention) on one sequence of ``CONTEXT_SEQ`` tokens per
    microbatch, its tokens split over cp in 1, 2 and 4 devices (``cp_activation_bytes``:
    {cp: bytes}). Compiled only, not run."""
    sizes = (
        QUICK_CONTEXT
        if quick
        else dict(seq=CONTEXT_SEQ, d_model=512, n_heads=8, mlp_dim=1408, vocab=32768)
    )
    config = models.LlamaConfig(
        vocab_size=sizes["vocab"],
        d_model=sizes["d_model"],
        n_layers=4,
        n_heads=sizes["n_heads"],
        mlp_dim=sizes["mlp_dim"],
    )
    figures = {}
    for shards in CONTEXT_SHARDS:
        runner = StepRunner(
            config,
            MeshConfig(cp=shards),
            Schedule("gpipe", 1, 1, 1),
            (1, 1, 1, sizes["seq"]),
            compile_only=True,
        )
        figures[str(shards)] = int(runner.compiled.memory_analysis().temp_size_in_bytes)
    return {"cp_activation_bytes": figures}


ATTENTION_SEQS = (1024, 4096, 8192)


BLOCKWISE_ONLY_SEQS = (16384,)


ATTENTION_WINDOW = 1024


ATTENTION_HEADS, ATTENTION_HEAD_DIM = 8, 64


QUICK_ATTENTION = dict(seqs=(64,), blockwise_only=(128,), window=32, block_size=32)


def attention_figures(repeats: int, quick: bool) -> dict:
    """Attention alone, forward and backward (the gradient of ``sum(out * cotangent)`` with
    respect to q, k and v), for each sequence length and mask: our blockwise and dense
    kernels and PyTorch's ``F.scaled_dot_product_attention`` (causal: ``is_causal``; window:
    a boolean mask, as torch has no window argument), timed in turn. Temporary bytes of our
    compiled kernels alongside."""
    from eqxzoo.nn import attend

    seqs = QUICK_ATTENTION["seqs"] if quick else ATTENTION_SEQS
    long_seqs = QUICK_ATTENTION["blockwise_only"] if quick else BLOCKWISE_ONLY_SEQS
    window = QUICK_ATTENTION["window"] if quick else ATTENTION_WINDOW
    block_size = QUICK_ATTENTION["block_size"] if quick else DEFAULT_BLOCK_SIZE
    seconds: dict[str, dict[str, dict[str, float]]] = {
        kernel: {"causal": {}, "window": {}} for kernel in ("blockwise", "dense", "pytorch")
    }
    temp_bytes: dict[str, dict[str, dict[str, int]]] = {
        kernel: {"causal": {}, "window": {}} for kernel in ("blockwise", "dense")
    }
    for seq in (*seqs, *long_seqs):
        shape = (1, seq, ATTENTION_HEADS, ATTENTION_HEAD_DIM)
        q, k, v, cotangent = (
            jax.random.normal(jax.random.key(i), shape, jnp.float32) for i in range(4)
        )
        positions = jnp.arange(seq)
        for mask, mask_window in (("causal", 0), ("window", window)):
            steps = {}
            kernels = ("blockwise",) if seq in long_seqs else ("blockwise", "dense")
            for kernel in kernels:

                def loss(
                    q, k, v, kernel=kernel, window=mask_window, positions=positions, dy=cotangent
                ):
                    out = attend(
                        q,
                        k,
                        v,
                        positions,
                        positions,
                        window=window,
                        scale=ATTENTION_HEAD_DIM**-0.5,
                        kernel=kernel,
                        block_size=block_size,
                    )
                    return jnp.sum(out * dy)

                compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
                temp_bytes[kernel][mask][str(seq)] = int(
                    compiled.memory_analysis().temp_size_in_bytes
                )
                steps[kernel] = functools.partial(compiled, q, k, v)
            if seq not in long_seqs:
                steps["pytorch"] = torch_attention_step(seq, 0 if mask == "causal" else window)
            for kernel, value in interleaved_seconds(steps, repeats).items():
                seconds[kernel][mask][str(seq)] = value
    return {"attention_fwd_bwd_s": seconds, "attention_temp_bytes": temp_bytes}


def torch_attention_step(seq: int, window: int) -> Callable[[], None]:
    """PyTorch's forward and backward of ``scaled_dot_product_attention`` on ``(1, 8, seq,
    64)`` fp32 tensors (causal, or causal within ``window`` by a boolean mask)."""
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    shape = (1, ATTENTION_HEADS, seq, ATTENTION_HEAD_DIM)
    q, k, v = (torch.randn(shape, generator=generator, requires_grad=True) for _ in range(3))
    cotangent = torch.randn(shape, generator=generator)
    mask = None
    if window:
        offsets = torch.arange(seq)[:, None] - torch.arange(seq)[None, :]
        mask = (offsets >= 0) & (offsets < window)

    def step() -> None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        out.backward(cotangent)
        q.grad = k.grad = v.grad = None

    return step
