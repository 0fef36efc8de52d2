#!/usr/bin/env bash
# Runs Triton's own perf_analyzer (from the tritonclient 2.51 wheel) against a running server, over gRPC
# with --streaming (the entry points are decoupled), on perf/data/perf_analyzer_input.json.
#
#   make serve                      # in another terminal (or any server on GRPC_PORT)
#   perf/perf_analyzer.sh [MODEL] [CONCURRENCY_RANGE]      # default: ensemble 1:4:1
#
# Installs what the perf_analyzer binary needs and the wheel does not carry: Debian's libb64-0d and
# PyPI's nvidia-cuda-runtime-cu12 (only for the shared library it links; no GPU is used).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="${1:-ensemble}"
RANGE="${2:-1:4:1}"
GRPC_PORT="${GRPC_PORT:-8001}"
VENV=.venv
if ! ldconfig -p | grep -q libb64.so.0d; then
    apt-get install -y -q libb64-0d >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q libb64-0d >/dev/null; }
fi
if ! "$VENV/bin/python" -c "import nvidia.cuda_runtime" 2>/dev/null; then
    "$VENV/bin/pip" install -q --no-deps nvidia-cuda-runtime-cu12==12.9.79
fi
CUDART="$("$VENV/bin/python" -c 'import nvidia.cuda_runtime, os; print(os.path.join(list(nvidia.cuda_runtime.__path__)[0], "lib"))')"
export LD_LIBRARY_PATH="$CUDART${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$VENV/bin/perf_analyzer" -m "$MODEL" -i grpc -u "localhost:$GRPC_PORT" --streaming \
    --input-data perf/data/perf_analyzer_input.json --concurrency-range "$RANGE" \
    --measurement-interval 4000 --stability-percentage 50 --max-trials 6
