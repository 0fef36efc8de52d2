"""Every key of the deployment spec reaches what is deployed: a walk over the spec's schema finds each
key, sets it through `disagg repository --set` to a value other than its default, and the written
repository (or, for the autoscaler's keys, its pools) changes. A key added to the spec without a way
into the repository fails here until it has one (or is listed, with why, as the autoscaler's or a
role's). And `--set` itself: paths, YAML values, errors, and the layout flags' deprecation."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
from file_tree import file_tree

from disagg.config import ConfigError
from disagg_tools.repository import DEPRECATED_FLAGS
from disagg_tools.repository import main as repository_main
from disagg_tools.spec import Spec, load_spec, with_overrides

# spec key -> (the overrides that set it to another value, the overrides of the baseline it is compared
# with: the companions that key needs to have an effect, without it)
CHANGES: dict[str, tuple[list[str], list[str]]] = {
    "dtype": (["dtype=float32"], []),
    "entry_points.cores": (["entry_points.cores=[1]"], []),
    "entry_points.request_timeout_s": (["entry_points.request_timeout_s=300"], []),
    "entry_points.slo.ttft_s": (["entry_points.slo.ttft_s=2"], []),
    "entry_points.slo.tpot_s": (["entry_points.slo.tpot_s=0.2"], []),
    "entry_points.admission.margin": (["entry_points.admission.margin=3"], []),
    "pools.prefill.cores": (["pools.prefill.cores=[2]"], []),
    "pools.prefill.gpus": (
        ["pools.prefill.gpus=[0]", "pools.decode.gpus=[1]"],
        ["pools.prefill.gpus=[2]", "pools.decode.gpus=[1]"],  # GPU pools go together: another GPU
    ),
    "pools.prefill.instances": (["pools.prefill.instances=2"], []),
    "pools.prefill.dtype": (["pools.prefill.dtype=float32"], []),
    "pools.prefill.nice": (["pools.prefill.nice=5"], []),
    "pools.prefill.local_decode": (["pools.prefill.local_decode=false"], []),
    "pools.prefill.borrow": (["pools.prefill.borrow=[]"], []),
    "pools.decode.cores": (["pools.decode.cores=[2]"], []),
    "pools.decode.gpus": (
        ["pools.prefill.gpus=[0]", "pools.decode.gpus=[1]"],
        ["pools.prefill.gpus=[0]", "pools.decode.gpus=[2]"],
    ),
    "pools.decode.instances": (["pools.decode.instances=2"], []),
    "pools.decode.dtype": (["pools.decode.dtype=float32"], []),
    "pools.decode.conditional.prefill_tokens": (["pools.decode.conditional.prefill_tokens=64"], []),
    "pools.decode.conditional.chunk_tokens": (
        ["pools.decode.conditional.prefill_tokens=64", "pools.decode.conditional.chunk_tokens=32"],
        ["pools.decode.conditional.prefill_tokens=64"],
    ),
    "pools.decode.batch_tpot_slo_s": (["pools.decode.batch_tpot_slo_s=0.05"], []),
    "pools.decode.batch_start": (
        ["pools.decode.batch_tpot_slo_s=0.05", "pools.decode.batch_start=8"],
        ["pools.decode.batch_tpot_slo_s=0.05"],
    ),
    "pools.decode.lend_tpot_s": (["pools.decode.lend_tpot_s=0.03"], []),
    "pools.colocated.cores": (["pools.colocated.cores=[1]"], []),
    "pools.colocated.gpus": (["pools.colocated.gpus=[0]"], []),
    "pools.colocated.instances": (["pools.colocated.instances=2"], []),
    "pools.colocated.dtype": (["pools.colocated.dtype=float32"], []),
    "pools.colocated.chunk_tokens": (["pools.colocated.chunk_tokens=64"], []),
    "kv.dtype": (["kv.dtype=float32"], []),
    "kv.cache_mb": (["kv.cache_mb=128"], []),
    "kv.block_size": (["kv.block_size=32"], []),
    "kv.lease_ttl_s": (["kv.lease_ttl_s=10"], []),
    "kv.transport": (["kv.transport=nixl"], []),
    "kv.prefix_cache": (["kv.prefix_cache=false"], []),
    "kv.checksum": (["kv.checksum=true"], []),
    "hot_prompts.pool": (["hot_prompts.pool={cores: [1], nice: 5}"], []),
    "hot_prompts.group_rate": (["hot_prompts.group_rate=2"], []),
    "hot_prompts.rate_adaptive": (
        ["hot_prompts.group_rate=2", "hot_prompts.rate_adaptive=true"],
        ["hot_prompts.group_rate=2"],
    ),
    "hot_prompts.step_ratio": (["hot_prompts.step_ratio=1.5"], []),
    "model.versions": (["model.versions=[{version: 1}, {version: 2}]"], []),
    "model.serving": (
        ["model.versions=[{version: 1}, {version: 2}]", "model.serving=2"],
        ["model.versions=[{version: 1}, {version: 2}]"],
    ),
}
AUTOSCALER = {  # read by `disagg autoscale --spec`, not by the repository
    "pools.prefill.autoscale.min_size": ["pools.prefill.autoscale={min_size: 2, max_size: 3}"],
    "pools.prefill.autoscale.max_size": ["pools.prefill.autoscale.max_size=3"],
    "pools.decode.autoscale.min_size": ["pools.decode.autoscale={min_size: 2, max_size: 3}"],
    "pools.decode.autoscale.max_size": ["pools.decode.autoscale.max_size=3"],
}
ELSEWHERE = {
    "schedule": "the autoscaler's day/night split (disagg autoscale --spec), tested in tests/unit/autoscaler",
    "remote": "served by role (disagg serve --spec --role), tested in test_spec.py and the topology tests",
}


# spec keys whose value reaches what is deployed under other words, and why; every other key is a
# configuration field (a config.pbtxt parameter) of the same name (test below)
OTHER_WORDS = {
    "model.versions": "Triton's model versions: a folder per version, not a parameter",
    "model.serving": "Triton's model versions: which folders the server loads",
    "pools.prefill.gpus": "Triton's instance_group (KIND_GPU, gpus)",
    "pools.decode.gpus": "Triton's instance_group (KIND_GPU, gpus)",
    "pools.colocated.gpus": "Triton's instance_group (KIND_GPU, gpus)",
    "pools.prefill.instances": "Triton's instance_group (count)",
    "pools.decode.instances": "Triton's instance_group (count)",
    "pools.colocated.instances": "Triton's instance_group (count)",
    "pools.colocated.chunk_tokens": "one key, two fields: chunked_prefill and max_prefill_tokens",
    "hot_prompts.pool": "a pool of its own (model decode_hot) and the entry points' hot_prompts.decode_model",
}


def _parameter_names(key: str) -> set[str]:
    """The config.pbtxt parameter name a spec key has: its own words within the model it configures
    (``entry_points.slo.ttft_s`` -> ``slo.ttft_s``; ``pools.decode.cores`` -> ``cores``); a section the
    pools hold, the key itself (``kv.cache_mb``)."""
    head, _, rest = key.partition(".")
    if head == "entry_points":
        return {rest}
    if head == "pools":
        return {rest.partition(".")[2]}
    return {key}


def _parameters(out: Path) -> dict[tuple[str, str], str]:
    import re

    found = {}
    for config in out.glob("*/config.pbtxt"):
        for name, value in re.findall(
            r'key: "([\w.]+)", value: \{ string_value: "([^"]*)" \}', config.read_text()
        ):
            found[(config.parent.name, name)] = value
    return found


def _keys(cls: type, prefix: str = "") -> list[str]:
    """Every key of the schema below ``cls``: a nested section's keys, a leaf's own (an optional
    section, such as a hot pool, is one key: it is set whole)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out += _keys(hint, f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def _written(tmp_path: Path, overrides: list[str]) -> dict[str, str]:
    out = tmp_path / str(len(list(tmp_path.iterdir())))
    assert repository_main(["--out", str(out), *(a for o in overrides for a in ("--set", o))]) == 0
    return file_tree(out)


def test_the_walk_finds_every_key_and_each_is_accounted_for():
    keys = _keys(Spec)
    assert len(keys) >= 40 and "pools.decode.lend_tpot_s" in keys and "entry_points.slo.ttft_s" in keys
    accounted = {*CHANGES, *AUTOSCALER, *ELSEWHERE}
    assert sorted(set(keys) - accounted) == [], "a spec key with no test of its way into the deployment"
    assert sorted(accounted - set(keys)) == [], "a key listed here that the spec no longer has"


@pytest.mark.parametrize("key", sorted(CHANGES))
def test_each_key_changes_the_written_repository(tmp_path: Path, key: str):
    changed, baseline = CHANGES[key]
    assert _written(tmp_path, changed) != _written(tmp_path, baseline), f"{key} changed nothing"


@pytest.mark.parametrize("key", sorted(AUTOSCALER))
def test_each_autoscaler_key_changes_the_autoscalers_pools(key: str):
    assert load_spec(None, AUTOSCALER[key]).autoscaler_pools() != Spec().autoscaler_pools()


def test_overrides_set_nested_keys_to_yaml_values_and_the_last_wins():
    data = with_overrides({"kv": {"cache_mb": 64}}, ["kv.prefix_cache=false", "pools.prefill.borrow=[]"])
    assert data == {"kv": {"cache_mb": 64, "prefix_cache": False}, "pools": {"prefill": {"borrow": []}}}
    assert with_overrides(None, ["dtype=float32", "dtype=auto"]) == {"dtype": "auto"}
    assert with_overrides({}, ["pools.decode.lend_tpot_s=null"]) == {
        "pools": {"decode": {"lend_tpot_s": None}}
    }
    spec = load_spec(None, ["pools.decode.lend_tpot_s=0.03", "hot_prompts.pool={cores: [1]}"])
    assert spec.pools.decode.lend_tpot_s == 0.03 and spec.hot_prompts.pool.cores == (1,)
    original = {"kv": {"cache_mb": 64}}
    with_overrides(original, ["kv.cache_mb=1"])
    assert original == {"kv": {"cache_mb": 64}}, "the parsed spec is not changed in place"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("kv.prefix_cache", "expected KEY=VALUE"),
        ("=1", "expected KEY=VALUE"),
        ("kv..cache_mb=1", "expected KEY=VALUE"),
        ("dtype.x=1", "dtype is not a section"),
        ("kv.cache_mb=[1", "not YAML"),
    ],
)
def test_a_malformed_override_is_refused(override: str, message: str):
    with pytest.raises(ValueError, match=message):
        with_overrides({"dtype": "auto"}, [override])


def test_an_unknown_or_invalid_key_is_refused_naming_its_path(tmp_path: Path, capsys):
    with pytest.raises(ConfigError, match=r"pools\.decode: unknown key\(s\) lend_tpot"):
        load_spec(None, ["pools.decode.lend_tpot=0.03"])
    assert repository_main(["--out", str(tmp_path / "r"), "--set", "kv.block_size=7"]) == 2
    assert "kv.block_size" in capsys.readouterr().err and not (tmp_path / "r").exists()


def test_set_with_a_layout_flag_is_refused_and_a_layout_flag_names_its_key(tmp_path: Path, capsys):
    with pytest.raises(SystemExit):
        repository_main(["--out", str(tmp_path / "a"), "--set", "kv.cache_mb=64", "--kv-cache-mb", "64"])
    capsys.readouterr()
    assert repository_main(["--out", str(tmp_path / "b"), "--kv-cache-mb", "64"]) == 0
    err = capsys.readouterr().err
    assert "--kv-cache-mb is deprecated" in err and "--set kv.cache_mb=" in err
    # the flag and the key write the same repository
    assert repository_main(["--out", str(tmp_path / "c"), "--set", "kv.cache_mb=64"]) == 0
    assert file_tree(tmp_path / "b") == file_tree(tmp_path / "c")


FLAG_CASES = [  # deprecated layout flags -> the spec keys that say the same
    (["--kv-dtype", "float32", "--lease-ttl-s", "7"], ["kv.dtype=float32", "kv.lease_ttl_s=7"]),
    (["--prefill-cores", "1", "--decode-cores", "0"], ["pools.prefill.cores=[1]", "pools.decode.cores=[0]"]),
    (["--prefill-borrow", ""], ["pools.prefill.borrow=[]"]),
    (
        ["--no-prefix-cache", "--no-local-decode"],
        ["kv.prefix_cache=false", "pools.prefill.local_decode=false"],
    ),
    (["--hot-decode-cores", "1", "--hot-decode-nice", "7"], ["hot_prompts.pool={cores: [1], nice: 7}"]),
    (
        ["--prefill-gpus", "0", "--decode-gpus", "1,2"],
        [
            "pools.prefill.gpus=[0]",
            "pools.prefill.instances=1",
            "pools.decode.gpus=[1,2]",
            "pools.decode.instances=2",
        ],
    ),
    (
        ["--transport", "nixl", "--colocated-chunk-tokens", "64"],
        ["kv.transport=nixl", "pools.colocated.chunk_tokens=64"],
    ),
]


@pytest.mark.parametrize(("flags", "overrides"), FLAG_CASES)
def test_layout_flags_write_what_their_spec_keys_write(
    tmp_path: Path, flags: list[str], overrides: list[str]
) -> None:
    """The deprecated layout flags are the spec's keys set on the default spec: one way in, the same
    repository as ``--set``."""
    assert repository_main(["--out", str(tmp_path / "flags"), *flags]) == 0
    assert file_tree(tmp_path / "flags") == _written(tmp_path, overrides) != _written(tmp_path, [])


def test_every_deprecated_flag_names_a_key_of_the_spec():
    keys = set(_keys(Spec))
    for flag, key in DEPRECATED_FLAGS.items():
        assert key in keys or key.rsplit(".", 1)[0] in keys, (flag, key)


def test_every_spec_key_is_a_configuration_field_of_the_same_name(tmp_path: Path):
    """Setting a key changes a config.pbtxt parameter of the key's own name (within the model it
    configures), unless the key is listed in OTHER_WORDS with why; a listed key that has since got a
    parameter of its own name fails too, so the list only shrinks."""
    for key in sorted(CHANGES):
        changed, baseline = CHANGES[key]
        out_a, out_b = tmp_path / f"{key}-a", tmp_path / f"{key}-b"
        for out, overrides in ((out_a, changed), (out_b, baseline)):
            assert repository_main(["--out", str(out), *(a for o in overrides for a in ("--set", o))]) == 0
        a, b = _parameters(out_a), _parameters(out_b)
        names = {name for (model, name) in set(a) | set(b) if a.get((model, name)) != b.get((model, name))}
        own = bool(names & _parameter_names(key))
        if key in OTHER_WORDS:
            assert not own, f"{key} now reaches a parameter of its own name: take it off OTHER_WORDS"
        else:
            assert own, f"{key} changed {sorted(names)}, none named {sorted(_parameter_names(key))}"
    assert set(OTHER_WORDS) <= set(CHANGES)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("entry_points.admission_margin=3", "entry_points.admission.margin=3"),
        ("pools.decode.conditional_prefill_tokens=64", "pools.decode.conditional.prefill_tokens=64"),
        ("pools.decode.conditional_chunk_tokens=32", "pools.decode.conditional.chunk_tokens=32"),
    ],
)
def test_an_old_key_loads_as_its_new_one_with_a_deprecation_warning(caplog, old: str, new: str):
    with caplog.at_level("WARNING", logger="disagg.config"):
        assert load_spec(None, [old]) == load_spec(None, [new]) != Spec()
    old_key, new_key = old.partition("=")[0], new.partition("=")[0]
    section = old_key.rsplit(".", 1)[0]  # the warning names the new key within the old one's section
    said = f"{old_key} is deprecated and goes in the next release: it is now {new_key[len(section) + 1 :]}"
    assert said in caplog.text
    with pytest.raises(ConfigError, match="give"):  # both at once: refused
        load_spec(None, [old, new])


def test_the_specs_kv_section_is_the_pools_in_the_same_words():
    """The spec's ``kv`` keys are the fields of the pools' KV section (``PoolConfig.kv``), with the same
    defaults where the spec does not deploy another (``dtype``: the decode pool's; ``prefix_cache``: on)."""
    from disagg.kv.settings import KVSettings
    from disagg_tools.spec import KV

    pool = {f.name: f.default for f in dataclasses.fields(KVSettings)}
    spec = {f.name: f.default for f in dataclasses.fields(KV)}
    assert set(spec) == set(pool)
    assert {k: v for k, v in spec.items() if spec[k] != pool[k]} == {"dtype": "", "prefix_cache": True}


@pytest.mark.parametrize("key", sorted(CHANGES))
def test_what_each_key_writes_is_read_back_by_its_models_builder(
    tmp_path: Path, key: str, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every config.pbtxt parameter a key writes is read by the builder of the model it configures, as
    the adapters read it (a pool's ``pool_config``, an entry point's ``OrchestratorConfig``): nothing
    unknown, nothing under a deprecated name."""
    from disagg.config import build
    from disagg.serving.orchestrator import OrchestratorConfig
    from disagg.triton.pool_model import pool_config

    changed, _ = CHANGES[key]
    out = tmp_path / "repository"
    assert repository_main(["--out", str(out), *(a for o in changed for a in ("--set", o))]) == 0
    written = _parameters(out)
    read = set()
    with caplog.at_level("WARNING", logger="disagg.config"):
        for model in sorted({model for model, _ in written}):
            params = {name: value for (m, name), value in written.items() if m == model}
            role = params.get("role")
            if role in ("prefill", "decode", "colocated"):
                pool_config(
                    {**params, "model_dir": str(tiny_model_dir)}, {"model_instance_name": f"{model}_0"}
                )
            elif role in ("orchestrator", "llm"):
                build(OrchestratorConfig, params, strings=True)
            else:
                assert set(params) <= {"role", "cores"}, (model, params)
                continue
            read.add(model)
    assert {"prefill", "decode", "colocated", "orchestrator", "llm"} <= read
    assert "deprecated" not in caplog.text
