"""GPT-2 (Radford et al. 2019): learned positions, LayerNorm, a GELU MLP of 4C.

Torch-free: the family's description and its parallel plan; the torch parts are in
``layers.py``, imported when a model is built.
"""

from __future__ import annotations

import importlib

from hpctrain.model.family import LAYER_NORM, LEARNED, Family
from hpctrain.model.gpt2.plan import PLAN


def _layers() -> type:
    # Named, not imported: the torch parts import the shape, which reads this family.
    return importlib.import_module("hpctrain.model.gpt2.layers").GPT2Layers


FAMILY = Family(arch="gpt", summary="GPT-2: learned positions, LayerNorm, GELU",
                positions=LEARNED, norm=LAYER_NORM, mlp_matrices=2, grouped_query=False,
                default_ffn_hidden=lambda n_embd: 4 * n_embd, plan=PLAN, layers=_layers,
                hugging_face="gpt2")
