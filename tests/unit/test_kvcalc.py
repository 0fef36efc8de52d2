"""KV calculator: hand-computed sizes, config parsing, links and CLI errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disagg_tools import kvcalc, tiny_model

# 2 x layers x kv_heads x head_dim x bytes, worked out by hand.
HAND_COMPUTED = {
    "opt-13b": 2 * 40 * 40 * 128 * 2,  # 819,200
    "opt-66b": 2 * 64 * 72 * 128 * 2,  # 2,359,296
    "opt-175b": 2 * 96 * 96 * 128 * 2,  # 4,718,592
    "llama-2-7b": 2 * 32 * 32 * 128 * 2,  # 524,288
    "llama-2-13b": 2 * 40 * 40 * 128 * 2,  # 819,200
    "llama-2-70b": 2 * 80 * 8 * 128 * 2,  # 327,680
    "llama-3-8b": 2 * 32 * 8 * 128 * 2,  # 131,072
    "llama-3-70b": 2 * 80 * 8 * 128 * 2,  # 327,680
    "disagg-tiny": 2 * 8 * 4 * 64 * 4,  # 16,384 (float32)
}


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert kvcalc.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def run_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert kvcalc.main(list(argv)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "Traceback" not in captured.err
    return captured.err


def write_config(tmp_path: Path, **fields) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(fields))
    return tmp_path


@pytest.mark.parametrize(("name", "expected"), sorted(HAND_COMPUTED.items()))
def test_preset_bytes_per_token(capsys, name: str, expected: int) -> None:
    report = run_json(capsys, "--preset", name, "--tokens", "1")
    assert report["bytes_per_token"] == expected
    assert report["bytes_per_request"] == expected


def test_every_preset_is_hand_checked() -> None:
    assert set(kvcalc.PRESETS) == set(HAND_COMPUTED)


def test_llama3_70b_request_batch_and_pcie4_time(capsys) -> None:
    report = run_json(
        capsys, "--preset", "Llama-3-70B", "--tokens", "4096", "--batch", "8", "--links", "pcie4"
    )
    assert report["bytes_per_token"] == 327_680
    assert report["bytes_per_request"] == 1_342_177_280  # 327,680 x 4096 = 1.25 GiB
    assert report["bytes_per_batch"] == 10_737_418_240
    assert report["mha_bytes_per_token"] == 327_680 * 8  # all 64 heads instead of 8
    [link] = report["links"]
    assert link["name"] == "pcie4"
    assert link["seconds_per_request"] == pytest.approx(1_342_177_280 / 32e9)  # 41.94 ms
    assert link["seconds_per_batch"] == pytest.approx(10_737_418_240 / 32e9)


def test_dtype_override_changes_element_size(capsys) -> None:
    report = run_json(capsys, "--preset", "llama-3-70b", "--tokens", "1", "--dtype", "float32")
    assert report["bytes_per_token"] == 2 * 80 * 8 * 128 * 4
    assert report["model"]["dtype_bytes"] == 4


def test_disagg_tiny_preset_matches_the_embedded_model() -> None:
    dims, shape = tiny_model.DIMS, kvcalc.PRESETS["disagg-tiny"]
    assert (shape.num_layers, shape.num_attention_heads, shape.num_kv_heads, shape.head_dim) == (
        dims.num_hidden_layers,
        dims.num_attention_heads,
        dims.num_key_value_heads,
        dims.head_dim,
    )
    assert shape.dtype == tiny_model.model_config(dims)["dtype"]


def test_model_config_defaults_kv_heads_and_head_dim(tmp_path: Path, capsys) -> None:
    model = write_config(tmp_path, num_hidden_layers=40, num_attention_heads=40, hidden_size=5120)
    report = run_json(capsys, "--model", str(model), "--tokens", "10")
    assert report["model"]["num_kv_heads"] == 40
    assert report["model"]["head_dim"] == 128
    assert report["model"]["dtype"] == "float16"  # no dtype in config: the default
    assert report["bytes_per_token"] == 819_200


def test_model_config_reads_gqa_head_dim_and_torch_dtype(tmp_path: Path, capsys) -> None:
    model = write_config(
        tmp_path,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=100,  # deliberately not heads x head_dim: head_dim wins
        head_dim=16,
        torch_dtype="float32",
    )
    report = run_json(capsys, "--model", str(model / "config.json"), "--tokens", "3")
    assert report["bytes_per_token"] == 2 * 2 * 2 * 16 * 4


def test_model_config_under_text_config(tmp_path: Path, capsys) -> None:
    text = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    model = write_config(tmp_path, text_config={**text, "dtype": "bfloat16"})
    assert run_json(capsys, "--model", str(model), "--tokens", "1")["bytes_per_token"] == 131_072


def test_tiny_model_checkpoint(tmp_path: Path, capsys) -> None:
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(tiny_model.model_config(tiny_model.DIMS)))
    assert run_json(capsys, "--model", str(model), "--tokens", "1")["bytes_per_token"] == 16_384


def test_custom_link_adds_and_overrides(capsys) -> None:
    report = run_json(
        capsys, "--preset", "opt-66b", "--tokens", "1000", "--links", "nvlink3,pcie4", "--link", "pcie4=20"
    )
    assert [(link["name"], link["gbps"]) for link in report["links"]] == [("nvlink3", 300.0), ("pcie4", 20.0)]
    assert report["links"][1]["seconds_per_request"] == pytest.approx(2_359_296_000 / 20e9)


def test_default_shows_every_builtin_link(capsys) -> None:
    report = run_json(capsys, "--preset", "llama-3-8b", "--tokens", "1")
    assert [link["name"] for link in report["links"]] == list(kvcalc.LINKS)


def test_link_table_states_units() -> None:
    assert "10^9 bytes" in kvcalc.UNITS_NOTE
    assert kvcalc.LINKS["pcie4"].gbps == 32.0
    assert kvcalc.LINKS["rdma-ib-hdr"].gbps == 25.0  # 200 Gb/s / 8
    assert kvcalc.LINKS["ethernet-100g"].gbps == 12.5


def test_text_output_explains_gqa_and_dtype(capsys) -> None:
    assert kvcalc.main(["--preset", "llama-3-70b", "--tokens", "4096", "--links", "nvlink4"]) == 0
    out = capsys.readouterr().out
    assert "327,680 B" in out
    assert "= 2 x 80 x 8 x 128 x 2" in out
    assert "grouped-query attention" in out
    assert "overstate the cache 8x" in out
    assert "element size" in out
    assert "10^9 bytes" in out


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--tokens", "5"], "--model --preset is required"),
        (["--preset", "gpt-5", "--tokens", "5"], "unknown preset"),
        (["--preset", "opt-66b"], "--tokens"),
        (["--preset", "opt-66b", "--tokens", "many"], "invalid int"),
        (["--preset", "opt-66b", "--tokens", "0"], "at least 1"),
        (["--preset", "opt-66b", "--tokens", "5", "--batch", "-2"], "at least 1"),
        (["--preset", "opt-66b", "--tokens", "5", "--dtype", "int8"], "invalid choice"),
        (["--preset", "opt-66b", "--tokens", "5", "--links", "carrier-pigeon"], "unknown link"),
        (["--preset", "opt-66b", "--tokens", "5", "--link", "fast"], "NAME=GBPS"),
        (["--preset", "opt-66b", "--tokens", "5", "--link", "x=abc"], "not a number"),
        (["--preset", "opt-66b", "--tokens", "5", "--link", "x=0"], "positive"),
        (["--preset", "opt-66b", "--tokens", "5", "--link", "x=nan"], "positive"),
        (["--model", "/no/such/dir", "--tokens", "5"], "no config.json"),
    ],
)
def test_bad_input_exits_2_with_message(capsys, argv: list[str], fragment: str) -> None:
    err = run_error(capsys, *argv)
    assert err.startswith("disagg kvcalc: error:")
    assert fragment in err


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"num_attention_heads": 8, "hidden_size": 512}, "no num_hidden_layers"),
        ({"num_hidden_layers": "8", "num_attention_heads": 8, "hidden_size": 512}, "positive integer"),
        ({"num_hidden_layers": True, "num_attention_heads": 8, "hidden_size": 512}, "positive integer"),
        ({"num_hidden_layers": 8, "num_attention_heads": 8, "hidden_size": 500}, "not a multiple"),
        (
            {"num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 3, "head_dim": 64},
            "multiple",
        ),
        (
            {"num_hidden_layers": 8, "num_attention_heads": 8, "head_dim": 64, "dtype": "float8_e4m3"},
            "--dtype",
        ),
        ({"num_hidden_layers": 5000, "num_attention_heads": 8, "head_dim": 64}, "outside"),
    ],
)
def test_bad_config_exits_2(tmp_path: Path, capsys, fields: dict, fragment: str) -> None:
    err = run_error(capsys, "--model", str(write_config(tmp_path, **fields)), "--tokens", "5")
    assert fragment in err


def test_unsupported_config_dtype_is_fine_with_override(tmp_path: Path, capsys) -> None:
    model = write_config(
        tmp_path, num_hidden_layers=1, num_attention_heads=1, head_dim=8, dtype="float8_e4m3"
    )
    report = run_json(capsys, "--model", str(model), "--tokens", "1", "--dtype", "bfloat16")
    assert report["bytes_per_token"] == 2 * 1 * 1 * 8 * 2


def test_invalid_json_config_exits_2(tmp_path: Path, capsys) -> None:
    (tmp_path / "config.json").write_text("{not json")
    assert "not valid JSON" in run_error(capsys, "--model", str(tmp_path), "--tokens", "5")
