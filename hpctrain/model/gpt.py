"""A GPT of the nanoGPT family, and the Llama family, in one readable file.

``arch="gpt"`` (GPT-2): learned position embeddings, pre-LayerNorm blocks, GELU MLP,
causal scaled-dot-product attention, input and output embeddings tied, residual
projections initialized with std 0.02 / sqrt(2 n_layer) (GPT-2 paper, section 2.3).
``arch="llama"`` changes four parts and keeps the rest: rotary position embeddings in
the attention instead of ``wpe`` (``rope.py``), RMSNorm instead of LayerNorm, a SwiGLU
MLP (Shazeer 2020), grouped-query attention (``n_kv_head`` key/value heads; Ainslie et
al. 2023), and usually a head of its own (``tie_embeddings=False``). Parameter names are
the same for both (``wte``, ``h.<i>.attn.c_attn``, ``h.<i>.mlp.c_fc``, ``ln_f``, and
``lm_head`` when untied), so pipeline stages, ZeRO and checkpoints treat them alike.

The model is three parts that pipeline stages reuse: ``embed`` (tokens -> residual
stream), the blocks ``h``, and ``head_loss`` (final norm, head, cross-entropy); a stage
runs the first and the last through the same ``EmbeddingAndHead`` code. The shape, with
its parameter count and FLOPs, is ``GPTConfig`` (``shape.py``).

Two options change how a block runs, never what it computes: ``recompute="block"`` keeps
only each block's input and runs the block again in backward (``torch.utils.checkpoint``;
Chen et al. 2016, "Training deep nets with sublinear memory cost"), and ``compile_model``
puts each block's body, and the head with its loss, through ``torch.compile``. Both act inside ``Block.forward``, so
the module hooks on a block (ZeRO-3 gathers its parameters before it and frees them
after) run once per forward, as without them. A checkpoint around the whole module would
run them again in backward's recomputation, and the freeing hook would take away the
parameters that the recomputed graph then needs (docs/design/compute-options.md).
``loss_chunk`` changes how the head runs, never what it computes (``chunked_loss.py``).

Shapes: B batch, T time (tokens), C channels (n_embd), nh heads, nkv key/value heads,
hs head size, H the MLP's hidden width, V vocab, Vp the padded vocabulary
(``GPTConfig.padded_vocab_size``).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from hpctrain.model.chunked_loss import chunked_cross_entropy
from hpctrain.model.rope import Rotary
from hpctrain.errors import UserError
from hpctrain.model.shape import GPTConfig
from hpctrain.sizes import MAX_CONTEXT, MAX_VOCAB, finite, whole


class RMSNorm(nn.Module):
    """x / rms(x) * weight (Zhang & Sennrich 2019), in fp32 whatever the input's dtype,
    as Llama's reference code does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def make_norm(cfg: GPTConfig) -> nn.Module:
    if cfg.arch == "llama":
        return RMSNorm(cfg.n_embd, cfg.norm_eps)
    return nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps, bias=cfg.bias)


class CausalSelfAttention(nn.Module):
    """One projection ``c_attn`` makes the queries (nh heads), keys and values (nkv heads
    each); with nkv < nh each key/value head serves nh / nkv query heads."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head, hs = cfg.n_head, cfg.n_kv_head, cfg.head_size
        self.head_size = hs
        self.widths = [cfg.n_head * hs, cfg.n_kv_head * hs, cfg.n_kv_head * hs]
        self.c_attn = nn.Linear(cfg.n_embd, sum(self.widths), bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.rotary = (Rotary(hs, cfg.rope_theta, cfg.rope_scaling)
                       if cfg.arch == "llama" else None)
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.c_attn(x)  # whole sequences even where x holds a rank's tokens
        B, T, _ = qkv.shape
        q, k, v = qkv.split(self.widths, dim=2)
        # (B, T, heads * hs) -> (B, heads, T, hs)
        q, k, v = (t.view(B, T, -1, self.head_size).transpose(1, 2) for t in (q, k, v))
        if self.rotary is not None:
            q, k = self.rotary.rotate(q), self.rotary.rotate(k)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True,
            enable_gqa=self.n_kv_head != self.n_head)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # (B, nh, T, hs) -> (B, T, nh hs)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    """GPT-2: c_proj(gelu(c_fc(x))). Llama (SwiGLU): ``c_fc`` holds the gate and the up
    projection in one matrix (2H rows: gate first), c_proj(silu(gate) * up)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.gated = cfg.arch == "llama"
        h = cfg.ffn_hidden
        self.c_fc = nn.Linear(cfg.n_embd, 2 * h if self.gated else h, bias=cfg.bias)
        self.c_proj = nn.Linear(h, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = self.c_fc(x).chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(self.c_fc(x))
        return self.drop(self.c_proj(h))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = make_norm(cfg)
        self.mlp = MLP(cfg)
        self.recompute = cfg.recompute == "block"
        self.compiled_body = None  # torch.compile(self.body), set by compile_model

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


class EmbeddingAndHead:
    """The two ends of the GPT, shared with the pipeline stages that hold them.

    A class with this mixin keeps the GPT's parts under the GPT's names (``cfg``, ``wte``,
    ``wpe`` (gpt only), ``drop``, ``ln_f``) and its head's weight as ``head_weight``: the
    GPT's is ``lm_head.weight`` (the token embedding when tied), a last pipeline stage's
    is its copy of the tied embedding or its own ``lm_head`` (``stage.py``). So a stage
    runs the very code the GPT runs, block_size check included.
    """

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> the residual stream (B, T, C)."""
        T = idx.size(1)
        if T > self.cfg.block_size:
            raise ValueError(f"sequence of {T} tokens exceeds block_size {self.cfg.block_size}")
        x = self.wte(idx)  # (B, T, C)
        if self.cfg.arch == "gpt":  # llama's positions are rotations inside attention
            x = x + self.wpe(torch.arange(T, device=idx.device))
        x = self.drop(x)
        return x if self.tensor_parallel is None else self.tensor_parallel.enter_blocks(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, V). The head computes Vp columns, the width the matmul wants;
        the padding's are cut off here, so no loss, gradient or sample ever sees them."""
        return F.linear(self.ln_f(h), self.head_weight)[..., :self.cfg.vocab_size]

    compiled_loss = None
    """``torch.compile(full_cross_entropy)``, set by ``compile_model`` (one per instance)."""

    tensor_parallel = None
    """On a tensor-parallel model (``parallel/tensor/``), what changes at its two ends:
    ``enter_blocks(x)`` gives the blocks their part of the residual stream (all of it,
    or this rank's tokens under sequence parallelism) and ``head_loss(model, h,
    targets)`` computes the head and the loss over this rank's slice of the
    vocabulary. None: the model is whole."""

    def head_loss(self, h: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Mean cross-entropy of the residual stream ``h`` against ``targets``; without
        targets, the last position's logits (B, 1, V): generation needs only those."""
        if self.tensor_parallel is not None:
            return self.tensor_parallel.head_loss(self, h, targets)
        if targets is None:
            return self.logits(h[:, [-1], :])
        if self.cfg.loss_chunk:
            return chunked_cross_entropy(self.ln_f(h), self.head_weight, targets,
                                         self.cfg.vocab_size, self.cfg.loss_chunk)
        loss = self.compiled_loss or full_cross_entropy
        return loss(h, self.ln_f, self.head_weight, targets, self.cfg.vocab_size)


def full_cross_entropy(h: torch.Tensor, norm: nn.Module, weight: torch.Tensor,
                       targets: torch.Tensor, vocab: int) -> torch.Tensor:
    """Final norm, head and mean cross-entropy over the first ``vocab`` logits, the
    softmax in fp32 even when computing in bf16. Eager, it writes the (B, T, Vp) logits,
    their cut and fp32 copy, and the fp32 log-softmax; compiled (``compile_model``), the
    cut, the up-cast and the softmax fuse into the kernels that read the matmul's output."""
    logits = F.linear(norm(h), weight)[..., :vocab].float()  # (B, T, V)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                           ignore_index=-1)


def compile_model(model: nn.Module, backward_twice: bool = False) -> int:
    """Compile, with ``torch.compile``, the body of every ``Block`` in ``model`` (a GPT or
    a pipeline stage) and, where ``model`` holds the head, the head with its loss;
    returns how many blocks. Per block, as torchtitan does: the blocks share one code
    object, so one compilation serves them all, and the hooks around a block stay eager
    (the compiler never traces an MPI call). The head and loss are compiled apart from
    the blocks, so that ZeRO-3's gather hooks on the model still run around them.

    ``backward_twice``: the graph is walked by two backward passes (a zero-bubble
    pipeline's B and W, ``split_backward.py``, the first with ``retain_graph=True``).
    AOTAutograd otherwise lets a compiled backward reuse the memory of the tensors the
    forward saved ("donated buffers") and refuses, at the first backward, any backward
    that keeps the graph. The switch is process-wide: AOTAutograd reads it when it
    compiles a graph, which may be at any later call (a recompilation for new shapes),
    and again at the backward; it only gives up that memory reuse."""
    if backward_twice:
        from torch._functorch import config as functorch_config
        functorch_config.donated_buffer = False
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for blk in blocks:
        blk.compiled_body = torch.compile(blk.body)
    if isinstance(model, EmbeddingAndHead) and getattr(model, "has_head", True):
        model.compiled_loss = torch.compile(full_cross_entropy)
    return len(blocks)


class GPT(EmbeddingAndHead, nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        if cfg.arch == "gpt":
            self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self._pad_vocabulary()  # wte (and an untied lm_head): (V, C) -> (Vp, C)
        if cfg.tie_embeddings:
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
            elif name in ("wte.weight", "lm_head.weight"):
                nn.init.normal_(p[:self.cfg.vocab_size], mean=0.0, std=0.02)
                nn.init.zeros_(p[self.cfg.vocab_size:])
            elif p.dim() >= 2:  # Linear weights and the position embedding
                nn.init.normal_(p, mean=0.0, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:  # LayerNorm and RMSNorm weights
                nn.init.ones_(p)

    def _pad_vocabulary(self) -> None:
        """Give the embedding its padded rows (zeros). Built unpadded first, the modules
        draw the random numbers an unpadded model draws, so the same seed gives the same
        values with and without padding."""
        pad = self.cfg.padded_vocab_size - self.cfg.vocab_size
        if pad:
            for module in (self.wte, self.lm_head):
                w = module.weight.detach()
                module.weight = nn.Parameter(torch.cat([w, w.new_zeros(pad, w.size(1))]))
            self.wte.num_embeddings = self.lm_head.out_features = self.cfg.padded_vocab_size

    @property
    def head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    def load_parameters(self, params: dict) -> None:
        """Load parameters by name as ``named_parameters`` gives them (a tied head
        appears once, as ``wte.weight``)."""
        if self.cfg.tie_embeddings:
            params = {**params, "lm_head.weight": params["wte.weight"]}
        self.load_state_dict(params)

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
    def complete(self, tokenizer, prompt: str, n_tokens: int, *, temperature: float = 0.8,
                 top_k: int | None = 50, seed: int = 0, should_stop=None) -> str:
        """``prompt`` and ``n_tokens`` sampled after it, as text (``tokenizer``: anything
        with ``encode(str) -> ids`` and ``decode(list) -> str``); an empty prompt starts
        from a newline. The training mode is restored afterwards. ``should_stop()``, asked
        before each token, ends the sample early (a signal while a long sample runs). Each
        number is bounded and finite first (``hpctrain.sizes``): they come from the command
        line."""
        whole(n_tokens, "the number of tokens to sample", 0, MAX_CONTEXT, error=UserError)
        finite(temperature, "the temperature", 0.0, error=UserError)
        if top_k is not None:
            whole(top_k, "top-k", 0, MAX_VOCAB, error=UserError)
        whole(seed, "the seed", -(2**63), 2**64 - 1, error=UserError)  # torch's range
        device = next(self.parameters()).device
        ids = torch.tensor([int(i) for i in tokenizer.encode(prompt or "\n")],
                           dtype=torch.long, device=device)[None]
        gen = torch.Generator(device=device).manual_seed(seed)
        was_training = self.training
        self.eval()
        out = self.generate(ids, n_tokens, temperature=temperature, top_k=top_k,
                            generator=gen, should_stop=should_stop)
        self.train(was_training)
        return tokenizer.decode(out[0].tolist())

    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None,
                 should_stop=None) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` (B, T), fewer when
        ``should_stop()`` turns true first."""
        for _ in range(max_new_tokens):
            if should_stop is not None and should_stop():
                break
            context = idx[:, -self.cfg.block_size:]
            logits = self(context)[:, -1, :] / max(temperature, 1e-6)  # (B, V)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            nxt = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, nxt), dim=1)
        return idx
