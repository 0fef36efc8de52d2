#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one prepared run (a lent GPU machine: see README, GPU status).
#
#   perf/gpu_check.sh            # from the repository root; results under $OUT (default /tmp/gpu_check)
#   DRY_RUN=1 PYTHON=.venv/bin/python perf/gpu_check.sh   # any machine: each step's command is shown
#                                # and only checked to load (its --help; the GPU tests collected)
#
# What it needs beside the working tree, in .gpu/ (made on a machine with the project installed by
# `perf/gpu_pack.sh`): triton.tar.xz (the Triton 2.51 binaries of the nvidia-pytriton wheel, with the
# Python 3.12 stub) and smollm2-shape/ (SmolLM2's config, tokenizer and tensor shapes, no weights).
# The machine's own python3 with a CUDA torch runs everything; the project is put on PYTHONPATH.
#
# Steps, each under its own time limit, each logged whether it passes or fails:
#   1. tests/gpu: the engine on CUDA (fp32 tokens equal the CPU's; bf16 and fp16 run), KV hand-offs
#      over CUDA IPC between processes, raw and engine to engine;
#   2. perf/gpu_serve_check.py: a real Triton serving KIND_GPU pools (CUDA IPC hand-off) against the
#      engine's own greedy text, and the served TPOT beside the decode pool's step inside the server;
#      then a second server on the same repository with engines that compute nothing (null_compute),
#      whose TPOT is the relay's floor (perf/relay_floor.py), and the target TPOT <= step + floor + 0.5 ms;
#   3. perf/kv_transfer_bench.py: cuda_ipc hand-off bandwidth beside a device-to-device copy;
#   4. perf/gpu_engine_bench.py: the engine against transformers on the GPU, the tiny model and
#      SmolLM2's shape with random weights (its real weights do not fit the transfer to the machine);
#   5. perf/graph_bench.py (graph_bench): Engine.decode_step() with the decode step captured as CUDA
#      graphs per batch bucket against the eager step, SmolLM2's shape in bf16 at batch 1, 8 and 64 with
#      512 tokens of context, and whether greedy tokens stay the same (fp32 and bf16). Prepared on CPU,
#      NOT yet run on a GPU (issue 45); GRAPH_BENCH_ARGS replaces its arguments.
# tests/gpu (step 1) includes the captured steps' and the Triton-lang kernel's GPU tests
# (tests/gpu/test_graphs_cuda.py). A short run for the graphs alone: STEPS="pytest_gpu graph_bench".
set -u
OUT=${OUT:-/tmp/gpu_check}
ROOT=$(pwd)
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
RUN="$OUT/run.log"  # every step's log, appended as it ends (at most 8 files come back from a lent machine)
: >"$RUN"

STEPS=${STEPS:-pytest_gpu serve_check kv_bench engine_bench graph_bench}  # a subset reruns only those

DRY_RUN=${DRY_RUN:-0}
step() {  # step NAME SECONDS COMMAND...: run, log its status and duration
	local name=$1 limit=$2
	shift 2
	case " $STEPS " in *" $name "*) ;; *) return ;; esac
	if [ "$DRY_RUN" = 1 ]; then  # the command as it would run; then only whether it loads
		echo "===== $name (dry run): $*" | tee -a "$RUN"
		if [ "$3" = pytest ]; then "$@" --collect-only >>"$RUN" 2>&1; else "$@" --help >>"$RUN" 2>&1; fi
		echo "===== $name loads: rc=$?" | tee -a "$RUN"
		return
	fi
	local start=$SECONDS
	timeout "$limit" "$@" >"$OUT/step.log" 2>&1
	local rc=$?
	echo "===== $name rc=$rc $((SECONDS - start))s" | tee -a "$RUN"
	tail -n 5 "$OUT/step.log"
	cat "$OUT/step.log" >>"$RUN"
	rm -f "$OUT/step.log"
}

if [ "$DRY_RUN" = 1 ]; then  # no GPU set-up: the project's own modules on the path
	export PYTHONPATH="$ROOT/tests:$ROOT" SHAPE=/tmp/models/smollm2-shape
else
{
	nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
	$PY -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
	nproc
} >>"$RUN" 2>&1
cat "$RUN"

SITE=/tmp/gpu_site
mkdir -p "$SITE"
ln -sfn "$ROOT/backends/disagg" "$SITE/disagg"
ln -sfn "$ROOT/tools" "$SITE/disagg_tools"
tar -C "$SITE" -xJf .gpu/triton.tar.xz
LIBDIR=$($PY -c "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))")
LIBPY=$(find "$LIBDIR" /usr/lib /usr/local/lib /opt -name 'libpython3.12.so.1.0' 2>/dev/null | head -n 1)
if [ -z "$LIBPY" ] && [ -f .gpu/libpython312.tar.xz ]; then  # the Python 3.12 stub links against it
	mkdir -p /tmp/gpu_libpython && tar -C /tmp/gpu_libpython -xJf .gpu/libpython312.tar.xz
	LIBPY=/tmp/gpu_libpython/libpython3.12.so.1.0
	echo "libpython3.12: none on this machine; the carried one" | tee -a "$RUN"
fi
echo "libpython3.12: ${LIBPY:-not found}" | tee -a "$RUN"
export PYTHONPATH="$SITE:$ROOT/tests:$ROOT"
# Triton's Python stub runs the models with this Python's packages but not its PYTHONPATH: a .pth file
# puts the project there too (a lent machine is bare and given back afterwards)
$PY -c "import os, site; [open(d + '/disagg_gpu_check.pth', 'w').write('$SITE\n') for d in site.getsitepackages() if os.path.isdir(d)]"
export MODEL_DIR="$ROOT/.models/tiny"  # the suite's model, built on first use (SmolLM2 cannot be fetched there)
export LD_LIBRARY_PATH="${LIBPY:+$(dirname "$LIBPY"):}${LD_LIBRARY_PATH:-}"

# SmolLM2's shape with random weights (normal, std 0.02; norms 1), beside its real tokenizer and config
SHAPE=/tmp/models/smollm2-shape
mkdir -p "$SHAPE"
cp .gpu/smollm2-shape/*.json "$SHAPE/"
$PY - "$SHAPE" <<'EOF'
import json, sys
import torch
from safetensors.torch import save_file
folder = sys.argv[1]
spec = json.load(open(f"{folder}/shapes.json"))
g = torch.Generator().manual_seed(0)
tensors = {
    name: torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=g) * 0.02
    for name, shape in spec["shapes"].items()
}
save_file(tensors, f"{folder}/model.safetensors", metadata=spec["metadata"])
EOF
rm -f "$SHAPE/shapes.json"
fi

step pytest_gpu 150 $PY -m pytest -q -rs -p no:cacheprovider tests/gpu -s
# Triton 2.51's Python stub was built for numpy 1.x: under the machine's numpy 2 it misreads BYTES
# tensors ("unpack_from requires a buffer of at least ..."), so the served models get the numpy of
# .gpu/whl (numpy 1.26) first on their path while the server runs, through a second .pth file
NUMPY_PTH=$($PY -c "import site; print(site.getsitepackages()[0])")/0_disagg_gpu_numpy.pth
if ls .gpu/whl/numpy-1*.whl >/dev/null 2>&1; then
	$PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu_numpy .gpu/whl/numpy-1*.whl
	echo "import sys; sys.path.insert(0, '/tmp/gpu_numpy')" >"$NUMPY_PTH"
fi
step serve_check 300 $PY -m perf.gpu_serve_check --out "$OUT/serve"
rm -f "$NUMPY_PTH"
cp "$OUT/serve/serve_check.json" "$OUT/serve/triton.log" "$OUT/" 2>/dev/null
step kv_bench 60 $PY -m perf.kv_transfer_bench --transports cuda_ipc shm --sizes-mib 1 16 64 256 --reps 5 --out "$OUT/kv"
cp "$OUT/kv/kv_transfer.json" "$OUT/" 2>/dev/null
# shellcheck disable=SC2086 # ENGINE_BENCH_ARGS is a list of arguments
step engine_bench 150 $PY -m perf.gpu_engine_bench ${ENGINE_BENCH_ARGS:---model .models/tiny --model $SHAPE --reps 3} --out-dir "$OUT/bench"
cp "$OUT/bench/gpu_engine_bench.md" "$OUT/bench/gpu_engine_bench.json" "$OUT/" 2>/dev/null
# shellcheck disable=SC2086 # GRAPH_BENCH_ARGS is a list of arguments
step graph_bench 150 $PY -m perf.graph_bench ${GRAPH_BENCH_ARGS:---model $SHAPE --batch 1 --batch 8 --batch 64 --context 512 --reps 3} --out-dir "$OUT/graph"
cp "$OUT/graph/graph_bench.md" "$OUT/graph/graph_bench.json" "$OUT/" 2>/dev/null
rm -rf "$OUT/serve" "$OUT/kv" "$OUT/bench" "$OUT/graph"
