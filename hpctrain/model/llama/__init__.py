"""The Llama family (Touvron et al. 2023): rotary positions, RMSNorm, a SwiGLU MLP,
grouped-query attention (``n_kv_head`` key/value heads), usually an untied head.

Torch-free: the family's description and its parallel plan; the torch parts are in
``layers.py``, imported when a model is built.
"""

from __future__ import annotations

import importlib

from hpctrain.model.family import RMS_NORM, ROTARY, Family
from hpctrain.model.llama.plan import PLAN


def default_ffn_hidden(n_embd: int) -> int:
    """Two thirds of 4C (SwiGLU has three matrices where GELU has two, so the parameters
    stay 8C^2), rounded up to a multiple of 256 (Llama's ``multiple_of``)."""
    return -(-int(2 * 4 * n_embd / 3) // 256) * 256


def _layers() -> type:
    # Named, not imported: the torch parts import the shape, which reads this family.
    return importlib.import_module("hpctrain.model.llama.layers").LlamaLayers


FAMILY = Family(arch="llama",
                summary="Llama: rotary positions, RMSNorm, SwiGLU, grouped-query attention",
                positions=ROTARY, norm=RMS_NORM, mlp_matrices=3, grouped_query=True,
                default_ffn_hidden=default_ffn_hidden, plan=PLAN, layers=_layers,
                hugging_face="llama")
