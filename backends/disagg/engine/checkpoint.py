"""Reading a Hugging Face checkpoint folder: config.json and *.safetensors.

Supported: Llama, Mistral and Qwen2 decoders (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP,
optional q/k/v bias, tied or untied embeddings). RoPE comes in two spellings, both accepted: the older
top-level ``rope_theta`` / ``rope_scaling`` and transformers 5's ``rope_parameters``. Any setting this
engine would silently get wrong is refused with an error naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from disagg.config import ConfigError, build
from disagg.engine.errors import CheckpointError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    # llama3 only
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of one checkpoint, validated."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def max_context(self) -> int:
        return self.max_position_embeddings


def _int_list(value: Any, field: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    raise CheckpointError(f"config field {field!r} must be an integer or a list of integers")


def parse_rope(raw: dict[str, Any]) -> RopeConfig:
    """RoPE settings from either spelling; refuse types and fields this engine does not implement."""
    params = raw.get("rope_parameters")
    if params is None:
        scaling = raw.get("rope_scaling") or {}
        if not isinstance(scaling, dict):
            raise CheckpointError("config field 'rope_scaling' must be an object or null")
        params = {**scaling, "rope_theta": raw.get("rope_theta", 10000.0)}
        where = "rope_scaling"
    else:
        if not isinstance(params, dict):
            raise CheckpointError("config field 'rope_parameters' must be an object")
        where = "rope_parameters"
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"unsupported {where}.rope_type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise CheckpointError(f"unsupported partial_rotary_factor {partial!r} (only 1.0)")
    if params.get("attention_factor") not in (None, 1.0):
        raise CheckpointError(f"unsupported {where}.attention_factor (only 1.0)")
    theta = params.get("rope_theta")
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise CheckpointError(f"{where}.rope_theta must be a positive number")
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    try:
        cfg = RopeConfig(
            theta=float(theta),
            rope_type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as exc:
        raise CheckpointError(f"llama3 RoPE needs {where}.{exc.args[0]}") from None
    except (TypeError, ValueError):
        raise CheckpointError(f"llama3 RoPE fields in {where} must be numbers") from None
    if cfg.factor <= 0 or cfg.high_freq_factor <= cfg.low_freq_factor or cfg.low_freq_factor <= 0:
        raise CheckpointError(f"inconsistent llama3 RoPE factors in {where}")
    return cfg


@dataclass(frozen=True)
class _ConfigJson:
    """The ``config.json`` keys this engine reads, typed (:func:`disagg.config.build`). Every other key
    of the file is transformers' business and ignored; a null value counts as absent."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None  # default: num_attention_heads
    head_dim: int | None = None  # default: hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    use_sliding_window: bool = False
    pretraining_tp: int = 1
    bos_token_id: Any = None  # kept only when an integer
    eos_token_id: Any = None  # an integer or a list of them (_int_list)


_CONFIG_JSON_KEYS = frozenset(f.name for f in fields(_ConfigJson))


def _positive(value: int, field: str) -> int:
    if value <= 0:
        raise CheckpointError(f"config field {field!r} must be a positive integer")
    return value


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """Validate a ``config.json`` dict and reduce it to what the engine needs."""
    try:
        c = build(_ConfigJson, {k: v for k, v in raw.items() if k in _CONFIG_JSON_KEYS and v is not None})
    except ConfigError as exc:
        raise CheckpointError(f"config.json: {exc}") from None
    if c.model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"unsupported model_type {c.model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if c.hidden_act != "silu":
        raise CheckpointError(f"unsupported hidden_act {c.hidden_act!r} (only 'silu')")
    hidden = _positive(c.hidden_size, "hidden_size")
    heads = _positive(c.num_attention_heads, "num_attention_heads")
    kv_heads = _positive(
        heads if c.num_key_value_heads is None else c.num_key_value_heads, "num_key_value_heads"
    )
    if heads % kv_heads:
        raise CheckpointError("num_attention_heads must be a multiple of num_key_value_heads")
    head_dim = c.head_dim or hidden // heads
    if head_dim <= 0 or head_dim % 2:
        raise CheckpointError("head_dim must be a positive even integer")
    max_pos = _positive(c.max_position_embeddings, "max_position_embeddings")
    if c.model_type == "mistral" and c.sliding_window:
        # Attention equals full attention while the context fits in the window: cap the context there.
        max_pos = min(max_pos, _positive(c.sliding_window, "sliding_window"))
    if c.model_type == "qwen2" and c.use_sliding_window:
        raise CheckpointError("unsupported use_sliding_window=true")
    if c.model_type == "llama" and c.pretraining_tp != 1:
        raise CheckpointError("unsupported pretraining_tp != 1")
    if not 0 < c.rms_norm_eps < 1:
        raise CheckpointError("rms_norm_eps must be a number in (0, 1)")
    bos = c.bos_token_id
    return ModelConfig(
        model_type=c.model_type,
        vocab_size=_positive(c.vocab_size, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_positive(c.intermediate_size, "intermediate_size"),
        num_layers=_positive(c.num_hidden_layers, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=max_pos,
        rope=parse_rope(raw),
        tie_word_embeddings=c.tie_word_embeddings,
        qkv_bias=c.model_type == "qwen2" or c.attention_bias,
        o_bias=c.attention_bias,
        mlp_bias=c.mlp_bias,
        bos_token_id=bos if isinstance(bos, int) and not isinstance(bos, bool) else None,
        eos_token_ids=_int_list(c.eos_token_id, "eos_token_id"),
    )


def load_config(model_dir: Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError("checkpoint folder has no config.json") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"config.json is unreadable: {type(exc).__name__}") from None
    if not isinstance(raw, dict):
        raise CheckpointError("config.json must hold an object")
    cfg = parse_config(raw)
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.exists():
        # generation_config.json's eos ids win, as in transformers' generate().
        gen = json.loads(gen_path.read_text())
        eos = _int_list(gen.get("eos_token_id"), "generation_config.eos_token_id")
        if eos:
            cfg = replace(cfg, eos_token_ids=eos)
    return cfg


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name the engine needs, with its shape (Hugging Face naming)."""
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            }
        )
        if cfg.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,)})
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.mlp_bias:
            for name, size in (("gate_proj", i), ("up_proj", i), ("down_proj", h)):
                shapes[p + f"mlp.{name}.bias"] = (size,)
    return shapes


def load_weights(model_dir: Path, cfg: ModelConfig, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Read every needed tensor from the folder's ``*.safetensors`` files, checked against the config,
    in ``dtype`` (None: as stored)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise CheckpointError("checkpoint folder has no *.safetensors file")
    wanted = expected_tensors(cfg)
    out: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name in wanted:
                    out[name] = f.get_tensor(name)
    check_tensors(out, cfg)
    return {name: out[name] if dtype is None else out[name].to(dtype) for name in wanted}


def check_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Refuse a set of tensors that lacks one the engine needs, or has one of the wrong shape or kind."""
    wanted = expected_tensors(cfg)
    missing = sorted(set(wanted) - set(tensors))
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(f"checkpoint lacks tensor(s) {missing[:3]}{more}")
    for name, shape in wanted.items():
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(f"tensor {name} has shape {tuple(tensors[name].shape)}, expected {shape}")
        if not tensors[name].is_floating_point():
            raise CheckpointError(f"tensor {name} is not floating point")
