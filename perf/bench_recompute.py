"""Activation recomputation: what each mode keeps for backward and what it costs in step
time, beside the formulas (``hpctrain/scaling/activations.py``, derived in
docs/design/compute-options.md from Korthikanti et al. 2022).

For a small GPT-2 and a small Llama (4 layers, width 128, 4 heads; Llama with 2 key/value
heads and SwiGLU of hidden width 512) at T tokens, where the blocks' activations dwarf
the parameters, fp32, one thread, in this process:

  - kept: the bytes of every storage an operator made in the blocks' forward that is
    still alive when it returns (``KeptActivations``: autograd's saved tensors and a
    selective checkpoint's cache alike; parameters and the blocks' input left out), and
    the same for the whole model's forward (embedding and head included);
  - predicted: the formula for the blocks (L layers x its bytes per layer): none
    ``activation_bytes_per_layer`` (gpt: 32 of Korthikanti's 34 words, no dropout
    masks without dropout), selective ``selective_bytes_per_layer``, block and every-2
    the layer inputs (and half of none's);
  - step time: forward and backward of one batch (median [min, max] over REPEATS steps
    after a warm-up, the modes taken in turn each repetition so drift hits all alike);
    ratios against none in the same run (of the medians, and of the fastest steps: on a
    shared machine the minimum is the figure least touched by other jobs), and the FLOP
    count's prediction (a wholly recomputed block runs its forward again: 8/6 of its
    FLOPs; selective: no FLOPs).

Goal (issue 41): selective keeps <= 0.6 of none's activations at <= 1.1x its step time.

    OMP_NUM_THREADS=1 python perf/bench_recompute.py [--quick]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.common import bench_parser, fmt, fmt_spread, print_table, write_result  # noqa: E402

MODES = {"none": {}, "selective": {"recompute": "selective"},
         "every-2": {"recompute_every": 2}, "block": {"recompute": "block"}}
MODELS = {"gpt": dict(arch="gpt"), "llama": dict(arch="llama", n_kv_head=2, ffn_hidden=512)}
SHAPE = dict(vocab_size=256, n_layer=4, n_embd=128, n_head=4)
T, ROWS, REPEATS = 1024, 2, 11
SELECTIVE_KEEPS, SELECTIVE_TIME = 0.6, 1.1


def kept_bytes(model, x, idx) -> tuple[int, int]:
    """(the blocks', the whole model's) bytes kept for backward by one forward."""
    from hpctrain.model.common.recompute import KeptActivations
    tables = lambda: [t for b in model.h if b.attn.rotary  # noqa: E731
                      for pair in b.attn.rotary._tables.values() for t in pair]
    with KeptActivations() as kept:
        h = x
        for block in model.h:
            h = block(h)
    blocks = kept.bytes(exclude=[*model.parameters(), x, *tables()])
    del h
    with KeptActivations() as kept:
        loss = model(idx, idx)
    whole = kept.bytes(exclude=[*model.parameters(), idx, *tables()])
    del loss
    return blocks, whole


def predicted(arch: str, cfg) -> dict:
    from hpctrain.scaling.activations import (activation_bytes_per_layer, layer_input_bytes,
                                              selective_bytes_per_layer)
    from hpctrain.scaling.models import ModelShape
    shape = ModelShape(**{k: v for k, v in cfg.shape().items()
                          if k in ModelShape.__dataclass_fields__})
    full = activation_bytes_per_layer(shape, ROWS, "fp32", flash_attention=True)
    full *= 32 / 34 if arch == "gpt" else 1.0
    inputs = layer_input_bytes(shape, ROWS, "fp32")
    L = cfg.n_layer
    layer, head = shape.layer_flops_per_token, shape.head_flops_per_token
    whole_time = (layer * 4 / 3 + head) / (layer + head)
    every_time = (layer * (1 + 1 / 6) + head) / (layer + head)
    return {"none": (L * full, 1.0),
            "selective": (L * selective_bytes_per_layer(shape, ROWS, "fp32"), 1.0),
            "every-2": (L * (full + inputs) / 2, every_time),
            "block": (L * inputs, whole_time)}


def measure(arch: str, repeats: int) -> dict:
    import torch

    from hpctrain.model.gpt import GPT, GPTConfig
    models, kept = {}, {}
    for mode, opts in MODES.items():
        torch.manual_seed(0)
        cfg = GPTConfig(block_size=T, **SHAPE, **MODELS[arch], **opts)
        models[mode] = GPT(cfg)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, SHAPE["vocab_size"], (ROWS, T), generator=g)
    x = torch.randn(ROWS, T, SHAPE["n_embd"], generator=g, requires_grad=True)
    for mode, m in models.items():
        kept[mode] = kept_bytes(m, x, idx)
    times = {mode: [] for mode in MODES}
    for rep in range(repeats + 1):  # the first: warm-up, not counted
        for mode, m in models.items():
            m.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            m(idx, idx).backward()
            if rep:
                times[mode].append(time.perf_counter() - t0)
    pred = predicted(arch, models["none"].cfg)
    rows = {}
    for mode in MODES:
        blocks, whole = kept[mode]
        rows[mode] = {"kept_blocks": blocks, "kept_model": whole,
                      "predicted_blocks": pred[mode][0], "predicted_time_ratio": pred[mode][1],
                      "step_s_all": times[mode],
                      "kept_ratio": blocks / kept["none"][0],
                      "predicted_kept_ratio": pred[mode][0] / pred["none"][0],
                      "model_kept_ratio": whole / kept["none"][1],
                      "time_ratio": statistics.median(times[mode])
                      / statistics.median(times["none"]),
                      "time_ratio_min": min(times[mode]) / min(times["none"])}
    return rows


def main(argv: list[str]) -> None:
    args = bench_parser(__doc__).parse_args(argv)
    import torch
    torch.set_num_threads(1)
    repeats = 2 if args.quick else REPEATS
    results = {}
    for arch in MODELS:
        rows = measure(arch, repeats)
        results[arch] = rows
        print_table(f"{arch}: T={T}, {ROWS} sequences, {SHAPE['n_layer']} layers, width "
                    f"{SHAPE['n_embd']}, fp32",
                    ["mode", "kept MiB", "predicted MiB", "kept/none", "predicted/none",
                     "model kept/none", "step s", "time/none", "min/min", "predicted time"],
                    [[mode, fmt(r["kept_blocks"] / 2**20), fmt(r["predicted_blocks"] / 2**20),
                      fmt(r["kept_ratio"]), fmt(r["predicted_kept_ratio"]),
                      fmt(r["model_kept_ratio"]), fmt_spread(r["step_s_all"]),
                      fmt(r["time_ratio"]), fmt(r["time_ratio_min"]),
                      fmt(r["predicted_time_ratio"])]
                     for mode, r in rows.items()])
    met = {arch: rows["selective"]["kept_ratio"] <= SELECTIVE_KEEPS
           and rows["selective"]["time_ratio"] <= SELECTIVE_TIME
           for arch, rows in results.items()}
    print(f"\ngoal: selective keeps <= {SELECTIVE_KEEPS} of none's at <= {SELECTIVE_TIME}x "
          f"its step time: " + ", ".join(f"{a} {'met' if ok else 'missed'}"
                                         for a, ok in met.items()))
    write_result("recompute", {
        "shape": SHAPE, "models": MODELS, "T": T, "rows": ROWS, "dtype": "fp32",
        "threads": torch.get_num_threads(), "repeats": repeats, "results": results,
        "goal": {"kept": SELECTIVE_KEEPS, "time": SELECTIVE_TIME}, "met": met},
        smoke=args.quick)


if __name__ == "__main__":
    main(sys.argv[1:])
