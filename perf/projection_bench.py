"""Projections: the engine's kernel against oneDNN's prepacked kernel (and MKL), side by side in one run.

For every projection of one forward step of a model (its layers' qkv, o, gate_up and down, and the
output head), at M input rows, on pinned cores, in the dtype the pools compute in here:
  - bf16 (a CPU with AVX-512-BF16): ``kernel``, ``disagg.engine.kernel.gemm`` on its own weight
    layout (what the pools run), against ``oneDNN``, ``torch.ops.mkldnn._linear_pointwise`` on a
    weight reordered once by ``_reorder_linear_weight`` (the engine's path where the kernels are not),
    and ``Q4_1 codes``, the decode rows of a bf16 pool on a Q4_1-coded checkpoint (SmolLM2's):
    ``disagg.engine.blockcode.bf16_gemm`` for the layers, the bf16 kernel for the head;
  - fp32 (a CPU with AVX2 and FMA): ``kernel``, ``disagg.engine.fp32kernel.gemm`` on its tiled weight
    (what the pools run on a plain fp32 checkpoint, and for prompt rows beside block codes), against
    oneDNN's prepacked fp32 kernel (batch hint 256) and MKL's ``F.linear`` (the reference).
Weights have the model's shapes (from its config.json; random values: speed does not depend on
them), one copy per layer, so a step streams them from memory as the engine's does. Repetitions are
interleaved (kernel, oneDNN, ..., kernel, ...) and the median of each is reported. Writes
projection_bench.json and projection_bench.md into --out-dir.

    python -m perf.projection_bench [--model DIR] [--cores 0[,1]] [--rows 1,2,4,8,16,32,64,300]
        [--dtype bfloat16|float32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

from disagg.engine import blockcode, fp32kernel, kernel
from disagg.engine.checkpoint import load_config
from disagg.engine.device import kernel_threads
from disagg.paths import resolve_model_dir
from disagg_tools.checkpoints import ensure_model

RESULTS = Path(__file__).resolve().parent / "results"
ONEDNN_FP32_HINT = 256  # oneDNN's batch-size hint for fp32: the fastest at 8 to 300 rows here

# a way to run a projection: (its name, the weight laid out once, then y = x W^T on that layout)
Runner = tuple[str, Callable[[torch.Tensor], object], Callable[[torch.Tensor, object], torch.Tensor]]


def _onednn(hint: int) -> Runner:
    return (
        "oneDNN",
        lambda w: torch.ops.mkldnn._reorder_linear_weight(w, hint),
        lambda x, packed: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
    )


def q4_1(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` rounded to Q4_1 codes (per run of 32 inputs: codes 0..15, an fp16 scale and min) and
    stored as their fp32 values, as the converter stores a quantized GGUF model."""
    runs = weight.float().reshape(-1, blockcode.RUN)
    low = runs.amin(-1, keepdim=True).half().float()
    scale = ((runs.amax(-1, keepdim=True) - low) / 15).half().float()
    codes = torch.where(scale > 0, ((runs - low) / scale.clamp(min=1e-30)).round().clamp(0, 15), 0)
    return (scale * codes + low).reshape(weight.shape)


def _codes(head: tuple[int, int]) -> Runner:
    """Decode rows as the bf16 pools run them on a Q4_1-coded checkpoint (SmolLM2's): the layers'
    projections on the codes, the output head (Q8_0 there) on the bf16 kernel."""
    gemm, code_gemm = kernel.gemm(), blockcode.bf16_gemm()

    def prepare(weight: torch.Tensor) -> tuple[str, object]:
        if tuple(weight.shape) == head:
            return "bf16", kernel.pack(weight)
        return "codes", blockcode.quads(blockcode.recover(q4_1(weight)))

    def call(x: torch.Tensor, laid: tuple[str, object]) -> torch.Tensor:
        kind, layout = laid
        return gemm(x, layout, None) if kind == "bf16" else code_gemm(x, layout, None)

    return "Q4_1 codes", prepare, call


def runners(dtype: str, head: tuple[int, int]) -> list[Runner]:
    """The engine's kernel first, then what it is compared with; refuses where the kernel is off."""
    if dtype == "bfloat16":
        gemm = kernel.gemm()
        if gemm is None:
            raise SystemExit(
                "the bf16 kernels are off here (no AVX-512-BF16 or no C compiler): try --dtype float32"
            )
        return [("kernel", kernel.pack, lambda x, packed: gemm(x, packed, None)), _onednn(1), _codes(head)]
    gemm32 = fp32kernel.gemm()
    if gemm32 is None:
        raise SystemExit(
            "the fp32 kernels are off here (no AVX2 and FMA or no C compiler): nothing to compare"
        )
    return [
        ("kernel", fp32kernel.pack, lambda x, tiles: gemm32(x, tiles, None)),
        _onednn(ONEDNN_FP32_HINT),
        ("MKL", lambda w: w, lambda x, w: F.linear(x, w)),
    ]


OURS = ("kernel", "Q4_1 codes")  # the engine's own kernels, on their thread team


def threads_for(name: str) -> AbstractContextManager[None]:
    """The engine's kernels get torch's threads for their team, as in an engine step
    (``disagg.engine.device.kernel_threads``); oneDNN and MKL run on torch's pool."""
    return kernel_threads() if name in OURS else nullcontext()


def shapes(model_dir: Path) -> tuple[list[tuple[int, int]], tuple[int, int], int]:
    """(out, in) of one layer's projections, the head's, and the layer count."""
    cfg = load_config(model_dir)
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    layer = [((cfg.num_heads + 2 * cfg.num_kv_heads) * hd, h), (h, cfg.num_heads * hd), (2 * i, h), (h, i)]
    return layer, (cfg.vocab_size, h), cfg.num_layers


def run(model_dir: Path, cores: tuple[int, ...], rows: list[int], reps: int, dtype: str) -> dict:
    os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(len(cores))
    layer, head, layers = shapes(model_dir)
    paths = runners(dtype, head)
    weights = [torch.randn(n, k).to(getattr(torch, dtype)) for _ in range(layers) for n, k in layer] + [
        torch.randn(*head).to(getattr(torch, dtype))
    ]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    laid = {name: [prepare(w) for w in weights] for name, prepare, _ in paths}
    widths = [w.shape[1] for w in weights]
    del weights
    table = []
    for m in rows:
        inputs = {k: torch.randn(m, k).to(getattr(torch, dtype)) for k in set(widths)}

        def step(name: str, call: Callable, inputs: dict = inputs) -> None:
            for layout, k in zip(laid[name], widths, strict=True):
                call(inputs[k], layout)

        samples: dict[str, list[float]] = {name: [] for name, _, _ in paths}
        for name, _, call in paths:  # warm-up
            with threads_for(name):
                step(name, call)
        for _ in range(reps):
            for name, _, call in paths:
                with threads_for(name):  # the engine's kernels run as in an engine step
                    start = time.perf_counter()
                    step(name, call)
                    samples[name].append(time.perf_counter() - start)
        ms = {name: statistics.median(values) * 1e3 for name, values in samples.items()}
        table.append(
            dict(rows=m, ms=ms, speedup={name: ms[name] / ms["kernel"] for name in ms if name != "kernel"})
        )
    return dict(
        model=str(model_dir),
        dtype=dtype,
        cores=list(cores),
        reps=reps,
        projections=len(widths),
        weight_bytes=weight_bytes,
        torch=torch.__version__,
        amx=kernel.cpu_has_amx(),
        table=table,
    )


def markdown(result: dict) -> str:
    others = [name for name in result["table"][0]["ms"] if name != "kernel"]
    lines = [
        f"# {result['dtype']} projections: the engine's kernel and {', '.join(others)}",
        "",
        f"Written by `perf/projection_bench.py`. Model shapes of `{Path(result['model']).name}`: "
        f"{result['projections']} projections, {result['weight_bytes'] / 1e6:.0f} MB of {result['dtype']} "
        f"weights per step; cores {result['cores']}, torch {result['torch']}, AMX: {result['amx']}; median "
        f"of {result['reps']} interleaved repetitions.",
        "",
        "| rows | kernel, ms | " + " | ".join(f"{name}, ms | kernel vs {name}" for name in others) + " |",
        "|---:|---:|" + "---:|---:|" * len(others),
    ]
    for row in result["table"]:
        cells = " | ".join(f"{row['ms'][name]:.1f} | {row['speedup'][name]:.2f}x" for name in others)
        lines.append(f"| {row['rows']} | {row['ms']['kernel']:.1f} | {cells} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: $MODEL_DIR, else SmolLM2-135M-Instruct)")
    parser.add_argument("--cores", default="0", help="comma-separated core list (default 0)")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,300")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        help="default: bfloat16 where its kernels run (AVX-512-BF16), else float32",
    )
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    model_dir = ensure_model(resolve_model_dir(args.model))
    cores = tuple(int(c) for c in args.cores.split(","))
    dtype = args.dtype or ("bfloat16" if kernel.gemm() is not None else "float32")
    result = run(model_dir, cores, [int(r) for r in args.rows.split(",")], args.reps, dtype)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "projection_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (args.out_dir / "projection_bench.md").write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
