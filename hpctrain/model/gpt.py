"""A GPT of the nanoGPT family in one readable file.

Learned position embeddings, pre-LayerNorm blocks, GELU MLP, causal scaled-dot-product
attention, input and output embeddings tied, residual projections initialized with
std 0.02 / sqrt(2 n_layer) (GPT-2 paper, section 2.3). The model is three parts that
pipeline stages reuse: ``embed`` (tokens -> residual stream), ``blocks``, and
``head_loss`` (final LayerNorm, tied head, cross-entropy).

Shapes: B batch, T time (tokens), C channels (n_embd), nh heads, hs head size, V vocab.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, nh, T, hs) -> (B, T, C)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied (Press & Wolf 2017)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=residual_std)
            elif p.dim() >= 2:  # Linear weights and embeddings
                nn.init.normal_(p, mean=0.0, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:  # LayerNorm weights
                nn.init.ones_(p)

    # The three parts, so that a pipeline stage can own a contiguous slice of them.
    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        if T > self.cfg.block_size:
            raise ValueError(f"sequence of {T} tokens exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))  # (B, T, V)

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(x).float()  # the softmax in fp32 even when computing in bf16
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Mean cross-entropy when ``targets`` is given, else the last position's logits."""
        x = self.embed(idx)
        for block in self.h:
            x = block(x)
        if targets is not None:
            return self.head_loss(x, targets)
        return self.logits(x[:, [-1], :])  # (B, 1, V): generation needs only the last one

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count (tied weights once); position embeddings excluded by default."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6N for the weights plus 12 L C T for attention scores
        (Chinchilla/PaLM appendix B accounting, as in nanoGPT's MFU estimate)."""
        c = self.cfg
        return 6.0 * self.num_params() + 12.0 * c.n_layer * c.n_embd * c.block_size

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` (B, T)."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.cfg.block_size:]
            logits = self(context)[:, -1, :] / max(temperature, 1e-6)  # (B, V)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            nxt = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, nxt), dim=1)
        return idx
