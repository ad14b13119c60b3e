"""A GPT of the nanoGPT family in one readable file.

Learned position embeddings, pre-LayerNorm blocks, GELU MLP, causal scaled-dot-product
attention, input and output embeddings tied, residual projections initialized with
std 0.02 / sqrt(2 n_layer) (GPT-2 paper, section 2.3). The model is three parts that
pipeline stages reuse: ``embed`` (tokens -> residual stream), the blocks ``h``, and
``head_loss`` (final LayerNorm, tied head, cross-entropy); a stage runs the first and
the last through the same ``EmbeddingAndHead`` code. The shape, with its parameter count
and FLOPs, is ``GPTConfig`` (``shape.py``).

Two options change how a block runs, never what it computes: ``recompute="block"`` keeps
only each block's input and runs the block again in backward (``torch.utils.checkpoint``;
Chen et al. 2016, "Training deep nets with sublinear memory cost"), and ``compile_blocks``
puts each block's body through ``torch.compile``. Both act inside ``Block.forward``, so
the module hooks on a block (ZeRO-3 gathers its parameters before it and frees them
after) run once per forward, as without them. A checkpoint around the whole module would
run them again in backward's recomputation, and the freeing hook would take away the
parameters that the recomputed graph then needs (docs/design/compute-options.md).

Shapes: B batch, T time (tokens), C channels (n_embd), nh heads, hs head size, V vocab,
Vp the padded vocabulary (``GPTConfig.padded_vocab_size``).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from hpctrain.model.shape import GPTConfig


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
        self.recompute = cfg.recompute == "block"
        self.compiled_body = None  # torch.compile(self.body), set by compile_blocks

    def body(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        body = self.body if self.compiled_body is None else self.compiled_body
        if self.recompute and torch.is_grad_enabled():
            # Saves only x; the first saved tensor backward asks for runs body(x) again,
            # with the same dropout masks (the RNG state is restored).
            return checkpoint(body, x, use_reentrant=False)
        return body(x)


def compile_blocks(model: nn.Module) -> int:
    """Compile the body of every ``Block`` in ``model`` (a GPT or a pipeline stage) with
    ``torch.compile``; returns how many. Per block, as torchtitan does: the blocks share
    one code object, so one compilation serves them all, and the hooks around a block
    stay eager (the compiler never traces an MPI call)."""
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for blk in blocks:
        blk.compiled_body = torch.compile(blk.body)
    return len(blocks)


class EmbeddingAndHead:
    """The two ends of the GPT, shared with the pipeline stages that hold them.

    A class with this mixin keeps the GPT's parts under the GPT's names (``cfg``, ``wte``,
    ``wpe``, ``drop``, ``ln_f``) and its head's weight as ``head_weight``: the GPT's is
    the token embedding (tied), a last pipeline stage's is its copy of it (``stage.py``).
    So a stage runs the very code the GPT runs, block_size check included.
    """

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> the residual stream (B, T, C)."""
        T = idx.size(1)
        if T > self.cfg.block_size:
            raise ValueError(f"sequence of {T} tokens exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, V). The head computes Vp columns, the width the matmul wants;
        the padding's are cut off here, so no loss, gradient or sample ever sees them."""
        return F.linear(self.ln_f(h), self.head_weight)[..., :self.cfg.vocab_size]

    def head_loss(self, h: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Mean cross-entropy of the residual stream ``h`` against ``targets``; without
        targets, the last position's logits (B, 1, V): generation needs only those."""
        if targets is None:
            return self.logits(h[:, [-1], :])
        logits = self.logits(h).float()  # the softmax in fp32 even when computing in bf16
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                               ignore_index=-1)


class GPT(EmbeddingAndHead, nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self._pad_vocabulary()  # wte: (V, C) -> (Vp, C)
        self.lm_head.weight = self.wte.weight  # tied (Press & Wolf 2017)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2's initialization. The padded embedding rows start at zero and, with no
        gradient, stay there; the real rows draw the very numbers an unpadded model
        draws, so padding changes no value the model computes."""
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=residual_std)
            elif name == "wte.weight":
                nn.init.normal_(p[:self.cfg.vocab_size], mean=0.0, std=0.02)
                nn.init.zeros_(p[self.cfg.vocab_size:])
            elif p.dim() >= 2:  # Linear weights and the position embedding
                nn.init.normal_(p, mean=0.0, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:  # LayerNorm weights
                nn.init.ones_(p)

    def _pad_vocabulary(self) -> None:
        """Give the embedding its padded rows (zeros). Built unpadded first, the modules
        draw the random numbers an unpadded model draws, so the same seed gives the same
        values with and without padding."""
        pad = self.cfg.padded_vocab_size - self.cfg.vocab_size
        if pad:
            w = self.wte.weight.detach()
            self.wte.weight = nn.Parameter(torch.cat([w, w.new_zeros(pad, w.size(1))]))
            self.wte.num_embeddings = self.lm_head.out_features = self.cfg.padded_vocab_size

    @property
    def head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Mean cross-entropy when ``targets`` is given, else the last position's logits."""
        x = self.embed(idx)
        for block in self.h:
            x = block(x)
        return self.head_loss(x, targets)

    def num_params(self, non_embedding: bool = True) -> int:
        """``GPTConfig.num_params``: tied weights once; position embeddings excluded by
        default."""
        return self.cfg.num_params(non_embedding)

    def flops_per_token(self) -> float:
        """``GPTConfig.flops_per_token``: 6N + 12 L C T."""
        return self.cfg.flops_per_token()

    @torch.no_grad()
    @torch.no_grad()
    def complete(self, tokenizer, prompt: str, n_tokens: int, *, temperature: float = 0.8,
                 top_k: int | None = 50, seed: int = 0) -> str:
        """``prompt`` and ``n_tokens`` sampled after it, as text (``tokenizer``: anything
        with ``encode(str) -> ids`` and ``decode(list) -> str``); an empty prompt starts
        from a newline. The training mode is restored afterwards."""
        device = next(self.parameters()).device
        ids = torch.tensor([int(i) for i in tokenizer.encode(prompt or "\n")],
                           dtype=torch.long, device=device)[None]
        gen = torch.Generator(device=device).manual_seed(seed)
        was_training = self.training
        self.eval()
        out = self.generate(ids, n_tokens, temperature=temperature, top_k=top_k,
                            generator=gen)
        self.train(was_training)
        return tokenizer.decode(out[0].tolist())

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
