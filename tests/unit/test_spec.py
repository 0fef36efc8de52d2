"""The deployment spec: the committed default spec writes the committed repository, versions become
version folders, and every error names its key's path in the file."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from file_tree import file_tree

from disagg.config import ConfigError
from disagg.paths import REPO_ROOT
from disagg.triton.pool_model import pool_config, version_manifest
from disagg.triton.version import read_manifest
from disagg_tools.repository import HotPool, HotPrompts
from disagg_tools.repository import main as repository_main
from disagg_tools.spec import Spec, load_spec, parse_spec

DEFAULT_SPEC = REPO_ROOT / "deploy" / "spec.yaml"


def test_the_committed_repository_is_the_default_spec(tmp_path):
    assert repository_main(["--spec", str(DEFAULT_SPEC), "--out", str(tmp_path)]) == 0
    assert file_tree(tmp_path) == file_tree(REPO_ROOT / "model_repository"), (
        "regenerate: disagg repository --spec"
    )
    assert load_spec(DEFAULT_SPEC) == Spec(), "the default spec spells out the defaults"


def test_versions_become_folders_with_their_checkpoint_and_probe(tmp_path):
    spec_file = tmp_path / "spec.yaml"
    spec = {
        "model": {
            "versions": [
                {"version": 1, "checkpoint": "a"},
                {"version": 2, "checkpoint": "/models/b", "probe": {"prompt": "Hi", "expect": " there"}},
            ],
            "serving": 1,
        },
        "dtype": "float32",
        "pools": {"decode": {"cores": [1], "instances": 2}},
        "entry_points": {"slo": {"ttft_s": 0.5}, "admission": {"margin": 3}},
    }
    spec_file.write_text(yaml.safe_dump(spec))
    out = tmp_path / "repo"
    assert repository_main(["--spec", str(spec_file), "--out", str(out)]) == 0
    for model in ("prefill", "decode", "colocated"):
        text = (out / model / "config.pbtxt").read_text()
        assert "version_policy: { specific: { versions: [ 1 ] } }" in text
        assert read_manifest(out / model, 1).checkpoint == str(tmp_path / "a"), "relative to the spec"
        second = read_manifest(out / model, 2)
        assert second.checkpoint == "/models/b" and second.probe.expect == " there"
        assert second.probe.max_tokens == 8
    for model in ("llm", "ensemble", "preprocessing"):  # entry points have one version, no manifest
        assert sorted(p.name for p in (out / model).iterdir()) == ["1", "config.pbtxt"]
        assert "version_policy" not in (out / model / "config.pbtxt").read_text()
    assert "kind: KIND_CPU, count: 2" in (out / "decode" / "config.pbtxt").read_text()
    assert 'key: "slo.ttft_s", value: { string_value: "0.5" }' in (out / "llm" / "config.pbtxt").read_text()
    for model in ("llm", "orchestrator", "orchestrator_colocated"):
        assert (
            'key: "admission.margin", value: { string_value: "3" }'
            in (out / model / "config.pbtxt").read_text()
        )

    # the pool adapter serves the version folder's checkpoint
    args = {"model_repository": str(out / "decode"), "model_version": "2", "model_instance_name": "decode_0"}
    text = (out / "decode" / "config.pbtxt").read_text()
    params = dict(re.findall(r'key: "([\w.]+)", value: \{ string_value: "([^"]*)" \}', text))
    config = pool_config(params, args, version_manifest(args))
    assert str(config.engine.model_dir) == "/models/b" and config.engine.dtype == "float32"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"pools": {"decode": {"corez": [1]}}}, r"^pools\.decode: unknown key\(s\) corez$"),
        ({"pools": {"prefill": {"cores": "0"}}}, r"^pools\.prefill\.cores: must be a list$"),
        ({"pools": {"prefill": {"cores": ["a"]}}}, r"^pools\.prefill\.cores\[0\]: must be an integer$"),
        ({"kv": {"cache_mb": 0}}, r"^kv\.cache_mb: must be in"),
        ({"kv": {"transport": "tcp"}}, r"^kv\.transport: must be one of shm, nixl$"),
        ({"kv": {"dtype": "int8"}}, r"^kv\.dtype: must be one of"),
        ({"pools": {"colocated": {"chunk_tokens": -1}}}, r"^pools\.colocated\.chunk_tokens: must be in"),
        ({"pools": {"decode": {"batch_start": -1}}}, r"^pools\.decode\.batch_start: must be in"),
        ({"pools": {"decode": {"batch_tpot_slo_s": -1}}}, r"^pools\.decode\.batch_tpot_slo_s: must be"),
        (
            {"pools": {"decode": {"conditional": {"chunk_tokens": 0}}}},
            r"conditional\.chunk_tokens: must be in",
        ),
        ({"pools": {"prefill": {"nice": 20}}}, r"^pools\.prefill\.nice: must be in \[0, 19\]$"),
        ({"hot_prompts": {"group_rate": -1}}, r"^hot_prompts\.group_rate: must be"),
        ({"dtype": "int8"}, r"^dtype: must be one of"),
        (
            {"pools": {"prefill": {"cores": [0, 1]}, "decode": {"cores": [1]}}},
            r"^pools\.decode\.cores: overlaps prefill\.cores \(core 1\)$",
        ),
        (
            {"pools": {"prefill": {"gpus": [0, 1], "instances": 2}, "decode": {"gpus": [1]}}},
            r"^pools\.decode\.gpus: overlaps prefill\.gpus \(GPU 1\)$",
        ),
        ({"pools": {"prefill": {"gpus": [0]}}}, r"^pools\.decode\.gpus: prefill and decode go on GPUs"),
        ({"pools": {"decode": {"cores": [1, 1]}}}, r"^pools\.decode\.cores: must list distinct"),
        ({"model": {"versions": [{"version": 1}, {"version": 1}]}}, r"^model\.versions: .*unique$"),
        ({"model": {"serving": 3}}, r"^model\.serving: must be one of the listed versions$"),
        ({"model": {"versions": [{"version": 0}]}}, r"^model\.versions\[0\]\.version: must be"),
        ({"model": {"versions": [{"version": 2, "probe": {"prompt": "x"}}]}}, r"probe\.expect: required"),
        (
            {"pools": {"prefill": {"autoscale": {"min_size": 3, "max_size": 2}}}},
            r"^pools\.prefill\.autoscale:",
        ),
        ({"schedule": {"day": "09:00"}}, r"^schedule: unknown key\(s\) day$"),
        (
            {"schedule": {"windows": [{"start": "9:00", "sizes": {"decode": 2}}]}},
            r"^schedule\.windows\[0\]\.start: ",
        ),
        (
            {"schedule": {"windows": [{"start": "09:00", "sizes": {"decoder": 2}}]}},
            r"^schedule\.windows\[0\]: no pool named 'decoder'$",
        ),
        (
            {"schedule": {"windows": [{"start": "09:00", "shares": {"decode": 0.5}}]}},
            r"^schedule\.windows\[0\]\.shares: shares need the schedule's total$",
        ),
        ({"remote": {"host": "x"}}, r"^remote: unknown key"),
        ({"remote": {"prefill": "x", "decode": "y:1"}}, r"^remote\.prefill: remote server 'x' needs a port"),
        (
            {
                "remote": {"prefill": "p:1", "decode": "d:1"},
                "pools": {"prefill": {"gpus": [0]}, "decode": {"gpus": [1]}},
            },
            r"^remote: pools on other hosts are CPU pools here",
        ),
        ({"hot_prompts": {"pool": {"cores": []}}}, r"^hot_prompts\.pool\.cores: "),
        ({"hot_prompts": {"rate_adaptive": True}}, r"^hot_prompts\.rate_adaptive: needs group_rate > 0"),
        ({"hot_prompts": {"group_rate": 2, "step_ratio": 1}}, r"^hot_prompts\.step_ratio: must be in"),
    ],
)
def test_spec_errors_name_the_path_in_the_file(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_spec(spec)


def test_a_spec_file_error_names_the_file_and_the_repository_refuses_mixed_flags(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools:\n  decode:\n    cores: [0]\n")
    assert repository_main(["--spec", str(bad), "--out", str(tmp_path / "r")]) == 2
    assert f"{bad}: pools.decode.cores: overlaps prefill.cores (core 0)" in capsys.readouterr().err
    assert not (tmp_path / "r").exists(), "nothing written from an invalid spec"
    with pytest.raises(SystemExit):
        repository_main(["--spec", str(DEFAULT_SPEC), "--out", str(tmp_path / "r"), "--dtype", "float32"])
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_spec(tmp_path / "list.yaml")


def test_the_spec_gives_the_autoscaler_its_bounds_and_targets():
    spec = parse_spec(
        {
            "entry_points": {"slo": {"ttft_s": 0.8, "tpot_s": 0.05}},
            "pools": {"decode": {"autoscale": {"min_size": 1, "max_size": 3}}},
        }
    )
    prefill, decode = spec.autoscaler_pools()
    assert (prefill["name"], prefill["max_size"], prefill["ttft_target_s"]) == ("prefill", 1, 0.8)
    assert (decode["min_size"], decode["max_size"], decode["tpot_target_s"]) == (1, 3, 0.05)
    assert json.loads(json.dumps(spec.autoscaler_pools())) == [prefill, decode]


def test_the_decode_batch_tuner_is_a_decode_pool_setting_that_reaches_its_parameters(tmp_path):
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump({"pools": {"decode": {"batch_tpot_slo_s": 0.05, "batch_start": 24}}}))
    assert repository_main(["--spec", str(spec_file), "--out", str(tmp_path / "repo")]) == 0
    text = (tmp_path / "repo" / "decode" / "config.pbtxt").read_text()
    params = dict(re.findall(r'key: "([\w.]+)", value: \{ string_value: "([^"]*)" \}', text))
    assert params["batch_tpot_slo_s"] == "0.05" and params["batch_start"] == "24"
    config = pool_config({**params, "model_dir": "/nonexistent"}, {"model_instance_name": "decode_0"})
    assert config.tuning().enabled and config.tuning().start == 24
    for pool in ("prefill", "colocated"):
        assert "batch_tpot_slo_s" not in (tmp_path / "repo" / pool / "config.pbtxt").read_text()
    with pytest.raises(ConfigError, match="batch_start"):
        parse_spec({"pools": {"decode": {"batch_start": "many"}}})


def test_the_adaptive_hot_group_rate_reaches_the_entry_points():
    spec = parse_spec({"hot_prompts": {"group_rate": 2, "rate_adaptive": True, "step_ratio": 1.3}})
    layout = spec.layout()
    hot = layout.hot_prompts
    assert (hot.group_rate, hot.rate_adaptive, hot.step_ratio) == (2, True, 1.3)


def test_a_spec_with_remote_pools_is_served_by_role():
    spec = parse_spec(
        {"remote": {"prefill": "dns:pre.llm.svc:8001", "decode": "10.0.0.3:8001,10.0.0.4:8001"}}
    )
    frontend = spec.layout("frontend")
    assert frontend.remote_pools == "prefill=dns:pre.llm.svc:8001;decode=10.0.0.3:8001,10.0.0.4:8001"
    assert spec.layout("prefill").pool_transport() == "nixl" and spec.layout("prefill").remote_pools == ""
    with pytest.raises(ValueError, match="served by role"):
        spec.layout()
    with pytest.raises(ValueError, match="need the spec's remote section"):
        parse_spec({}).layout("frontend")


def test_core_loans_reach_both_pools_with_the_decode_budget(tmp_path):
    """`pools.prefill.borrow` names decode cores the prefill pool borrows; the decode pool lends them
    within `lend_tpot_s`, by default half the entry points' TPOT SLO."""
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump({"pools": {"prefill": {"borrow": [1]}}}))
    assert repository_main(["--spec", str(spec_file), "--out", str(tmp_path / "repo")]) == 0

    def params(pool: str) -> dict[str, str]:
        text = (tmp_path / "repo" / pool / "config.pbtxt").read_text()
        return dict(re.findall(r'key: "([\w.]+)", value: \{ string_value: "([^"]*)" \}', text))

    prefill, decode = params("prefill"), params("decode")
    assert prefill["borrow"] == "1" and "lend" not in prefill
    assert decode["lend"] == "1" and decode["lend_tpot_s"] == "0.05"  # half the default TPOT SLO, 0.1 s
    assert "borrow" not in params("colocated") and "lend" not in params("colocated")
    config = pool_config({**decode, "model_dir": "/nonexistent"}, {"model_instance_name": "decode_0"})
    assert (config.lend, config.lend_tpot_s) == ((1,), 0.05)
    config = pool_config({**prefill, "model_dir": "/nonexistent"}, {"model_instance_name": "prefill_0"})
    assert config.borrow == (1,)
    budget = parse_spec({"entry_points": {"slo": {"tpot_s": 0.06}}, "pools": {"prefill": {"borrow": [1]}}})
    assert budget.layout().decode_lend_tpot_s == pytest.approx(0.03)
    given = parse_spec({"pools": {"prefill": {"borrow": [1]}, "decode": {"lend_tpot_s": 0.02}}})
    assert given.layout().decode_lend_tpot_s == 0.02
    assert parse_spec({}).layout().borrowed_cores() == "1"  # by default: the decode core, where possible
    assert parse_spec({"pools": {"prefill": {"borrow": []}}}).layout().borrowed_cores() == ""
    hot = parse_spec({"hot_prompts": {"pool": {"cores": [1]}}})
    assert hot.layout().borrowed_cores() == ""  # the hot pool shares the decode core: no loans
    two = parse_spec({"pools": {"decode": {"instances": 2}}})
    assert two.layout().borrowed_cores() == ""


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"pools": {"prefill": {"borrow": [2]}}}, r"^pools\.prefill\.borrow: core 2 is not the decode"),
        ({"pools": {"prefill": {"borrow": [1, 1]}}}, r"^pools\.prefill\.borrow: must list distinct core"),
        ({"pools": {"decode": {"lend_tpot_s": -1}}}, r"^pools\.decode\.lend_tpot_s: must be a number"),
    ],
)
def test_a_core_that_cannot_be_borrowed_is_refused_by_name(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_spec(spec)


def test_loans_are_between_one_prefill_and_one_decode_instance_on_cpu():
    from disagg_tools.repository import Layout

    with pytest.raises(ValueError, match="prefill_borrow: core loans are between one prefill"):
        Layout(prefill_borrow="1", decode_instances=2)
    assert Layout(decode_instances=2).borrowed_cores() == ""  # auto: none where loans cannot be
    with pytest.raises(ValueError, match="prefill_borrow: core 1 is also the hot decode pool's"):
        Layout(prefill_borrow="1", hot_prompts=HotPrompts(pool=HotPool(cores=(1,))))
    with pytest.raises(ValueError, match="prefill_borrow: core 3 is not in decode_cores"):
        Layout(prefill_borrow="3")
