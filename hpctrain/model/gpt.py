"""The skeleton every model family shares (after nanoGPT's ``model.py``): token
embedding, blocks, final norm, head, and the loss.

The family (``--model.arch``, ``families.py``) supplies the parts: GPT-2's learned
positions, LayerNorm and GELU MLP (``gpt2/``), Llama's rotary positions, RMSNorm and
SwiGLU (``llama/``). Parameter names are the same for every family built in (``wte``,
``h.<i>.attn.c_attn``, ``h.<i>.mlp.c_fc``, ``ln_f``, ``lm_head`` when untied); the
family's parallel plan (``plan.py``) names them for ``parallel/``. Pipeline stages run
the two ends through the same ``EmbeddingAndHead`` code. Recomputation, compilation and
the chunked loss change how the model runs, never what it computes
(docs/design/compute-options.md, docs/design/models.md).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from hpctrain.errors import UserError
from hpctrain.model.chunked_loss import chunked_cross_entropy
from hpctrain.model.common.layers import Block
from hpctrain.model.common.moe import RESIDUAL_OUTPUTS as MOE_RESIDUAL_OUTPUTS
from hpctrain.model.families import family_of
from hpctrain.model.plan import ParallelPlan
from hpctrain.model.shape import GPTConfig
from hpctrain.sizes import MAX_CONTEXT, MAX_VOCAB, finite, whole


class EmbeddingAndHead:
    """The two ends of the GPT, shared with the pipeline stages that hold them.

    A class with this mixin keeps the GPT's parts under the GPT's names (``cfg``, the
    plan's embedding modules, ``ln_f``) and its head's weight as ``head_weight``: the
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
        if "wpe" in self._modules:  # learned positions; rotary ones act inside attention
            x = x + self.wpe(torch.arange(T, device=idx.device) if self.token_positions is None
                             else self.token_positions(T, idx.device))
        x = self.drop(x)
        return x if self.tensor_parallel is None else self.tensor_parallel.enter_blocks(x)

    @property
    def plan(self) -> ParallelPlan:
        """The family's parallel plan: what ``parallel/`` may split, cut and tie."""
        return family_of(self.cfg.arch).plan

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, V). The head computes Vp columns, the width the matmul wants;
        the padding's are cut off here, so no loss, gradient or sample ever sees them."""
        return F.linear(self.ln_f(h), self.head_weight)[..., :self.cfg.vocab_size]

    token_positions = None
    """Under context parallelism (``parallel/context/apply.py``): ``(T, device) -> (T,)``,
    the global positions of this rank's T tokens. None: 0..T-1."""

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
        chunk = self.cfg.head_chunk(targets.numel())
        if chunk:
            return chunked_cross_entropy(self.ln_f(h), self.head_weight, targets,
                                         self.cfg.vocab_size, chunk)
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
        if blk.recompute == "selective":
            blk.compiled_selective = torch.compile(blk.selective)
    if isinstance(model, EmbeddingAndHead) and getattr(model, "has_head", True):
        model.compiled_loss = torch.compile(full_cross_entropy)
    return len(blocks)


class GPT(EmbeddingAndHead, nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        layers = family_of(cfg.arch).layers()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        positions = layers.positions(cfg)
        if positions is not None:
            self.wpe = positions
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(layers.block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = layers.norm(cfg)
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
        residual = tuple(f"{path}.weight" for path in self.plan.residual_outputs()) + tuple(
            f"{self.plan.moe}.{name}" for name in MOE_RESIDUAL_OUTPUTS)
        for name, p in self.named_parameters():
            if name.endswith(residual):
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
