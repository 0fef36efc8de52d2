"""Block-coded test checkpoints (a random checkpoint's weights made GGUF codes, stored in fp32 as the
converter writes a quantized model) and a greedy run of an engine, for the engine tests of the
block-code kernels."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

from disagg.engine.engine import Engine
from disagg.engine.params import SamplingParams
from disagg.engine.sequence import Request


def coded_copy(source: Path, out: Path, dtype: torch.dtype = torch.float32) -> Path:
    """``source`` with every projection weight made a Q4_1 code and the output head a Q8_0 one, the
    values stored in ``dtype`` (fp32: as the GGUF converter writes a quantized model; bf16: the same
    values rounded, where no code can be found)."""
    shutil.copytree(source, out)
    weights = load_file(source / "model.safetensors")
    for name, tensor in weights.items():
        kind = GGMLQuantizationType.Q8_0 if name == "lm_head.weight" else GGMLQuantizationType.Q4_1
        if tensor.dim() == 2 and tensor.shape[1] % 32 == 0 and name != "model.embed_tokens.weight":
            values = tensor.float().numpy()
            weights[name] = torch.from_numpy(dequantize(quantize(values, kind), kind).astype(np.float32))
        else:
            weights[name] = tensor.float().contiguous()
        weights[name] = weights[name].to(dtype).contiguous()
    save_file(weights, out / "model.safetensors")
    return out


def greedy(
    engine: Engine, prompts: list[tuple[int, ...]], tokens: int, chunk: int | None = None
) -> list[list[int]]:
    """Greedy tokens of ``prompts``, prefilled together (or each in chunks of ``chunk``), in their order."""
    out: dict[int, list[int]] = {}
    if chunk is None:
        firsts = engine.prefill([Request(p, SamplingParams(max_tokens=tokens)) for p in prompts])
        out = {f.seq_id: [f.token_id] for f in firsts}
    else:
        for prompt in prompts:
            seq_id = engine.start(Request(prompt, SamplingParams(max_tokens=tokens)))
            first = None
            while first is None:
                first = engine.prefill_chunk(seq_id, chunk)
            out[first.seq_id] = [first.token_id]
    while any(len(t) < tokens for t in out.values()):
        for step in engine.decode_step():
            out[step.seq_id].append(step.token_id)
    return [out[k] for k in sorted(out)]
