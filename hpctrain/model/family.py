"""A model family: what the shape, the parallel code and the checkpoint tools need to
know of it, without torch (the config and the planner read it on login nodes).

Families share one skeleton (``gpt.py``: token embedding, blocks, final norm, head);
each says how its parts are built (``layers``, imported only when a model is built)
and carries its parallel plan (``plan.py``). Adding one: docs/design/models.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from hpctrain.model.plan import ParallelPlan

LEARNED, ROTARY = "learned", "rotary"
LAYER_NORM, RMS_NORM = "layernorm", "rmsnorm"


@dataclass(frozen=True)
class Family:
    arch: str
    """The ``--model.arch`` value that picks it (recorded in every checkpoint)."""
    summary: str
    """One line for help texts."""
    positions: str
    """``LEARNED`` (an embedding ``wpe`` added to the tokens) or ``ROTARY`` (rotations
    inside the attention)."""
    norm: str
    """``LAYER_NORM`` (weight, and bias with ``bias``) or ``RMS_NORM`` (weight only)."""
    mlp_matrices: int
    """Matrices of the MLP: 2 (in, out) or 3 (gate, up, out): the parameter count."""
    grouped_query: bool
    """Whether key/value heads may be fewer than query heads (``n_kv_head``)."""
    default_ffn_hidden: Callable[[int], int]
    """The MLP's hidden width for a residual width, when the config leaves it at 0."""
    plan: ParallelPlan
    layers: Callable[[], type]
    """Returns the family's ``FamilyLayers`` class (``common/layers.py``), imported on
    call: the torch code that builds its norms, MLP, rotary and position parts."""
    hugging_face: str | None = None
    """The Hugging Face layout its checkpoints export to and import from ('gpt2',
    'llama'), None for none (``checkpoint/hf_names.py``)."""
