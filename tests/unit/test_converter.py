"""GGUF → checkpoint conversion (``disagg fetch-model --gguf``): a round trip through the ``gguf``
library's own writer, determinism, refusals, and never writing into a folder it did not create."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from disagg.engine.engine import Engine, EngineConfig
from disagg.engine.params import SamplingParams
from disagg.engine.sequence import Request
from disagg.engine.tokenizer import Tokenizer
from disagg.pool.offline import generate
from disagg_tools import catalog, converter

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over 12345 lazy dogs.",
    "héllo wörld, 日本語 and 🎉 emoji",
    "def f(x):\n    return x ** 2\n\n\tif x: pass",
    "</s> and <s> inside text",
    "",
]


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order, written independently of the converter's inverse: each head's
    first and second halves are interleaved row by row."""
    d = w.shape[0] // heads
    out = np.empty_like(w)
    for h in range(heads):
        block = w[h * d : (h + 1) * d]
        out[h * d : (h + 1) * d : 2] = block[: d // 2]
        out[h * d + 1 : (h + 1) * d : 2] = block[d // 2 :]
    return out


def write_gguf(model_dir: Path, path: Path, *, arch: str = "llama", tok_model: str = "gpt2") -> Path:
    """Write a Hugging Face Llama checkpoint as an F32 GGUF with the ``gguf`` library's writer, laid
    out as llama.cpp's converter lays it out (names, Q/K rows, flattened tokenizer)."""
    import gguf

    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    weights = load_file(str(model_dir / "model.safetensors"))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    writer.add_tokenizer_model(tok_model)
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([3 if t in special else 1 for t, _ in vocab])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_pad_token_id(cfg["pad_token_id"])
    names = {v: k for k, v in converter._LAYER_TENSORS.items()}
    for name, tensor in weights.items():
        array = tensor.numpy()
        if name.startswith("model.layers."):
            _, _, n, *rest = name.split(".")
            module = ".".join(rest[:-1])
            if module == "self_attn.q_proj":
                array = _permute(array, cfg["num_attention_heads"])
            elif module == "self_attn.k_proj":
                array = _permute(array, cfg["num_key_value_heads"])
            gguf_name = f"blk.{n}.{names[module]}.{rest[-1]}"
        else:
            gguf_name = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
            }.get(name, "output.weight")
        writer.add_tensor(gguf_name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tiny_model_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def converted(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return converter.convert(tiny_gguf, tmp_path_factory.mktemp("conv") / "tiny")


def test_round_trip_restores_the_weights_exactly(tiny_model_dir: Path, converted: Path) -> None:
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    back = load_file(str(converted / "model.safetensors"))
    assert set(back) == set(original)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and cfg["architectures"] == ["LlamaForCausalLM"]


def test_round_trip_tokenizes_and_generates_the_same_tokens(tiny_model_dir: Path, converted: Path) -> None:
    ours, theirs = Tokenizer(tiny_model_dir), Tokenizer(converted)
    bos = ours.token_id("<s>")
    for text in TEXTS:
        # The tiny tokenizer's post-processor adds <s>; a converted one adds nothing (documented).
        assert ours.encode(text) == [bos, *theirs.encode(text)], text
        assert theirs.decode(theirs.encode(text), skip_special_tokens=False) == text
    prompt = tuple(ours.encode("The quick brown fox"))
    params = SamplingParams(max_tokens=24)
    got = [
        generate(Engine(EngineConfig(model_dir=d, dtype="float32", kv_cache_mb=8)), Request(prompt, params))[
            0
        ]
        for d in (tiny_model_dir, converted)
    ]
    assert got[0] == got[1] and len(got[0]) == 24


def test_conversion_is_deterministic_and_stamped(tiny_gguf: Path, converted: Path, tmp_path: Path) -> None:
    again = converter.convert(tiny_gguf, tmp_path / "again")
    files = sorted(p.name for p in converted.iterdir())
    assert files == sorted([*converter.MODEL_FILES, converter.STAMP_FILE])
    for name in files:
        assert (again / name).read_bytes() == (converted / name).read_bytes(), name
    stamp = json.loads((converted / converter.STAMP_FILE).read_text())
    assert stamp["source"]["sha256"] == converter.sha256_file(tiny_gguf)
    assert converter.is_converted(converted, verify=True)
    assert converter.is_converted(converted, source_sha256=stamp["source"]["sha256"])
    assert not converter.is_converted(converted, source_sha256="0" * 64)


def test_a_tampered_file_fails_verification(converted: Path, tmp_path: Path, tiny_gguf: Path) -> None:
    copy = converter.convert(tiny_gguf, tmp_path / "copy")
    (copy / "config.json").write_text((copy / "config.json").read_text() + " ")
    assert converter.is_converted(copy)  # presence only
    assert not converter.is_converted(copy, verify=True)


@pytest.mark.parametrize("content", [{}, {"config.json": "{}"}, {"model.safetensors": "weights"}])
def test_never_writes_into_a_folder_it_did_not_create(
    tiny_gguf: Path, tmp_path: Path, content: dict[str, str]
) -> None:
    out = tmp_path / "user"
    out.mkdir()
    for name, text in content.items():
        (out / name).write_text(text)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert catalog.main(["--gguf", str(tiny_gguf), "--out", str(out)]) == 2
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["user"]


def test_replaces_its_own_earlier_output(tiny_gguf: Path, tmp_path: Path) -> None:
    out = converter.convert(tiny_gguf, tmp_path / "m")
    inode = (out / "model.safetensors").stat().st_ino
    assert catalog.main(["--gguf", str(tiny_gguf), "--out", str(out)]) == 0
    assert (out / "model.safetensors").stat().st_ino != inode
    assert converter.is_converted(out, verify=True)


@pytest.mark.parametrize(
    ("arch", "tok_model", "field"),
    [("falcon", "gpt2", "general.architecture"), ("llama", "llama", "tokenizer.ggml.model")],
)
def test_unsupported_files_are_refused_naming_the_field(
    tiny_model_dir: Path, tmp_path: Path, arch: str, tok_model: str, field: str
) -> None:
    path = write_gguf(tiny_model_dir, tmp_path / "x.gguf", arch=arch, tok_model=tok_model)
    with pytest.raises(converter.ConversionError, match=field):
        converter.convert(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unpermute_inverts_llama_cpp_row_order() -> None:
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4 * 8, 3)
    assert np.array_equal(converter._unpermute(_permute(w, 4), 4), w)
