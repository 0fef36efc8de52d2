"""Small random Hugging Face checkpoints written by the pinned transformers, for oracle tests.

Weights are drawn wider than the library's default init so that greedy decoding wanders over many
tokens instead of looping on one or two.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

BASE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=256,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
)

# kind -> (config class name, overrides)
KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-mha": ("LlamaConfig", dict(num_key_value_heads=4)),
    "llama-gqa": ("LlamaConfig", dict(num_key_value_heads=2, rms_norm_eps=1e-5)),
    "llama-tied": ("LlamaConfig", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen2-bias": ("Qwen2Config", dict(num_key_value_heads=2)),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, head_dim=32)),
    "llama3-rope": (
        "LlamaConfig",
        dict(
            num_key_value_heads=2,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
}


def _widen(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
            elif "lm_head" in name or "embed" in name:
                # large logit gaps: near-ties (where rounding may pick either token) become rare
                param.copy_(torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)


def write_checkpoint(out: Path, kind: str, seed: int = 0) -> Path:
    """Save a random checkpoint of ``kind`` (see KINDS) with transformers' own save_pretrained."""
    import transformers

    cls_name, overrides = KINDS[kind]
    config = getattr(transformers, cls_name)(**{**BASE, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    _widen(model, seed)
    model.save_pretrained(out)
    return out


def write_legacy_checkpoint(out: Path, seed: int = 0) -> Path:
    """A checkpoint whose hand-written config.json uses the older top-level RoPE spelling."""
    write_checkpoint(out, "llama-gqa", seed)
    raw = json.loads((out / "config.json").read_text())
    raw.pop("rope_parameters", None)
    raw["rope_theta"] = 50000.0
    raw["rope_scaling"] = None
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out


def reference_greedy(
    model_dir: Path | None,
    prompt: list[int],
    new_tokens: int,
    model: Any = None,
    eos_token_id: int | None = None,
) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and, per step, the gap between its top two logits.

    ``model`` is an already loaded transformers model (else ``model_dir`` is loaded in fp32);
    ``eos_token_id`` is the end token the min-length processor masks, as the engine masks its own.
    """
    import transformers

    if model is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    extra = {} if eos_token_id is None else {"eos_token_id": eos_token_id}
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            **extra,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    gaps = []
    for logits in out.scores:  # after the min-length processor, as the engine sees them
        top2 = torch.topk(logits[0].float(), 2).values
        gaps.append(float(top2[0] - top2[1]))
    return tokens, gaps


def comparable_prefix(gaps: list[float], tolerance: float = 1e-3) -> int:
    """Number of leading steps before the first near-tie, where rounding may pick either token."""
    for step, gap in enumerate(gaps):
        if gap < tolerance:
            return step
    return len(gaps)
