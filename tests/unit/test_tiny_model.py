"""The embedded tiny Llama: deterministic bytes, loadable by transformers, varied greedy output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from disagg_tools import tiny_model

PROMPTS = (
    "The harbour town woke slowly.",
    "def mean(values):",
    "Numbers and dates: 1, 2, 3,",
    "naïve café — 日本語 🙂",
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model.build(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def _read_all(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_two_builds_are_byte_identical(model_dir: Path, tmp_path: Path) -> None:
    again = tiny_model.build(tmp_path / "again")
    first, second = _read_all(model_dir), _read_all(again)
    assert sorted(first) == sorted(tiny_model.MODEL_FILES)
    assert first == second


def test_another_seed_changes_only_the_weights(model_dir: Path, tmp_path: Path) -> None:
    other = _read_all(tiny_model.build(tmp_path / "seed1", seed=1))
    base = _read_all(model_dir)
    differing = {name for name in base if base[name] != other[name]}
    assert differing == {"model.safetensors", tiny_model.STAMP_FILE}


def test_build_leaves_no_temporary_folders(tmp_path: Path) -> None:
    tiny_model.build(tmp_path / "m")
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_files_are_world_readable(model_dir: Path) -> None:
    for path in [model_dir, *model_dir.iterdir()]:
        assert path.stat().st_mode & 0o444 == 0o444, path.name


def test_config_uses_rope_parameters_spelling(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
    assert "rope_theta" not in config
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is False
    assert config["dtype"] == "float32"
    assert config["num_attention_heads"] * config["head_dim"] == config["hidden_size"]


def test_config_matches_tokenizer_special_ids(model_dir: Path, hf_tokenizer) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert config["bos_token_id"] == generation["bos_token_id"] == hf_tokenizer.bos_token_id
    assert config["eos_token_id"] == generation["eos_token_id"] == hf_tokenizer.eos_token_id
    assert config["pad_token_id"] == hf_tokenizer.pad_token_id
    assert len(hf_tokenizer) == config["vocab_size"]


def test_weights_have_hf_llama_names_and_fp32(model_dir: Path) -> None:
    dims = tiny_model.DIMS
    tensors = load_file(model_dir / "model.safetensors")
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(dims.num_hidden_layers):
        expected |= {
            f"model.layers.{i}.{name}.weight"
            for name in (
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_proj",
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
                "input_layernorm",
                "post_attention_layernorm",
            )
        }
    assert set(tensors) == expected
    assert all(t.dtype == torch.float32 for t in tensors.values())
    kv_width = dims.num_key_value_heads * dims.head_dim
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (kv_width, dims.hidden_size)
    assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (dims.hidden_size, dims.intermediate_size)


def test_transformers_loads_model_with_expected_size(hf_model) -> None:
    n_params = sum(p.numel() for p in hf_model.parameters())
    assert n_params == 24_650_240
    assert hf_model.config.num_key_value_heads == 4


@pytest.mark.parametrize("text", ["naïve café — 日本語 🙂", "  two leading spaces\n\tand a tab ", "x"])
def test_tokenizer_round_trips_utf8(hf_tokenizer, text: str) -> None:
    ids = hf_tokenizer(text).input_ids
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == text


def test_encode_prepends_bos_once(hf_tokenizer) -> None:
    ids = hf_tokenizer("hello there").input_ids
    assert ids[0] == hf_tokenizer.bos_token_id
    assert ids.count(hf_tokenizer.bos_token_id) == 1
    assert hf_tokenizer("hello there", add_special_tokens=False).input_ids == ids[1:]


def test_greedy_output_is_varied_and_prompt_dependent(hf_model, hf_tokenizer) -> None:
    special = set(range(len(tiny_model.SPECIAL_TOKENS)))
    continuations = []
    for prompt in PROMPTS:
        ids = hf_tokenizer(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = hf_model.generate(ids, max_new_tokens=64, do_sample=False)
        new = out[0, ids.shape[1] :].tolist()
        assert len(new) == 64  # never stops early: special tokens have zero logits
        assert len(set(new)) >= 20, (prompt, new)
        assert not special & set(new)
        continuations.append(tuple(new))
    assert len(set(continuations)) == len(PROMPTS)


def test_main_if_missing_keeps_existing_folder(tmp_path: Path) -> None:
    out = tmp_path / "m"
    assert tiny_model.main(["--out", str(out)]) == 0
    before = (out / "model.safetensors").stat().st_ino
    assert tiny_model.main(["--out", str(out), "--if-missing"]) == 0
    assert (out / "model.safetensors").stat().st_ino == before


def test_main_rebuilds_its_own_folder_for_another_seed(tmp_path: Path) -> None:
    out = tmp_path / "m"
    assert tiny_model.main(["--out", str(out)]) == 0
    assert tiny_model.is_complete(out, seed=0)
    assert not tiny_model.is_complete(out, seed=3)
    assert tiny_model.main(["--out", str(out), "--if-missing", "--seed", "3"]) == 0
    assert tiny_model.is_complete(out, seed=3)


@pytest.mark.parametrize("content", [{}, {"config.json": "{}"}, {"model.safetensors": "x" * 100}])
def test_main_refuses_a_folder_it_did_not_create(
    tmp_path: Path, content: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """A folder from elsewhere (empty, half a checkpoint, someone's weights) is refused, not replaced."""
    out = tmp_path / "m"
    out.mkdir()
    for name, text in content.items():
        (out / name).write_text(text)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    for flags in ([], ["--if-missing"]):
        caplog.clear()
        assert tiny_model.main(["--out", str(out), *flags]) == 2
        assert "refusing to write" in caplog.text
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary folder left


def test_main_rejects_negative_seed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        tiny_model.main(["--out", str(tmp_path / "m"), "--seed", "-1"])
    assert exc.value.code == 2
    assert "--seed" in capsys.readouterr().err


def test_module_does_not_import_transformers() -> None:
    code = "import sys, disagg_tools.tiny_model; print('transformers' in sys.modules)"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert result.stdout.strip() == "False"
