# shardcache: `make precompute train` runs the whole demo; `make test` runs the tests.
# Every target sets up .venv on first use. Point the targets at real data with
#   make precompute DATA=/data/train.jsonl OUT=/data/cache CONFIG=configs/my.yaml
#   make train OUT=/data/cache RUN=runs/exp1 STEPS=10000 CONFIG=configs/train.yaml
# A RUN that already holds a run needs RESUME=auto (continue it) or RESUME=fresh (replace it).
# (OUT is the cache directory: `--cache` of both stages; RUN the training run directory.)
# The recipes run `python -m shardcache COMMAND` (the `shardcache` console script once installed).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DATA ?= data/demo/samples.jsonl
OUT ?= cache/demo
CONFIG ?= configs/precompute.yaml
TRAIN_CONFIG ?= configs/train-demo.yaml
RUN ?= runs/demo
RESUME ?=
STEPS ?=
MODELS ?= models
PYTEST_ARGS ?=
# CONFIG= is the config of the target being run: `make train CONFIG=configs/train.yaml` works too
# (with both targets in one call, CONFIG goes to precompute and TRAIN_CONFIG to train).
ifeq ($(origin CONFIG),command line)
  ifeq ($(filter precompute bench,$(MAKECMDGOALS)),)
    TRAIN_CONFIG := $(CONFIG)
  endif
endif
# CUDA GPUs on this machine, counted once and only when a recipe needs it (0 without CUDA or .venv).
# SHARDCACHE_FAKE_GPUS=N (environment or make variable) pretends N GPUs: `make -n` checks, tests.
_GPUS = $(eval _GPUS := $(or $(SHARDCACHE_FAKE_GPUS),$(shell $(PY) -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)))$(_GPUS)
# train: one process per GPU when CUDA is present, else 2 CPU processes (gloo)
NPROC ?= $(if $(filter-out 0,$(_GPUS)),$(_GPUS),2)
# precompute: one rank per GPU (torchrun) when CUDA is present, else a single process: on the CPU
# the encoders already use every core
PRECOMPUTE_NPROC ?= $(if $(filter-out 0,$(_GPUS)),$(_GPUS),1)
_PRECOMPUTE_RUN = $(if $(filter-out 1,$(PRECOMPUTE_NPROC)),$(PY) -m torch.distributed.run --standalone --nproc_per_node=$(PRECOMPUTE_NPROC),$(PY))

.PHONY: FORCE setup precompute train test test-long test-floors inspect view browser launchers bench bench-venv bench-gpu bench-gpu-stage-one models demo-data boson-venv core-venv clean help

help:
	@echo "make precompute   encode DATA (default: the bundled demo) into OUT ($(OUT))"
	@echo "make train        DDP training on OUT with torchrun ($(NPROC) processes); RESUME=auto|fresh for a RUN that holds a run"
	@echo "make test         the test suite"
	@echo "make test-long    the property tests with many examples (HYPOTHESIS_PROFILE=long)"
	@echo "make inspect      shardcache shards info OUT"
	@echo "make view         shardcache shards view OUT: the cache in a web browser (http://127.0.0.1:8000/)"
	@echo "make browser      install Debian's Chromium for the viewer's browser tests (part of make test)"
	@echo "make launchers    install OpenMPI's mpirun and MPICH's mpiexec for the launcher tests (part of make test)"
	@echo "make bench        benchmarks (writes benchmarks/results/*.json), the loader beside LitData/Mosaic"
	@echo "make bench-venv   the peers' benchmark venv ($(BENCH_VENV): litdata, mosaicml-streaming)"
	@echo "make bench-gpu    stage one with real-size encoders and the recipes' data wait on a CUDA GPU"
	@echo "make bench-gpu-stage-one  stage one's GPU checks in one call (~5 min): batched codes, codec s/s, steady state"
	@echo "make models       build the tiny random test models into $(MODELS)/"
	@echo "make demo-data    regenerate data/demo (needs espeak-ng)"
	@echo "make core-venv    $(CORE_VENV): the core install alone (what a training node needs), its size"
	@echo "make boson-venv   $(BOSON_VENV): boson-multimodal 0.1.1 + transformers 4.46 (tests/test_higgs_boson.py)"

# The venv sees system site-packages, so a torch the user already has (e.g. a CUDA build) is kept;
# only when none is importable do we install the CPU wheel torch==2.13.0. `pip install -e .` also
# compiles the loader's native reader (setup.py: shards/native/readv.c, with a C compiler; without
# one it is skipped and the loaders read with the pure-Python executor), again when its source changes.
# Each target installs the extra it uses (pyproject.toml): the core alone for `inspect`, [precompute] for
# precompute/models/demo-data, [train] for train, [dev] (all of them + the test tools) for the tests and
# benchmarks; $(VENV)/.installed is the [dev] install.
$(VENV)/.installed-%: pyproject.toml setup.py shards/native/readv.c
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "torch==2.13.0"
	$(PY) -m pip install -e ".$(if $(filter core,$*),,[$*])"
	touch $@

$(VENV)/.installed: $(VENV)/.installed-dev
	touch $(VENV)/.installed-core $(VENV)/.installed-precompute $(VENV)/.installed-train $(VENV)/.installed-inspect $@

setup: $(VENV)/.installed

$(MODELS)/.built: $(wildcard tools/testing/*.py) | $(VENV)/.installed-precompute
	$(PY) -m tools.testing --out $(MODELS)
	touch $@

models: $(MODELS)/.built

# boson-multimodal 0.1.1 (Higgs-Audio's own code) pins transformers<4.47 and cannot be imported beside
# transformers 5: a venv of its own, for the test of loaders.higgs.HiggsChatMLDataset against Boson's
# prepare_chatml_sample, collator and model (tests/test_higgs_boson.py, which runs this target). --no-deps:
# its other requirements (torchaudio, descript-audio-codec, boto3, s3fs, ruff...) serve its audio tokenizer
# and serving code, which the test does not import; the rest is what those modules and loaders/shards import.
BOSON_VENV ?= build/boson-venv
$(BOSON_VENV)/.installed:
	$(PYTHON) -m venv $(BOSON_VENV)
	$(BOSON_VENV)/bin/pip install -q "torch==2.13.0" "transformers==4.46.3" dacite pandas loguru librosa pyarrow numpy safetensors fsspec xxhash
	$(BOSON_VENV)/bin/pip install -q --no-deps "boson-multimodal==0.1.1"
	touch $@

boson-venv: $(BOSON_VENV)/.installed

# What a training node installs: `pip install shardcache` (the core, no extra) in a venv of its own, without
# the system site-packages; tests/test_install.py (marked long) reads a cache with it. `du -sh` says its size.
CORE_VENV ?= build/core-venv
$(CORE_VENV)/.installed: pyproject.toml setup.py $(wildcard shards/*.py shards/commands/*.py loaders/*.py shardcache/*.py)
	test -x $(CORE_VENV)/bin/python || $(PYTHON) -m venv $(CORE_VENV)
	$(CORE_VENV)/bin/pip install -q "torch==2.13.0" .
	rm -rf build/lib* build/bdist.* build/temp.* *.egg-info
	touch $@

core-venv: $(CORE_VENV)/.installed
	@du -sh $(CORE_VENV)

# A stamp per (OUT, DATA, CONFIG) under build/stamps: `make precompute` runs the job when the manifest, the config
# or the models changed since its last run into OUT, or OUT has no integrity root (no finished cache there);
# else it says the cache is up to date. The venv is an order-only prerequisite (here and of the models): `make test`
# installs [dev] after `make precompute` and touches every extra's stamp, which must not make the cache stale. FORCE=1 runs it anyway (the job itself then encodes only what changed:
# a media file replaced under the same name is seen there, not here).
_PRECOMPUTE_STAMP = build/stamps/precompute-$(shell printf '%s' '$(abspath $(OUT))|$(abspath $(DATA))|$(abspath $(CONFIG))' | cksum | cut -d' ' -f1)
precompute: $(_PRECOMPUTE_STAMP)
	@test -n "$(_PRECOMPUTE_RAN)" || echo "precompute: $(OUT) is up to date with $(DATA), $(CONFIG) and $(MODELS) (FORCE=1 runs it again)"

$(_PRECOMPUTE_STAMP): $(MODELS)/.built $(wildcard $(DATA) $(CONFIG)) \
		$(if $(FORCE)$(if $(wildcard $(OUT)/integrity.json),,missing),FORCE) | $(VENV)/.installed-precompute
	$(_PRECOMPUTE_RUN) -m shardcache precompute --manifest $(DATA) --cache $(OUT) --config $(CONFIG)
	@mkdir -p $(@D) && touch $@
	$(eval _PRECOMPUTE_RAN := 1)

FORCE:

# --dry_run first, in one process: a bad option, cache or run directory is one line (exit 2), not a line per
# rank and torchrun's traceback
_TRAIN_ARGS = --cache $(OUT) --run_dir $(RUN) --config $(TRAIN_CONFIG) $(if $(STEPS),--training.steps $(STEPS)) \
	$(if $(RESUME),--checkpoint.resume $(RESUME))
train: $(VENV)/.installed-train
	@$(PY) -m shardcache train $(_TRAIN_ARGS) --dry_run
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node=$(NPROC) -m shardcache train $(_TRAIN_ARGS)

# The suite in parallel processes (pytest-xdist): one per core, at most 4 (every test keeps to its own
# tmp_path and free ports; on the 2-core VM 2 processes ran it in 399 s, 3 in 407 s: no gain from more).
# TEST_JOBS=0 runs it in this process. --dist loadgroup: tests marked xdist_group("name") run on one worker
# (the browser tests: one set of caches, one Chromium; modules whose fixtures train or encode), every
# other test as before.
TEST_JOBS ?= auto
test: $(VENV)/.installed browser launchers
	$(PY) -m pytest -q -m "not long" -n $(TEST_JOBS) --maxprocesses 4 --dist loadgroup $(PYTEST_ARGS)

# The tests marked `long` (a cheaper test of each feature runs in `make test`), Boson's own trainer
# against loaders.higgs (builds $(BOSON_VENV) on first use), then hypothesis-built hostile manifests
# and manifests of colliding keys and quoted cells through the real stage-one job: 400 examples each
# (the suite runs 20 and 10); HYPOTHESIS_MAX_EXAMPLES=N for
# another number. Prints how many rows ran and the reject reasons seen.
test-long: $(VENV)/.installed launchers
	$(PY) -m pytest -q -m long -n $(TEST_JOBS) --maxprocesses 4 --dist loadgroup $(PYTEST_ARGS)
	SHARDCACHE_BUILD_BOSON=1 $(PY) -m pytest -q tests/test_higgs_boson.py $(PYTEST_ARGS)
	HYPOTHESIS_PROFILE=long $(PY) -m pytest -q -s -p no:warnings tests/test_hostile_rows.py tests/test_manifest_properties.py $(PYTEST_ARGS)

# The suite on the dependency floors of pyproject.toml (tests/floors.txt; torch 2.9.1 is a CUDA build of
# several GB from PyPI, run on the CPU). Run once when a floor changes; not part of `make test`.
FLOORS_VENV ?= .venv-floors
test-floors:
	test -x $(FLOORS_VENV)/bin/python || $(PYTHON) -m venv $(FLOORS_VENV)
	PIP_CONSTRAINT= $(FLOORS_VENV)/bin/python -m pip install --isolated -c tests/floors.txt -e . pytest scikit-image \
		"peft>=0.10" "s3fs>=2024.6" "moto[server]>=5" "hypothesis>=6.100"
	rm -f $(MODELS)/.built  # the tiny models saved by the floor versions; `make models` remakes them after
	$(FLOORS_VENV)/bin/python -m tools.testing --out $(MODELS)
	$(FLOORS_VENV)/bin/python -m pytest -q $(PYTEST_ARGS)
	rm -f $(MODELS)/.built

# Every extra includes the core: a venv that holds any install (`make precompute`, `make train`, `make test`)
# serves `inspect` as it is; only a venv with none installs the core (no reinstall: 31 s before a 1 s summary).
_ANY_INSTALL = $(firstword $(sort $(wildcard $(VENV)/.installed-*)) $(VENV)/.installed-core)
inspect: $(_ANY_INSTALL)
	$(PY) -m shardcache shards info $(OUT)

# `shards view` needs the [inspect] extra (Jinja2, DuckDB, matplotlib, Pillow); PORT=0 takes any free port.
# A port already taken is said here in make's terms (PORT=), before the viewer starts.
PORT ?= 8000
view: $(VENV)/.installed-inspect
	@$(PY) -c "import socket, sys; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('127.0.0.1', int(sys.argv[1])))" $(PORT) 2>/dev/null \
		|| { echo "make view: port $(PORT) is taken on 127.0.0.1; choose another with PORT=, e.g. make view PORT=8080 (PORT=0: any free port)" >&2; exit 2; }
	$(PY) -m shardcache shards view $(OUT) --port $(PORT)

# The viewer's browser tests (tests/test_viewer_browser.py) drive the system's Chromium through Playwright
# (the [dev] extra; no browser download). Debian's package is installed here where it is missing and this
# is root with apt-get (CI, a fresh machine); anywhere else this says how, and the tests skip saying so.
CHROMIUM ?= /usr/bin/chromium
browser:
	@if [ -x "$(CHROMIUM)" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "browser: installing Debian's chromium for the viewer's browser tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	else \
		echo "browser: no $(CHROMIUM): the viewer's browser tests will skip; install it with sudo apt-get install chromium"; \
	fi

# tests/test_launchers.py runs the loader, stage one and add-field under the real OpenMPI mpirun and MPICH
# mpiexec (PMI) beside torchrun (srun is emulated: no SLURM cluster here). Debian's openmpi-bin and mpich are
# installed here where missing and this is root with apt-get (CI, a fresh machine); elsewhere those tests skip.
launchers:
	@if command -v mpirun.openmpi >/dev/null && command -v mpiexec.hydra >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "launchers: installing Debian's openmpi-bin and mpich for tests/test_launchers.py"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin mpich >/dev/null; \
	else \
		echo "launchers: no mpirun.openmpi/mpiexec.hydra: their tests will skip; sudo apt-get install openmpi-bin mpich"; \
	fi

# The loader's peers (LitData, Mosaic Streaming) pin numpy and transformers versions this project does
# not use, so they get a venv of their own, with the torch version of $(VENV) (the same wheel where it is
# at hand). `make bench` builds it when it can and otherwise measures without the peers (it says so).
BENCH_VENV ?= .venv-bench
PEERS ?= "litdata==0.2.76" "mosaicml-streaming==0.13.0"
$(BENCH_VENV)/.installed: $(VENV)/.installed
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install "torch==$$($(PY) -c 'import torch; print(torch.__version__.split("+")[0])')" $(PEERS)
	touch $@

bench-venv: $(BENCH_VENV)/.installed

# CEILING_N: samples per job kind of stage one's null-encoder ceiling (synthetic corpus, written once
# into $$SHARDCACHE_BENCH_CORPUS or ~/.cache/shardcache/bench-corpus); `--only ceiling` runs it alone.
CEILING_N ?= 2000
# SCALE_SIZES: manifest rows of stage one's scale section (planning, no-change rerun, peak RSS per rank;
# benchmarks/bench_scale_stage_one.py); `--only scale_stage_one` runs it alone.
SCALE_SIZES ?= 10000,100000,1000000
bench: $(VENV)/.installed $(MODELS)/.built
	@$(MAKE) --no-print-directory bench-venv || echo "bench: no benchmark venv ($(BENCH_VENV)); the peers (LitData, Mosaic) are skipped"
	$(PY) -m benchmarks.run --ceiling-n $(CEILING_N) --scale-sizes $(SCALE_SIZES)
	$(PY) scripts/gen_docs.py  # docs/benchmarks.md's table from benchmarks/results/summary.md

# On a CUDA machine: stage one with real-size random encoders and the recipes' data wait with 0/2/8
# workers (benchmarks/results/gpu.*), then stage one's TTS and TheWorld jobs at steady state
# (benchmarks/results/gpu_steady.*), and whether the codecs' codes change when batched
# (benchmarks/results/gpu_codec_batch.*); elsewhere each says it needs a GPU and exits 0.
bench-gpu: $(VENV)/.installed $(MODELS)/.built
	$(PY) -m benchmarks.gpu
	$(PY) -m benchmarks.gpu_steady
	$(PY) -m benchmarks.gpu_codec_batch

# Stage one's GPU checks in one call of about 5 minutes (benchmarks/results/gpu_stage_one.*): whether a
# batched clip's codes with zero slots beside it equal its codes with real clips at every place, the
# Higgs tokenizer's audio s/s by batching and by 2 processes (codes run to run, 2 processes vs 1), and
# the TTS and TheWorld jobs at default settings against their encoders alone with where the time went.
bench-gpu-stage-one: $(VENV)/.installed $(MODELS)/.built
	$(PY) -m benchmarks.gpu_stage_one

demo-data: $(VENV)/.installed-precompute
	$(PY) scripts/make_demo_data.py --out data/demo

clean:
	rm -rf cache runs $(MODELS) $(BOSON_VENV)
