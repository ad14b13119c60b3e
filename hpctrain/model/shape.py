"""The GPT's shape, its parameter count and its training FLOPs, without torch.

``GPTConfig`` is the one description of a model: the run's config makes it, ``GPT`` is
built from it, checkpoints record its ``shape()``, and the performance model counts with
it. It lives apart from ``gpt.py`` so that the config, the planner and manifest checks
use it without importing torch (on login nodes, before MPI). It holds resolved numbers
(the family's defaults for ``n_kv_head=0``, ``ffn_hidden=0``) and the padded vocabulary
(``vocab_multiple``). ``docs/design/models.md``; the padding:
``docs/design/compute-options.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from hpctrain.model.families import ARCHS, family_of
from hpctrain.model.family import LAYER_NORM, LEARNED, ROTARY, Family
from hpctrain.model.moe_shape import check_moe, is_moe_block, moe_mlp_params
from hpctrain.sizes import (MAX_CONTEXT, MAX_ELEMENTS, MAX_EXPERTS, MAX_LAYERS, MAX_VOCAB,
                            MAX_WIDTH, finite, whole)

SIZE_LIMITS = {"vocab_size": (1, MAX_VOCAB), "block_size": (1, MAX_CONTEXT),
               "n_layer": (1, MAX_LAYERS), "n_head": (1, MAX_WIDTH), "n_embd": (1, MAX_WIDTH),
               "vocab_multiple": (1, MAX_WIDTH), "n_kv_head": (0, MAX_WIDTH),
               "ffn_hidden": (0, MAX_WIDTH), "loss_chunk": (-1, MAX_CONTEXT),
               "recompute_every": (0, MAX_LAYERS), "moe_experts": (0, MAX_EXPERTS),
               "moe_top_k": (1, MAX_EXPERTS), "moe_shared": (0, MAX_EXPERTS),
               "moe_every": (1, MAX_LAYERS), "moe_ffn_hidden": (0, MAX_WIDTH)}
"""The range of every size of a model (``hpctrain.sizes``): a shape from a config, a
checkpoint's manifest or a Hugging Face config.json is checked against it when it
becomes a ``GPTConfig``, before anything is built from it."""


AUTO_LOGITS_BYTES = 256 * 2**20
"""The automatic head (``loss_chunk=0``) computes the logits in chunks when a micro-batch's
would take more than this many bytes in fp32 (tokens x vocabulary columns x 4), and then
in chunks of at most this many bytes. Why 256 MiB: ``docs/design/long-context.md``."""

WHOLE_HEAD = -1
"""``loss_chunk`` value that asks for the head and loss over all tokens at once."""


def head_chunk(loss_chunk: int, tokens: int, columns: int, bound: int | None = None) -> int:
    """Tokens per chunk of the head and loss, 0 for all at once: ``loss_chunk`` when it is
    positive, 0 for ``WHOLE_HEAD``, and for 0 (automatic) 0 while ``tokens`` x ``columns``
    fp32 logits take at most ``bound`` bytes (``AUTO_LOGITS_BYTES``), else as many tokens
    as fit in it (at least one)."""
    if loss_chunk:
        return max(loss_chunk, 0)
    bound = AUTO_LOGITS_BYTES if bound is None else bound
    per_token = 4 * max(columns, 1)
    if tokens * per_token <= bound:
        return 0
    return max(bound // per_token, 1)


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False
    vocab_multiple: int = 1
    """Pad the embedding and head rows up to a multiple of this (1: no padding)."""
    recompute: str = "none"
    """Activation recomputation (``RECOMPUTE``): 'none' keeps every activation;
    'selective' keeps the matrix multiplies' and attention's outputs and recomputes the
    element-wise work between them (norms, activations, rotary, dropout); 'block' keeps
    only each block's input and runs the block again in backward."""
    recompute_every: int = 0
    """Recompute every N-th block wholly (blocks N-1, 2N-1, ...: ``block_recompute``),
    the others as ``recompute`` says ('none' or 'selective'); 0 = no such blocks."""
    arch: str = "gpt"
    """The model family (``families.py``): 'gpt' (GPT-2), 'llama', or a registered one."""
    n_kv_head: int = 0
    """Key/value heads (grouped-query attention: n_head / n_kv_head query heads share
    one); 0 = n_head (multi-head attention)."""
    ffn_hidden: int = 0
    """Hidden width of the MLP; 0 = the architecture's rule (``default_ffn_hidden``)."""
    rope_theta: float = 10000.0
    """Base of the rotary position embeddings' frequencies (llama)."""
    rope_scaling: str = ""
    """Rotary frequency scaling for contexts longer than the training one (llama): ''
    none, 'linear:F' (positions divided by F), 'llama3:F:LOW:HIGH:ORIG' (Llama 3.1's
    wavelength-dependent scaling, ``rope.py``)."""
    norm_eps: float = 1e-5
    """Epsilon of the LayerNorms (gpt) or RMSNorms (llama)."""
    tie_embeddings: bool = True
    """The head uses the token embedding's matrix (GPT-2, small Llamas); False gives the
    head its own (Llama 3 8B)."""
    loss_chunk: int = 0
    """Compute the head and the loss this many tokens at a time, recomputing each chunk's
    logits in backward (``chunked_loss.py``); 0 = automatic (``head_chunk``: in chunks
    only when a micro-batch's fp32 logits would exceed ``AUTO_LOGITS_BYTES``);
    -1 (``WHOLE_HEAD``) = all at once, always."""
    qkv_bias: bool = False
    """Biases on the query/key/value projection only (Qwen2's attention), whatever
    ``bias`` says of the other layers."""
    moe_experts: int = 0
    """Routed experts of each MoE block (``moe_shape.py``); 0 = every block is dense."""
    moe_top_k: int = 2
    """Experts each token is routed to."""
    moe_shared: int = 0
    """Shared experts every token of a MoE block passes through (DeepSeekMoE)."""
    moe_shared_gate: bool = False
    """Scale the shared experts' output by sigmoid(a learned per-token gate) (Qwen-MoE)."""
    moe_every: int = 1
    """Every N-th block is a MoE block (blocks N-1, 2N-1, ...); 1 = every block."""
    moe_ffn_hidden: int = 0
    """Hidden width of one expert; 0 = ``ffn_hidden``."""
    moe_router: str = "softmax"
    """Router scores: 'softmax' over the experts or 'sigmoid' per expert."""
    moe_norm_topk: bool = True
    """Divide each token's top-k scores by their sum (Mixtral: yes; Qwen-MoE: no)."""
    moe_aux_loss: float = 0.01
    """Coefficient of the load-balancing loss (Switch Transformer's, per sequence)."""
    moe_z_loss: float = 0.0
    """Coefficient of the router z-loss (ST-MoE: the mean squared log-sum-exp of the
    router logits); 0 = off."""
    moe_capacity: float = 0.0
    """Capacity factor: an expert takes at most ceil(factor x tokens x top_k / experts)
    of a micro-batch's tokens and the rest are dropped (counted); 0 = dropless."""

    def head_chunk(self, tokens: int, columns: int = 0) -> int:
        """Tokens per chunk of the head and loss for a micro-batch of ``tokens`` over
        ``columns`` vocabulary columns (default: the whole vocabulary); 0 = all at once."""
        return head_chunk(self.loss_chunk, tokens, columns or self.vocab_size)

    def __post_init__(self):
        self._check_sizes()
        family = family_of(self.arch)
        if self.n_kv_head == 0:
            self.n_kv_head = self.n_head
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} must be a multiple of "
                             f"n_kv_head={self.n_kv_head}")
        if not family.grouped_query and self.n_kv_head != self.n_head:
            raise ValueError(f"grouped-query attention (n_kv_head < n_head) needs arch=llama "
                             f"(a family that has it), not arch={self.arch}")
        if self.ffn_hidden == 0:
            self.ffn_hidden = family.default_ffn_hidden(self.n_embd)
        if family.positions == ROTARY and self.head_size % 2:
            raise ValueError(f"rotary embeddings turn pairs of channels: the head size "
                             f"n_embd / n_head = {self.head_size} must be even")
        parse_scaling(self.rope_scaling)
        self._check_recompute()
        check_moe(self)
        finite(self.moe_aux_loss, "moe_aux_loss", 0.0)
        finite(self.moe_z_loss, "moe_z_loss", 0.0)
        finite(self.moe_capacity, "moe_capacity", 0.0)
        if self.num_params(non_embedding=False) > MAX_ELEMENTS:
            raise ValueError(f"the model has {self.num_params(non_embedding=False):,} "
                             f"parameters, more than any model (limit {MAX_ELEMENTS:,})")

    def _check_sizes(self) -> None:
        """Every size bounded and every number finite (``hpctrain.sizes``), before a
        default is derived from them or a parameter counted."""
        for name, (low, high) in SIZE_LIMITS.items():
            whole(getattr(self, name), name, low, high)
        finite(self.dropout, "dropout", 0.0, 1.0)
        finite(self.rope_theta, "rope_theta", 0.0, low_open=True)
        finite(self.norm_eps, "norm_eps", 0.0, low_open=True)

    def _check_recompute(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute={self.recompute!r} is not one of "
                             f"{', '.join(RECOMPUTE)}")
        if self.recompute == "block" and self.recompute_every:
            raise ValueError(f"recompute_every={self.recompute_every} picks the blocks "
                             "recomputed wholly, and recompute='block' already recomputes "
                             "every block: set recompute_every=0, or recompute to 'none' or "
                             "'selective' for the other blocks")

    def block_recompute(self, index: int) -> str:
        """How block ``index`` (0-based, of the whole model) recomputes: 'block' for every
        ``recompute_every``-th (the last of each group of N, so N=1 is every block and
        the last block of an N-multiple depth is one), else ``recompute``."""
        n = self.recompute_every
        return "block" if n and index % n == n - 1 else self.recompute

    @property
    def family(self) -> Family:
        return family_of(self.arch)

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the token embedding and the tied head: ``vocab_size`` rounded up to a
        multiple of ``vocab_multiple``."""
        m = self.vocab_multiple
        return -(-self.vocab_size // m) * m

    def shape(self) -> dict:
        """Every field that fixes the parameters (all but dropout, recomputation and the
        loss chunk): what a checkpoint records and a resume must match."""
        return {k: getattr(self, k) for k in SHAPE_KEYS}

    @classmethod
    def from_shape(cls, record: dict) -> GPTConfig:
        """The model a ``shape()`` record describes (a checkpoint's; extra keys, such as a
        config section's dropout, are ignored). KeyError when one of GPT-2's own keys is
        missing; the keys added later take the values every older record describes
        (``vocab_multiple=1``: written before vocabulary padding; ``arch="gpt"`` with
        its defaults: written before the Llama family)."""
        later = {k: record[k] for k in LATER_KEYS if k in record}
        if "vocab_multiple" not in later:
            later["vocab_multiple"] = 1
        return cls(**{k: record[k] for k in SHAPE_KEYS if k not in LATER_KEYS}, **later)

    def norm_params(self) -> int:
        """One LayerNorm (weight, and bias with ``bias``) or RMSNorm (weight only)."""
        c = self.n_embd
        return 2 * c if self.bias and self.family.norm == LAYER_NORM else c

    def block_params(self) -> int:
        """Parameters of one dense transformer block."""
        c, h, kv = self.n_embd, self.ffn_hidden, self.n_kv_head * self.head_size
        matrices = self.family.mlp_matrices  # 3: gate, up, down
        n = self.attention_params() + matrices * c * h + 2 * self.norm_params()
        if self.bias:  # the MLP's Linear biases
            n += (matrices - 1) * h + c
        return n

    def attention_params(self) -> int:
        """Parameters of one block's attention: q, k, v and the output projection, with
        their biases."""
        c, kv = self.n_embd, self.n_kv_head * self.head_size
        n = c * (c + 2 * kv) + c * c
        if self.bias or self.qkv_bias:
            n += c + 2 * kv
        return n + (c if self.bias else 0)

    def params_of_block(self, index: int, active: bool = False) -> int:
        """Parameters of block ``index``: a dense block's, or a MoE block's with all of
        its experts (``active``: only the ``moe_top_k`` routed ones a token works with)."""
        if not is_moe_block(self, index):
            return self.block_params()
        return self.attention_params() + 2 * self.norm_params() + moe_mlp_params(self, active)

    def blocks_params(self, active: bool = False) -> int:
        """Parameters of all blocks (``active``: as ``params_of_block``)."""
        return sum(self.params_of_block(i, active) for i in range(self.n_layer))

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters of ``GPT(self)``, a tied embedding and head once (padded rows
        included: they take memory like any other). ``non_embedding`` leaves out what does
        no matrix multiply per token: the position embeddings, and an untied token
        embedding (a lookup; the head's own matrix stays)."""
        c, rows = self.n_embd, self.padded_vocab_size * self.n_embd
        n = self.blocks_params() + rows + self.norm_params()  # head: wte or lm_head
        if non_embedding:
            return n
        return n + self.position_params() + (0 if self.tie_embeddings else rows)

    def position_params(self) -> int:
        """A learned position embedding's parameters (0 for rotary positions)."""
        return self.block_size * self.n_embd if self.family.positions == LEARNED else 0

    def active_params(self) -> int:
        """``num_params()`` counting, in a MoE block, only the experts a token is routed
        to: the parameters whose matrix multiplies one token costs."""
        return self.num_params() - self.blocks_params() + self.blocks_params(active=True)

    def parameters_text(self) -> str:
        """The start-up line's parameter count: with MoE blocks, the total and the active
        ones a token works with."""
        text = f"{self.num_params() / 1e6:.2f}M parameters"
        if self.moe_experts:
            text += f" ({self.active_params() / 1e6:.2f}M active)"
        return text

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6N for the weights (forward 2N, backward 4N) plus
        12 L C T for attention scores and their weighted sum (Chinchilla/PaLM appendix B
        accounting, as in nanoGPT's MFU estimate). N is the active parameters (a MoE
        block's routed experts count top_k times, not moe_experts times) and counts the
        real vocabulary only: the padded rows' logits are computed and thrown away, work
        that MFU must not credit."""
        padding = (self.padded_vocab_size - self.vocab_size) * self.n_embd
        return (6.0 * (self.active_params() - padding)
                + 12.0 * self.n_layer * self.n_embd * self.block_size)


def parse_scaling(spec: str) -> tuple[str, list[float]]:
    """Rotary scaling (``rope.py``): '' -> ('none', []); 'linear:F' -> ('linear', [F]); 'llama3:F:LOW:HIGH:ORIG'."""
    if not spec:
        return "none", []
    kind, *args = spec.split(":")
    want = {"linear": 1, "llama3": 4}.get(kind)
    try:
        values = [finite(float(a), "a factor", 0.0, low_open=True) for a in args]
    except ValueError:
        values = []
    if want is None or len(values) != want:
        raise ValueError(f"rope_scaling {spec!r}: use '' (none), 'linear:FACTOR' or "
                         "'llama3:FACTOR:LOW_FREQ_FACTOR:HIGH_FREQ_FACTOR:ORIGINAL_CONTEXT' "
                         "with finite positive numbers")
    if kind == "llama3" and values[1] >= values[2]:
        raise ValueError(f"rope_scaling {spec!r}: LOW_FREQ_FACTOR must be below "
                         "HIGH_FREQ_FACTOR")
    return kind, values


def default_ffn_hidden(arch: str, n_embd: int) -> int:
    """The MLP's hidden width family ``arch`` gives a residual width of ``n_embd``."""
    return family_of(arch).default_ffn_hidden(n_embd)


TRAINING_KEYS = ("dropout", "recompute", "recompute_every", "loss_chunk", "moe_aux_loss",
                 "moe_z_loss", "moe_capacity")
"""Fields that change how a model trains, not its parameters."""

SHAPE_KEYS = tuple(f.name for f in fields(GPTConfig) if f.name not in TRAINING_KEYS)
"""The fields of ``GPTConfig.shape()``: those that decide what the model computes."""

RECOMPUTE = ("none", "selective", "block")
"""The activation recomputation modes (``GPTConfig.recompute``)."""

LATER_KEYS = ("vocab_multiple", "arch", "n_kv_head", "ffn_hidden", "rope_theta",
              "rope_scaling", "norm_eps", "tie_embeddings", "qkv_bias", "moe_experts",
              "moe_top_k", "moe_shared", "moe_shared_gate", "moe_every", "moe_ffn_hidden",
              "moe_router", "moe_norm_topk")
"""Shape keys that older checkpoints lack (``from_shape`` fills them in)."""
