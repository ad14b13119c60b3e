"""Pipeline pieces that need no MPI: the layer split, stages chained in one process, and
the configuration checks."""

import pytest
import torch

from hpctrain.config import check_layout
from hpctrain.errors import ConfigError
from hpctrain.model.gpt import GPT, GPTConfig
from hpctrain.parallel.pipeline import schedules as S
from hpctrain.parallel.pipeline.stage import PipelineStage, layer_split
from tests.helpers import cpu_world, tiny_config


def test_layer_split_is_contiguous_and_even():
    assert layer_split(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [len(r) for r in layer_split(7, 3)] == [3, 2, 2]
    with pytest.raises(ValueError):
        layer_split(2, 3)


@pytest.mark.parametrize("p,v,kind", [(2, 1, "1f1b"), (4, 1, "1f1b"), (2, 2, "interleaved"),
                                      (3, 2, "interleaved"), (2, 1, "zbv"), (3, 1, "zbv")])
def test_stages_chained_in_one_process_give_the_model_loss_and_gradients(p, v, kind):
    """zbv: placed in a V, the head sits on stage 0 beside the embedding and uses it
    directly (no copy)."""
    cfg = GPTConfig(vocab_size=40, block_size=12, n_layer=6, n_head=2, n_embd=16)
    v_shape = kind in S.V_PLACED
    v = S.chunks_per_stage(kind, v)
    torch.manual_seed(0)
    ref = GPT(cfg)
    x, y = torch.randint(0, 40, (3, 12)), torch.randint(0, 40, (3, 12))
    ref_loss = ref(x, y)
    ref_loss.backward()
    stages = []
    for s in range(p):
        torch.manual_seed(0)  # every rank builds the same model and keeps its stage
        stages.append(PipelineStage(GPT(cfg), s, p, v_shape=v_shape) if v_shape else
                      PipelineStage(GPT(cfg), s, p, v))
    assert sorted(i for st in stages for layers in st.chunk_layers for i in layers) == \
        list(range(cfg.n_layer))
    # Chunk g lives where the schedule places it; activations are cut from the graph
    # between chunks, as they are between ranks.
    inputs, outputs, h = [], [], x
    for g in range(p * v):
        if g > 0:
            h = h.detach().requires_grad_(True)
        inputs.append(h)
        s, c = S.place(kind, g, p)
        assert stages[s].chunk_layers[c] == list(layer_split(cfg.n_layer, p * v)[g])
        h = stages[s].chunk_forward(c, h, y if g == p * v - 1 else None)
        outputs.append(h)
    torch.testing.assert_close(h, ref_loss, atol=1e-6, rtol=0)
    grad = None
    for g in range(p * v - 1, -1, -1):
        outputs[g].backward(grad)
        grad = inputs[g].grad if g > 0 else None
    named = {n: t for st in stages for n, t in st.named_parameters()}
    assert sorted(named) == sorted(n for n, _ in ref.named_parameters())
    # The tied embedding: the head's gradient lives on the last stage's copy (in a V
    # the head uses the embedding itself).
    head = stages[0] if v_shape else stages[-1]
    assert (head.head_copy is None) == v_shape
    tied = named["wte.weight"].grad + (0 if v_shape else head.head_weight.grad)
    torch.testing.assert_close(tied, ref.wte.weight.grad, atol=1e-6, rtol=0)
    for n, t in named.items():
        if n != "wte.weight":
            torch.testing.assert_close(t.grad, dict(ref.named_parameters())[n].grad,
                                       atol=1e-6, rtol=0, msg=n)


@pytest.mark.parametrize("overrides,match", [
    ({"parallel.pp": 2, "parallel.zero": 2}, "ZeRO level 0 or 1"),
    ({"parallel.pp": 3}, "cannot fill 3 stage"),
    ({"parallel.pp": 2, "parallel.virtual_stages": 2}, "schedule=interleaved"),
    ({"parallel.pp": 2, "parallel.schedule": "interleaved", "parallel.virtual_stages": 2,
      "parallel.micro_batches": 3}, "multiple of --parallel.pp=2"),
    ({"parallel.pp": 0}, "at least 1"),
    ({"parallel.pp": 2, "parallel.schedule": "zbv", "parallel.micro_batches": 3},
     "raise --parallel.micro_batches \\(now 3\\) to 4"),
    ({"parallel.pp": 2, "parallel.schedule": "zbv", "parallel.micro_batches": 4,
      "model.n_layer": 3}, "2 chunk"),
])
def test_pipeline_config_errors_name_the_fix(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config(tmp_path / "d.h5", tmp_path, **overrides)


def test_world_size_must_be_a_multiple_of_pp(tmp_path):
    cfg = tiny_config(tmp_path / "d.h5", tmp_path, **{"parallel.pp": 2})
    check_layout(cfg, 4)
    with pytest.raises(ConfigError, match=r"mpiexec -n 4"):
        check_layout(cfg, 3)
    cfg = tiny_config(tmp_path / "d.h5", tmp_path, **{"parallel.pp": 2,
                                                      "parallel.micro_batches": 4})
    with pytest.raises(ConfigError, match="over 6 data-parallel replica"):
        check_layout(cfg, 12)  # 12 ranks = 6 replicas x 2 stages; 6 x 4 micro-batches > 8


def test_grid_places_a_pipeline_on_consecutive_ranks():
    from hpctrain.comm.grid import grid_coords, grid_rank
    dp, pp = 3, 4
    coords = [grid_coords(r, dp, pp)[:2] for r in range(dp * pp)]
    assert coords[:4] == [(0, 0), (0, 1), (0, 2), (0, 3)]  # replica 0's stages: ranks 0-3
    assert sorted(coords) == [(d, s) for d in range(dp) for s in range(pp)]
    for r, (d, s) in enumerate(coords):
        assert grid_rank(d, s, dp, pp) == r
    outer = [grid_coords(r, dp, pp, pipeline_inner=False)[:2] for r in range(dp * pp)]
    assert outer[:3] == [(0, 0), (1, 0), (2, 0)]  # replicas of stage 0 side by side
    for r, (d, s) in enumerate(outer):
        assert grid_rank(d, s, dp, pp, pipeline_inner=False) == r


def test_grid_keeps_a_tensor_parallel_group_on_adjacent_ranks():
    from hpctrain.comm.grid import grid_coords, grid_rank
    dp, pp, tp = 2, 3, 2
    coords = [grid_coords(r, dp, pp, tp=tp) for r in range(dp * pp * tp)]
    # ranks 0 and 1 are the two halves of replica 0's stage 0; then stage 1; ...
    assert coords[:4] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert sorted(coords) == [(d, s, t) for d in range(dp) for s in range(pp) for t in range(tp)]
    for r, (d, s, t) in enumerate(coords):
        assert grid_rank(d, s, dp, pp, tp=tp, tp_index=t) == r
    outer = [grid_coords(r, dp, pp, pipeline_inner=False, tp=tp) for r in range(dp * pp * tp)]
    assert outer[:4] == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]
    for r, (d, s, t) in enumerate(outer):
        assert grid_rank(d, s, dp, pp, pipeline_inner=False, tp=tp, tp_index=t) == r


def test_grid_on_one_rank_and_a_bad_size():
    from mpi4py import MPI

    from hpctrain.comm.grid import GridError, ProcessGrid
    world = cpu_world(MPI.COMM_SELF)
    grid = ProcessGrid.create(world)
    assert (grid.dp, grid.pp, grid.stage, grid.is_first, grid.is_last) == (1, 1, 0, True, True)
    with pytest.raises(GridError, match="--parallel.pp must divide"):
        ProcessGrid.create(world, 2)


def test_a_stage_runs_the_gpts_own_embedding_and_head():
    assert PipelineStage.embed is GPT.embed and PipelineStage.head_loss is GPT.head_loss
    cfg = GPTConfig(vocab_size=40, block_size=12, n_layer=2, n_head=2, n_embd=16)
    torch.manual_seed(0)
    first, last = PipelineStage(GPT(cfg), 0, 2), PipelineStage(GPT(cfg), 1, 2)
    with pytest.raises(ValueError, match="13 tokens exceeds block_size 12"):
        first.chunk_forward(0, torch.zeros(2, 13, dtype=torch.long))
    h = first.chunk_forward(0, torch.randint(0, 40, (2, 12)))
    assert last.chunk_forward(0, h).shape == (2, 1, 40)  # no targets: logits, as GPT's
