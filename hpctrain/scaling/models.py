"""GPT shapes for the performance model: parameter counts and FLOPs without building one.

A ``ModelShape`` is a ``GPTConfig`` with a name: its counts are ``GPTConfig``'s
(``num_params``, ``flops_per_token``), the very ones ``GPT`` and the trainer report
(6N + 12 L C T, Chinchilla/PaLM appendix B), split here into the per-block and head
parts that pipeline stages hold. No torch is imported (the planner runs on login nodes).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cached_property
from importlib import resources

from hpctrain.errors import UserError
from hpctrain.model.moe_shape import expert_hidden, expert_params, is_moe_block
from hpctrain.model.shape import GPTConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass(frozen=True)
class ModelShape:
    """``GPTConfig``'s fields that fix the parameters (all but dropout, see
    ``GPTConfig.shape``), a name, and the counts the performance model needs (computed
    once per shape: the planner asks for them thousands of times)."""
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int
    name: str = ""
    bias: bool = False
    vocab_multiple: int = 1
    """Embedding rows padded to a multiple of this; 1 (no padding) is what every record
    and calibration written before ``--model.vocab_multiple`` describes. Study runs
    train with this value (``runner.train_command``), so they match the model."""
    arch: str = "gpt"
    n_kv_head: int = 0
    ffn_hidden: int = 0
    rope_theta: float = 10000.0
    rope_scaling: str = ""
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    qkv_bias: bool = False
    moe_experts: int = 0
    """Routed experts per MoE block (``model/moe_shape.py``); 0 = dense."""
    moe_top_k: int = 2
    moe_shared: int = 0
    moe_shared_gate: bool = False
    moe_every: int = 1
    moe_ffn_hidden: int = 0
    moe_router: str = "softmax"
    moe_norm_topk: bool = True

    def __post_init__(self):
        for field in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size",
                      "vocab_multiple"):
            if int(getattr(self, field)) < 1:
                raise UserError(f"model {self.label}: {field} must be at least 1")
        if not isinstance(self.bias, bool):
            raise UserError(f"model {self.label}: bias must be true or false, not "
                            f"{self.bias!r}")
        if self.n_embd % self.n_head:
            raise UserError(f"model {self.label}: n_embd {self.n_embd} is not a multiple of "
                            f"n_head {self.n_head}; pick a width divisible by the head count")
        try:  # the architecture's checks, and its defaults for n_kv_head and ffn_hidden
            gpt = GPTConfig.from_shape(self.fields())
        except (ValueError, TypeError) as e:
            raise UserError(f"model {self.label}: {e}") from None
        object.__setattr__(self, "n_kv_head", gpt.n_kv_head)
        object.__setattr__(self, "ffn_hidden", gpt.ffn_hidden)

    def fields(self) -> dict:
        """The dataclass fields (what a record stores), without the cached counts."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__}

    @cached_property
    def gpt(self) -> GPTConfig:
        return GPTConfig.from_shape(self.fields())

    @property
    def label(self) -> str:
        return self.name or self.key

    @property
    def key(self) -> str:
        """Identifies a shape in calibration files (the compute rate depends on it; biases
        add FLOPs, counted, but do not change the rate)."""
        key = (f"L{self.n_layer}-H{self.n_head}-C{self.n_embd}-T{self.block_size}"
               f"-V{self.vocab_size}")
        if self.arch != "gpt":  # GPT-2 keys stay as calibration files wrote them
            key += f"-{self.arch}-KV{self.n_kv_head}-F{self.ffn_hidden}"
        if self.moe_experts:  # dense keys stay as they were
            key += (f"-E{self.moe_experts}k{self.moe_top_k}s{self.moe_shared}"
                    f"n{self.moe_every}F{expert_hidden(self.gpt)}")
        return key

    @cached_property
    def params_per_block(self) -> tuple[int, ...]:
        """Parameters of each block, in order: a dense block's, or a MoE block's with all
        of its experts (``moe_every`` decides which blocks route, ``model/moe_shape.py``)."""
        return tuple(self.gpt.params_of_block(i) for i in range(self.n_layer))

    @cached_property
    def active_per_block(self) -> tuple[int, ...]:
        """Parameters one token works with in each block (a MoE block's ``moe_top_k``
        routed experts, not all of them): what its FLOPs count."""
        return tuple(self.gpt.params_of_block(i, active=True) for i in range(self.n_layer))

    @cached_property
    def experts_per_block(self) -> tuple[int, ...]:
        """Routed-expert parameters of each block (0 for a dense one): what expert
        parallelism spreads over its ranks. The router and shared experts stay dense."""
        one = self.moe_experts * expert_params(self.gpt)
        return tuple(one if is_moe_block(self.gpt, i) else 0 for i in range(self.n_layer))

    @property
    def layer_params(self) -> float:
        """Parameters of the average block (every block's when all are alike)."""
        return sum(self.params_per_block) / self.n_layer

    @cached_property
    def embedding_params(self) -> int:
        """The head's matrix (the tied token embedding, or the untied head) and the final
        norm."""
        return self.params_non_embedding - sum(self.params_per_block)

    @cached_property
    def params(self) -> int:
        """All parameters, position embeddings included (what ranks store and reduce)."""
        return self.gpt.num_params(non_embedding=False)

    @cached_property
    def params_non_embedding(self) -> int:
        """``GPT.num_params()``: everything but the position embeddings."""
        return self.gpt.num_params()

    @property
    def layer_flops_per_token(self) -> float:
        """Forward + backward FLOPs of the average block per token: 6 per active weight,
        plus attention scores and their weighted sum (12 C T)."""
        return (6.0 * sum(self.active_per_block) / self.n_layer
                + 12.0 * self.n_embd * self.block_size)

    @property
    def head_flops_per_token(self) -> float:
        return 6.0 * self.embedding_params

    @cached_property
    def flops_per_token(self) -> float:
        """``GPTConfig.flops_per_token``: the layers' and the head's above, summed."""
        return self.gpt.flops_per_token()

    def busiest_stage(self, pp: int) -> range:
        """The blocks of the pipeline stage holding the most parameters, stages cut as the
        trainer cuts them (contiguous, sizes differing by at most one, the first ones
        larger: ``parallel/pipeline/stage.py``'s ``layer_split``)."""
        return max(self._stage_ranges(pp),
                   key=lambda r: sum(self.params_per_block[i] for i in r))

    def stage_params(self, pp: int) -> int:
        """Parameters on the largest pipeline stage: its blocks, plus the token embedding
        (and GPT-2's positions) on the first stage; the last holds the head (a copy of a
        tied embedding, see parallelism.md), of the same size."""
        blocks = sum(self.params_per_block[i] for i in self.busiest_stage(pp))
        return blocks + self.embedding_params + self.gpt.position_params()

    def stage_expert_params(self, pp: int) -> int:
        """Routed-expert parameters of the stage ``stage_params`` counts (all of the
        model's when ``pp`` is 1)."""
        return sum(self.experts_per_block[i] for i in self.busiest_stage(pp))

    def stage_flops_per_token(self, pp: int) -> float:
        """Forward + backward FLOPs per token of the blocks of the slowest stage."""
        stage = max(self._stage_ranges(pp),
                    key=lambda r: sum(self.active_per_block[i] for i in r))
        active = sum(self.active_per_block[i] for i in stage)
        return 6.0 * active + 12.0 * len(stage) * self.n_embd * self.block_size

    def _stage_ranges(self, pp: int) -> list[range]:
        base, extra = divmod(self.n_layer, pp)
        return [range(s * base + min(s, extra), (s + 1) * base + min(s + 1, extra))
                for s in range(pp)]


def presets() -> dict[str, dict]:
    text = resources.files("hpctrain.scaling").joinpath("models.toml").read_text()
    return tomllib.loads(text)


def preset_shape(name: str, **overrides) -> ModelShape:
    """A preset by name, with any field overridden (``block_size=2048``)."""
    table = presets()
    if name not in table:
        raise UserError(f"unknown model {name!r}; use one of {', '.join(table)}, a model "
                        ".toml or Hugging Face config.json, or --shape n_layer=..,n_embd=..,"
                        "n_head=..,vocab=..")
    fields = dict(table[name])
    fields.update({k: v for k, v in overrides.items() if v or v is False})
    return ModelShape(name=name, **fields)


SHAPE_KEYS = {"n_layer": "n_layer", "n_embd": "n_embd", "n_head": "n_head",
              "n_kv_head": "n_kv_head", "ffn": "ffn_hidden", "vocab": "vocab_size",
              "seq": "block_size", "arch": "arch", "experts": "moe_experts",
              "top_k": "moe_top_k", "shared": "moe_shared", "moe_ffn": "moe_ffn_hidden",
              "moe_every": "moe_every"}
"""``--shape`` keys and the ``ModelShape`` fields they set."""

MAY_BE_ZERO = ("shared",)
"""``--shape`` keys that may be 0 (no shared experts)."""


def parse_shape(spec: str, seq_len: int = 0) -> ModelShape:
    """``--shape n_layer=32,n_embd=4096,n_head=32,n_kv_head=8,ffn=14336,vocab=128256``:
    a model of any shape. Llama (RMSNorm, SwiGLU, rotary, untied head) when ``n_kv_head``
    or ``ffn`` is given, else GPT-2's; ``arch=gpt|llama`` says which; ``seq`` or
    ``--seq-len`` the context (default 2048). ``experts=8,top_k=2[,shared=..][,moe_ffn=..]
    [,moe_every=..]`` makes it a mixture of experts (``model/moe_shape.py``)."""
    fields: dict = {}
    for item in spec.split(","):
        key, eq, value = item.strip().partition("=")
        if not eq or key not in SHAPE_KEYS:
            raise UserError(f"--shape {item.strip()!r}: give key=value pairs separated by "
                            f"commas, keys among {', '.join(SHAPE_KEYS)}")
        if key == "arch":
            if value not in ("gpt", "llama"):
                raise UserError(f"--shape arch={value!r}: use gpt or llama")
            fields["arch"] = value
            continue
        least = 0 if key in MAY_BE_ZERO else 1
        if not value.isdigit() or int(value) < least:
            raise UserError(f"--shape {key}={value!r}: use a whole number of at least {least}")
        fields[SHAPE_KEYS[key]] = int(value)
    missing = [k for k in ("n_layer", "n_embd", "n_head", "vocab")
               if SHAPE_KEYS[k] not in fields]
    if missing:
        raise UserError(f"--shape {spec!r} lacks {', '.join(missing)}; give at least "
                        "n_layer, n_embd, n_head and vocab")
    llama = fields.get("arch") == "llama" or (
        "arch" not in fields and ("n_kv_head" in fields or "ffn_hidden" in fields))
    if llama:
        fields.update(arch="llama", tie_embeddings=False)
    fields["block_size"] = seq_len or fields.get("block_size", 2048)
    return ModelShape(name=f"shape L{fields['n_layer']} C{fields['n_embd']}", **fields)


def model_file_shape(path: str, seq_len: int = 0) -> ModelShape:
    """A model from a TOML file (the fields of a ``models.toml`` entry, at the top or in a
    ``[model]`` table) or a Hugging Face ``config.json``."""
    import json
    from pathlib import Path

    from hpctrain.checkpoint.hf_config import from_hf_config

    p = Path(path)
    if not p.is_file():
        raise UserError(f"--model {path}: no such file; give a preset ({', '.join(presets())}),"
                        " a model .toml, a Hugging Face config.json, or --shape")
    try:
        if p.suffix == ".json":
            record, _ = from_hf_config(json.loads(p.read_text()), bias=False)
        else:
            data = tomllib.loads(p.read_text())
            record = data.get("model", data)
    except (ValueError, OSError, UnicodeDecodeError) as e:  # JSON and TOML errors are ValueErrors
        raise UserError(f"--model {path}: cannot read a model from it ({e})") from None
    known = set(ModelShape.__dataclass_fields__) - {"name"}
    unknown = sorted(set(record) - known - {"dropout"})
    if unknown:
        raise UserError(f"--model {path}: unknown key(s) {', '.join(unknown)}; a model file "
                        f"sets {', '.join(sorted(known))}")
    fields = {k: v for k, v in record.items() if k in known}
    if seq_len:
        fields["block_size"] = seq_len
    try:
        return ModelShape(name=p.stem, **fields)
    except TypeError as e:
        raise UserError(f"--model {path}: {e}") from None


def resolve_model(model: str = "", shape: str = "", seq_len: int = 0) -> ModelShape:
    """What ``--model`` / ``--shape`` name: a preset, a model file, or a shape."""
    if shape and model:
        raise UserError("give --model or --shape, not both")
    if shape:
        return parse_shape(shape, seq_len)
    if not model:
        raise UserError("give --model NAME (a preset, a .toml or config.json) or --shape")
    if model.endswith((".toml", ".json")) or "/" in model:
        return model_file_shape(model, seq_len)
    return preset_shape(model, block_size=seq_len)
