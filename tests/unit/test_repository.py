"""The committed model repository is exactly what the generator writes."""

from __future__ import annotations

from disagg.paths import REPO_ROOT
from disagg.serving.interface import ALL_INPUTS
from disagg_tools.repository import Layout, main, render


def test_committed_repository_matches_the_generator():
    repo = REPO_ROOT / "model_repository"
    rendered = render(Layout())
    assert sorted(p.name for p in repo.iterdir() if p.is_dir()) == sorted(rendered)
    for name, text in rendered.items():
        assert (repo / name / "config.pbtxt").read_text() == text, f"regenerate: disagg repository ({name})"
        assert (repo / name / "1").is_dir()


def test_entry_points_declare_every_input_and_pools_are_pinned(tmp_path):
    rendered = render(Layout(prefill_cores="2", decode_cores="3"))
    for entry in ("ensemble", "ensemble_colocated", "llm", "preprocessing"):
        for spec in ALL_INPUTS:
            assert f'name: "{spec.name}"' in rendered[entry]
    assert 'key: "cores", value: { string_value: "2" }' in rendered["prefill"]
    assert 'key: "cores", value: { string_value: "3" }' in rendered["decode"]
    assert 'key: "nice"' in rendered["prefill"] and 'key: "nice"' not in rendered["decode"]
    assert main(["--out", str(tmp_path), "--dtype", "float32"]) == 0
    assert 'string_value: "float32"' in (tmp_path / "decode" / "config.pbtxt").read_text()


def test_pool_parameters_parse_into_valid_configs(tiny_model_dir):
    """Every parameter the repository gives a pool converts and validates as the adapter does it."""
    import re

    from disagg.serving.pool import PoolConfig
    from disagg.triton.pool_model import ADAPTER_KEYS, _typed

    for name in ("prefill", "decode", "colocated"):
        text = (REPO_ROOT / "model_repository" / name / "config.pbtxt").read_text()
        params = dict(re.findall(r'key: "(\w+)", value: \{ string_value: "([^"]*)" \}', text))
        settings = _typed({k: v for k, v in params.items() if k not in ADAPTER_KEYS and k != "cores"})
        config = PoolConfig.from_dict({"role": params["role"], "model_dir": tiny_model_dir, **settings})
        assert config.engine.dtype == "bfloat16"
        assert config.nice == (10 if name == "prefill" else 0)
