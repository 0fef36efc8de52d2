"""The real default model: SmolLM2-135M-Instruct as ``disagg fetch-model`` converts it, against
transformers loading the same GGUF file with its own loader (an independent reading of the file)."""

from __future__ import annotations

import functools

import pytest
import torch
from checkpoints import comparable_prefix, reference_greedy

from disagg.engine.engine import Engine, EngineConfig
from disagg.engine.params import SamplingParams
from disagg.engine.sequence import Request
from disagg.engine.tokenizer import Tokenizer
from disagg.pool.offline import generate
from disagg_tools.catalog import SMOLLM2, package_file

pytestmark = pytest.mark.slow

NEW_TOKENS = 40
EOS = 2  # <|im_end|>


def chat(question: str) -> str:
    """SmolLM2's chat template, as its tokenizer_config.json's template renders one user turn."""
    return (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    )


LONG = (
    "Disaggregated serving runs the prompt phase and the token phase of a language model on separate "
    "devices. The prompt phase is compute bound: it reads the whole prompt at once. The token phase is "
    "bound by memory bandwidth: each step reads every weight to produce one token per sequence. "
)
PROMPTS = [
    "The capital of France is",
    chat("What is the capital of France?"),
    chat("Write a Python function that returns the square of a number."),
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    chat("Summarize this text in one sentence:\n" + LONG * 4),
]
TOKENIZER_TEXTS = [
    *PROMPTS,
    "héllo wörld, 日本語, Ελληνικά, emoji 🎉🚀 and a zero-width\u200bjoiner",
    "  leading spaces, tabs\tand\r\nnewlines\n\n\n",
    "numbers 3.14159, 1,000,000 and 2026-12-01T10:00:00Z",
    'class A:\n    def __init__(self):\n        self.x = {"k": [1, 2]}  # comment\n',
    "<|im_start|>user\nHi<|im_end|>\n<|endoftext|><repo_name>x<file_sep>",
    "<|im_start|> spaced <|im_end|>",
]


@pytest.fixture(scope="module")
def gguf_path():
    return package_file(SMOLLM2, install=False)


@pytest.fixture(scope="module", autouse=True)
def gguf_parsed_once():
    """transformers parses the GGUF file anew for its config, its weights and its tokenizer (about 9 s
    each here, mostly the vocabulary's strings) and rebuilds gguf's tensor-name map once per module of
    the model (about 9 s in all). Both are pure reads of one file: keep the first of each for this
    module. Only the time changes; transformers still reads the file with its own loader."""
    gguf = pytest.importorskip("gguf")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="module")
def reference_model(gguf_path):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    return Engine(EngineConfig(model_dir=smollm2_dir, dtype="float32", kv_cache_mb=128))


def test_tokenizer_ids_equal_transformers_gguf_tokenizer(smollm2_dir, gguf_path):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    ours = Tokenizer(smollm2_dir)
    for text in TOKENIZER_TEXTS:
        ids = ours.encode(text)
        assert ids == reference.encode(text, add_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.token_id("<|im_end|>") == EOS


def test_prompt_lengths_span_5_to_300_tokens(smollm2_dir):
    lengths = [len(Tokenizer(smollm2_dir).encode(p)) for p in PROMPTS]
    assert min(lengths) == 5 and 250 <= max(lengths) <= 300, lengths


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_greedy_tokens_equal_transformers_on_the_gguf(index, smollm2_dir, engine, reference_model):
    prompt = Tokenizer(smollm2_dir).encode(PROMPTS[index])
    expected, gaps = reference_greedy(None, prompt, NEW_TOKENS, model=reference_model, eos_token_id=EOS)
    params = SamplingParams(max_tokens=NEW_TOKENS, min_length=NEW_TOKENS)
    got, reason = generate(engine, Request(tuple(prompt), params))
    upto = comparable_prefix(gaps)
    assert upto >= 8, f"reference has a near-tie at step {upto}"
    assert got[:upto] == expected[:upto]
    assert reason == "length" and len(got) == NEW_TOKENS
    assert engine.kv.free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_answers_the_capital_of_france(smollm2_dir, dtype):
    tokenizer = Tokenizer(smollm2_dir)
    engine = Engine(EngineConfig(model_dir=smollm2_dir, dtype=dtype, kv_cache_mb=32))
    prompt = tokenizer.encode(chat("What is the capital of France?"))
    token_ids, reason = generate(engine, Request(tuple(prompt), SamplingParams(max_tokens=24)))
    assert reason == "stop" and token_ids[-1] == EOS
    assert "Paris" in tokenizer.decode(token_ids)


def test_an_fp32_prefill_with_bf16_kv_feeds_a_bf16_decode_that_still_answers(smollm2_dir):
    """The pairing kv_dtype exists for: prefill computing in fp32, its KV rounded to bf16 and handed
    to a bf16 decode engine (its kernels reading the cache): the answer survives the hand-off."""
    tokenizer = Tokenizer(smollm2_dir)
    src = Engine(EngineConfig(model_dir=smollm2_dir, dtype="float32", kv_dtype="bfloat16", kv_cache_mb=32))
    dst = Engine(EngineConfig(model_dir=smollm2_dir, dtype="bfloat16", kv_cache_mb=32))
    prompt = tokenizer.encode(chat("What is the capital of France?"))
    (out,) = src.prefill([Request(tuple(prompt), SamplingParams(max_tokens=24))], decode=False)
    state, layout, blocks = src.export_kv(out.seq_id)
    seq_id = dst.import_kv(state, layout, src.kv.memory[torch.tensor(blocks)])
    tokens = list(state.generated_token_ids)
    while dst.active_sequences():
        tokens += [o.token_id for o in dst.decode_step() if o.seq_id == seq_id]
    assert tokens[-1] == EOS and "Paris" in tokenizer.decode(tokens)
