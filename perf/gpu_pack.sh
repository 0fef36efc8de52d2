#!/usr/bin/env bash
# Packs what perf/gpu_check.sh needs beside the working tree into .gpu/ (ignored by git; carried to a
# lent GPU machine, which has no package registry and a 64 MiB transfer limit):
#   .gpu/triton.tar.xz  the Triton 2.51 files of the installed nvidia-pytriton wheel: the server, the
#                       Python backend, the Python 3.12 stub (the GPU machine's Python) and the wheel's
#                       shared libraries (less its bundled libpython3.13); about 27 MB;
#   .gpu/smollm2-shape/ SmolLM2-135M-Instruct's config, tokenizer and tensor shapes (no weights);
#   .gpu/whl/           numpy 1.26.4 for Python 3.12 (the served models' numpy there);
#   .gpu/libpython312.tar.xz  a libpython3.12.so.1.0 found here, used there only if that machine has none.
# Run from the repository root after `make install` and `make model`.
set -eu
PY=${PY:-.venv/bin/python}
SP=$($PY -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('pytriton').submodule_search_locations[0]).parent)")
MODEL=${MODEL:-.models/smollm2-135m-instruct}
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/pytriton/tritonserver/python_backend_stubs" "$STAGE/nvidia_pytriton.libs" .gpu/smollm2-shape
touch "$STAGE/pytriton/__init__.py"
cp -r "$SP/pytriton/tritonserver/bin" "$SP/pytriton/tritonserver/backends" "$SP/pytriton/tritonserver/caches" \
	"$STAGE/pytriton/tritonserver/"
cp -r "$SP/pytriton/tritonserver/python_backend_stubs/3.12" "$STAGE/pytriton/tritonserver/python_backend_stubs/"
rm -rf "$STAGE/pytriton/tritonserver/backends/python/__pycache__"
find "$SP/nvidia_pytriton.libs" -maxdepth 1 -type f ! -name 'libpython3*' -exec cp {} "$STAGE/nvidia_pytriton.libs/" \;
tar -C "$STAGE" -cJf .gpu/triton.tar.xz .
cp "$MODEL"/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json} .gpu/smollm2-shape/
$PY - "$MODEL/model.safetensors" .gpu/smollm2-shape/shapes.json <<'PYEOF'
import json, sys
from safetensors import safe_open
with safe_open(sys.argv[1], "pt") as f:
    spec = {"shapes": {k: list(f.get_slice(k).get_shape()) for k in f.keys()}, "metadata": f.metadata()}
json.dump(spec, open(sys.argv[2], "w"))
PYEOF
# numpy 1.x for Python 3.12: Triton 2.51's Python stub misreads BYTES tensors under numpy 2
mkdir -p .gpu/whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	--platform manylinux_2_17_x86_64 -d .gpu/whl numpy==1.26.4
# a fallback libpython3.12 for the Python 3.12 stub, for a GPU machine whose Python has none (LIBPY=)
LIBPY=${LIBPY:-$(find /usr/lib /usr/local/lib /opt -name 'libpython3.12.so.1.0' 2>/dev/null | head -n 1)}
if [ -n "$LIBPY" ]; then
	tar -C "$(dirname "$LIBPY")" -cJf .gpu/libpython312.tar.xz libpython3.12.so.1.0
fi
du -sh .gpu
