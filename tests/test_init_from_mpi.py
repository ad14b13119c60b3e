"""``--train.init_from`` over real MPI ranks: ZeRO and pipeline layouts start from the
checkpoint's weights with a fresh optimizer, as the single-process reference does."""

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.data.dataset import TokenDataset
from hpctrain.train.trainer import Trainer
from tests.helpers import cpu_world, LLAMA, random_weights, tiny_config, weights_checkpoint
from tests.reference import plain_torch_run

pytestmark = pytest.mark.mpi(min_size=2)
COMM = MPI.COMM_WORLD
ARCHS = {"gpt": {"model.bias": True}, "llama": LLAMA}
SMALL_BUCKETS = {"parallel.bucket_mb": 0.02, "parallel.first_bucket_mb": 0.005}


@pytest.mark.parametrize("arch,layout", [
    ("gpt", {"parallel.zero": 1, **SMALL_BUCKETS}),
    ("llama", {"parallel.zero": 3, **SMALL_BUCKETS}),
    ("llama", {"parallel.pp": 2, "parallel.micro_batches": 2}),
    ("gpt", {"parallel.pp": 2})])
def test_init_from_at_any_layout_is_the_plain_loop_from_the_weights(mpi_dataset, shared_tmp,
                                                                    arch, layout):
    """Weights recorded unpadded, run padded to 64: every step's loss equals the plain
    loop's from the same weights (rank 0 writes them and computes the reference)."""
    opts = {**ARCHS[arch], **layout, "train.max_iters": 4}
    cfg = tiny_config(mpi_dataset, f"{shared_tmp}/run", **opts)
    made = None
    if COMM.rank == 0:
        ds = TokenDataset(mpi_dataset)
        vocab, tokenizer = ds.vocab_size, ds.tokenizer.meta()
        ds.close()
        gpt_cfg = cfg.model.to_gpt(vocab)
        weights = random_weights(gpt_cfg)
        ckpt = weights_checkpoint(f"{shared_tmp}/ckpt", weights, gpt_cfg, tokenizer)
        made = (str(ckpt), plain_torch_run(cfg, init=weights).losses)
    ckpt, ref_losses = COMM.bcast(made, root=0)
    run = tiny_config(mpi_dataset, f"{shared_tmp}/run", **opts, **{"train.init_from": ckpt})
    result = Trainer(run, cpu_world(COMM), verbose=False).fit()
    np.testing.assert_allclose(result.losses, ref_losses, atol=1e-5, rtol=0)
