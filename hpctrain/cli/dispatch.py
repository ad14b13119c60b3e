"""``hpctrain`` command line: prepare, train, sample, ckpt, jobscript, launch, scale, plan,
doctor.

    hpctrain prepare --corpus stdlib --output datasets/stdlib-char.h5
    mpiexec -n 4 hpctrain train default --train.max_iters=200
    hpctrain sample --checkpoint runs/default --prompt "def "
    hpctrain ckpt import --from hf models/gpt2 --output ckpt/gpt2    # then --train.init_from
    hpctrain jobscript --system polaris --nodes 2 --walltime 00:30:00 --queue debug \
        --account PROJECT --output job.sh -- train default
    hpctrain launch --dry-run -- train default        # inside a PBS/SLURM job
    hpctrain scale run perf/studies/local.toml && hpctrain scale report runs/study-local
    hpctrain plan --system polaris --nodes 64 --model gpt2-xl
    mpiexec -n 4 hpctrain doctor --json doctor.json   # check a node before training

Errors a user can fix print one message and exit with status 2. MPI is initialized only
by the subcommands that need it, after the configuration has been validated.
"""

from __future__ import annotations

import argparse
import os
import json
import sys

from hpctrain.comm.world_check import LaunchMismatch
from hpctrain.errors import EXIT_USER_ERROR, UserError


def _add_prepare(sub) -> None:
    p = sub.add_parser(
        "prepare", help="tokenize text files into an HDF5 token file (in parallel under mpiexec)",
        description="Tokenize text into the HDF5 token format (io/FORMAT.md). Under "
                    "`mpiexec -n N` the files are shared out among the ranks, tokenized in "
                    "parallel and written into one file with MPI-IO; the file is the same "
                    "for any N.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", metavar="PATH",
                     help="text files, directories (all files, sorted) or globs")
    src.add_argument("--corpus", choices=["stdlib"],
                     help="built-in corpus: 'stdlib' = this Python's standard library sources")
    src.add_argument("--combine", nargs="+", metavar="FILE.h5",
                     help="prepared token files (same tokenizer) to list in a manifest "
                          "(--output NAME.json): one dataset, each split the files' splits "
                          "in order")
    p.add_argument("--output", required=True, metavar="FILE.h5")
    p.add_argument("--tokenizer", default="char", metavar="NAME",
                   help="char (vocabulary from the text), byte (256), gpt2 (GPT-2 BPE via "
                        "tiktoken, from its local cache), or hf:DIR (the Hugging Face "
                        "tokenizer.json in DIR, e.g. the model directory you import)")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="fraction of the tokens used for validation (default 0.1): "
                        "whole files in a fixed random order; of one file, its last tokens")
    p.add_argument("--max-bytes", type=int, default=None,
                   help="size budget of the built-in corpus (default 4 MB)")
    p.add_argument("--romio-hints", default="", metavar="K=V,...",
                   help="ROMIO hints for writing the file under mpiexec, e.g. "
                        "striping_factor=8,striping_unit=16777216 (Lustre)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --output if it exists (by default an existing file is "
                        "left alone and the command fails)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="under mpiexec: how long any rank may wait for the others in one "
                        "step before the job aborts, naming the step (default 300, as "
                        "training's --comm.timeout)")


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a GPT (run under mpiexec for several ranks)",
                       add_help=False,
                       description="Train RECIPE; override any option with --section.key=value.")
    p.add_argument("recipe", nargs="?", help="built-in recipe name or a .toml file")
    p.add_argument("-h", "--help", action="store_true", help="list every option and exit")
    p.add_argument("--print-config", action="store_true", help="print the resolved config")


def _add_sample(sub) -> None:
    p = sub.add_parser("sample", help="generate text from a trained checkpoint")
    p.add_argument("--checkpoint", required=True, help="the run's out_dir, its final.h5, or a "
                   "sharded checkpoint (checkpoints/step_N)")
    p.add_argument("--prompt", default="\n")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)


_JOB_COMMANDS = ("jobscript", "launch")
_JOB_EPILOG = ("Everything after '--' is the hpctrain command the job runs: "
               "train RECIPE [--section.key=value ...].")


def _add_jobscript(sub) -> None:
    p = sub.add_parser(
        "jobscript", help="write a PBS/SLURM job script for Polaris, Aurora, ... or any cluster",
        description="Render a job script for SYSTEM that runs `hpctrain train ...` on its "
                    "nodes: directives, module setup, CPU/GPU binding, GPU-aware MPI, a run "
                    "directory with the job's records, and the launch line. Queue limits "
                    "are checked before anything is written.",
        usage="hpctrain jobscript --system NAME [--nodes N] [--walltime HH:MM:SS] [--queue Q] "
              "[--account A] [options] [--output FILE] -- train RECIPE [overrides]",
        epilog=_JOB_EPILOG + " Example: hpctrain jobscript --system polaris --nodes 2 "
               "--walltime 00:30:00 --queue debug --account MyProject --output job.sh "
               "-- train default --data.path=datasets/stdlib-char.h5")
    p.add_argument("--system", metavar="NAME", help="polaris, aurora, perlmutter, frontier, "
                   "pbs, slurm, local, or the path of your own .toml profile")
    p.add_argument("--list-systems", action="store_true",
                   help="show every system with its queues and limits, then exit")
    p.add_argument("--nodes", type=int, metavar="N", help="nodes to request (default 1)")
    p.add_argument("--walltime", metavar="HH:MM:SS")
    p.add_argument("--queue", metavar="Q", help="queue (PBS), QOS (Perlmutter) or partition")
    p.add_argument("--account", metavar="A", help="project/allocation to charge")
    p.add_argument("--job-name", metavar="NAME", help="job name (default hpctrain)")
    p.add_argument("--filesystems", nargs="+", metavar="FS",
                   help="filesystems the job needs, e.g. home:eagle (default: the system's)")
    p.add_argument("--env", action="extend", nargs="+", default=[], metavar="KEY=VAL",
                   help="export KEY=VAL in the job (overrides the system's value)")
    p.add_argument("--array", metavar="SPEC", help="job array, e.g. 0-7 or 0-31%%8; "
                   "'{array_index}' in an override becomes the sub-job's index")
    p.add_argument("--profile", choices=["nsys"], help="run local rank 0 of each node "
                   "under Nsight Systems; reports go to <run dir>/nsys/")
    p.add_argument("--ranks-per-node", type=int, metavar="N",
                   help="default: the system's (one per GPU or tile)")
    p.add_argument("--srun-mpi", metavar="PLUGIN", help="srun's --mpi= plugin on the "
                   "generic slurm system: pmi2, pmix, ... (default auto: chosen in the job "
                   "for the MPI library mpi4py loads)")
    p.add_argument("--venv", metavar="DIR", help="virtual environment to activate after the "
                   "module setup (default: the active one; 'none' for none; ~/ allowed)")
    p.add_argument("--setup", metavar="FILE", help="replace the system's module setup with "
                   "the commands in FILE (one per line; each must succeed)")
    p.add_argument("--run-root", metavar="DIR",
                   help="where run directories are made (default: runs, under the submit dir)")
    p.add_argument("--no-queue-check", action="store_true",
                   help="skip the queue limit checks (if the site changed its limits)")
    p.add_argument("--doctor", action="store_true", help="a job that runs `hpctrain doctor` "
                   "on the nodes instead of training (the same as '-- doctor')")
    p.add_argument("--output", "-o", metavar="FILE", help="write the script here "
                   "(atomically, executable) instead of printing it")


def _add_launch(sub) -> None:
    p = sub.add_parser(
        "launch", help="inside a job: build the system's mpiexec/srun line and run it",
        description="Detect the batch system (PBS_JOBID, SLURM_JOB_ID, or none), read the "
                    "node count, build the launch line for the system, print it and run it. "
                    "Returns the launcher's exit status.",
        usage="hpctrain launch [--system NAME] [--dry-run] [options] -- train RECIPE [overrides]",
        epilog=_JOB_EPILOG + " Without a batch system: `mpiexec -n <ranks>` on this machine, "
               "one rank per CPU core unless --ranks says otherwise.")
    p.add_argument("--system", metavar="NAME", help="default: $HPCTRAIN_SYSTEM (set by job "
                   "scripts), else pbs, slurm or local after the detected batch system")
    p.add_argument("--dry-run", action="store_true", help="print the launch line, run nothing")
    p.add_argument("--nodes", type=int, metavar="N",
                   help="node count (default: from the allocation; lets --dry-run preview)")
    p.add_argument("--ranks-per-node", type=int, metavar="N")
    p.add_argument("--ranks", type=int, metavar="N", help="ranks on this machine (local only)")
    p.add_argument("--srun-mpi", metavar="PLUGIN", help="srun's --mpi= plugin (default: the "
                   "system's; auto chooses it for the MPI library mpi4py loads)")
    p.add_argument("--profile", choices=["nsys"], help="run local rank 0 under nsys")


def _add_ckpt(sub) -> None:
    p = sub.add_parser("ckpt", help="inspect, merge, reshard, export or import a sharded "
                                    "checkpoint",
                       description="Work with a sharded checkpoint (a run's out_dir, its "
                                   "checkpoints/ folder, or one checkpoints/step_N) on one "
                                   "process. Any checkpoint loads at any world size and ZeRO "
                                   "stage with `hpctrain train ... --train.resume=PATH`, or "
                                   "starts a new run from its weights with "
                                   "--train.init_from=PATH.")
    acts = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    a = acts.add_parser("inspect", help="step, layout, model, shards")
    a.add_argument("path")
    a.add_argument("--verify", action="store_true", help="read every shard, check CRC-32s")
    a = acts.add_parser("merge", help="all shards into one HDF5 file (the final.h5 format)")
    a.add_argument("path")
    a.add_argument("--output", required=True, metavar="FILE.h5")
    a = acts.add_parser("reshard", help="rewrite for another world size / ZeRO stage, so "
                                        "that each rank reads only its own shard")
    a.add_argument("path")
    a.add_argument("--world", type=int, required=True, metavar="N")
    a.add_argument("--zero", type=int, required=True, choices=[0, 1, 2, 3])
    a.add_argument("--bucket-mb", type=float, default=25.0,
                   help="as --parallel.bucket_mb of the run that will resume (default 25)")
    a.add_argument("--first-bucket-mb", type=float, default=1.0)
    a.add_argument("--output", required=True, metavar="DIR")
    a = acts.add_parser("export", help="weights as safetensors, or a Hugging Face GPT-2 "
                                       "or Llama directory (config.json + model.safetensors)")
    a.add_argument("path")
    a.add_argument("--format", choices=["safetensors", "hf"], default="hf")
    a.add_argument("--output", required=True, metavar="FILE_OR_DIR")
    a = acts.add_parser("import", help="a Hugging Face GPT-2 or Llama directory as a "
                                       "checkpoint to fine-tune (--train.init_from)",
                        description="Read DIR's config.json, its safetensors weights (one "
                                    "file or an index with shards; pickle files are refused) "
                                    "and its tokenizer.json, and write a sharded checkpoint: "
                                    "step 0, weights only, fp32.")
    a.add_argument("source", metavar="DIR")
    a.add_argument("--from", dest="source_format", choices=["hf"], required=True,
                   help="the source's format: hf (a Hugging Face model directory)")
    a.add_argument("--output", required=True, metavar="DIR")
    a.add_argument("--vocab-multiple", type=int, default=1, metavar="N",
                   help="pad the vocabulary rows to a multiple of N (default 1, none; "
                        "--train.init_from pads to the run's --model.vocab_multiple anyway)")


def _add_scale(sub) -> None:
    p = sub.add_parser("scale", help="scaling studies: run a sweep, report it, calibrate the "
                                     "performance model",
                       description="Scaling studies from a TOML sweep spec (see "
                                   "perf/studies/local.toml): run every point, write one JSON "
                                   "record per run, build a Markdown/HTML report with plots.")
    acts = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    a = acts.add_parser("run", help="run every point of a study (or write job scripts)",
                        description="Run each point with the system's launcher under a time "
                                    "limit; a failed point is recorded and the study goes on. "
                                    "With --jobs DIR nothing runs: job scripts are written.")
    a.add_argument("study", metavar="STUDY.toml")
    a.add_argument("--out", metavar="DIR", help="records and runs go here "
                   "(default: runs/study-<name>)")
    a.add_argument("--launch-system", metavar="NAME", default=None,
                   help="job profile whose launcher runs the points: local (default), or "
                        "polaris/aurora/... inside a job's allocation")
    a.add_argument("--quiet-wait", type=float, default=0.0, metavar="S",
                   help="before each run wait up to S seconds until other processes leave "
                        "the cores alone (a shared machine); the busy cores are recorded")
    a.add_argument("--jobs", metavar="DIR", help="write job scripts here instead of running")
    a.add_argument("--one-job", action="store_true", help="with --jobs: one script that runs "
                   "all points on one allocation (the largest point's nodes)")
    for flag, hint in (("--system", "job profile for --jobs (polaris, aurora, ...)"),
                       ("--account", "project to charge"), ("--queue", "queue"),
                       ("--walltime", "HH:MM:SS per job")):
        a.add_argument(flag, help=hint)
    a.add_argument("--venv", metavar="DIR", help="environment the jobs activate")
    a = acts.add_parser("report", help="tables and plots from a study's records",
                        description="Write DIR/report.md, DIR/report.html and DIR/plots/*.png "
                                    "from DIR/records/*.json.")
    a.add_argument("folder", metavar="DIR")
    a = acts.add_parser("calibrate", help="measure this machine for the performance model",
                        description="Time forward+backward per model shape, AdamW, and the "
                                    "collectives at each rank count (under mpiexec); write a "
                                    "calibration file that studies and plan use.")
    a.add_argument("study", nargs="?", metavar="STUDY.toml",
                   help="calibrate for this study's model shapes, dtype and rank counts")
    a.add_argument("--output", required=True, metavar="FILE.json")
    a.add_argument("--ranks", type=int, nargs="+", metavar="N",
                   help="group sizes for the collectives (default: the study's, else 2 4)")
    a.add_argument("--model", default="default", metavar="NAME",
                   help="model preset to calibrate without a study (default: default)")


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="rank the parallel layouts of a model on N nodes by "
                                    "predicted step time",
                       description="Enumerate (dp, pp, ZeRO stage, micro-batches) layouts that "
                                   "fit device memory, predict each step with the performance "
                                   "model and print them fastest first.")
    p.add_argument("--system", required=True, metavar="NAME",
                   help="polaris, aurora, local, or a .toml performance profile")
    p.add_argument("--nodes", type=int, required=True, metavar="N")
    p.add_argument("--model", required=True, metavar="NAME",
                   help="gpt2, gpt2-medium, gpt2-large, gpt2-xl, gpt3-2.7b, gpt3-6.7b, "
                        "gpt3-13b, llama3-8b, default")
    p.add_argument("--global-batch", type=int, default=0, metavar="SEQ",
                   help="sequences per optimizer step (default: 512, GPT-2's, or one per "
                        "rank when there are more ranks)")
    p.add_argument("--seq-len", type=int, default=0, metavar="T",
                   help="context length (default: the model's)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--recompute", default="none", choices=["none", "block"],
                   help="as --model.recompute: block keeps only each layer's input (a third "
                        "more compute)")
    p.add_argument("--loss-chunk", type=int, default=0, metavar="N",
                   help="as --model.loss_chunk: the head's logits N tokens at a time "
                        "(default 0: all at once)")
    p.add_argument("--ranks-per-node", type=int, default=0, metavar="N",
                   help="default: the system's (one per GPU or tile)")
    p.add_argument("--calibration", metavar="FILE.json", help="measured numbers to use")
    p.add_argument("--top", type=int, default=12, metavar="K", help="rows to print")
    p.add_argument("--explain", nargs="?", const=1, type=int, metavar="RANK",
                   help="show the terms of the layout ranked RANK (default 1)")


def _add_doctor(sub) -> None:
    p = sub.add_parser(
        "doctor", help="check this node: devices, MPI, allreduce, bf16 p2p, a training step",
        description="An acceptance check to run with mpiexec in a one-node job before "
                    "training: each rank's device and CPU affinity, the MPI library and "
                    "thread level, GPU-aware MPI per vendor, allreduce of host and device "
                    "buffers (checked and timed), a bf16 round trip between rank pairs and "
                    "one GPT training step (tokens/s, MFU). Exits 1 naming any failed check.")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "xpu", "fake"],
                   help="as --train.device (fake: the CPU posing as a GPU)")
    p.add_argument("--gpu-aware", default="auto", choices=["auto", "yes", "no"],
                   help="as --comm.gpu_aware")
    p.add_argument("--sizes", type=float, nargs="+", default=[1.0, 25.0, 150.0],
                   metavar="MIB", help="allreduce sizes in MiB (default 1 25 150)")
    p.add_argument("--model", default="auto", choices=["auto", "small", "gpt2-124m"],
                   help="the training step's model (auto: gpt2-124m on a GPU, else small)")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON here")
    p.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="how long any wait may take before the job aborts (default 300)")


def cmd_doctor(args) -> int:
    from mpi4py import MPI

    from hpctrain.comm.abort import install_abort_handler
    from hpctrain.comm.world import World
    from hpctrain.doctor.run import run_doctor

    install_abort_handler(MPI.COMM_WORLD)
    world = World.create(MPI.COMM_WORLD, timeout=args.timeout, device=args.device,
                         gpu_aware=args.gpu_aware, system=os.environ.get("HPCTRAIN_SYSTEM"))
    try:
        return run_doctor(world, sizes_mib=args.sizes, model=args.model, json_path=args.json,
                          out=lambda line: print(line, flush=True))
    finally:
        world.close()


def cmd_ckpt(args) -> int:
    from hpctrain.checkpoint import tools

    if args.action == "inspect":
        print(tools.inspect(args.path, verify=args.verify))
    elif args.action == "merge":
        print(f"wrote {tools.merge(args.path, args.output)}")
    elif args.action == "reshard":
        out = tools.reshard(args.path, args.output, world=args.world, zero=args.zero,
                            bucket_mb=args.bucket_mb, first_bucket_mb=args.first_bucket_mb)
        print(f"wrote {out}: resume with mpiexec -n {args.world} hpctrain train ... "
              f"--parallel.zero={args.zero} --train.resume={out}")
    elif args.action == "import":
        _import(args)
    else:
        print(f"wrote {tools.export(args.path, args.format, args.output)}")
    return 0


def _import(args) -> None:
    import shlex

    from hpctrain.checkpoint.hf_import import import_hf
    from hpctrain.checkpoint.weights import model_options

    done = import_hf(args.source, args.output, vocab_multiple=args.vocab_multiple)
    for note in done.notes:
        print(f"note: {note}")
    m = done.model
    print(f"wrote {done.path}: {m['arch']}, {m['n_layer']} layers, {done.n_params:,} "
          "parameters (fp32, step 0, weights only)")
    print(f"fine-tune it: hpctrain train RECIPE --data.path=DATA.h5 "
          f"{shlex.quote(f'--train.init_from={done.path}')} {' '.join(model_options(m))} "
          "(a shorter --model.block_size is fine)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpctrain", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_prepare(sub)
    _add_train(sub)
    _add_sample(sub)
    _add_jobscript(sub)
    _add_launch(sub)
    _add_ckpt(sub)
    _add_scale(sub)
    _add_plan(sub)
    _add_doctor(sub)
    return parser


def _version() -> str:
    from hpctrain import __version__

    return f"hpctrain {__version__}"


def cmd_prepare(args) -> int:
    from hpctrain.config import parse_hints
    from hpctrain.data.corpus import DEFAULT_BYTES, stdlib_files
    from hpctrain.data.prepare import combine, prepare

    hints = parse_hints(args.romio_hints)
    if args.combine:  # a few metadata reads: one process does it
        from hpctrain.comm.abort import env_rank

        if env_rank() == 0:
            s = combine(args.combine, args.output, overwrite=args.overwrite)
            print(f"wrote manifest {s['output']}: {s['shards']} shard(s), "
                  f"{s['train_tokens']:,} train / {s['val_tokens']:,} val tokens")
        return 0
    comm = None
    if _launched_by_mpi():  # every rank takes part; one rank's failure ends the job
        from mpi4py import MPI

        from hpctrain.comm.abort import install_abort_handler

        comm = MPI.COMM_WORLD
        install_abort_handler(comm)
    from hpctrain.comm.world_check import check_world_size

    check_world_size(1 if comm is None else comm.Get_size())  # srun copies: one message
    root = comm is None or comm.Get_rank() == 0
    inputs = args.input or stdlib_files(args.max_bytes or DEFAULT_BYTES)
    show = root and (sys.stderr.isatty() or (comm is not None and comm.Get_size() > 1))
    s = prepare(inputs, args.output, tokenizer=args.tokenizer, val_fraction=args.val_fraction,
                show_progress=show, comm=comm, romio_hints=hints, overwrite=args.overwrite,
                timeout=args.timeout)
    if root:
        print(f"prepared {s['output']}: {s['files']} file(s), {s['tokens']:,} "
              f"tokens ({s['train_tokens']:,} train / {s['val_tokens']:,} val), "
              f"{s['tokenizer']} vocabulary of {s['vocab_size']}, {s['ranks']} rank(s)")
    return 0


def _launched_by_mpi() -> bool:
    """Whether an MPI launcher started this process (then prepare runs on all ranks; on
    its own it runs without initializing MPI, e.g. on a login node)."""

    return any(name in os.environ for name in
               ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "PALS_RANKID", "PMI_SIZE"))


def cmd_train(args, overrides: list[str]) -> int:
    from hpctrain.config import describe_options, recipe_names

    if args.help:
        print("usage: hpctrain train RECIPE [--section.key=value ...]\n\n"
              f"built-in recipes: {', '.join(recipe_names())}\n\noptions:\n"
              + describe_options())
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
        signals.restore()  # for callers of main() in-process; a process just exits


def _train(args, overrides: list[str], signals) -> int:
    from hpctrain.config import check_out_dir, load_config

    cfg = load_config(args.recipe, overrides)
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=1))
        return 0
    check_out_dir(cfg.train.out_dir)  # on every rank, before MPI: one message, no hang

    from mpi4py import MPI

    from hpctrain.comm.abort import install_abort_handler
    from hpctrain.comm.world_check import check_world_size
    from hpctrain.comm.world import World
    from hpctrain.train.trainer import Trainer

    install_abort_handler(MPI.COMM_WORLD)
    check_world_size(MPI.COMM_WORLD.Get_size())
    world = World.create(MPI.COMM_WORLD, timeout=cfg.comm.timeout, device=cfg.train.device,
                         gpu_aware=cfg.comm.gpu_aware, system=os.environ.get("HPCTRAIN_SYSTEM"))
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
    print(model.complete(tok, args.prompt, args.tokens, temperature=args.temperature,
                         top_k=args.top_k or None, seed=args.seed))
    return 0


def cmd_jobscript(args, command: list[str]) -> int:
    from hpctrain.jobs.render import SUBMIT, render, write_script
    from hpctrain.jobs.spec import build_spec
    from hpctrain.jobs.job_system import describe_systems

    if args.list_systems:
        print(describe_systems())
        return 0
    if args.doctor:
        if command and command[0] != "doctor":
            raise UserError("--doctor runs `hpctrain doctor` instead of a command: drop "
                            f"'-- {' '.join(command)}'")
        command = command or ["doctor"]
    spec = build_spec(system=args.system, command=command, nodes=args.nodes,
                      walltime=args.walltime, queue=args.queue, account=args.account,
                      job_name=args.job_name, filesystems=args.filesystems, env=args.env,
                      array=args.array, profiler=args.profile,
                      ranks_per_node=args.ranks_per_node, venv=args.venv,
                      setup_file=args.setup, run_root=args.run_root,
                      check_queue=not args.no_queue_check, srun_mpi=args.srun_mpi)
    text = render(spec)  # validated and rendered in full before anything is written
    if not args.output:
        sys.stdout.write(text)
        return 0
    path = write_script(args.output, text)
    p = spec.system
    where = f", queue {spec.queue}" if spec.queue else ""
    when = f", walltime {spec.walltime}" if spec.walltime else ""
    rpn = spec.ranks_per_node or p.launch.ranks_per_node or "one per core"
    print(f"wrote {path}: {p.name}, {spec.nodes} node(s) x {rpn} rank(s){where}{when}")
    print(f"submit it from the directory its relative paths refer to:  "
          f"{SUBMIT[p.batch.scheduler]} {path}")
    result = "doctor.json" if spec.command[0] == "doctor" else "metrics.jsonl"
    print(f"results: {spec.run_root}/{spec.job_name}-<job id>/{result}")
    return 0


def cmd_launch(args, command: list[str]) -> int:

    from hpctrain.jobs.command import check_command
    from hpctrain.jobs.launch_line import detect_allocation, plan_launch, run_launch
    from hpctrain.jobs.job_system import job_system, srun_mpi

    check_command(command)
    if args.srun_mpi is not None:
        srun_mpi(args.srun_mpi)
    alloc = detect_allocation()
    system = args.system or os.environ.get("HPCTRAIN_SYSTEM") or \
        {"pbs": "pbs", "slurm": "slurm", "none": "local"}[alloc.scheduler]
    argv = plan_launch(job_system(system), alloc, command, nodes=args.nodes,
                       ranks_per_node=args.ranks_per_node, ranks=args.ranks,
                       profiler=args.profile, srun_mpi=args.srun_mpi)
    return run_launch(argv, dry_run=args.dry_run)


def _split_job_command(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """``jobscript``/``launch`` take the command to run after ``--``: split it off whole,
    so that its options never reach argparse."""
    if argv and argv[0] in _JOB_COMMANDS and "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, None


def _mpi_world_if_running():
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi.COMM_WORLD
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    argv, job_command = _split_job_command(argv)
    args, extra = parser.parse_known_args(argv)
    try:
        if args.command == "train":
            return cmd_train(args, extra)
        if extra and args.command in _JOB_COMMANDS:
            raise UserError(f"unrecognized arguments: {' '.join(extra)}; the command to run "
                            f"goes after '--': hpctrain {args.command} [options] -- train "
                            "RECIPE [--section.key=value ...]")
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        if args.command == "jobscript":
            return cmd_jobscript(args, job_command or [])
        if args.command == "launch":
            return cmd_launch(args, job_command or [])
        if args.command == "prepare":
            return cmd_prepare(args)
        if args.command == "ckpt":
            return cmd_ckpt(args)
        if args.command == "doctor":
            return cmd_doctor(args)
        if args.command == "scale":
            from hpctrain.scaling.commands import cmd_scale

            return cmd_scale(args)
        if args.command == "plan":
            from hpctrain.scaling.commands import cmd_plan

            return cmd_plan(args)
        return cmd_sample(args)
    except UserError as exc:
        from hpctrain.comm.abort import abort_job, env_rank

        comm = _mpi_world_if_running()
        if comm is not None and comm.Get_size() > 1:
            abort_job(comm, exc)  # other ranks may be waiting in a collective
        # Rank 0 speaks for the job; a 1-rank world speaks for itself (srun copies that
        # never joined one job each carry their own SLURM_PROCID).
        alone = (comm is not None and comm.Get_size() == 1) or isinstance(exc, LaunchMismatch)
        if env_rank() == 0 or alone:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
