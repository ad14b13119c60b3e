"""The ``[model]`` section: the model's shape (``GPTConfig``'s fields, same names) and
how it computes (recomputation, the chunked head, the mixture-of-experts options)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hpctrain.config.options import (AT_LEAST_0, AT_LEAST_1, FRACTION, POSITIVE, Bounds,
                                     check_fields, opt, require)
from hpctrain.errors import ConfigError
from hpctrain.model.moe_shape import ROUTERS
from hpctrain.model.shape import ARCHS, AUTO_LOGITS_BYTES, RECOMPUTE, GPTConfig


@dataclass
class ModelConfig:
    n_layer: int = opt(4, "number of transformer blocks", bounds=AT_LEAST_1)
    n_head: int = opt(4, "attention heads per block", bounds=AT_LEAST_1)
    n_embd: int = opt(128, "width of the residual stream", bounds=AT_LEAST_1)
    block_size: int = opt(64, "context length in tokens", bounds=AT_LEAST_1)
    vocab_size: int = opt(0, "vocabulary size; 0 takes it from the dataset",
                          bounds=AT_LEAST_0)
    dropout: float = opt(0.0, "dropout probability (0 keeps runs equal across world sizes)",
                         bounds=FRACTION)
    bias: bool = opt(False, "use biases in Linear and LayerNorm layers")
    vocab_multiple: int = opt(64, "pad the embedding and head rows up to a multiple of this "
                                  "(50257 -> 50304 at 64): a faster head matmul on GPUs; the "
                                  "padded rows are never a token; 1 pads nothing",
                              bounds=AT_LEAST_1)
    recompute: str = opt("none", "activation recomputation: 'selective' keeps the matrix "
                                 "multiplies' outputs and recomputes the norms, activations, "
                                 "rotary and dropout between them in backward; 'block' keeps "
                                 "only each transformer block's input and runs the block "
                                 "again in backward (least memory, about a third more "
                                 "compute)", RECOMPUTE)
    recompute_every: int = opt(0, "recompute every N-th transformer block wholly (blocks "
                                  "N-1, 2N-1, ...), the others as model.recompute says "
                                  "(none or selective); 0 = none so", bounds=AT_LEAST_0)
    arch: str = opt("gpt", "architecture: 'gpt' (GPT-2: learned positions, LayerNorm, GELU) "
                           "or 'llama' (rotary positions, RMSNorm, SwiGLU, grouped-query "
                           "attention)", ARCHS)
    n_kv_head: int = opt(0, "key/value heads (grouped-query attention, llama); 0 = n_head",
                         bounds=AT_LEAST_0)
    ffn_hidden: int = opt(0, "hidden width of the MLP; 0 = 4 x n_embd (gpt) or 8/3 x n_embd "
                             "rounded up to a multiple of 256 (llama)", bounds=AT_LEAST_0)
    rope_theta: float = opt(10000.0, "base of the rotary position frequencies (llama; Llama 3 "
                                     "uses 500000)", bounds=POSITIVE)
    rope_scaling: str = opt("", "rotary frequency scaling (llama): '' none, 'linear:F', or "
                                "'llama3:F:LOW:HIGH:ORIG' as Llama 3.1")
    norm_eps: float = opt(1e-5, "epsilon of the LayerNorms / RMSNorms", bounds=POSITIVE)
    tie_embeddings: bool = opt(True, "the head shares the token embedding's matrix; false "
                                     "gives it its own (Llama 3 8B)")
    loss_chunk: int = opt(0, "compute the head and the loss this many tokens at a time, "
                             "recomputing each chunk's logits in backward (the logits never "
                             "exist whole); 0 = automatic: in chunks only when a "
                             "micro-batch's fp32 logits (tokens x vocabulary x 4 bytes) "
                             f"would exceed {AUTO_LOGITS_BYTES >> 20} MiB, then that much "
                             "of them at a time; -1 = "
                             "all at once, always (with train.compile the fused head, "
                             "fastest on GPUs when it fits)",
                          bounds=Bounds(-1))
    qkv_bias: bool = opt(False, "biases on the query/key/value projection only (Qwen2's "
                                "attention), whatever model.bias says")
    moe_experts: int = opt(0, "routed experts per MoE block (a mixture of experts: each "
                              "token goes to moe_top_k of them); 0 = dense MLPs",
                           bounds=AT_LEAST_0)
    moe_top_k: int = opt(2, "experts each token is routed to", bounds=AT_LEAST_1)
    moe_shared: int = opt(0, "shared experts every token of a MoE block passes through "
                             "(DeepSeekMoE)", bounds=AT_LEAST_0)
    moe_shared_gate: bool = opt(False, "scale the shared experts' output by a learned "
                                       "sigmoid gate per token (Qwen-MoE)")
    moe_every: int = opt(1, "every N-th block is a MoE block (blocks N-1, 2N-1, ...)",
                         bounds=AT_LEAST_1)
    moe_ffn_hidden: int = opt(0, "hidden width of one expert; 0 = model.ffn_hidden",
                              bounds=AT_LEAST_0)
    moe_router: str = opt("softmax", "router scores: 'softmax' over the experts (Mixtral) "
                                     "or 'sigmoid' per expert (DeepSeek-V3)", ROUTERS)
    moe_norm_topk: bool = opt(True, "divide each token's top-k router scores by their sum "
                                    "(Mixtral: true; Qwen-MoE: false)")
    moe_aux_loss: float = opt(0.01, "coefficient of the load-balancing loss (Switch "
                                    "Transformer's, per sequence); its value is logged",
                              bounds=AT_LEAST_0)
    moe_z_loss: float = opt(0.0, "coefficient of the router z-loss (ST-MoE); 0 = off",
                            bounds=AT_LEAST_0)
    moe_capacity: float = opt(0.0, "capacity factor: an expert takes at most ceil(factor x "
                                   "tokens x top_k / experts) of a micro-batch's tokens, the "
                                   "rest are dropped and counted; 0 = dropless (exact)",
                              bounds=AT_LEAST_0)

    def __post_init__(self):
        check_fields(self, "model")
        require(self.n_embd % self.n_head == 0,
                 f"model.n_embd={self.n_embd} must be a multiple of model.n_head="
                 f"{self.n_head}; change one of them")
        try:  # the shape's own checks (heads, rope_scaling), on a placeholder vocabulary
            self.to_gpt(self.vocab_size or 1)
        except ValueError as e:
            raise ConfigError(f"model: {e}; change the --model.* options") from None

    def to_gpt(self, vocab_size: int = 0) -> GPTConfig:
        """The model this section describes: the one place where the config becomes a
        ``GPTConfig`` (same field names). ``vocab_size`` is the dataset's; it fills in
        ``model.vocab_size=0``."""
        vocab = self.vocab_size or vocab_size
        require(vocab >= 1, "model.vocab_size=0 takes the vocabulary from the dataset, "
                             "and there is none here; set --model.vocab_size")
        return GPTConfig(**{**dataclasses.asdict(self), "vocab_size": vocab})
