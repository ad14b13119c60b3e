"""``hpctrain`` command line: prepare, train, sample.

    hpctrain prepare --corpus stdlib --output datasets/stdlib-char.h5
    mpiexec -n 4 hpctrain train default --train.max_iters=200
    hpctrain sample --checkpoint runs/default --prompt "def "

Errors a user can fix print one message and exit with status 2. MPI is initialized only
by the subcommands that need it, after the configuration has been validated.
"""

from __future__ import annotations

import argparse
import json
import sys

from hpctrain.errors import EXIT_USER_ERROR, UserError


def _add_prepare(sub) -> None:
    p = sub.add_parser("prepare", help="tokenize text files into an HDF5 token file",
                       description="Tokenize text into the HDF5 token format (io/FORMAT.md).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", metavar="PATH",
                     help="text files, directories (all files, sorted) or globs")
    src.add_argument("--corpus", choices=["stdlib"],
                     help="built-in corpus: 'stdlib' = this Python's standard library sources")
    p.add_argument("--output", required=True, metavar="FILE.h5")
    p.add_argument("--tokenizer", default="char", choices=["char", "byte"])
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="last fraction of the tokens used for validation (default 0.1)")
    p.add_argument("--max-bytes", type=int, default=None,
                   help="size budget of the built-in corpus (default 4 MB)")


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a GPT (run under mpiexec for several ranks)",
                       add_help=False,
                       description="Train RECIPE; override any option with --section.key=value.")
    p.add_argument("recipe", nargs="?", help="built-in recipe name or a .toml file")
    p.add_argument("-h", "--help", action="store_true", help="list every option and exit")
    p.add_argument("--print-config", action="store_true", help="print the resolved config")


def _add_sample(sub) -> None:
    p = sub.add_parser("sample", help="generate text from a trained checkpoint")
    p.add_argument("--checkpoint", required=True, help="final.h5 or the run's out_dir")
    p.add_argument("--prompt", default="\n")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpctrain", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_prepare(sub)
    _add_train(sub)
    _add_sample(sub)
    return parser


def _version() -> str:
    from hpctrain import __version__

    return f"hpctrain {__version__}"


def cmd_prepare(args) -> int:
    from hpctrain.comm.abort import env_rank
    from hpctrain.data.corpus import DEFAULT_BYTES, stdlib_files
    from hpctrain.data.prepare import prepare

    if env_rank() != 0:  # preparation is serial: under mpiexec only rank 0 writes
        return 0
    inputs = args.input or stdlib_files(args.max_bytes or DEFAULT_BYTES)
    summary = prepare(inputs, args.output, tokenizer=args.tokenizer,
                      val_fraction=args.val_fraction, show_progress=sys.stderr.isatty())
    print(f"prepared {summary['output']}: {summary['files']} file(s), {summary['tokens']:,} "
          f"tokens ({summary['train_tokens']:,} train / {summary['val_tokens']:,} val), "
          f"{summary['tokenizer']} vocabulary of {summary['vocab_size']}")
    return 0


def cmd_train(args, overrides: list[str]) -> int:
    from hpctrain.config import describe_options, load_config, recipe_names

    if args.help:
        print("usage: hpctrain train RECIPE [--section.key=value ...]\n\n"
              f"built-in recipes: {', '.join(recipe_names())}\n\noptions:\n"
              + describe_options())
        return 0
    if not args.recipe:
        raise UserError(f"name a recipe: hpctrain train RECIPE (built-in: "
                        f"{', '.join(recipe_names())}, or a path to a .toml file)")
    cfg = load_config(args.recipe, overrides)
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=1))
        return 0

    from mpi4py import MPI

    from hpctrain.comm.abort import install_abort_handler
    from hpctrain.comm.world import World
    from hpctrain.train.trainer import Trainer

    install_abort_handler(MPI.COMM_WORLD)
    world = World.create(MPI.COMM_WORLD, timeout=cfg.comm.timeout,
                         cuda_aware=cfg.comm.cuda_aware, use_cuda=cfg.comm.device != "cpu")
    Trainer(cfg, world).fit()
    return 0


def cmd_sample(args) -> int:
    import numpy as np
    import torch

    from hpctrain.checkpoint.single_file import load_checkpoint
    from hpctrain.data.tokenizers import tokenizer_from_meta
    from hpctrain.model.gpt import GPT, GPTConfig

    ckpt = load_checkpoint(args.checkpoint)
    m = ckpt.config["model"]
    tok = tokenizer_from_meta(ckpt.tokenizer)
    model = GPT(GPTConfig(vocab_size=m["vocab_size"] or tok.vocab_size,
                          block_size=m["block_size"], n_layer=m["n_layer"],
                          n_head=m["n_head"], n_embd=m["n_embd"], bias=m["bias"]))
    state = {k: torch.from_numpy(v) for k, v in ckpt.model.items()}
    state["lm_head.weight"] = state["wte.weight"]
    model.load_state_dict(state)
    model.eval()
    ids = torch.tensor(tok.encode(args.prompt).astype(np.int64))[None]
    gen = torch.Generator().manual_seed(args.seed)
    out = model.generate(ids, args.tokens, temperature=args.temperature,
                         top_k=args.top_k or None, generator=gen)
    print(tok.decode(out[0].tolist()))
    return 0


def _mpi_world_if_running():
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi.COMM_WORLD
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    try:
        if args.command == "train":
            return cmd_train(args, extra)
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        if args.command == "prepare":
            return cmd_prepare(args)
        return cmd_sample(args)
    except UserError as exc:
        from hpctrain.comm.abort import abort_job, env_rank

        comm = _mpi_world_if_running()
        if comm is not None and comm.Get_size() > 1:
            abort_job(comm, exc)  # other ranks may be waiting in a collective
        if env_rank() == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
