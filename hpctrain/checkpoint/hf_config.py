"""A Hugging Face ``config.json`` from an hpctrain model record, and back.

The export writes ``GPT2LMHeadModel`` (arch gpt), ``LlamaForCausalLM`` (a dense llama),
``MixtralForCausalLM`` or ``Qwen2MoeForCausalLM`` (a llama with experts: ``hf_layout``
picks); the import reads those four ``model_type``s and refuses, naming the key, every
setting hpctrain's model would compute differently. GPT-2's ``gelu_new`` imports with a
note (hpctrain computes the exact GELU). What is read, refused and accepted:
``docs/design/hf-interop.md`` ("What is mapped", "What is refused").
"""

from __future__ import annotations

from hpctrain.checkpoint.format import CheckpointError
from hpctrain.model.moe_shape import expert_hidden
from hpctrain.model.shape import GPTConfig, parse_scaling
from hpctrain.sizes import MAX_ELEMENTS, finite, whole

SUPPORTED = ("gpt2", "llama", "mixtral", "qwen2_moe")
CLASSES = "GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM"
GELU_APPROXIMATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
MOE_FORMS = ("hpctrain exports a mixture of experts as MixtralForCausalLM (moe_shared=0, "
             "moe_every=1, moe_norm_topk=true, qkv_bias=false) or Qwen2MoeForCausalLM "
             "(moe_shared > 0 with moe_shared_gate=true), both with moe_router='softmax' "
             "and bias=false; export any other with --format safetensors")


def hf_layout(cfg: GPTConfig) -> str:
    """The Hugging Face layout of ``cfg``'s model ('gpt2', 'llama', 'mixtral',
    'qwen2_moe'); CheckpointError naming the setting none of them computes."""
    family = cfg.family.hugging_face
    if family is None:
        raise CheckpointError(f"model family {cfg.arch!r} has no Hugging Face layout: "
                              "export its tensors with --format safetensors")
    if family == "llama" and cfg.qkv_bias and not cfg.bias and not cfg.moe_experts:
        raise CheckpointError("qkv_bias=true (biases on q, k, v only) has no "
                              "LlamaForCausalLM form; export with --format safetensors")
    if not cfg.moe_experts:
        return family
    if family != "llama":
        raise CheckpointError(f"a {cfg.arch} model with experts has no Hugging Face form; "
                              f"{MOE_FORMS}")
    bad = ("moe_router", cfg.moe_router) if cfg.moe_router != "softmax" else (
        ("bias", True) if cfg.bias else None)
    if bad is None and not cfg.moe_shared:
        bad = next(((k, v) for k, v, fine in (
            ("moe_every", cfg.moe_every, 1), ("moe_norm_topk", cfg.moe_norm_topk, True),
            ("qkv_bias", cfg.qkv_bias, False)) if v != fine), None)
        layout = "mixtral"
    elif bad is None:
        bad = None if cfg.moe_shared_gate else ("moe_shared_gate", False)
        layout = "qwen2_moe"
    if bad is not None:
        raise CheckpointError(f"{bad[0]}={bad[1]!r} has no Hugging Face form: {MOE_FORMS}")
    return layout


def to_hf_config(model: dict) -> dict:
    """``config.json`` for the model that ``model`` (``GPTConfig.shape()``) records."""
    cfg = GPTConfig.from_shape(model)
    layout = hf_layout(cfg)
    common = {"vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings,
              "torch_dtype": "float32"}
    if layout == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **common,
                "n_positions": cfg.block_size, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer,
                "n_head": cfg.n_head, "n_inner": cfg.ffn_hidden, "activation_function": "gelu",
                "layer_norm_epsilon": cfg.norm_eps, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                "attn_pdrop": 0.0}
    kind, v = parse_scaling(cfg.rope_scaling)
    scaling = None
    if kind == "linear":
        scaling = {"rope_type": "linear", "factor": v[0]}
    elif kind == "llama3":
        scaling = {"rope_type": "llama3", "factor": v[0], "low_freq_factor": v[1],
                   "high_freq_factor": v[2], "original_max_position_embeddings": int(v[3])}
    common.update({"hidden_size": cfg.n_embd, "num_hidden_layers": cfg.n_layer,
                   "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head,
                   "head_dim": cfg.head_size, "max_position_embeddings": cfg.block_size,
                   "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
                   "rope_scaling": scaling, "hidden_act": "silu", "attention_dropout": 0.0})
    if layout == "llama":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
                "intermediate_size": cfg.ffn_hidden, "attention_bias": cfg.bias,
                "mlp_bias": cfg.bias}
    moe = {"num_experts_per_tok": cfg.moe_top_k, "output_router_logits": False}
    if layout == "mixtral":
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **common,
                **moe, "intermediate_size": expert_hidden(cfg),
                "num_local_experts": cfg.moe_experts, "router_jitter_noise": 0.0,
                "sliding_window": None}
    # Qwen2-MoE: q, k, v always carry biases here (zeros for a model without them), the
    # form every transformers version loads; the import reads all-zero ones as none.
    return {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", **common,
            **moe, "intermediate_size": cfg.ffn_hidden,
            "moe_intermediate_size": expert_hidden(cfg),
            "shared_expert_intermediate_size": cfg.moe_shared * expert_hidden(cfg),
            "num_experts": cfg.moe_experts, "norm_topk_prob": cfg.moe_norm_topk,
            "decoder_sparse_step": cfg.moe_every, "mlp_only_layers": [], "qkv_bias": True,
            "use_sliding_window": False}


def from_hf_config(config: dict, *, bias: bool, vocab_multiple: int = 1
                   ) -> tuple[dict, list[str]]:
    """The model record (``GPTConfig.shape()``) of a Hugging Face ``config.json``, and
    notes for the user. ``bias``: whether the weights' optional biases are kept (GPT-2's,
    Qwen2-MoE's q, k, v: all of them exactly zero is a model without them; ``hf_import``
    decides). ValueError names the first key hpctrain cannot follow."""
    kind = config.get("model_type")
    if kind not in SUPPORTED:
        raise ValueError(f"model_type {kind!r} is not one hpctrain imports (it imports "
                         f"{', '.join(SUPPORTED)}: {CLASSES})")
    read = {"gpt2": _gpt2, "llama": _llama, "mixtral": _mixtral, "qwen2_moe": _qwen2_moe}
    fields, notes = read[kind](config, bias)
    return GPTConfig(**fields, vocab_multiple=vocab_multiple).shape(), notes


def _gpt2(c: dict, bias: bool) -> tuple[dict, list[str]]:
    notes = []
    act = c.get("activation_function", "gelu_new")
    if act in GELU_APPROXIMATIONS:
        notes.append(f"activation_function is {act!r} (GELU's tanh approximation); "
                     "hpctrain computes the exact GELU, so logits differ slightly from "
                     "the original's (about 1e-4 of the largest logit)")
    elif act != "gelu":
        raise ValueError(f"activation_function {act!r} is not GELU, the only one hpctrain's "
                         "GPT-2 computes")
    for key, fine in (("add_cross_attention", False), ("scale_attn_by_inverse_layer_idx", False),
                      ("scale_attn_weights", True)):
        if c.get(key, fine) != fine:
            raise ValueError(f"{key} is {c[key]!r}; hpctrain's GPT-2 computes {key}={fine}")
    n_embd = _int(c, "n_embd")
    inner = c.get("n_inner")
    return {"arch": "gpt", "vocab_size": _int(c, "vocab_size"),
            "block_size": _int(c, "n_positions"), "n_layer": _int(c, "n_layer"),
            "n_head": _int(c, "n_head"), "n_embd": n_embd,
            "ffn_hidden": 4 * n_embd if inner is None else _int(c, "n_inner"),
            "norm_eps": _float(c, "layer_norm_epsilon", 1e-5), "bias": bias,
            "tie_embeddings": _bool(c, "tie_word_embeddings", True)}, notes


def _rotary_model(c: dict, eps: float) -> dict:
    """What Llama, Mixtral and Qwen2-MoE configs say alike: sizes, heads, the rotary
    embedding, the norm, the SwiGLU activation (``eps``: the class's default)."""
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {c['hidden_act']!r} is not 'silu', the SwiGLU gate "
                         "hpctrain's Llama computes")
    n_embd, n_head = _int(c, "hidden_size"), _int(c, "num_attention_heads")
    head_dim = c.get("head_dim")
    if head_dim is not None and (n_embd % n_head or _int(c, "head_dim") != n_embd // n_head):
        raise ValueError(f"head_dim {head_dim} is not hidden_size / num_attention_heads "
                         f"({n_embd} / {n_head}), the head size hpctrain's model uses")
    kv = c.get("num_key_value_heads")
    theta, scaling = _rope(c)
    return {"arch": "llama", "vocab_size": _int(c, "vocab_size"),
            "block_size": _int(c, "max_position_embeddings"),
            "n_layer": _int(c, "num_hidden_layers"), "n_head": n_head, "n_embd": n_embd,
            "n_kv_head": n_head if kv is None else _int(c, "num_key_value_heads"),
            "ffn_hidden": _int(c, "intermediate_size"), "norm_eps": _float(c, "rms_norm_eps", eps),
            "rope_theta": theta, "rope_scaling": scaling,
            "tie_embeddings": _bool(c, "tie_word_embeddings", False)}


def _llama(c: dict, bias: bool) -> tuple[dict, list[str]]:
    biases = (_bool(c, "attention_bias", False), _bool(c, "mlp_bias", False))
    if biases[0] != biases[1]:
        raise ValueError(f"attention_bias={biases[0]} and mlp_bias={biases[1]}: hpctrain's "
                         "model has biases on every projection or on none")
    return {**_rotary_model(c, 1e-6), "bias": biases[0]}, []


def _mixtral(c: dict, bias: bool) -> tuple[dict, list[str]]:
    """Every layer a MoE layer: a softmax router over ``num_local_experts``, the top
    ``num_experts_per_tok`` weights renormalised, experts ``intermediate_size`` wide."""
    fields = _rotary_model(c, 1e-5)
    window = c.get("sliding_window")
    if window is not None and _int(c, "sliding_window") < fields["block_size"]:
        raise ValueError(f"sliding_window {window} is shorter than max_position_embeddings "
                         f"{fields['block_size']}: hpctrain attends over the whole context")
    notes = _jitter(c)
    return {**fields, "moe_experts": _int(c, "num_local_experts", 8),
            "moe_top_k": _int(c, "num_experts_per_tok", 2), "moe_router": "softmax",
            "moe_norm_topk": True}, notes


def _qwen2_moe(c: dict, bias: bool) -> tuple[dict, list[str]]:
    """Every ``decoder_sparse_step``-th layer a MoE layer (the others dense,
    ``intermediate_size`` wide): a softmax router, ``moe_intermediate_size``-wide experts
    and one shared expert behind a sigmoid gate; biases on q, k, v (``qkv_bias``)."""
    fields = _rotary_model(c, 1e-6)
    if _bool(c, "use_sliding_window", False):
        raise ValueError("use_sliding_window is true: hpctrain attends over the whole context")
    if any(t != "full_attention" for t in c.get("layer_types") or ()):
        raise ValueError(f"layer_types {c['layer_types']!r} is not full_attention throughout: "
                         "hpctrain attends over the whole context")
    if _int(c, "num_experts", 60) == 0:
        raise ValueError("num_experts is 0 (no layer has experts); hpctrain imports "
                         "Qwen2-MoE models with experts")
    width = _int(c, "moe_intermediate_size", 1408)
    shared = _int(c, "shared_expert_intermediate_size", 5632)
    if shared % width:
        raise ValueError(f"shared_expert_intermediate_size {shared} is not a multiple of "
                         f"moe_intermediate_size {width}: hpctrain's shared expert is "
                         "moe_shared experts wide")
    step, n_layer = _int(c, "decoder_sparse_step", 1), fields["n_layer"]
    if step > n_layer:
        raise ValueError(f"decoder_sparse_step {step} exceeds num_hidden_layers {n_layer} "
                         "(no layer has experts); hpctrain imports Qwen2-MoE models with experts")
    dense = c.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(type(i) is int for i in dense):
        raise ValueError(f"mlp_only_layers {dense!r} is not a list of layer numbers")
    moved = [i for i in dense if (i + 1) % step == 0 and 0 <= i < n_layer]
    if moved:
        raise ValueError(f"mlp_only_layers makes layer {moved[0]} dense, which "
                         f"decoder_sparse_step {step} makes a MoE layer: hpctrain's MoE layers "
                         "are every decoder_sparse_step-th, with no exceptions")
    return {**fields, "qkv_bias": _bool(c, "qkv_bias", True) and bias,
            "moe_experts": _int(c, "num_experts", 60),
            "moe_top_k": _int(c, "num_experts_per_tok", 4), "moe_ffn_hidden": width,
            "moe_shared": shared // width, "moe_shared_gate": True, "moe_every": step,
            "moe_router": "softmax", "moe_norm_topk": _bool(c, "norm_topk_prob", False)}, []


def _jitter(c: dict) -> list[str]:
    noise = _float(c, "router_jitter_noise", 0.0, low_open=False)
    return ([f"router_jitter_noise is {noise}: hpctrain's router adds no noise in "
             "training (the imported model computes the same; fine-tuning differs)"]
            if noise else [])


def _rope(c: dict) -> tuple[float, str]:
    """(rope_theta, hpctrain's rope_scaling spec) from either transformers spelling."""
    params = c.get("rope_parameters")
    if isinstance(params, dict):  # transformers 5: theta and scaling in one record
        theta, scaling = params.get("rope_theta", c.get("rope_theta", 10000.0)), params
    else:
        theta, scaling = c.get("rope_theta", 10000.0), c.get("rope_scaling")
    finite(theta, "rope_theta", 0.0, low_open=True)
    if c.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor is not 1: hpctrain rotates whole heads")
    if scaling is None:
        return float(theta), ""
    if not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling {scaling!r} is not an object")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    try:
        if kind == "default":
            spec = ""
        elif kind == "linear":
            spec = f"linear:{float(scaling['factor'])!r}"
        elif kind == "llama3":
            spec = ":".join(["llama3", *(repr(float(scaling[k])) for k in (
                "factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings"))])
        else:
            raise ValueError(f"rope type {kind!r} is not one hpctrain computes (default, "
                             "linear, llama3)")
        parse_scaling(spec)
    except (KeyError, TypeError) as e:
        raise ValueError(f"rope scaling {scaling!r} lacks or mistypes {e}") from None
    return float(theta), spec


def _int(c: dict, key: str, default: int | None = None) -> int:
    """``c[key]``, or ``default`` (the transformers class's) when absent; required
    without one."""
    if key not in c and default is None:
        raise ValueError(f"{key} is missing")
    low = 0 if key == "num_experts" else 1  # no experts: refused by name (_qwen2_moe)
    return whole(c.get(key, default), key, low, MAX_ELEMENTS)  # GPTConfig checks each size


def _float(c: dict, key: str, default: float, low_open: bool = True) -> float:
    return finite(c.get(key, default), key, 0.0, low_open=low_open)


def _bool(c: dict, key: str, default: bool) -> bool:
    v = c.get(key, default)
    if not isinstance(v, bool):
        raise ValueError(f"{key} is {v!r}, not true or false")
    return v
