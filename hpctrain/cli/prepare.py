"""``hpctrain prepare``: text -> one HDF5 token file, on one process or on every rank of an
``mpiexec`` (``hpctrain/data/prepare.py`` does the work)."""

from __future__ import annotations

import os
import signal
import sys


def add_prepare(sub) -> None:
    p = sub.add_parser(
        "prepare", help="tokenize text or records files, or convert nanoGPT or Megatron "
                        "token files, into an HDF5 token file (in parallel under mpiexec)",
        description="Tokenize text into the HDF5 token format (io/FORMAT.md). Under "
                    "`mpiexec -n N` the input (files, JSON-lines byte ranges, Parquet row "
                    "groups) is shared out among the ranks, tokenized in "
                    "parallel and written into one file with MPI-IO; the file is the same "
                    "for any N. With --format, token files made by nanoGPT or Megatron-LM "
                    "are converted instead, their ids checked, in parallel alike.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", metavar="PATH",
                     help="text files, records files (.jsonl, .json, .jsonl.gz, .jsonl.zst, "
                          ".parquet, .arrow: one document each), directories (a dataset "
                          "directory's records files, else all files, sorted) or globs")
    src.add_argument("--corpus", choices=["stdlib"],
                     help="built-in corpus: 'stdlib' = this Python's standard library sources")
    src.add_argument("--combine", nargs="+", metavar="FILE.h5",
                     help="prepared token files (same tokenizer) to list in a manifest "
                          "(--output NAME.json): one dataset, each split the files' splits "
                          "in order")
    p.add_argument("--output", required=True, metavar="FILE.h5")
    p.add_argument("--tokenizer", default=None, metavar="NAME",
                   help="char (vocabulary from the text; the default), byte (256), gpt2 "
                        "(GPT-2 BPE via tiktoken, from its local cache), or hf:DIR (the "
                        "Hugging Face tokenizer.json in DIR, e.g. the model directory you "
                        "import)")
    p.add_argument("--format", default=None, choices=TOKEN_FORMATS,
                   help="--input is already tokenized: nanogpt-bin (nanoGPT's raw uint16 "
                        "train.bin and val.bin, or one .bin split at end-of-text ids) or "
                        "megatron (Megatron-LM's PREFIX.bin + PREFIX.idx); converted, not "
                        "tokenized again (io/README.md, Bring your own tokens)")
    p.add_argument("--vocab-size", type=int, default=None, metavar="N",
                   help="with --format: the tokenizer's vocabulary size, above every id "
                        "(default for nanogpt-bin: GPT-2's 50257; megatron needs it)")
    p.add_argument("--eot-id", type=int, default=None, metavar="ID",
                   help="with --format: the end-of-text id between documents (default "
                        "50256, GPT-2's, when the vocabulary is 50257); GPT-2's 50257 and "
                        "50256 record the gpt2 tokenizer, so samples decode")
    p.add_argument("--text-field", default="text", metavar="NAME",
                   help="the key (JSON lines) or column (Parquet, Arrow) holding each "
                        "document's text (default: text)")
    p.add_argument("--on-bad-record", choices=["fail", "skip"], default="fail",
                   help="a record that is not valid JSON, lacks the text field, holds no "
                        "string there, or is not UTF-8: fail the command before writing "
                        "anything, naming the first ones (default), or leave it out")
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


TOKEN_FORMATS = ("nanogpt-bin", "megatron")  # hpctrain/data/token_import.py FORMATS


def check_format_options(args) -> None:
    """``--format`` converts token files: it takes ``--input`` and no ``--tokenizer``
    (the tokens are made); ``--vocab-size`` and ``--eot-id`` belong to it alone."""
    from hpctrain.errors import UserError

    if args.format is None:
        for option, value in (("--vocab-size", args.vocab_size), ("--eot-id", args.eot_id)):
            if value is not None:
                raise UserError(f"{option} describes tokens converted with --format "
                                "nanogpt-bin|megatron; text takes its vocabulary from "
                                "--tokenizer")
        return
    if args.tokenizer is not None:
        raise UserError(f"--format {args.format} converts tokens made already, so there is "
                        "nothing for --tokenizer to do; drop it (state --vocab-size and "
                        "--eot-id instead)")
    if not args.input:
        raise UserError(f"--format {args.format} converts the files given with --input, not "
                        "--corpus or --combine")


class Stopped(Exception):
    """A signal that ends ``prepare``: raised, not the default action, so that its spill
    files are removed on the way out (the default action left them, 100 MB a rank)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum, _frame) -> None:
    raise Stopped(signum)


def cmd_prepare(args) -> int:
    from hpctrain.config import parse_hints
    from hpctrain.data.corpus import DEFAULT_BYTES, stdlib_files
    from hpctrain.data.prepare import combine, prepare

    check_format_options(args)
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
        from hpctrain.comm.abort import install_abort_handler
        from hpctrain.comm.mpi import MPI  # checks the launcher is this MPI's first

        comm = MPI.COMM_WORLD
        install_abort_handler(comm)
    from hpctrain.comm.world_check import check_world_size

    check_world_size(1 if comm is None else comm.Get_size())  # srun copies: one message
    root = comm is None or comm.Get_rank() == 0
    inputs = args.input or stdlib_files(args.max_bytes or DEFAULT_BYTES)
    show = root and (sys.stderr.isatty() or (comm is not None and comm.Get_size() > 1))
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        if args.format:
            from hpctrain.data.token_import import import_tokens

            s = import_tokens(inputs, args.output, fmt=args.format, vocab_size=args.vocab_size,
                              eot_id=args.eot_id, val_fraction=args.val_fraction, comm=comm,
                              romio_hints=hints, overwrite=args.overwrite,
                              timeout=args.timeout)
        else:
            s = prepare(inputs, args.output, tokenizer=args.tokenizer or "char",
                        val_fraction=args.val_fraction, show_progress=show, comm=comm,
                        romio_hints=hints, overwrite=args.overwrite, timeout=args.timeout,
                        text_field=args.text_field, on_bad_record=args.on_bad_record)
    except Stopped as stop:  # the spill files went on the way out (prepare's finally)
        print(f"prepare: stopped by {signal.Signals(stop.signum).name}; {args.output} was "
              "not written", file=sys.stderr)
        return 128 + stop.signum
    finally:
        signal.signal(signal.SIGTERM, previous)
    if root and s.get("bad_records"):  # records files only
        print(f"skipped {s['bad_records']:,} bad record(s); the first: "
              + "; ".join(s["bad_record_examples"]), file=sys.stderr)
    if root:
        verb = f"converted ({args.format})" if args.format else "prepared"
        print(f"{verb} {s['output']}: {s['files']} file(s), {s['tokens']:,} "
              f"tokens ({s['train_tokens']:,} train / {s['val_tokens']:,} val), "
              f"{s['tokenizer']} vocabulary of {s['vocab_size']}, {s['ranks']} rank(s)")
    return 0


def _launched_by_mpi() -> bool:
    """Whether an MPI launcher started this process (then prepare runs on all ranks; on
    its own it runs without initializing MPI, e.g. on a login node)."""

    return any(name in os.environ for name in
               ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "PALS_RANKID", "PMI_SIZE"))
