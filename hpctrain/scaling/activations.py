"""What a training step keeps in memory for backward, and what tensor parallelism does to
it: activations per layer (Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models", arXiv 2205.05198), the head's logits, and the micro-batches
a pipeline stage holds at once. Pure functions of the shape and the arrangement's numbers.

Tensor parallelism over t ranks divides what lies between a column-parallel layer's input
and the row-parallel layer's output; sequence parallelism divides the rest too (the
column-parallel inputs gathered again in backward), as Korthikanti's 34/t assumes.
The words per layer and token: docs/design/scaling-model.md ("The performance model").
"""

from __future__ import annotations

from hpctrain.model.moe_shape import expert_hidden, moe_blocks
from hpctrain.model.shape import head_chunk
from hpctrain.scaling.models import ModelShape


def word_bytes(dtype: str) -> float:
    return 4.0 if dtype == "fp32" else 2.0


def activation_bytes_per_layer(shape: ModelShape, rows: int, dtype: str,
                               flash_attention: bool, tp: int = 1, sp: bool = False) -> float:
    """Bytes one transformer layer keeps for backward on one rank, for ``rows`` sequences
    of s tokens, split over ``tp`` ranks (``sp``: sequence parallelism too).

    GPT-2: Korthikanti et al. 2022, eq. 1: s b h (34 + 5 a s / h) bytes in 16 bits: of
    the 34, 24 lie inside the tensor-parallel regions and 10 outside (the two norms' 4,
    the two column-parallel inputs' 4, the dropout masks' 2; their eq. 2: 10 + 24/t); with
    sequence parallelism all of it divides by t (their eq. 4: 34/t).
    The attention-score term (without flash attention) divides by t. fp32 doubles it.

    Llama: the tensors ``gpt.Block`` keeps, counted one by one (``llama_bytes_per_token``).
    Korthikanti's idealised accounting of Llama's parts would give 12h + 4 h_kv + 8H in
    16 bits (41 s b h for Llama 3 8B); the block keeps more, chiefly because its RMSNorm
    computes in fp32 as Llama's reference code does (51.5 s b h in bf16)."""
    s, h, a = shape.block_size, shape.n_embd, shape.n_head
    word = word_bytes(dtype)
    moe = s * rows * moe_bytes_per_token(shape, dtype, 4.0 if shape.arch == "llama" else 2.0,
                                         tp, sp)
    if shape.arch == "llama":
        # without flash attention the softmax output, a s^2 words per sequence
        scores = 0.0 if flash_attention else word * a * s * s * rows / tp
        return s * rows * llama_bytes_per_token(shape, dtype, tp, sp) + scores + moe
    inside, norms, column_inputs = 24.0, 6.0, 4.0
    per = (inside + norms + column_inputs) / tp if sp else inside / tp + norms + column_inputs
    per += 0.0 if flash_attention else 5.0 * a * s / (h * tp)
    return s * rows * h * per * word / 2.0 + moe


def moe_bytes_per_token(shape: ModelShape, dtype: str, hidden_words: float, tp: int = 1,
                        sp: bool = False) -> float:
    """What a MoE block keeps per token beyond the dense block it replaces, averaged over
    the blocks (``moe_every``): the hidden tensors of the ``moe_top_k`` routed and the
    shared experts in place of the dense MLP's (``hidden_words`` words per hidden unit:
    Llama's gate-and-up, SiLU and product 4, GPT-2's GELU input and output 2), split over
    tp; each token's k dispatched copies and k expert outputs before the combine (2 k h
    words, cut along the sequence with sp); the router's fp32 probabilities (4 E)."""
    if not shape.moe_experts:
        return 0.0
    gpt, word, k = shape.gpt, word_bytes(dtype), shape.moe_top_k
    experts = hidden_words * (expert_hidden(gpt) * (k + shape.moe_shared) - shape.ffn_hidden)
    routed = 2.0 * k * shape.n_embd / (tp if sp else 1)
    per_block = word * (experts / tp + routed) + 4.0 * shape.moe_experts
    return per_block * moe_blocks(gpt) / shape.n_layer


def llama_bytes_per_token(shape: ModelShape, dtype: str, tp: int = 1, sp: bool = False) -> float:
    """Bytes a Llama block keeps per token on one of ``tp`` ranks (w bytes a word: 2 in
    bf16, 4 in fp32; h width, h_kv = n_kv_head x head size, H the SwiGLU's hidden width),
    with flash attention:
      each RMSNorm: its input in fp32 (4h) and the normalized input (wh)  2 x (4h + wh)
      the weighted output, the QKV or the MLP projection's input          2 x wh
      the QKV projection's output, kept whole as V's storage; rotated Q and K;
        the attention output (the output projection's input)          w (3h + 3 h_kv)
      gate and up (one tensor: the SiLU and the product read it), SiLU(gate), the
        product (the down projection's input)                         w 4H
    = 8h + w (7h + 3 h_kv + 4H). Under tensor parallelism the last two rows divide by tp
    (heads and hidden width are split); with sequence parallelism everything does (the
    norms work on a rank's tokens, and each projection keeps only its rank's tokens of
    its input and gathers them again in backward). Left out (1% in the tests' narrow block, less at real widths): the norms' and
    the softmax's statistics (a few numbers per token) and the rotary tables.
    ``tests/test_scaling_model.py`` counts a real block's saved tensors against it."""
    h, big = shape.n_embd, shape.ffn_hidden
    kv = shape.n_kv_head * (h // shape.n_head)
    word = word_bytes(dtype)
    norms = 2.0 * (4.0 * h + word * h)
    inputs = 2.0 * word * h
    inside = word * (3.0 * h + 3.0 * kv + 4.0 * big)
    return (inside + norms + inputs) / tp if sp else inside / tp + norms + inputs


def selective_bytes_per_layer(shape: ModelShape, rows: int, dtype: str, tp: int = 1,
                              sp: bool = False) -> float:
    """Bytes one layer keeps under selective recomputation (``--model.recompute=
    selective``, ``model/common/recompute.py``), with flash attention: the outputs of the
    matrix multiplies and of attention, and the layer's input, w bytes a word:
      the layer's input (the first norm recomputes from it)                 w h
      the QKV projection's output (q, k, v are views of it)         w (h + 2 h_kv)
      attention's output (its backward reads it; = the output projection's input) w h
      the output projection's product (the residual and the second norm from it) w h
      the MLP's first projection (gpt: H; llama: gate and up, 2H)         w m H
      the MLP's output projection's product                                 w h
    = w (5h + 2 h_kv + m H) per token: gpt 11h words (22h bytes in 16 bits, against
    Korthikanti's 34h without recomputation), Llama 3 8B 25h bytes in bf16 (51.5h
    without). Dropout's masks are drawn again, never kept. Over tp ranks the QKV, attention and MLP outputs are split; the
    row-parallel products are each rank's whole partial sums, taken before their
    reduction; sequence parallelism cuts the input along the sequence.
    ``tests/test_recompute.py`` measures a real block's against it."""
    h, big = shape.n_embd, shape.ffn_hidden
    kv = shape.n_kv_head * (h // shape.n_head)
    m = 2.0 if shape.arch == "llama" else 1.0
    inside = 2.0 * h + 2.0 * kv + m * big
    words = h / (tp if sp else 1) + inside / tp + 2.0 * h
    moe = moe_bytes_per_token(shape, dtype, m, tp, sp)  # the experts' first projections
    return shape.block_size * rows * (words * word_bytes(dtype) + moe)


def layer_input_bytes(shape: ModelShape, rows: int, dtype: str, tp: int = 1,
                      sp: bool = False) -> float:
    """What recomputation keeps of a layer: its input (s b h words), cut along the
    sequence with sequence parallelism."""
    return shape.block_size * rows * shape.n_embd * word_bytes(dtype) / (tp if sp else 1)


def micro_batches_in_flight(p: int, m: int, schedule: str) -> int:
    """Activations a stage holds at once: all m for GPipe, at most p for 1F1B (stage 0);
    zb-h1 keeps a micro-batch's graph until its W, up to 2 p - 1 (stage 0, bounded by
    the simulator's test); zbv holds up to 2 p + 2 micro-batch chunks of half a stage
    until W on every stage, p + 1 whole-stage micro-batches (the simulator's test)."""
    if p <= 1:
        return 1
    if schedule == "zbv":
        return min(p + 1, m)
    if schedule == "zb-h1":
        return min(2 * p - 1, m)
    return m if schedule == "gpipe" else min(p, m)


def logits_bytes(shape: ModelShape, tokens: int, loss_chunk: int, tp: int = 1) -> float:
    """The head's logits and their gradient in fp32 for one micro-batch of ``tokens``
    (cross-entropy upcasts), in chunks of tokens as the trainer's ``--model.loss_chunk``
    makes them (``GPTConfig.head_chunk``: N tokens, 0 automatic, -1 all at once), with
    one fp32 log-sum-exp per token kept for backward when chunked
    (``model/chunked_loss.py``). Over tp ranks each holds its slice of the vocabulary,
    and the vocabulary-parallel loss always works in chunks
    (``parallel/tensor/cross_entropy.py``: a chunk of every token when not chunked)."""
    columns = -(-shape.vocab_size // tp)
    chunk = head_chunk(loss_chunk, tokens, columns)
    rows = min(tokens, chunk) if chunk else tokens
    logits = 2 * 4.0 * rows * shape.vocab_size / tp
    return logits + (4.0 * tokens if chunk or tp > 1 else 0.0)

