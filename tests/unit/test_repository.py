"""The committed model repository is exactly what the generator writes."""

from __future__ import annotations

import pytest

from disagg.config import ConfigError, build
from disagg.engine.device import auto_dtype
from disagg.paths import REPO_ROOT
from disagg.serving.text_api import ALL_INPUTS
from disagg_tools.repository import KV, HotPool, HotPrompts, Layout, main, render
from disagg_tools.spec import load_spec


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

    from disagg.pool.instance import PoolConfig
    from disagg.triton.pool_model import pool_config

    for name in ("prefill", "decode", "colocated"):
        text = (REPO_ROOT / "model_repository" / name / "config.pbtxt").read_text()
        params = dict(re.findall(r'key: "([\w.]+)", value: \{ string_value: "([^"]*)" \}', text))
        config = pool_config(
            {**params, "model_dir": str(tiny_model_dir)}, {"model_instance_name": f"{name}_0"}
        )
        assert config.role == name and config.engine.dtype == auto_dtype("cpu"), "auto, resolved by its rule"
        assert config.engine.cores == tuple(int(c) for c in params["cores"].split(","))
        assert config.nice == (10 if name == "prefill" else 0)
        assert not set(params) & set(PoolConfig.RENAMED), "no parameter under a deprecated name"
        assert {k for k in params if k.startswith("kv.")} >= {"kv.cache_mb", "kv.block_size"}


def test_orchestrator_parameters_parse_into_valid_configs():
    """The entry points' parameters (orchestrator, orchestrator_colocated, llm) are all OrchestratorConfig
    keys, typed as the adapter reads them."""
    import re

    from disagg.config import build
    from disagg.serving.orchestrator import OrchestratorConfig

    for name, mode in (
        ("orchestrator", "disaggregated"),
        ("orchestrator_colocated", "colocated"),
        ("llm", "disaggregated"),
    ):
        text = (REPO_ROOT / "model_repository" / name / "config.pbtxt").read_text()
        params = dict(re.findall(r'key: "([\w.]+)", value: \{ string_value: "([^"]*)" \}', text))
        config = build(OrchestratorConfig, params, strings=True)
        assert config.mode == mode and config.request_timeout_s == Layout().request_timeout_s
        assert config.role == ("llm" if name == "llm" else "orchestrator") and config.cores == "0"


def test_gpu_variant_puts_pools_on_disjoint_gpus_and_hands_kv_over_cuda_ipc(tmp_path, tiny_model_dir):
    """`--prefill-gpus/--decode-gpus`: KIND_GPU groups (one instance per listed GPU), the engine on the
    instance's GPU, CUDA IPC between prefill and decode. Rendered and validated here; NOT run on a GPU."""
    import re

    from disagg.pool.instance import transport_options
    from disagg.triton import glue
    from disagg.triton.pool_model import pool_config

    argv = ["--out", str(tmp_path), "--prefill-gpus", "0", "--decode-gpus", "1,2", "--colocated-gpus", "3"]
    assert main(argv) == 0
    text = {
        name: (tmp_path / name / "config.pbtxt").read_text() for name in ("prefill", "decode", "colocated")
    }
    assert "instance_group [ { kind: KIND_GPU, count: 1, gpus: [ 0 ] } ]" in text["prefill"]
    assert "instance_group [ { kind: KIND_GPU, count: 1, gpus: [ 1, 2 ] } ]" in text["decode"]
    assert "instance_group [ { kind: KIND_GPU, count: 1, gpus: [ 3 ] } ]" in text["colocated"]
    assert "KIND_GPU" not in (tmp_path / "llm" / "config.pbtxt").read_text()  # the front end stays on CPU
    for name, body in text.items():
        params = dict(re.findall(r'key: "([\w.]+)", value: \{ string_value: "([^"]*)" \}', body))
        assert params["device"] == "cuda"
        # the instance Triton placed on GPU 2 (decode's second): the adapter puts the engine there
        instance = {
            "model_instance_name": f"{name}_1",
            "model_instance_kind": "GPU",
            "model_instance_device_id": "2",
        }
        config = pool_config({**params, "model_dir": str(tiny_model_dir)}, instance)
        assert config.engine.device == "cuda:2"
        if name == "colocated":
            assert "kv.transport" not in params and transport_options(config) == {}
        else:
            assert config.kv.transport == "cuda_ipc"
            assert transport_options(config)["cuda"].device == "cuda:2"  # its regions on its own GPU
    assert glue.instance_device({"model_instance_kind": "CPU", "model_instance_device_id": "0"}) is None


def test_gpu_variant_refuses_shared_or_one_sided_gpus():
    import pytest

    with pytest.raises(ValueError, match="disjoint"):
        Layout(prefill_gpus="0,1", decode_gpus="1")
    with pytest.raises(ValueError, match="go together"):
        Layout(prefill_gpus="0")
    with pytest.raises(ValueError, match="GPU ids"):
        Layout(prefill_gpus="0", decode_gpus="gpu1")
    with pytest.raises(SystemExit):
        main(["--prefill-gpus", "0", "--decode-gpus", "0"])


def test_prefill_and_decode_share_one_kv_dtype_whatever_they_compute_in(tmp_path):
    import re

    def params(rendered: dict[str, str], pool: str) -> dict[str, str]:
        return dict(re.findall(r'key: "([\w.]+)", value: \{ string_value: "([^"]*)" \}', rendered[pool]))

    mixed = render(Layout(prefill_dtype="float32", decode_dtype="bfloat16"))
    assert params(mixed, "prefill")["dtype"] == "float32" and params(mixed, "decode")["dtype"] == "bfloat16"
    # unset: the decode pool's compute dtype, for both sides of the hand-off
    assert params(mixed, "prefill")["kv.dtype"] == params(mixed, "decode")["kv.dtype"] == "bfloat16"
    assert params(mixed, "colocated")["dtype"] == "auto" and "kv.dtype" not in params(mixed, "colocated")
    chosen = render(Layout(dtype="float32", kv=KV(dtype="bfloat16")))
    assert {params(chosen, p)["kv.dtype"] for p in ("prefill", "decode")} == {"bfloat16"}
    with pytest.raises(ValueError, match="dtype: must be one of"):
        Layout(kv=KV(dtype="int8"))
    assert main(["--out", str(tmp_path), "--prefill-dtype", "float32", "--kv-dtype", "float32"]) == 0
    assert (
        'key: "kv.dtype", value: { string_value: "float32" }'
        in (tmp_path / "decode" / "config.pbtxt").read_text()
    )


def test_conditional_variant_lets_the_decode_pool_prefill_short_prompts(tiny_model_dir, caplog):
    """`--conditional-prefill-tokens N`: the decode pool prefills prompts of up to N tokens itself, in
    chunks, and the disaggregated entry points route them there (parsed as the adapters parse them)."""
    import re

    from disagg.config import build
    from disagg.serving.orchestrator import OrchestratorConfig
    from disagg.triton.pool_model import pool_config

    rendered = render(Layout(conditional_prefill_tokens=512, conditional_chunk_tokens=64))

    def params(name: str) -> dict[str, str]:
        return dict(re.findall(r'key: "([\w.]+)", value: \{ string_value: "([^"]*)" \}', rendered[name]))

    decode = pool_config({**params("decode"), "model_dir": str(tiny_model_dir)}, {"model_instance_name": "d"})
    scheduling = decode.scheduling()
    assert (scheduling.local_prefill_tokens, scheduling.max_prefill_tokens) == (512, 64)
    assert scheduling.chunked_prefill
    for name in ("orchestrator", "llm"):
        assert build(OrchestratorConfig, params(name), strings=True).conditional.prefill_tokens == 512
    assert "conditional.prefill_tokens" not in rendered["orchestrator_colocated"]
    assert "conditional" not in rendered["prefill"] + rendered["colocated"]
    assert "conditional" not in render(Layout())["llm"], "off by default"
    # a decode pool's config.pbtxt of the release before: the same scheduling, with a warning
    old = {k: v for k, v in params("decode").items() if not k.startswith("conditional.")}
    old |= {"local_prefill_tokens": "512", "chunked_prefill": "true", "max_prefill_tokens": "64"}
    with caplog.at_level("WARNING", logger="disagg.config"):
        before = pool_config({**old, "model_dir": str(tiny_model_dir)}, {"model_instance_name": "d"})
    assert before.scheduling() == scheduling and before.conditional == decode.conditional
    assert "local_prefill_tokens is deprecated" in caplog.text
    with pytest.raises(ValueError, match="give that"):  # one chunk, said once
        pool_config(
            {**params("decode"), "max_prefill_tokens": "32", "model_dir": str(tiny_model_dir)},
            {"model_instance_name": "d"},
        )


def test_prefix_cache_variant_turns_it_on_in_the_prefill_and_colocated_pools(tmp_path, tiny_model_dir):
    """`--prefix-cache`: the prefill and colocated engines keep prompt prefixes; the decode pool, which
    only imports KV, has no such setting; on by default (parsed as the adapter parses it)."""
    import re

    from disagg.triton.pool_model import pool_config

    assert main(["--out", str(tmp_path), "--prefix-cache"]) == 0
    for name, expected in (("prefill", True), ("colocated", True), ("decode", False)):
        text = (tmp_path / name / "config.pbtxt").read_text()
        params = dict(re.findall(r'key: "([\w.]+)", value: \{ string_value: "([^"]*)" \}', text))
        config = pool_config(
            {**params, "model_dir": str(tiny_model_dir)}, {"model_instance_name": f"{name}_0"}
        )
        assert config.kv.prefix_cache is config.engine.prefix_cache is expected, name
    for name in ("prefill", "colocated"):  # on in the default deployment too
        assert 'key: "kv.prefix_cache", value: { string_value: "true" }' in render(Layout())[name]


def test_admission_margin_and_prefix_cache_flags_reach_entry_points_and_pools(tmp_path, tiny_model_dir):
    """`--admission-margin M` goes to every entry point's orchestrator (parsed as the adapter parses
    it); `--no-prefix-cache` / `--prefix-cache` switch the prefill and colocated pools' cache."""
    import re

    from disagg.serving.orchestrator import OrchestratorConfig
    from disagg.triton.pool_model import pool_config

    def params(name: str) -> dict[str, str]:
        text = (tmp_path / name / "config.pbtxt").read_text()
        return dict(re.findall(r'key: "([\w.]+)", value: \{ string_value: "([^"]*)" \}', text))

    for flag, cached in (("--no-prefix-cache", False), ("--prefix-cache", True)):
        assert main(["--out", str(tmp_path), "--admission-margin", "2.5", flag]) == 0
        for name in ("orchestrator", "orchestrator_colocated", "llm"):
            assert build(OrchestratorConfig, params(name), strings=True).admission.margin == 2.5, name
        for name in ("prefill", "colocated"):
            config = pool_config(
                {**params(name), "model_dir": str(tiny_model_dir)}, {"model_instance_name": "p"}
            )
            assert config.kv.prefix_cache is config.engine.prefix_cache is cached, (flag, name)
    with pytest.raises(ConfigError, match=r"entry_points\.admission\.margin: must be in"):
        load_spec(None, ["entry_points.admission.margin=-1"])
    default = render(Layout())
    for name in ("orchestrator", "orchestrator_colocated", "llm"):  # on in the default deployment
        assert 'key: "admission.margin", value: { string_value: "2" }' in default[name]


@pytest.mark.parametrize(
    ("overrides", "margin"),
    [
        ([], "2"),  # the orchestrator's 1 s target is a guess: twice it
        (["entry_points.slo.ttft_s=1.6"], "1"),  # told its SLO: the SLO itself
        (["entry_points.slo.tpot_s=0.05"], "2"),  # a TPOT SLO alone says nothing of the wait
        (["entry_points.slo.ttft_s=1.6", "entry_points.admission.margin=3"], "3"),  # said: kept
        (["entry_points.admission.margin=0"], "0"),  # off stays off
    ],
)
def test_the_admission_margin_follows_the_ttft_slo_the_spec_sets(overrides: list[str], margin: str) -> None:
    """Unset, the margin is 1 where the spec sets `entry_points.slo.ttft_s` (margin 1 served more than 2
    with the SLO told, perf/results/admission_margin) and 2 where the 1 s target is a guess; a margin
    the spec says is kept, whatever the SLO."""
    layout = load_spec(None, overrides).layout()
    rendered = render(layout)
    for name in ("orchestrator", "orchestrator_colocated", "llm"):
        assert f'key: "admission.margin", value: {{ string_value: "{margin}" }}' in rendered[name], name
    assert layout.admission_margin == float(margin)


def test_hot_decode_variant_adds_a_hot_pool_the_entry_points_route_to(tmp_path, tiny_model_dir):
    """`--hot-decode-cores 1 --hot-group-rate 2`: a second decode pool, decode_hot, on core 1 at its
    niceness; the disaggregated entry points name it and the group rate, the colocated one only the
    rate (it has no decode leg); the default repository has neither."""
    import re

    from disagg.config import build
    from disagg.serving.orchestrator import HOT_POOL, OrchestratorConfig
    from disagg.triton.orchestrator_model import deployed_pools
    from disagg.triton.pool_model import pool_config

    def params(name: str) -> dict[str, str]:
        text = (tmp_path / name / "config.pbtxt").read_text()
        return dict(re.findall(r'key: "([\w.]+)", value: \{ string_value: "([^"]*)" \}', text))

    assert main(["--out", str(tmp_path), "--hot-decode-cores", "1", "--hot-group-rate", "2"]) == 0
    hot = pool_config(
        {**params(HOT_POOL), "model_dir": str(tiny_model_dir)}, {"model_instance_name": f"{HOT_POOL}_0"}
    )
    assert hot.role == "decode" and hot.engine.cores == (1,) and hot.nice == HotPool.nice
    for name in ("orchestrator", "llm"):
        config = build(OrchestratorConfig, params(name), strings=True)
        assert config.hot_prompts.decode_model == HOT_POOL and config.hot_prompts.group_rate == 2.0
        assert HOT_POOL in deployed_pools(config, str(tmp_path / name))
    colocated = build(OrchestratorConfig, params("orchestrator_colocated"), strings=True)
    assert colocated.hot_prompts.decode_model == "" and colocated.hot_prompts.group_rate == 2.0
    assert '"hot_prompts.group_rate"' in (tmp_path / "llm" / "config.pbtxt").read_text()
    assert HOT_POOL not in render(Layout()) and "hot_" not in render(Layout())["llm"]
    with pytest.raises(ConfigError, match=r"hot_prompts\.pool\.nice: must be in \[0, 19\]"):
        load_spec(None, ["hot_prompts.pool={cores: [1], nice: 20}"])


def test_an_adaptive_hot_group_rate_reaches_every_entry_point(tmp_path):
    """`--hot-group-rate 2 --hot-rate-adaptive --hot-step-ratio 1.3`: the entry points' caps adapt
    (disagg.hot.throttle) under a maximum of 2 req/s; without the flags, no such parameter."""
    import re

    from disagg.serving.orchestrator import OrchestratorConfig

    def params(name: str) -> dict[str, str]:
        text = (tmp_path / name / "config.pbtxt").read_text()
        return dict(re.findall(r'key: "([\w.]+)", value: \{ string_value: "([^"]*)" \}', text))

    flags = ["--hot-group-rate", "2", "--hot-rate-adaptive", "--hot-step-ratio", "1.3"]
    assert main(["--out", str(tmp_path), *flags]) == 0
    for name in ("orchestrator", "llm", "orchestrator_colocated"):
        throttle = build(OrchestratorConfig, params(name), strings=True).hot_prompts.throttle
        assert throttle is not None and (throttle.max_rate, throttle.step_ratio) == (2.0, 1.3), name
    assert "hot_prompts.rate_adaptive" not in render(Layout(hot_prompts=HotPrompts(group_rate=2)))["llm"]
    assert (
        "hot_prompts.step_ratio"
        not in render(Layout(hot_prompts=HotPrompts(group_rate=2, rate_adaptive=True)))["llm"]
    )
    with pytest.raises(ConfigError, match=r"hot_prompts\.rate_adaptive: needs group_rate > 0"):
        load_spec(None, ["hot_prompts.rate_adaptive=true"])
    with pytest.raises(ConfigError, match=r"hot_prompts\.step_ratio: must be in \(1, 100\]"):
        load_spec(None, ["hot_prompts.step_ratio=1.0"])


def test_hot_prompt_groups_use_the_prefix_cache_block_size():
    assert "hot_prompts.block_tokens" not in render(Layout())["llm"]
    for name in ("llm", "orchestrator"):
        assert (
            'key: "hot_prompts.block_tokens", value: { string_value: "32" }'
            in render(Layout(kv=KV(block_size=32)))[name]
        )


def test_role_variants_split_the_models_and_the_pools_hand_kv_over_quiet_nixl(tmp_path, tiny_model_dir):
    """`--role`: a frontend carries the entry points and names its remote pools; a pool role carries
    its pool alone, its KV over NIXL without the progress thread (PoolConfig.nixl_progress_thread)."""
    import re

    from disagg.pool.instance import transport_options
    from disagg.serving.orchestrator import OrchestratorConfig
    from disagg.triton.pool_model import pool_config

    remote = "prefill=10.0.0.2:8001;decode=dns:decode.llm.svc:8001"
    assert main(["--out", str(tmp_path / "front"), "--role", "frontend", "--remote-pools", remote]) == 0
    front = sorted(p.name for p in (tmp_path / "front").iterdir())
    assert front == ["ensemble", "llm", "orchestrator", "postprocessing", "preprocessing"]
    for name in ("llm", "orchestrator"):
        body = (tmp_path / "front" / name / "config.pbtxt").read_text()
        params = dict(re.findall(r'key: "([\w.]+)", value: \{ string_value: "([^"]*)" \}', body))
        own = {k: v for k, v in params.items() if k not in ("role",)}
        assert build(OrchestratorConfig, own, strings=True).remote.servers == {
            "prefill": "10.0.0.2:8001",
            "decode": "dns:decode.llm.svc:8001",
        }
    for role in ("prefill", "decode"):
        assert main(["--out", str(tmp_path / role), "--role", role]) == 0
        assert [p.name for p in (tmp_path / role).iterdir()] == [role]
        body = (tmp_path / role / role / "config.pbtxt").read_text()
        params = dict(re.findall(r'key: "([\w.]+)", value: \{ string_value: "([^"]*)" \}', body))
        config = pool_config(
            {**params, "model_dir": str(tiny_model_dir)}, {"model_instance_name": f"{role}_0"}
        )
        assert config.kv.transport == "nixl" and transport_options(config)["nixl"].progress_thread is False
    with pytest.raises(SystemExit):  # a frontend without its pools' servers is refused
        main(["--out", str(tmp_path / "bad"), "--role", "frontend"])
