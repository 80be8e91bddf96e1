"""The reference model in plain PyTorch eager fp32, as a training step for the bench to time.

This is the yardstick for our own training step: the same pre-norm transformer (rotary
attention, tanh-GELU MLP, untied head, AdamW) written the way a competent PyTorch user
would, with no `torch.compile` and torch's default thread count.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def _rotate_half(features: torch.Tensor) -> torch.Tensor:
    """`(..., head_dim) -> (..., head_dim)`: `[a, b] -> [-b, a]` over the two halves."""
    first_half, second_half = features.chunk(2, dim=-1)
    return torch.cat((-second_half, first_half), dim=-1)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary positions in the rotate-half layout."""

    def __init__(self, d_model: int, n_heads: int, seq_len: int, theta: float = 10000.0):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.q, self.k, self.v, self.o = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))
        inverse_frequencies = theta ** (-torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        angles = torch.outer(torch.arange(seq_len).float(), inverse_frequencies)
        angles = torch.cat((angles, angles), dim=-1)  # (seq, head_dim), halves share frequencies
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def _heads(self, projected: torch.Tensor) -> torch.Tensor:
        """`(batch, seq, d_model) -> (batch, heads, seq, head_dim)`."""
        batch, seq, _ = projected.shape
        return projected.view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)

    def _rotate(self, heads: torch.Tensor) -> torch.Tensor:
        """Applies rotary positions to `(batch, heads, seq, head_dim)`."""
        seq = heads.shape[-2]
        return heads * self.cos[:seq] + _rotate_half(heads) * self.sin[:seq]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """`(batch, seq, d_model) -> (batch, seq, d_model)`."""
        queries = self._rotate(self._heads(self.q(hidden)))
        keys = self._rotate(self._heads(self.k(hidden)))
        values = self._heads(self.v(hidden))
        attended = F.scaled_dot_product_attention(queries, keys, values, is_causal=True)
        return self.o(attended.transpose(1, 2).reshape(hidden.shape))


class Block(nn.Module):
    """Pre-norm transformer block: `x + attn(ln1(x))`, then `x + mlp(ln2(x))`."""

    def __init__(self, d_model: int, n_heads: int, mlp_dim: int, seq_len: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_heads, seq_len)
        self.mlp_in = nn.Linear(d_model, mlp_dim, bias=False)
        self.mlp_out = nn.Linear(mlp_dim, d_model, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """`(batch, seq, d_model) -> (batch, seq, d_model)`."""
        hidden = hidden + self.attn(self.ln1(hidden))
        return hidden + self.mlp_out(F.gelu(self.mlp_in(self.ln2(hidden)), approximate="tanh"))


class ReferenceModel(nn.Module):
    """Token ids `(batch, seq)` to logits `(batch, seq, vocab)`."""

    def __init__(
        self,
        *,
        vocab_size: int,
        d_model: int,
        n_layers: int,
        n_heads: int,
        mlp_dim: int,
        seq_len: int,
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(
            Block(d_model, n_heads, mlp_dim, seq_len) for _ in range(n_layers)
        )
        self.final_norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(token_ids)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(self.final_norm(hidden))


def torch_train_step(
    *,
    vocab_size: int,
    d_model: int,
    n_layers: int,
    n_heads: int,
    mlp_dim: int,
    batch: int,
    seq_len: int,
    warmup: int = 2,
    seed: int = 0,
) -> Callable[[], None]:
    """One training step of the reference model in PyTorch eager, fp32, AdamW, after
    ``warmup`` untimed ones: `zero_grad`, forward, cross-entropy over ``(batch*seq, vocab)``,
    backward, ``optimizer.step()``, on the same random batch each call."""
    torch.manual_seed(seed)
    model = ReferenceModel(
        vocab_size=vocab_size,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        mlp_dim=mlp_dim,
        seq_len=seq_len,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    generator = torch.Generator().manual_seed(seed)
    token_ids = torch.randint(vocab_size, (batch, seq_len), generator=generator)
    targets = torch.randint(vocab_size, (batch, seq_len), generator=generator)

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = model(token_ids)
        F.cross_entropy(logits.view(-1, vocab_size), targets.view(-1)).backward()
        optimizer.step()

    for _ in range(warmup):
        train_step()
    return train_step
