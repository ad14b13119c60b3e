"""``hpctrain train`` (a recipe with ``--section.key=value`` overrides, under ``mpiexec``
for several ranks) and ``hpctrain sample`` (text from a trained checkpoint)."""

from __future__ import annotations

import json
import signal
import sys

from hpctrain.errors import UserError


def add_train(sub) -> None:
    p = sub.add_parser("train", help="train a GPT (run under mpiexec for several ranks)",
                       add_help=False,
                       description="Train RECIPE; override any option with --section.key=value.")
    p.add_argument("recipe", nargs="?", help="built-in recipe name or a .toml file")
    p.add_argument("-h", "--help", action="store_true", help="list every option and exit")
    p.add_argument("--print-config", nargs="?", const="toml", choices=("toml", "json"),
                   help="print the resolved config and exit: a TOML recipe that reproduces "
                        "the run (the default), or json")


def add_sample(sub) -> None:
    p = sub.add_parser("sample", help="generate text from a trained checkpoint")
    p.add_argument("--checkpoint", required=True, help="the run's out_dir, its final.h5, or a "
                   "sharded checkpoint (checkpoints/step_N)")
    p.add_argument("--prompt", default="\n")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)


def cmd_train(args, overrides: list[str]) -> int:
    from hpctrain.config import describe_options, recipe_names

    if args.help:
        values = (f"the values of {args.recipe}" if args.recipe else
                  "the built-in defaults (name a recipe to see its values)")
        print("usage: hpctrain train RECIPE [--section.key=value ...]\n\n"
              f"built-in recipes: {', '.join(recipe_names())}\n\noptions, with {values}:\n"
              + describe_options(args.recipe, overrides))
        return 0
    if not args.recipe:
        raise UserError(f"name a recipe: hpctrain train RECIPE (built-in: "
                        f"{', '.join(recipe_names())}, or a path to a .toml file)")
    from hpctrain.train.stop import SignalFlag

    # From here on a scheduler's SIGTERM / SIGUSR1 is recorded, not fatal: the trainer
    # acts on it at the next point every rank agrees on (train/stop.py).
    signals = SignalFlag().install()
    try:
        return _train(args, overrides, signals)
    finally:
        # The process's own command line ignores them until it has exited; a caller of
        # main() in-process gets its handlers back.
        signals.restore(ignore=args.owns_process)


def _train(args, overrides: list[str], signals) -> int:
    from hpctrain.config import check_out_dir, load_config

    cfg = load_config(args.recipe, overrides)
    if args.print_config == "json":
        print(json.dumps(cfg.to_dict(), indent=1))
        return 0
    if args.print_config:
        from hpctrain.config.recipe_file import recipe_toml

        print(recipe_toml(cfg, note="save it as a .toml file: hpctrain train FILE trains it"),
              end="")
        return 0
    check_out_dir(cfg.train.out_dir)  # on every rank, before MPI: one message, no hang
    from hpctrain.train.tensorboard import tensorboard_dir

    scalars = tensorboard_dir(cfg.train.tensorboard, cfg.train.out_dir)
    if scalars is not None:
        check_out_dir(str(scalars), "--train.tensorboard")

    from hpctrain.cli.job_world import job_world
    from hpctrain.train.trainer import Trainer

    world = job_world(timeout=cfg.comm.timeout, device=cfg.train.device,
                      gpu_aware=cfg.comm.gpu_aware, collectives=cfg.comm.collectives)
    Trainer(cfg, world, signals=signals).fit()
    return 0


def cmd_sample(args) -> int:
    from hpctrain.checkpoint.weights import load_weights
    from hpctrain.data.tokenizers import tokenizer_from_meta
    from hpctrain.model.gpt import GPT, GPTConfig

    state, m, tokenizer = load_weights(args.checkpoint)
    if not tokenizer:
        raise UserError(f"{args.checkpoint} records no tokenizer; sample from a checkpoint "
                        "written by `hpctrain train`")
    tok = tokenizer_from_meta(tokenizer)
    try:  # the recorded shape and the stored tensors must agree
        model = GPT(GPTConfig.from_shape(m))
        model.load_parameters(state)
    except (KeyError, TypeError, ValueError, AssertionError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise UserError(f"{args.checkpoint}: its weights do not fit the model shape it "
                        f"records ({first}); the file is damaged: sample from another "
                        "checkpoint") from None
    from hpctrain.train.stop import SignalFlag

    # Ctrl-C or SIGTERM ends the sample at the next token: what it has is printed, and the
    # exit status is the signal's (128 + its number), without a traceback.
    signals = SignalFlag().install()
    try:
        text = model.complete(tok, args.prompt, args.tokens, temperature=args.temperature,
                              top_k=args.top_k or None, seed=args.seed,
                              should_stop=lambda: signals.stopping)
    except KeyboardInterrupt:  # a second Ctrl-C: stop at once
        print("sample: interrupted (Ctrl-C twice)", file=sys.stderr)
        return 128 + signal.SIGINT
    finally:
        signals.restore(ignore=args.owns_process)
    print(text)
    if signals.received:
        print(f"sample: stopped by {signals.cause} before {args.tokens} tokens",
              file=sys.stderr)
        return 128 + signals.received
    return 0
