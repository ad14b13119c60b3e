"""What can be configured: one dataclass per section of a recipe, and ``Config``, which
holds them all.

Every field carries its help text (``opt(default, help)``, ``options.py``), so
``hpctrain train RECIPE --help`` can list them all. Each section checks itself in
``__post_init__``; every message names the fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from hpctrain.config.options import (AT_LEAST_0, AT_LEAST_1, FRACTION, POSITIVE, SHARE, Bounds,
                                     SwitchOrPath, check_fields, field_types, opt, parse_hints,
                                     parse_step_range, require)
from hpctrain.errors import ConfigError
from hpctrain.config.model_section import ModelConfig
from hpctrain.sizes import MAX_BATCH_TOKENS, MAX_CONTEXT, MAX_WAIT_S

MAX_TRACED_STEPS = 20
"""The most steps ``--train.profile`` traces (a trace grows by megabytes per rank and
step)."""

TRANSPORTS = ("auto", "mpi", "shm", "xccl")
"""``--comm.transport``'s values (``comm/transport.py`` has a transport for each)."""


@dataclass
class DataConfig:
    path: str = opt("", "prepared HDF5 token file (made by `hpctrain prepare`)")
    sampler: str = opt("epoch", "training order: 'epoch' = shuffled non-overlapping windows "
                                "(Megatron-LM), 'random' = uniform random starts (nanoGPT)",
                       ("epoch", "random"))
    verify: bool = opt(True, "check the file's CRC-32 blocks (in parallel) before training")
    reader: str = opt("auto", "how ranks read windows: 'mpiio' = collective MPI-IO reads at "
                              "the arrays' byte offsets, 'h5mpio' = parallel HDF5 (h5py "
                              "built with MPI), 'mmap' = a memory map per rank (no MPI-IO); "
                              "'auto' = h5mpio where h5py has MPI, else mpiio",
                      ("auto", "mpiio", "h5mpio", "mmap"))
    prefetch: bool = opt(True, "read the next step's batch in a background thread while "
                               "the current step computes")
    romio_hints: str = opt("", "ROMIO hints for MPI-IO, key=value,key=value (e.g. "
                               "romio_cb_read=enable,cb_nodes=8); empty keeps hpctrain's "
                               "defaults for random windows (see io/README.md)")
    local_copy_dir: str = opt("", "copy the dataset to this node-local directory first (one "
                                  "rank per node) and read it there, e.g. /local/scratch on "
                                  "Polaris")

    def __post_init__(self):
        _check_fields(self)
        try:
            parse_hints(self.romio_hints)
        except ConfigError as e:
            raise ConfigError(f"data.romio_hints: {e}") from None


@dataclass
class ParallelConfig:
    micro_batches: int = opt(1, "micro-batches per rank and step (gradient accumulation)",
                             bounds=AT_LEAST_1)
    bucket_mb: float = opt(25.0, "gradient bucket cap in MiB (PyTorch DDP's default)",
                           bounds=POSITIVE)
    first_bucket_mb: float = opt(1.0, "cap of the first bucket reduced, so that "
                                      "communication starts early in backward",
                                 bounds=POSITIVE)
    zero: int = opt(0, "ZeRO level: 0 replicates everything (plain data parallelism), 1 "
                       "shards optimizer state, 2 also gradients, 3 also parameters",
                    (0, 1, 2, 3))
    pp: int = opt(1, "pipeline stages: the model's layers are cut into pp stages, one per "
                     "rank of a pipeline; the ranks are dp x pp", bounds=AT_LEAST_1)
    schedule: str = opt("1f1b", "pipeline schedule (pp > 1): 1f1b (least activation "
                                "memory), gpipe (all forwards, then all backwards), "
                                "interleaved (virtual_stages chunks per rank: smaller "
                                "bubble, more messages), zb-h1 (zero bubble: backward "
                                "split into input and weight gradients, weights' passes "
                                "fill the bubble), zbv (zero bubble in a V: two chunks "
                                "per rank, rank 0 holding the first and the last; needs "
                                "micro_batches >= 2 pp)",
                    ("1f1b", "gpipe", "interleaved", "zb-h1", "zbv"))
    virtual_stages: int = opt(1, "model chunks per pipeline rank (interleaved schedule)",
                              bounds=AT_LEAST_1)
    pass_times: str = opt("", "relative times F,B,W of a model chunk's forward, "
                              "input-gradient and weight-gradient passes (e.g. 1,1.3,1.05), "
                              "which the zb-h1 and zbv orders are built for (unless the "
                              "equal-time order idles less with them); empty: equal. A "
                              "zero-bubble run on CPUs ends by printing the times it "
                              "measured")
    tp: int = opt(1, "tensor-parallel ranks: every layer's weights and work are split over "
                     "tp adjacent ranks (keep them on one node); the ranks are dp x pp x tp",
                  bounds=AT_LEAST_1)
    sequence_parallel: bool = opt(False, "with tp > 1, also split the norms and the residual "
                                         "stream along the sequence: activation memory per "
                                         "rank drops by tp, the same bytes move")
    cp: int = opt(1, "context-parallel ranks: each sequence is cut into 2 cp chunks, two per "
                     "rank, and attention runs as ring attention over the group (long "
                     "sequences: activation memory per rank drops by cp); the ranks are "
                     "dp x pp x cp x tp", bounds=AT_LEAST_1)
    ep: int = opt(1, "expert-parallel ranks: each MoE layer's experts are shared out over "
                     "ep consecutive data-parallel replicas, tokens reaching them by an "
                     "all-to-all (a divisor of dp and of model.moe_experts)",
                  bounds=AT_LEAST_1)

    def __post_init__(self):
        _check_fields(self)
        require(self.schedule == "interleaved" or self.virtual_stages == 1,
                 f"--parallel.virtual_stages={self.virtual_stages} needs "
                 "--parallel.schedule=interleaved" + (
                     " (zb-h1 runs one chunk per rank; --parallel.schedule=zbv places two "
                     "per rank itself)" if self.schedule in ("zb-h1", "zbv") else ""))
        require(self.schedule != "interleaved" or self.micro_batches % self.pp == 0,
                 f"the interleaved schedule takes micro-batches in groups of the {self.pp} "
                 f"stages; make --parallel.micro_batches (now {self.micro_batches}) a "
                 f"multiple of --parallel.pp={self.pp}")
        require(self.schedule != "zbv" or self.pp == 1 or self.micro_batches >= 2 * self.pp,
                f"the zbv schedule needs at least 2 x --parallel.pp = {2 * self.pp} "
                f"micro-batches to fill its V; raise --parallel.micro_batches (now "
                f"{self.micro_batches}) to {2 * self.pp} or more, or use "
                "--parallel.schedule=zb-h1")
        require(self.pass_time_ratios() is None or self.schedule in ("zb-h1", "zbv"),
                f"--parallel.pass_times orders the zero-bubble schedules (zb-h1, zbv); "
                f"the {self.schedule} schedule has no such order: leave it empty")
        require(self.tp > 1 or not self.sequence_parallel,
                "--parallel.sequence_parallel splits the sequence over the tensor-parallel "
                "ranks: it needs --parallel.tp > 1")

    def pass_time_ratios(self) -> tuple[float, float, float] | None:
        """``pass_times`` as (F, B, W); None when empty (equal times)."""
        if not self.pass_times.strip():
            return None
        try:
            values = tuple(float(x) for x in self.pass_times.split(","))
        except ValueError:
            values = ()
        require(len(values) == 3 and all(0 < v < float("inf") for v in values)
                and max(values) <= 1000 * min(values),
                f"--parallel.pass_times takes three positive numbers F,B,W within 1000x of "
                f"each other (a chunk's forward, input-gradient and weight-gradient pass, "
                f"e.g. 1,1.3,1.05), not {self.pass_times!r}")
        return values


@dataclass
class OptimConfig:
    name: str = opt("adamw", "optimizer: adamw (decoupled weight decay, fused kernel), or sgd "
                             "(plain gradient descent, no momentum: the update is lr x gradient, "
                             "so any error in the gradient's scale shows at the first step)",
                    ("adamw", "sgd"))
    lr: float = opt(1e-3, "peak learning rate", bounds=POSITIVE)
    min_lr: float = opt(1e-4, "learning rate at the end of the decay (cosine or wsd)",
                         bounds=AT_LEAST_0)
    warmup_iters: int = opt(100, "linear warm-up steps", bounds=AT_LEAST_0)
    lr_decay_iters: int = opt(0, "the step the decay ends at (min_lr from there on); 0 means "
                                 "train.max_iters", bounds=AT_LEAST_0)
    schedule: str = opt("cosine", "learning-rate schedule after the warm-up: cosine (decay "
                                  "to min_lr), wsd (warmup-stable-decay: lr held, then a "
                                  "linear decay over the last --optim.decay_fraction), "
                                  "constant", ("cosine", "wsd", "constant"))
    decay_fraction: float = opt(0.2, "wsd: the share of the steps after the warm-up spent "
                                     "decaying to min_lr (the last ones)", bounds=SHARE)
    weight_decay: float = opt(0.1, "AdamW weight decay (matrices and embeddings only)",
                               bounds=AT_LEAST_0)
    beta1: float = opt(0.9, "AdamW beta1", bounds=FRACTION)
    beta2: float = opt(0.99, "AdamW beta2", bounds=FRACTION)
    eps: float = opt(1e-8, "AdamW epsilon", bounds=POSITIVE)
    grad_clip: float = opt(1.0, "clip the global gradient norm to this; 0 disables",
                            bounds=AT_LEAST_0)

    def __post_init__(self):
        _check_fields(self)
        require(self.min_lr <= self.lr, "optim.min_lr must be in [0, optim.lr]")


@dataclass
class TrainConfig:
    batch_size: int = opt(12, "global batch in sequences (all ranks and micro-batches)",
                         bounds=AT_LEAST_1)
    max_iters: int = opt(2000, "optimizer steps to train", bounds=AT_LEAST_0)
    log_interval: int = opt(10, "steps between log lines and metrics.jsonl records",
                           bounds=AT_LEAST_1)
    eval_interval: int = opt(250, "steps between validation estimates; 0 disables",
                            bounds=AT_LEAST_0)
    eval_iters: int = opt(20, "batches per validation estimate", bounds=AT_LEAST_1)
    final_eval: bool = opt(True, "evaluate on the validation split at the end (its size: "
                                 "--train.final_eval_batches)")
    final_eval_batches: int = opt(100, "the final evaluation's size: at most this many "
                                       "batches of 64 windows, spread evenly over the "
                                       "validation split (the same windows at any rank "
                                       "count); 0 takes every window", bounds=AT_LEAST_0)
    out_dir: str = opt("runs/default", "where metrics.jsonl, the checkpoint and the "
                                       "sample are written")
    tensorboard: SwitchOrPath = opt("false", "also write metrics.jsonl's numbers as TensorBoard "
                                    "scalars, from rank 0 (needs `pip install "
                                    "tensorboard`): 'true' into <out_dir>/tensorboard, a "
                                    "path into that folder, 'false' not at all")
    seed: int = opt(1337, "seed for initialization and data order",
                   bounds=Bounds(0, 2**64 - 1))  # numpy's SeedSequence, torch.manual_seed
    dtype: str = opt("fp32", "compute precision; bf16 keeps fp32 master weights and Adam "
                              "moments and reduces gradients in fp32", ("fp32", "bf16"))
    peak_tflops: float = opt(0.0, "device peak TFLOP/s for MFU; 0 looks the device up",
                             bounds=AT_LEAST_0)
    threads: int = opt(0, "CPU threads per rank; 0 = OMP_NUM_THREADS or cores/ranks",
                      bounds=AT_LEAST_0)
    # -- the device (hpctrain/comm/device.py)
    device: str = opt("auto", "where each rank computes: auto = the GPU it sees (cuda: "
                              "NVIDIA or AMD ROCm; xpu: Intel) else the CPU, but an error "
                              "where HPCTRAIN_SYSTEM promises GPUs and none is visible; "
                              "fake = the CPU posing as a GPU (tests the GPU code paths)",
                      ("auto", "cpu", "cuda", "xpu", "fake"))
    sample_tokens: int = opt(200, "tokens generated from the final model; 0 skips",
                            bounds=Bounds(0, MAX_CONTEXT))
    sample_prompt: str = opt("\n", "prompt for the final sample")
    save_checkpoint: bool = opt(True, "write <out_dir>/final.h5 and a sharded checkpoint "
                                      "at the end")
    ckpt_interval: int = opt(0, "steps between sharded checkpoints in <out_dir>/checkpoints "
                                "(0: only at the end)", bounds=AT_LEAST_0)
    ckpt_async: bool = opt(False, "periodic checkpoints are asynchronous: the state is "
                                  "copied into host memory (pinned on GPUs, kept for the "
                                  "run) and a thread writes it while training goes on; one "
                                  "save in flight at most, the next save, a stop and the "
                                  "end wait for it; synchronous, with one warning, where "
                                  "the copy would not fit in memory")
    ckpt_files: str = opt("rank", "files of a sharded checkpoint: rank = one per rank; node = "
                                  "one per node, written by its first rank (fewer files for "
                                  "the file system's metadata servers at scale)",
                          ("rank", "node"))
    ckpt_keep: int = opt(3, "sharded checkpoints kept (the oldest are deleted); 0 keeps all",
                        bounds=AT_LEAST_0)
    resume: str = opt("", "'auto' continues from <out_dir>/checkpoints/latest when it "
                          "exists; a path resumes from that checkpoint (any world size or "
                          "ZeRO level); '' starts fresh")
    init_from: str = opt("", "start a new run (step 0, fresh optimizer and learning-rate "
                             "schedule) from the weights of this checkpoint: one `hpctrain "
                             "ckpt import` wrote, a run's out_dir or final.h5, or a "
                             "checkpoints/step_N (any layout); the --model.* options must "
                             "describe its model (the vocabulary padding may differ). With "
                             "--train.resume=auto a checkpoint in out_dir wins, so a "
                             "requeued job continues instead of starting over")
    overwrite: bool = opt(False, "start fresh in an out_dir that holds an earlier run: its "
                                 "outputs are moved into <out_dir>/previous-<time>/ "
                                 "(nothing is deleted)")
    on_nonfinite: str = opt("abort", "a step whose gradient norm is NaN or inf: 'abort' the "
                                     "job, or 'skip' the update and go on",
                            ("abort", "skip"))
    max_skipped_steps: int = opt(10, "with on_nonfinite=skip: stop the run (exit 2, the last "
                                     "good checkpoint kept) after this many skipped steps "
                                     "in a row", bounds=AT_LEAST_1)
    stop_check_steps: int = opt(1, "steps between the ranks' agreements on a stop signal "
                                   "(SIGTERM/SIGUSR1): a signal is acted on within twice "
                                   "this many steps", bounds=AT_LEAST_1)
    time_limit: float = opt(0.0, "seconds the job may run, counted from its start "
                                 "($HPCTRAIN_JOB_START, which generated job scripts set, "
                                 "else the process start): training saves and stops early "
                                 "enough to finish the save within it; 0 = no limit "
                                 "(Slurm's $SLURM_JOB_END_TIME counts too)",
                            bounds=AT_LEAST_0)
    progress: bool = opt(True, "show a progress bar on rank 0")
    tf32: bool = opt(True, "let fp32 matrix multiplies use TF32 tensor cores on GPUs "
                           "(no effect on CPUs, or on bf16 compute)")
    compile: bool = opt(False, "compile each transformer block, and the head with its loss, "
                               "with torch.compile (minutes of compilation at the first "
                               "step, then faster steps on GPUs)")
    wandb: str = opt("off", "also log metrics.jsonl's numbers and the config to Weights & "
                            "Biases, from rank 0 (needs `pip install 'hpctrain[wandb]'`): "
                            "'offline' into <out_dir>/wandb (the run's end prints the `wandb "
                            "sync` command to run where there is network), 'online' to the "
                            "server as it goes, 'off' not at all", ("off", "offline", "online"))
    wandb_project: str = opt("hpctrain", "the W&B project of --train.wandb's run")
    wandb_name: str = opt("", "the W&B run's name; '' takes out_dir's last folder name")
    profile: str = opt("", "steps to trace with the torch profiler, e.g. '20-22' or '20' "
                           "(1-based, at most 20 steps): each rank writes <out_dir>/trace/"
                           "rank<r>.json (Perfetto or chrome://tracing) and `hpctrain "
                           "report` summarises the top kernels and the idle share per rank; "
                           "'' traces nothing")
    fp8: bool = opt(False, "compute the transformer blocks' linear layers (not the head) "
                           "in FP8 with dynamic scaling (torchao's float8 training; master "
                           "weights, gradients and their reductions stay as --train.dtype "
                           "has them); needs --train.dtype=bf16 and a GPU with FP8 units "
                           "(NVIDIA compute capability 8.9 or newer, AMD MI300-class); "
                           "`pip install 'hpctrain[gpu]'`; --train.device=fake emulates it")

    @property
    def traced_steps(self) -> range:
        """The 1-based steps ``--train.profile`` names (at most ``MAX_TRACED_STEPS``)."""
        return parse_step_range("train.profile", self.profile, MAX_TRACED_STEPS)

    def __post_init__(self):
        _check_fields(self)
        require(self.out_dir != "", "train.out_dir must name a directory")
        require(self.tensorboard.strip() != "", "train.tensorboard must be true, false or "
                                                "the folder to write the event files into")
        traced = self.traced_steps
        require(not traced or traced[-1] <= self.max_iters, f"--train.profile={self.profile} "
                f"traces step {traced[-1] if traced else 0}, but the run ends at step "
                f"{self.max_iters} (--train.max_iters): trace steps up to {self.max_iters}, "
                "or raise --train.max_iters")
        require(not self.fp8 or self.dtype == "bf16", "--train.fp8=true computes in FP8 "
                "beside bf16 activations: add --train.dtype=bf16")
        require(self.wandb_project.strip() != "", "train.wandb_project must name a W&B project")
        require(not (self.ckpt_async and self.ckpt_files == "node"), "--train.ckpt_async "
                "writes from a thread, which makes no MPI call, and --train.ckpt_files=node "
                "hands shards over MPI: drop one of them (--train.ckpt_files=rank)")
        require(not self.init_from or self.resume in ("", "auto"),
                 f"--train.resume={self.resume} continues a run and --train.init_from="
                 f"{self.init_from} starts a new one from weights; give one of them (or "
                 "--train.resume=auto with init_from: resume when out_dir has a checkpoint)")


@dataclass
class CommConfig:
    timeout: float = opt(300.0, "seconds any MPI wait may take before the job aborts",
                        bounds=Bounds(0, MAX_WAIT_S, low_open=True))
    gpu_aware: str = opt("auto", "hand device memory to MPI directly (yes) or through host "
                                 "buffers (no); auto asks the MPI library about this "
                                 "device's vendor (CUDA, ROCm, Level Zero)",
                         ("auto", "yes", "no"))
    transport: str = opt("auto", "how gradient buckets, ZeRO shards and parameters move "
                                 "(comm/transport.py): mpi (MPI collectives only), shm (as "
                                 "mpi, but plain data parallelism sums CPU gradients in the "
                                 "node's shared memory, with MPI between nodes; an error "
                                 "where it cannot work), xccl (the device's collective "
                                 "library through torch.distributed: NCCL, RCCL, oneCCL; "
                                 "gloo on CPUs); auto takes xccl on GPUs whose library torch "
                                 "has, else shm where every node holds the same number (>1) "
                                 "of ranks and /dev/shm has room, else mpi",
                         TRANSPORTS)

    @property
    def collectives(self) -> str:
        """The world's bulk transport (``World.create``): xccl, mpi (also under shm) or
        auto."""
        return "mpi" if self.transport == "shm" else self.transport

    @property
    def allreduce(self) -> str:
        """How plain data parallelism sums (``use_shared_memory``): shm, mpi or auto
        (xccl: the device library sums, never the shared memory)."""
        return self.transport if self.transport in ("shm", "mpi") else "auto"

    def __post_init__(self):
        _check_fields(self)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    comm: CommConfig = field(default_factory=CommConfig)

    def __post_init__(self):
        p, t = self.parallel, self.train
        require(t.batch_size * self.model.block_size <= MAX_BATCH_TOKENS,
                 f"train.batch_size={t.batch_size} sequences of model.block_size="
                 f"{self.model.block_size} tokens are more than {MAX_BATCH_TOKENS} tokens per "
                 "step; lower --train.batch_size")
        require(self.comm.transport != "shm" or (p.zero == 0 and t.dtype == "fp32"),
                 "--comm.transport=shm is the plain data-parallel path (fp32, ZeRO level "
                 "0); ZeRO levels and bf16 reduce with MPI collectives: use "
                 "--comm.transport=auto or mpi")
        if p.cp > 1:
            self._check_context_parallel()
        if p.pp == 1:
            return
        # What the pipeline path does not do (yet); each message names the way out.
        require(p.zero <= 1, f"--parallel.pp={p.pp} combines with ZeRO level 0 or 1 along "
                 "the data-parallel axis; use --parallel.zero=0 or 1 (levels 2-3 shard "
                 "gradients per micro-batch, which the pipeline does not support)")
        chunks = 2 if p.schedule == "zbv" else p.virtual_stages
        require(self.model.n_layer >= p.pp * chunks,
                 f"model.n_layer={self.model.n_layer} cannot fill {p.pp} stage(s) x "
                 f"{chunks} chunk(s) each; lower --parallel.pp or "
                 "--parallel.virtual_stages, or use more layers")

    def _check_context_parallel(self) -> None:
        """What context parallelism (``parallel/context/``) needs and does not do (yet);
        each message names the way out. docs/design/context-parallel.md."""
        p, m = self.parallel, self.model
        require(m.block_size % (2 * p.cp) == 0,
                f"model.block_size={m.block_size} does not cut into 2 x --parallel.cp = "
                f"{2 * p.cp} equal chunks; use a block_size that is a multiple of "
                f"{2 * p.cp}, or another --parallel.cp")
        require(m.dropout == 0, f"--parallel.cp={p.cp} needs model.dropout=0 (ring "
                "attention does not replay attention dropout in backward)")
        require(not self.train.compile, f"--parallel.cp={p.cp} runs without "
                "--train.compile: the ring's MPI messages sit inside every block, which "
                "torch.compile cannot trace; drop --train.compile")
        require(self.comm.transport != "shm", f"--parallel.cp={p.cp} reduces gradients "
                "with MPI: use --comm.transport=auto or mpi")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTION_TYPES = field_types(Config)
"""Section name -> its dataclass, in recipe order."""
_SECTION_NAMES = {cls: name for name, cls in SECTION_TYPES.items()}


def _check_fields(section) -> None:
    check_fields(section, _SECTION_NAMES[type(section)])
