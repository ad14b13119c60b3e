"""A Hugging Face ``config.json`` from an hpctrain model record, and back.

The export writes ``GPT2LMHeadModel`` (arch gpt) or ``LlamaForCausalLM`` (arch llama)
configs; the import reads those two ``model_type``s and refuses, naming the key, every
setting hpctrain's model would compute differently. GPT-2's ``gelu_new`` imports with a
note (hpctrain computes the exact GELU). What is read, refused and accepted:
``docs/design/hf-interop.md`` ("What is mapped", "What is refused").
"""

from __future__ import annotations

from hpctrain.model.shape import GPTConfig, parse_scaling
from hpctrain.sizes import MAX_ELEMENTS, finite, whole

SUPPORTED = ("gpt2", "llama")
GELU_APPROXIMATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def to_hf_config(model: dict) -> dict:
    """``config.json`` for the model that ``model`` (``GPTConfig.shape()``) records."""
    cfg = GPTConfig.from_shape(model)
    common = {"vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings,
              "torch_dtype": "float32"}
    if cfg.family.hugging_face == "gpt2":
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
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
            "hidden_size": cfg.n_embd, "intermediate_size": cfg.ffn_hidden,
            "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
            "num_key_value_heads": cfg.n_kv_head, "head_dim": cfg.head_size,
            "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta, "rope_scaling": scaling, "hidden_act": "silu",
            "attention_bias": cfg.bias, "mlp_bias": cfg.bias, "attention_dropout": 0.0}


def from_hf_config(config: dict, *, bias: bool, vocab_multiple: int = 1
                   ) -> tuple[dict, list[str]]:
    """The model record (``GPTConfig.shape()``) of a Hugging Face ``config.json``, and
    notes for the user. ``bias``: whether GPT-2's biases are kept (the weights decide,
    ``hf_import``). ValueError names the first key hpctrain cannot follow."""
    kind = config.get("model_type")
    if kind not in SUPPORTED:
        raise ValueError(f"model_type {kind!r} is not one hpctrain imports (it imports "
                         f"{' and '.join(SUPPORTED)}: GPT2LMHeadModel, LlamaForCausalLM)")
    fields, notes = (_gpt2 if kind == "gpt2" else _llama)(config, bias)
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


def _llama(c: dict, bias: bool) -> tuple[dict, list[str]]:
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {c['hidden_act']!r} is not 'silu', the SwiGLU gate "
                         "hpctrain's Llama computes")
    biases = (_bool(c, "attention_bias", False), _bool(c, "mlp_bias", False))
    if biases[0] != biases[1]:
        raise ValueError(f"attention_bias={biases[0]} and mlp_bias={biases[1]}: hpctrain's "
                         "model has biases on every projection or on none")
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
            "ffn_hidden": _int(c, "intermediate_size"),
            "norm_eps": _float(c, "rms_norm_eps", 1e-6), "rope_theta": theta,
            "rope_scaling": scaling, "bias": biases[0],
            "tie_embeddings": _bool(c, "tie_word_embeddings", False)}, []


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


def _int(c: dict, key: str) -> int:
    if key not in c:
        raise ValueError(f"{key} is missing")
    return whole(c[key], key, 1, MAX_ELEMENTS)  # each size's own limit: GPTConfig's


def _float(c: dict, key: str, default: float) -> float:
    return finite(c.get(key, default), key, 0.0, low_open=True)


def _bool(c: dict, key: str, default: bool) -> bool:
    v = c.get(key, default)
    if not isinstance(v, bool):
        raise ValueError(f"{key} is {v!r}, not true or false")
    return v
