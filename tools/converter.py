"""GGUF file → Hugging Face checkpoint folder the engine (and transformers, vLLM) load as-is.

Read and dequantized with the ``gguf`` library (llama.cpp's own Python package); nothing here parses
the file format or implements a quantization kernel. What this module knows is how llama.cpp's
converter changed a Hugging Face checkpoint on the way in, and undoes it:

- tensor names (``blk.N.attn_q.weight`` → ``model.layers.N.self_attn.q_proj.weight``);
- the rows of Q and K in the ``llama`` architecture, permuted per head from the Hugging Face
  half-split RoPE layout to llama.cpp's interleaved pairs (``_unpermute`` is the inverse);
- the tokenizer, flattened into metadata arrays (tokens, merges, token types, special ids), rebuilt
  as a ``tokenizer.json`` with the ``tokenizers`` library.

Weights are stored as the exact float32 values the quantized blocks decode to, in a fixed order, so
two conversions of one file are byte-identical. The folder's stamp (``disagg_checkpoint.json``)
records the converter version, the source file's SHA-256 and every written file's SHA-256: the
checkpoint's fingerprint.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from disagg_tools.folder import CHECKPOINT_FILES, read_stamp, staging, write_json

log = logging.getLogger("disagg.converter")

# Bump when anything that changes the written bytes changes.
CONVERTER_VERSION = 1
STAMP_FILE = "disagg_checkpoint.json"
MODEL_FILES = CHECKPOINT_FILES
SUPPORTED_ARCHITECTURES = ("llama",)
# tokenizer.ggml.pre values whose pre-tokenization this module reproduces: GPT-2's byte-level regex,
# with digits split one by one first for the StarCoder family (SmolLM among them).
PRE_TOKENIZERS = {"default": False, "gpt-2": False, "smollm": True, "starcoder": True}
# llama.cpp token types (gguf.TokenType): control tokens are special, user-defined ones are added
# tokens that are not special.
CONTROL, USER_DEFINED = 3, 4

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


class ConversionError(ValueError):
    """The GGUF file is not one this converter can turn into a checkpoint; the message says why."""


@dataclass(frozen=True)
class Metadata:
    """The GGUF key/value pairs, decoded to Python values."""

    values: dict[str, Any]

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.values:
            raise ConversionError(f"GGUF metadata lacks {key!r}")
        return self.values[key]


def read_metadata(reader: Any) -> Metadata:
    values: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        values[key] = field.contents()
    return Metadata(values)


# ---------------------------------------------------------------------------------- configs
def model_config(meta: Metadata, tied: bool) -> dict[str, Any]:
    """``config.json`` (``LlamaForCausalLM``, transformers-5 spelling) from the GGUF metadata."""
    arch = meta.require("general.architecture")
    hidden = int(meta.require(f"{arch}.embedding_length"))
    heads = int(meta.require(f"{arch}.attention.head_count"))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ConversionError(f"unsupported partial rotary embedding ({arch}.rope.dimension_count)")
    if meta.get(f"{arch}.rope.scaling.type", "none") not in ("none",):
        raise ConversionError(
            f"unsupported {arch}.rope.scaling.type {meta.get(f'{arch}.rope.scaling.type')!r}"
        )
    tokens = meta.require("tokenizer.ggml.tokens")
    vocab = int(meta.get(f"{arch}.vocab_size", len(tokens)))
    bos, eos, pad = _special_ids(meta)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(meta.require(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(meta.require(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta.require(f"{arch}.context_length")),
        "rms_norm_eps": float(meta.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_parameters": {
            "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            "rope_type": "default",
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "use_cache": True,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "dtype": "float32",
        "torch_dtype": "float32",
    }


def _special_ids(meta: Metadata) -> tuple[int | None, int | None, int | None]:
    def one(key: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}")
        return int(value) if value is not None else None

    return one("bos_token_id"), one("eos_token_id"), one("padding_token_id")


def generation_config(meta: Metadata) -> dict[str, Any]:
    bos, eos, pad = _special_ids(meta)
    return {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad, "do_sample": False}


# -------------------------------------------------------------------------------- tokenizer
def build_tokenizer(meta: Metadata) -> Tokenizer:
    """A byte-level BPE ``Tokenizer`` from the flattened GGUF vocabulary.

    Only ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE) is supported; SentencePiece vocabularies
    are refused. No BOS is added on encode: the chat template writes its own markers, and the
    Hugging Face tokenizers these files come from add none either (``add_bos_token`` in the GGUF is
    llama.cpp's setting for its own runtime).
    """
    kind = meta.require("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConversionError(f"unsupported tokenizer.ggml.model {kind!r} (only byte-level BPE, 'gpt2')")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ConversionError(
            f"unsupported tokenizer.ggml.pre {pre!r} (supported: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    tokens: list[str] = list(meta.require("tokenizer.ggml.tokens"))
    types: list[int] = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in meta.require("tokenizer.ggml.merges")]
    if any(len(m) != 2 for m in merges):
        raise ConversionError("tokenizer.ggml.merges holds an entry that is not two tokens")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ConversionError("tokenizer.ggml.tokens holds duplicate tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if PRE_TOKENIZERS[pre]:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    added = [
        AddedToken(tokens[i], special=t == CONTROL, normalized=False)
        for i, t in enumerate(types)
        if t in (CONTROL, USER_DEFINED)
    ]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    return tok


def tokenizer_config(meta: Metadata, tokens: list[str]) -> dict[str, Any]:
    bos, eos, pad = _special_ids(meta)
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    arch = meta.require("general.architecture")

    def name(i: int | None) -> str | None:
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name(bos),
        "eos_token": name(eos),
        "pad_token": name(pad),
        "unk_token": name(None if unk is None else int(unk)),
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.require(f"{arch}.context_length")),
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config


# ---------------------------------------------------------------------------------- weights
def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row permutation of a Q or K weight ([heads*head_dim, hidden]).

    llama.cpp stores each head's rows as (head_dim/2, 2) interleaved pairs; Hugging Face keeps the
    two halves of the head apart (rotate_half). Shape: [H*D, C] → [H, D/2, 2, C] → [H, 2, D/2, C].
    """
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str:
    """The Hugging Face tensor name of a GGUF tensor name; refuse names this converter does not know."""
    base, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        raise ConversionError(f"unexpected tensor {gguf_name!r}")
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{int(parts[1])}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    raise ConversionError(f"unsupported tensor {gguf_name!r}")


def read_weights(reader: Any, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32 under its Hugging Face name, Q/K rows un-permuted."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    out: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        # GGUF lists dimensions fastest-first; numpy (and Hugging Face) want them slowest-first.
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            values = np.asarray(tensor.data, dtype=np.float32)
        else:
            values = dequantize(tensor.data, tensor.tensor_type)
        # A copy: the reader's arrays are read-only views of the memory-mapped file.
        values = np.array(values.reshape(shape), dtype=np.float32, copy=True)
        if name.endswith("self_attn.q_proj.weight"):
            values = _unpermute(values, config["num_attention_heads"])
        elif name.endswith("self_attn.k_proj.weight"):
            values = _unpermute(values, config["num_key_value_heads"])
        out[name] = torch.from_numpy(np.ascontiguousarray(values))
    return dict(sorted(out.items()))


# --------------------------------------------------------------------------------- convert
def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def convert(gguf_path: Path, out_dir: Path, source: dict[str, Any] | None = None) -> Path:
    """Write the checkpoint folder of ``gguf_path`` to ``out_dir`` (which must not exist, or be an
    earlier output of this converter) and return ``out_dir``."""
    from gguf import GGUFReader

    gguf_path = Path(gguf_path)
    try:
        reader = GGUFReader(str(gguf_path))
    except (OSError, ValueError) as exc:
        raise ConversionError(f"cannot read GGUF file {gguf_path.name}: {exc}") from None
    meta = read_metadata(reader)
    arch = meta.require("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConversionError(
            f"unsupported general.architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    tied = all(t.name != "output.weight" for t in reader.tensors)
    config = model_config(meta, tied)
    tokenizer = build_tokenizer(meta)
    weights = read_weights(reader, config)
    _check_tensors(weights, config)
    tokens = list(meta.require("tokenizer.ggml.tokens"))
    with staging(out_dir, STAMP_FILE) as tmp:
        (tmp / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
        write_json(tmp / "tokenizer_config.json", tokenizer_config(meta, tokens))
        write_json(tmp / "config.json", config)
        write_json(tmp / "generation_config.json", generation_config(meta))
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        stamp = {
            "converter_version": CONVERTER_VERSION,
            "source": {"file": gguf_path.name, "sha256": sha256_file(gguf_path), **(source or {})},
            "files": {name: sha256_file(tmp / name) for name in MODEL_FILES},
        }
        write_json(tmp / STAMP_FILE, stamp)  # last: its presence marks the folder complete
    log.info("converted %s to %s", gguf_path.name, out_dir)
    return Path(out_dir)


def _check_tensors(weights: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """The engine's own checks (every tensor present, right shape), before anything is written."""
    from disagg.engine.checkpoint import check_tensors, parse_config

    try:
        check_tensors(weights, parse_config(config))
    except ValueError as exc:
        raise ConversionError(f"GGUF does not make a complete checkpoint: {exc}") from None


def is_converted(out_dir: Path, source_sha256: str | None = None, verify: bool = False) -> bool:
    """True if ``out_dir`` is a complete output of this converter version (of that source, if given).

    With ``verify`` every file's SHA-256 is checked against the stamp; otherwise only presence.
    """
    stamp = read_stamp(out_dir, STAMP_FILE)
    if stamp is None or stamp.get("converter_version") != CONVERTER_VERSION:
        return False
    if source_sha256 is not None and stamp.get("source", {}).get("sha256") != source_sha256:
        return False
    files = stamp.get("files", {})
    if set(files) != set(MODEL_FILES) or not all((Path(out_dir) / n).is_file() for n in files):
        return False
    return not verify or all(sha256_file(Path(out_dir) / n) == digest for n, digest in files.items())
