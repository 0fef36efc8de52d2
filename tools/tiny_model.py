"""Write the project's embedded default model: a small random Llama checkpoint folder.

The folder is a regular Hugging Face checkpoint (``config.json``, ``model.safetensors``,
``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``) that
``transformers``, vLLM and genai-perf load as-is. Nothing is downloaded: the weights come
from a seeded ``torch.Generator`` and the tokenizer is a byte-level BPE trained on a
corpus embedded below, so two builds with the same seed are byte-identical.

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
# Written for this project. Varied on purpose (prose, dialogue, numbers, code, markup)
# so the BPE merges cover common English words, whitespace runs and code punctuation.
CORPUS = r"""
The harbour town woke slowly. Fishing boats came in before dawn, their lamps still
burning, and the gulls followed them like a noisy escort. By seven o'clock the bakery
on Mill Street had sold its first hundred loaves, and the ferry to the island was
already late, as it was every Tuesday.

Mara kept the lighthouse log in a green notebook. Each night she wrote the wind, the
height of the swell and the names of the ships that passed. "Nothing remarkable," she
wrote on most nights, although she never quite believed it. A cargo ship carrying
timber, a yacht with a torn sail, a coastguard cutter on patrol: every one of them had
somewhere to be, and she liked to guess where.

When the storm arrived in October it was not a surprise. The barometer had been
falling for two days, the radio had warned everyone twice, and the harbour master had
moved the smaller boats into the inner basin. Still, nobody was ready for the noise.
The wind screamed through the rigging, slates flew from the roofs, and the sea climbed
over the breakwater as if it wanted to see the town for itself.

In the morning the damage was counted. Three windows were broken at the school, the
old pier had lost a section of railing, and a rowing boat was found upside down in the
car park. People stood in small groups and told each other what they had heard in the
night. Then they fetched brooms, ladders and tea, and began to put things right.

A simple recipe for lentil soup: rinse 250 g of red lentils. Chop one onion, two
carrots and a stick of celery. Soften the vegetables in a little oil for ten minutes,
add the lentils, a teaspoon of cumin and 1.2 litres of stock, and simmer for about
twenty-five minutes until the lentils fall apart. Season with salt, pepper and a
squeeze of lemon. It keeps for three days in the fridge and freezes well.

Questions people often ask about trains. Why is my train late? Usually because another
train ahead of it is late, and delays spread along a line like ripples in a pond. Why
can't the train simply go faster to catch up? Because the timetable already assumes a
sensible speed, and the signals keep trains apart for safety. What should I do if I
miss a connection? Ask the staff on the platform; they can often put you on the next
service without a new ticket.

The committee met on Thursday at 18:30 and agreed on four points. First, the library
will open one hour later on Saturdays. Second, the budget for new books rises by 4%.
Third, volunteers are needed for the summer reading club. Fourth, the next meeting is
moved to the second week of September, because the hall is booked for a wedding.

"Are you sure this is the right road?" asked Tom.
"No," said his sister, "but it is the only road, so it will have to be right."
They walked on between the hedges until the church tower appeared above the trees.
"There," she said. "I told you." He decided not to remind her of what she had said.

Good software is written for the next reader. Choose names that say what a thing is
for, keep functions short enough to read in one go, and write down why a decision was
made, not only what the code does. Tests are a form of documentation that cannot drift
out of date without someone noticing. When an error happens, say what went wrong, what
value was wrong, and what the caller can do about it.

def mean(values: list[float]) -> float:
    '''Return the arithmetic mean of a non-empty list.'''
    if not values:
        raise ValueError("mean() needs at least one value")
    return sum(values) / len(values)


class Counter:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, key: str, n: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n

    def most_common(self, k: int) -> list[tuple[str, int]]:
        return sorted(self.counts.items(), key=lambda item: -item[1])[:k]


for i in range(10):
    if i % 3 == 0:
        print(f"{i} is a multiple of three")
    else:
        print(i, "is not")

#include <stdio.h>

int main(void) {
    int total = 0;
    for (int i = 1; i <= 100; i++) {
        total += i;
    }
    printf("sum = %d\n", total);
    return 0;
}

$ mkdir -p build && cd build
$ cmake .. -DCMAKE_BUILD_TYPE=Release
$ make -j8 && ./run_tests --verbose

{"name": "sensor-7", "temperature": 21.5, "humidity": 0.43, "ok": true,
 "readings": [12, 15, 19, 22, 30], "location": {"lat": 51.5, "lon": -0.12}}

SELECT city, COUNT(*) AS visits FROM trips WHERE year = 2023 GROUP BY city ORDER BY
visits DESC LIMIT 10;

<html><body><h1>Welcome</h1><p>This page is <b>under construction</b>.</p></body></html>

A short history of measurement. Early units came from the body: a foot, a hand, the
length of a stride. They were easy to carry but hard to agree on, since no two feet are
alike. Markets and builders needed something better, so towns kept standard rods and
weights in public places, where anyone could check a merchant's scale. Later, scientists
defined units from nature itself, first from the size of the Earth and then from the
speed of light and the properties of atoms. A metre today is the distance light travels
in a vacuum in 1/299,792,458 of a second.

The garden in spring: tulips by the wall, a row of beans climbing their canes, and a
blackbird that sings from the chimney every evening at the same time. Weeding is slow
work, but it is quiet, and an hour passes without anyone noticing. By June there will
be strawberries, if the slugs do not find them first.

Numbers and dates: 1, 2, 3, 10, 42, 100, 256, 1024, 65536; 3.14159, 2.71828, 0.5;
2024-01-15, 12/03/1999, 09:45, 23:59:59. Prices: $4.99, 12.50 EUR, £7. Percentages:
15%, 99.9%, 0.01%. Temperatures: -5 °C, 37 °C, 451 °F.

Words from other places arrive in English all the time: café, naïve, déjà vu, façade,
jalapeño, smörgåsbord, fiancée, Übermensch, résumé. Other scripts too: 日本語, 中文,
한국어, Ελληνικά, русский, العربية, हिन्दी. And a few symbols: → ← ✓ ★ ♥ € — … 🙂 🚀 🌍.

Dear Sam, thank you for the book. I read it on the train and missed my stop, which is
the best review I can give. The chapter about the river was my favourite. Let me know
when you are free next month; we could walk along the canal and have lunch at the mill.
Best wishes, Jo.

Why do cats sit in boxes? Nobody knows for certain. A box is warm, it hides them from
view, and it gives them somewhere safe to watch from. It may also be that a cat simply
likes to be where it is not expected, which is a reason many people would understand.

To be clear about the plan: we start at nine, take the coastal path to the old mill,
stop for lunch, and return over the hill before it gets dark. Bring water, a jacket and
good shoes. If it rains heavily, we will meet at the museum instead and decide there.
"""


# ----------------------------------------------------------------------- tokenizer
def train_tokenizer(vocab_size: int = DIMS.vocab_size) -> Tokenizer:
    """Train the byte-level BPE on ``CORPUS``; ids 0, 1, 2 are ``<pad>``, ``<s>``, ``</s>``.

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
    yield from CORPUS.strip().splitlines(keepends=True)


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
