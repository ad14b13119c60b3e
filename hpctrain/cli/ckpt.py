"""``hpctrain ckpt inspect | merge | reshard | export | import``: a sharded checkpoint on
one process (``hpctrain/checkpoint/ckpt_commands.py`` and ``hf_import.py`` do the work)."""

from __future__ import annotations


def add_ckpt(sub) -> None:
    p = sub.add_parser("ckpt", help="inspect, merge, reshard, export or import a sharded "
                                    "checkpoint",
                       description="Work with a sharded checkpoint (a run's out_dir, its "
                                   "checkpoints/ folder, or one checkpoints/step_N) on one "
                                   "process. Any checkpoint loads at any world size and ZeRO "
                                   "level with `hpctrain train ... --train.resume=PATH`, or "
                                   "starts a new run from its weights with "
                                   "--train.init_from=PATH.")
    acts = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    a = acts.add_parser("inspect", help="step, layout, model, shards")
    a.add_argument("path")
    a.add_argument("--verify", action="store_true", help="read every shard, check CRC-32s")
    a = acts.add_parser("merge", help="all shards into one HDF5 file (the final.h5 format)")
    a.add_argument("path")
    a.add_argument("--output", required=True, metavar="FILE.h5")
    a = acts.add_parser("reshard", help="rewrite for another world size / ZeRO level, so "
                                        "that each rank reads only its own shard")
    a.add_argument("path")
    a.add_argument("--world", type=int, required=True, metavar="N")
    a.add_argument("--zero", type=int, required=True, choices=[0, 1, 2, 3])
    a.add_argument("--bucket-mb", type=float, default=25.0,
                   help="as --parallel.bucket_mb of the run that will resume (default 25)")
    a.add_argument("--first-bucket-mb", type=float, default=1.0)
    a.add_argument("--output", required=True, metavar="DIR")
    a = acts.add_parser("export", help="weights as safetensors, a Hugging Face GPT-2 "
                                       "or Llama directory (config.json + model.safetensors), "
                                       "or a torch Distributed Checkpoint (dcp: weights and "
                                       "Adam state, torchtitan's names for Llama)")
    a.add_argument("path")
    a.add_argument("--format", choices=["safetensors", "hf", "dcp"], default="hf")
    a.add_argument("--output", required=True, metavar="FILE_OR_DIR")
    a = acts.add_parser("import", help="a Hugging Face GPT-2 or Llama directory, or a torch "
                                       "Distributed Checkpoint, as a checkpoint to fine-tune "
                                       "(--train.init_from)",
                        description="hf: read DIR's config.json, its safetensors weights (one "
                                    "file or an index with shards; pickle files are refused) "
                                    "and its tokenizer.json. dcp: read the model tensors of "
                                    "a torch Distributed Checkpoint directory (any number "
                                    "of ranks wrote it), the model named by its "
                                    "hpctrain_dcp.json or --config. Either writes a sharded "
                                    "checkpoint: step 0, weights only, fp32.")
    a.add_argument("source", metavar="DIR")
    a.add_argument("--from", dest="source_format", choices=["hf", "dcp"], required=True,
                   help="the source's format: hf (a Hugging Face model directory) or dcp "
                        "(torch.distributed.checkpoint, as torchtitan saves)")
    a.add_argument("--output", required=True, metavar="DIR")
    a.add_argument("--config", metavar="FILE",
                   help="dcp only: the model, as a Hugging Face config.json or an hpctrain "
                        "export's hpctrain_dcp.json (default: DIR/hpctrain_dcp.json)")
    a.add_argument("--vocab-multiple", type=int, default=None, metavar="N",
                   help="pad the vocabulary rows to a multiple of N (default 1, none, or "
                        "the multiple hpctrain_dcp.json records; --train.init_from pads to the "
                        "run's --model.vocab_multiple anyway)")


def cmd_ckpt(args) -> int:
    from hpctrain.checkpoint import ckpt_commands

    if args.action == "inspect":
        print(ckpt_commands.inspect(args.path, verify=args.verify))
    elif args.action == "merge":
        print(f"wrote {ckpt_commands.merge(args.path, args.output)}")
    elif args.action == "reshard":
        out = ckpt_commands.reshard(args.path, args.output, world=args.world, zero=args.zero,
                                    bucket_mb=args.bucket_mb, first_bucket_mb=args.first_bucket_mb)
        print(f"wrote {out}: resume with mpiexec -n {args.world} hpctrain train ... "
              f"--parallel.zero={args.zero} --train.resume={out}")
    elif args.action == "import":
        _import(args)
    else:
        print(f"wrote {ckpt_commands.export(args.path, args.format, args.output)}")
    return 0


def _import(args) -> None:
    import shlex

    from hpctrain.checkpoint.sharded import CheckpointError
    from hpctrain.checkpoint.weights import model_options

    if args.source_format == "dcp":
        from hpctrain.checkpoint.dcp import import_dcp

        done = import_dcp(args.source, args.output, config=args.config,
                          vocab_multiple=args.vocab_multiple)
    else:
        from hpctrain.checkpoint.hf_import import import_hf

        if args.config is not None:
            raise CheckpointError("--config is for --from dcp; a Hugging Face directory "
                                  "holds its own config.json")
        multiple = 1 if args.vocab_multiple is None else args.vocab_multiple
        done = import_hf(args.source, args.output, vocab_multiple=multiple)
    for note in done.notes:
        print(f"note: {note}")
    m = done.model
    print(f"wrote {done.path}: {m['arch']}, {m['n_layer']} layers, {done.n_params:,} "
          "parameters (fp32, step 0, weights only)")
    print(f"fine-tune it: hpctrain train RECIPE --data.path=DATA.h5 "
          f"{shlex.quote(f'--train.init_from={done.path}')} {' '.join(model_options(m))} "
          "(a shorter --model.block_size is fine)")
