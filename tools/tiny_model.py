"""Write the project's embedded default model: a small random Llama checkpoint folder.

The folder is a regular Hugging Face checkpoint (``config.json``, ``model.safetensors``,
``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``) that
``transformers``, vLLM and genai-perf load as-is. Nothing is downloaded: the weights come
from a seeded ``torch.Generator`` and the tokenizer is a byte-level BPE trained on a
corpus shipped beside this module (``tiny_corpus.txt``), so two builds with the same seed
are byte-identical.

The weights are random, but scaled so that the context (attention over earlier tokens)
outweighs the current token's embedding: greedy decoding then wanders over many tokens
instead of looping on one to three, and different prompts give different continuations.

This module must not import ``transformers``: it is a runtime tool, and ``transformers``
is only the test oracle.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from disagg_tools.folder import CHECKPOINT_FILES, FolderError, read_stamp, staging, write_json

log = logging.getLogger("disagg.tiny_model")

# Bump when anything that changes the written bytes changes (init, corpus, dims, file
# set), so an existing folder from an older builder is rebuilt by ``--if-missing``.
BUILDER_VERSION = 1
STAMP_FILE = "disagg_tiny_model.json"
MODEL_FILES = (*CHECKPOINT_FILES, STAMP_FILE)

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = (PAD, BOS, EOS)  # ids 0, 1, 2 in this order


@dataclass(frozen=True)
class TinyLlamaDims:
    """Shape of the embedded model (head_dim = hidden_size / num_attention_heads = 64)."""

    vocab_size: int = 1024
    hidden_size: int = 512
    intermediate_size: int = 1408
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


DIMS = TinyLlamaDims()

# Query/key gain above 1 sharpens attention, so which earlier tokens a position attends
# to depends strongly on the content; residual-update gain of 1 keeps each layer's
# contribution comparable to the embedding rather than negligible.
QK_GAIN = 2.0
OUT_GAIN = 1.0


# --------------------------------------------------------------------------- corpus
# Written for this project (``tiny_corpus.txt``). Varied on purpose (prose, dialogue, numbers,
# code, markup) so the BPE merges cover common English words, whitespace runs and code punctuation.
CORPUS_FILE = Path(__file__).with_name("tiny_corpus.txt")


def read_corpus() -> str:
    """The corpus the tokenizer is trained on (``tiny_corpus.txt`` beside this module, UTF-8).

    Read as bytes and decoded, with no newline translation, so the trained tokenizer, hence the
    model folder, depends on the file's bytes alone.
    """
    return CORPUS_FILE.read_bytes().decode("utf-8")


# ----------------------------------------------------------------------- tokenizer
def train_tokenizer(vocab_size: int = DIMS.vocab_size) -> Tokenizer:
    """Train the byte-level BPE on the corpus (``read_corpus``); ids 0, 1, 2 are ``<pad>``, ``<s>``, ``</s>``.

    Byte-level means every UTF-8 string encodes (no unknown token) and decodes back to
    the same bytes. Encoding prepends ``<s>`` through the post-processor.
    """
    tokenizer = Tokenizer(models.BPE())
    # No normalizer: any normalisation would break exact round trips of the input.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,  # the corpus is small; allow rare pairs so the vocab fills up
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_corpus_lines(), trainer=trainer)
    got = tokenizer.get_vocab_size()
    if got != vocab_size:
        # The model's embedding is sized to vocab_size; a smaller tokenizer would leave
        # ids the model can emit but the tokenizer cannot decode.
        raise RuntimeError(f"tokenizer trained to {got} tokens, expected {vocab_size}")
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    return tokenizer


def _corpus_lines() -> Iterator[str]:
    # Keep the newline on each line so the merges learn indentation and line breaks.
    yield from read_corpus().strip().splitlines(keepends=True)


# -------------------------------------------------------------------------- weights
def init_weights(dims: TinyLlamaDims, seed: int) -> dict[str, torch.Tensor]:
    """Random fp32 weights under the standard HF Llama tensor names.

    The scales are chosen for varied greedy output, not for learning: unit-variance
    embeddings, projections that keep each residual update near unit RMS (so after a
    few layers the context dominates the current token), and sharper attention logits.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    h, inter, hd = dims.hidden_size, dims.intermediate_size, dims.head_dim
    q_out, kv_out = dims.num_attention_heads * hd, dims.num_key_value_heads * hd

    def normal(shape: tuple[int, int], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    def norm_weight() -> torch.Tensor:
        # Around 1 with some spread, so channels are not all weighted alike.
        return 1.0 + 0.2 * torch.randn((h,), generator=gen, dtype=torch.float32)

    # Insertion order fixes the draw order from the generator, hence the bytes.
    weights: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal((dims.vocab_size, h), 1.0)}
    for i in range(dims.num_hidden_layers):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm_weight()
        weights[p + "self_attn.q_proj.weight"] = normal((q_out, h), QK_GAIN / math.sqrt(h))
        weights[p + "self_attn.k_proj.weight"] = normal((kv_out, h), QK_GAIN / math.sqrt(h))
        weights[p + "self_attn.v_proj.weight"] = normal((kv_out, h), 1.0 / math.sqrt(h))
        weights[p + "self_attn.o_proj.weight"] = normal((h, q_out), OUT_GAIN / math.sqrt(q_out))
        weights[p + "post_attention_layernorm.weight"] = norm_weight()
        weights[p + "mlp.gate_proj.weight"] = normal((inter, h), 1.0 / math.sqrt(h))
        weights[p + "mlp.up_proj.weight"] = normal((inter, h), 1.0 / math.sqrt(h))
        weights[p + "mlp.down_proj.weight"] = normal((h, inter), OUT_GAIN / math.sqrt(inter))
    weights["model.norm.weight"] = norm_weight()
    lm_head = normal((dims.vocab_size, h), 1.0 / math.sqrt(h))
    # Special tokens get a zero row, hence logit 0, far below the top of ~1000 random
    # logits: greedy decoding never emits <pad>/<s>/</s>, so output runs to max_tokens.
    lm_head[: len(SPECIAL_TOKENS)] = 0.0
    weights["lm_head.weight"] = lm_head
    return weights


# --------------------------------------------------------------------------- configs
def model_config(dims: TinyLlamaDims) -> dict[str, Any]:
    """``config.json`` for ``LlamaForCausalLM`` in transformers-5 spelling (rope_parameters)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": dims.vocab_size,
        "hidden_size": dims.hidden_size,
        "intermediate_size": dims.intermediate_size,
        "num_hidden_layers": dims.num_hidden_layers,
        "num_attention_heads": dims.num_attention_heads,
        "num_key_value_heads": dims.num_key_value_heads,
        "head_dim": dims.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": dims.max_position_embeddings,
        "rms_norm_eps": dims.rms_norm_eps,
        "rope_parameters": {"rope_theta": dims.rope_theta, "rope_type": "default"},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "pad_token_id": SPECIAL_TOKENS.index(PAD),
        "bos_token_id": SPECIAL_TOKENS.index(BOS),
        "eos_token_id": SPECIAL_TOKENS.index(EOS),
        "dtype": "float32",
        # transformers >= 5 reads "dtype"; older readers (transformers 4, some vLLM
        # versions) read "torch_dtype". Both agree, and transformers 5 accepts both silently.
        "torch_dtype": "float32",
    }


def generation_config() -> dict[str, Any]:
    """Greedy by default; no sampling knobs."""
    return {
        "bos_token_id": SPECIAL_TOKENS.index(BOS),
        "eos_token_id": SPECIAL_TOKENS.index(EOS),
        "pad_token_id": SPECIAL_TOKENS.index(PAD),
        "do_sample": False,
    }


def tokenizer_config(dims: TinyLlamaDims) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": dims.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }


# ----------------------------------------------------------------------------- build
def build(out_dir: Path, *, seed: int = 0) -> Path:
    """Write the model folder to ``out_dir`` atomically and return its path.

    The files are written into a temporary sibling folder that is then renamed into place, so a
    concurrent reader sees either no folder or a complete one. An existing folder at ``out_dir`` is
    replaced only if this builder made it (it carries the stamp); anything else there is refused
    with ``FolderError`` and left untouched.
    """
    with staging(Path(out_dir), STAMP_FILE) as tmp:
        _write_files(tmp, DIMS, seed)
    return Path(out_dir)


def is_complete(out_dir: Path, *, seed: int = 0) -> bool:
    """True if ``out_dir`` holds every file, written by this builder version with ``seed``."""
    out_dir = Path(out_dir)
    if not all((out_dir / name).is_file() for name in MODEL_FILES):
        return False
    return read_stamp(out_dir, STAMP_FILE) == _stamp(seed)


def _stamp(seed: int) -> dict[str, Any]:
    return {"builder_version": BUILDER_VERSION, "seed": seed}


def _write_files(folder: Path, dims: TinyLlamaDims, seed: int) -> None:
    tokenizer = train_tokenizer(dims.vocab_size)
    (folder / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    write_json(folder / "tokenizer_config.json", tokenizer_config(dims))
    write_json(folder / "config.json", model_config(dims))
    write_json(folder / "generation_config.json", generation_config())
    save_file(init_weights(dims, seed), str(folder / "model.safetensors"), metadata={"format": "pt"})
    # The stamp is written last: its presence marks the folder complete.
    write_json(folder / STAMP_FILE, _stamp(seed))


def main(argv: list[str] | None = None) -> int:
    """``disagg make-model``: write the tiny model folder; 0 on success, 2 on bad input."""
    parser = argparse.ArgumentParser(
        prog="disagg make-model",
        description="Write the embedded tiny Llama checkpoint (random weights, BPE tokenizer).",
    )
    parser.add_argument("--out", required=True, type=Path, help="target folder")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument(
        "--if-missing", action="store_true", help="do nothing if a complete model for this seed is there"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(name)s: %(message)s")
    if args.seed < 0:
        parser.error("--seed must be >= 0")
    if args.if_missing and is_complete(args.out, seed=args.seed):
        log.info("model already present at %s", args.out)
        return 0
    try:
        build(args.out, seed=args.seed)
    except FolderError as exc:
        log.error("%s", exc)
        return 2
    except OSError as exc:
        log.error("cannot write model to %s: %s", args.out, exc.strerror or exc)
        return 1
    log.info("wrote tiny Llama model (seed %d) to %s", args.seed, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
