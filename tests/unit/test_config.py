"""disagg.config.build: typed by the dataclass's annotations, a strings mode for config.pbtxt, errors
that name the key path; and the orchestrator's settings through it."""

from __future__ import annotations

import enum
import logging
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest

from disagg.config import ConfigError, build
from disagg.serving.orchestrator import OrchestratorConfig


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Level(enum.Enum):
    LOW = 1
    HIGH = 2


@dataclass(frozen=True)
class Inner:
    size: int = 1
    name: str = "inner"

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError("size must be >= 1")


@dataclass(frozen=True)
class Sample:
    count: int
    ratio: float = 0.5
    flag: bool = False
    label: str = "x"
    note: str = ""
    path: Path = Path("/tmp")
    kind: Literal["a", "b"] = "a"
    colour: Colour = Colour.RED
    level: Level = Level.LOW
    limit: int | None = None
    names: tuple[str, ...] = ()
    cores: tuple[int, ...] | None = None
    pair: tuple[int, float] = (0, 0.0)
    inner: Inner = field(default_factory=Inner)
    extra: Any = None
    blob: bytes = b""

    def __post_init__(self) -> None:
        if self.count > 100:
            raise ValueError("count must be at most 100")


@dataclass(frozen=True)
class Outer:
    items: tuple[Inner, ...]
    main: Inner = field(default_factory=Inner)


def refused(cls: type, data: dict[str, Any], **kw: Any) -> str:
    with pytest.raises(ConfigError) as info:
        build(cls, data, **kw)
    return str(info.value)


def test_every_type_is_converted_from_plain_values() -> None:
    cfg = build(
        Sample,
        {
            "count": 3,
            "ratio": 2,  # an int is fine for a float
            "flag": True,
            "label": "y",
            "path": "/data/model",
            "kind": "b",
            "colour": "blue",
            "level": 2,
            "limit": None,
            "names": ["p", "q"],
            "cores": (0, 1),
            "pair": [1, 2.5],
            "inner": {"size": 4},
            "extra": {"anything": [1]},
            "blob": b"\x00\x01",
        },
    )
    assert cfg == Sample(
        count=3,
        ratio=2.0,
        flag=True,
        label="y",
        path=Path("/data/model"),
        kind="b",
        colour=Colour.BLUE,
        level=Level.HIGH,
        names=("p", "q"),
        cores=(0, 1),
        pair=(1, 2.5),
        inner=Inner(size=4),
        extra={"anything": [1]},
        blob=b"\x00\x01",
    )
    assert isinstance(cfg.ratio, float) and isinstance(cfg.names, tuple)
    assert build(Sample, {"count": 1}) == Sample(count=1)  # defaults, default_factory included
    assert build(Sample, {"count": 1, "colour": Colour.BLUE}).colour is Colour.BLUE


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"count": True}, "count: must be an integer"),  # bool is not an int
        ({"count": "3"}, "count: must be an integer"),  # no strings outside strings mode
        ({"count": 1.0}, "count: must be an integer"),
        ({"count": 1, "ratio": False}, "ratio: must be a finite number"),
        ({"count": 1, "ratio": float("nan")}, "ratio: must be a finite number"),
        ({"count": 1, "flag": 1}, "flag: must be true or false"),
        ({"count": 1, "label": ""}, "label: must be a non-empty string"),
        ({"count": 1, "label": 5}, "label: must be a non-empty string"),
        ({"count": 1, "kind": "c"}, "kind: must be one of a, b"),
        ({"count": 1, "colour": "green"}, "colour: must be one of red, blue"),
        ({"count": 1, "level": True}, "level: must be one of 1, 2"),
        ({"count": 1, "names": "p,q"}, "names: must be a list"),
        ({"count": 1, "names": ["p", 3]}, "names[1]: must be a non-empty string"),
        ({"count": 1, "pair": [1]}, "pair: must have 2 items"),
        ({"count": 1, "path": 3}, "path: must be a non-empty path"),
        ({"count": 1, "blob": "text"}, "blob: must be bytes"),
        ({"count": 1, "inner": 3}, "inner: must be a mapping"),
        ({"count": 1, "limit": "7"}, "limit: must be an integer"),
    ],
)
def test_wrong_types_are_refused_by_key(data: dict[str, Any], message: str) -> None:
    assert refused(Sample, data) == message


def test_empty_string_is_allowed_only_where_it_is_the_default() -> None:
    assert build(Sample, {"count": 1, "note": ""}).note == ""
    assert "label" in refused(Sample, {"count": 1, "label": ""})


def test_unknown_and_missing_keys_are_refused() -> None:
    assert refused(Sample, {"count": 1, "colr": "red", "bogus": 1}) == "unknown key(s) bogus, colr"
    assert refused(Sample, {"ratio": 0.1}) == "count: required"
    assert refused(Outer, {}) == "items: required"
    assert refused(Inner, {"sise": 2}, where="pools[0]") == "pools[0]: unknown key(s) sise"


def test_nested_errors_carry_the_key_path() -> None:
    assert refused(Outer, {"items": [{}, {"size": "2"}]}) == "items[1].size: must be an integer"
    assert refused(Outer, {"items": [], "main": {"colour": "red"}}) == "main: unknown key(s) colour"
    assert refused(Sample, {"count": 1, "inner": {"size": 0}}, where="engine") == (
        "engine.inner: size must be >= 1"
    )
    outer = build(Outer, {"items": [{"size": 2}, Inner(size=3)]})
    assert outer.items == (Inner(size=2), Inner(size=3)) and outer.main == Inner()


def test_a_sections_fields_may_be_given_as_dotted_keys() -> None:
    """config.pbtxt is a flat map: ``main.size`` is field ``size`` of section ``main``."""
    outer = build(Outer, {"items": "", "main.size": "4", "main.name": "m"}, strings=True)
    assert outer.main == Inner(size=4, name="m")
    assert build(Sample, {"count": 1, "inner.size": 2}).inner == Inner(size=2)
    assert refused(Outer, {"items": [], "main.colour": "red"}) == "main: unknown key(s) colour"
    assert refused(Outer, {"items": [], "main.size": 0}) == "main: size must be >= 1"
    assert refused(Sample, {"count": 1, "ratio.x": 1}) == "unknown key(s) ratio.x"  # not a section
    assert refused(Sample, {"count": 1, "nope.x": 1}) == "unknown key(s) nope.x"
    assert "given whole and by its keys" in refused(Outer, {"items": [], "main": {}, "main.size": 2})


def test_post_init_value_errors_become_config_errors_with_the_prefix() -> None:
    with pytest.raises(ConfigError) as info:
        build(Sample, {"count": 101}, where="pools[2]")
    assert str(info.value) == "pools[2]: count must be at most 100"
    assert isinstance(info.value, ValueError)  # callers catching ValueError still do
    assert isinstance(info.value.__cause__, ValueError)
    assert refused(Sample, {"count": 101}) == "count must be at most 100"


def test_strings_mode_parses_config_pbtxt_values() -> None:
    cfg = build(
        Sample,
        {
            "count": " 7 ",
            "ratio": "0.25",
            "flag": "Yes",
            "path": "/m",
            "kind": "b",
            "colour": "blue",
            "level": "2",
            "limit": "12",
            "names": "p, q",
            "cores": "0,1,2",
            "pair": "3,4.5",
            "inner": {"size": "9"},
        },
        strings=True,
    )
    assert (cfg.count, cfg.ratio, cfg.flag, cfg.path) == (7, 0.25, True, Path("/m"))
    assert (cfg.kind, cfg.colour, cfg.level, cfg.limit) == ("b", Colour.BLUE, Level.HIGH, 12)
    assert (cfg.names, cfg.cores, cfg.pair, cfg.inner) == (("p", "q"), (0, 1, 2), (3, 4.5), Inner(size=9))
    for word, value in (
        ("1", True),
        ("true", True),
        ("TRUE", True),
        ("0", False),
        ("false", False),
        ("no", False),
    ):
        assert build(Sample, {"count": "1", "flag": word}, strings=True).flag is value


def test_strings_mode_empty_values() -> None:
    cfg = build(
        Sample, {"count": "1", "limit": "", "cores": "", "names": "", "ratio": "", "label": ""}, strings=True
    )
    assert cfg.limit is None and cfg.cores is None  # "" is None for an optional field
    assert cfg.names == ()  # and no items for a list
    assert (cfg.ratio, cfg.label) == (0.5, "x")  # and the default elsewhere
    assert refused(Sample, {"count": ""}, strings=True) == "count: required"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"flag": "on"}, "flag: must be one of 1, true, yes, 0, false, no"),
        ({"count": "3.5"}, "count: must be an integer"),
        ({"ratio": "fast"}, "ratio: must be a finite number"),
        ({"ratio": "inf"}, "ratio: must be a finite number"),
        ({"cores": "0,x"}, "cores[1]: must be an integer"),
        ({"kind": "c"}, "kind: must be one of a, b"),
        ({"colour": "RED"}, "colour: must be one of red, blue"),
    ],
)
def test_strings_mode_refuses_bad_text(data: dict[str, Any], message: str) -> None:
    assert refused(Sample, {"count": "1", **data}, strings=True) == message


def test_not_a_dataclass_is_a_bug_not_bad_input() -> None:
    with pytest.raises(TypeError):
        build(dict, {})  # type: ignore[type-var]
    with pytest.raises(ConfigError, match="must be a mapping"):
        build(Inner, ["size", 1])  # type: ignore[arg-type]


def test_the_module_imports_without_torch_or_numpy() -> None:
    code = "import sys, disagg.config; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------ OrchestratorConfig


def test_orchestrator_config_from_parameters() -> None:
    params = {
        "role": "llm",
        "mode": "colocated",
        "cores": "0;1",
        "request_timeout_s": "30",
        "max_inflight": "64",
        "prefill_model": "p",
        "decode_model": "d",
        "colocated_model": "c",
        "slo.ttft_s": "0.5",
        "slo.tpot_s": "0.05",
        "slo.window_s": "120",
        "model_dir": "/models/x",
        "secret_file": "",
    }
    cfg = build(OrchestratorConfig, params, strings=True)
    assert (cfg.role, cfg.mode, cfg.cores, cfg.request_timeout_s) == ("llm", "colocated", "0;1", 30.0)
    assert cfg.max_inflight == 64
    assert cfg.pool_models == {"prefill": "p", "decode": "d", "colocated": "c"}
    assert (cfg.slo.ttft_s, cfg.slo.tpot_s, cfg.slo.window_s) == (0.5, 0.05, 120.0)
    assert cfg.model_dir == Path("/models/x") and cfg.secret_file is None
    with pytest.raises(AttributeError):
        cfg.max_inflight = 1  # type: ignore[misc]


def test_orchestrator_config_defaults() -> None:
    cfg = build(OrchestratorConfig, {}, strings=True)
    assert cfg == OrchestratorConfig()
    assert (cfg.mode, cfg.request_timeout_s, cfg.max_inflight) == ("disaggregated", 600.0, 256)
    assert cfg.pool_models == {"prefill": "prefill", "decode": "decode", "colocated": "colocated"}
    assert (cfg.slo.ttft_s, cfg.slo.tpot_s, cfg.slo.window_s) == (1.0, 0.1, 60.0)
    assert cfg.model_dir is None and cfg.cores == ""
    assert OrchestratorConfig(mode="colocated", request_timeout_s=5.0).max_inflight == 256


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"max_inflght": "10"}, "unknown key(s) max_inflght"),
        ({"max_inflight": "0"}, "max_inflight must be in [1, 65536]"),
        ({"max_inflight": "65537"}, "max_inflight must be in [1, 65536]"),
        ({"max_inflight": "many"}, "max_inflight: must be an integer"),
        ({"mode": "both"}, "mode must be one of"),
        ({"role": "prefill"}, "role: must be one of orchestrator, llm"),
        ({"slo.ttft_s": "0"}, "slo.ttft_s: must be a positive number"),
        ({"slo_ttft_s": "0"}, "slo.ttft_s: must be a positive number"),  # the old name, for a release
        ({"request_timeout_s": "-1"}, "request_timeout_s must be a number of seconds in (0, 86400]"),
    ],
)
def test_orchestrator_config_refuses_bad_parameters(params: dict[str, str], message: str) -> None:
    assert message in refused(OrchestratorConfig, params, strings=True)


def test_orchestrator_config_range_edges_and_direct_construction() -> None:
    assert build(OrchestratorConfig, {"max_inflight": "1"}, strings=True).max_inflight == 1
    assert build(OrchestratorConfig, {"max_inflight": "65536"}, strings=True).max_inflight == 65536
    # types are build's: checked once, from plain values
    assert refused(OrchestratorConfig, {"decode_model": ""}) == "decode_model: must be a non-empty string"
    assert refused(OrchestratorConfig, {"max_inflight": True}) == "max_inflight: must be an integer"
    with pytest.raises(ValueError, match="max_inflight"):  # ranges: the dataclass's, however it is made
        OrchestratorConfig(max_inflight=0)


def test_a_renamed_key_still_works_for_a_release_with_a_warning_naming_the_new_one(caplog):
    from disagg.pool.instance import PoolConfig

    engine = {"model_dir": "/m"}
    with caplog.at_level(logging.WARNING, logger="disagg.config"):
        old = PoolConfig.from_dict({"role": "prefill", "local_generate": "true", **engine}, strings=True)
    assert old.local_decode is True
    assert "local_generate is deprecated" in caplog.text and "now local_decode" in caplog.text
    new = PoolConfig.from_dict({"role": "prefill", "local_decode": "true", **engine}, strings=True)
    assert new == old
    with pytest.raises(ConfigError, match="local_generate and local_decode are one key"):
        PoolConfig.from_dict(
            {"role": "prefill", "local_generate": "1", "local_decode": "1", **engine}, strings=True
        )


SECTION_RENAMES = {  # the orchestrator's old flat parameters: each with a value other than its default
    "admission_margin": "3",
    "admission_sheddable_margin": "0.25",
    "admission_cold_backlog_tokens": "512",
    "conditional_prefill_tokens": "64",
    "conditional_backlog_s": "0.5",
    "probe_interval_s": "2",
    "probe_timeout_s": "3",
    "pool_recovery": "false",
    "recovery_backoff_s": "7",
    "cancel_poll_s": "0.05",
    "cancel_checks_per_s": "50",
    "remote_pools": "prefill=10.0.0.2:8001",
    "fallback_ladder": "disaggregated,shed",
    "local_max_tokens": "16",
    "migration_limit": "1",
    "retry_after_s": "9",
    "shed_sheddable_when_degraded": "false",
    "colocated_first_when_decode_gone": "false",
}


@pytest.mark.parametrize("old", sorted(SECTION_RENAMES))
def test_an_orchestrator_parameter_moved_into_a_section_still_works_for_a_release(old: str, caplog) -> None:
    new = OrchestratorConfig.RENAMED[old]
    value = SECTION_RENAMES[old]
    with caplog.at_level(logging.WARNING, logger="disagg.config"):
        by_old = build(OrchestratorConfig, {old: value}, strings=True)
    assert f"{old} is deprecated and goes in the next release: it is now {new}" in caplog.text
    by_new = build(OrchestratorConfig, {new: value}, strings=True)
    assert by_old == by_new != OrchestratorConfig()
    section, field = new.split(".")
    assert getattr(getattr(by_new, section), field) != getattr(getattr(OrchestratorConfig(), section), field)


def test_every_section_rename_is_tested() -> None:
    earlier = ("hot_prompts.", "slo.")  # sections of their own tests
    moved = {old for old, new in OrchestratorConfig.RENAMED.items() if not new.startswith(earlier)}
    # remote_tls needs a folder of certificates: tests/unit/test_tls.py
    assert moved == {*SECTION_RENAMES, "remote_tls"}


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"admission.margin": "-1"}, "admission.margin: must be a number >= 0"),
        ({"conditional.prefill_tokens": "-1"}, "conditional.prefill_tokens: must be in [0, 1048576]"),
        ({"health.probe_timeout_s": "0"}, "health.probe_timeout_s: must be a number of seconds in (0, 3600]"),
        ({"cancel.checks_per_s": "0.5"}, "cancel.checks_per_s: must be in [1, 1e+06]"),
        ({"degradation.ladder": "local"}, "degradation.ladder: must end with 'shed'"),
        ({"degradation.migration_limit": "101"}, "degradation.migration_limit: must be in [0, 100]"),
        ({"remote.pools": "embed=h:1"}, "remote: pools names pools this entry point has not"),
        ({"remote.tls": "/nowhere"}, "remote.tls: goes with pools"),
    ],
)
def test_a_section_refuses_its_bad_values_naming_its_key(params: dict[str, str], message: str) -> None:
    assert message in refused(OrchestratorConfig, params, strings=True)


KV_RENAMES = {  # a pool's old flat KV parameters: each with a value other than its default
    "kv_cache_mb": "64",
    "block_size": "32",
    "kv_dtype": "bfloat16",
    "prefix_cache": "true",
    "transport": "nixl",
    "lease_ttl_s": "5",
    "checksum": "true",
}
POOL = {"role": "prefill", "model_dir": "/m"}  # the engine's float32 compute dtype, so bfloat16 KV differs


@pytest.mark.parametrize("old", sorted(KV_RENAMES))
def test_a_pool_kv_parameter_moved_into_its_section_still_works_for_a_release(old: str, caplog) -> None:
    from disagg.kv.settings import ENGINE_FIELDS
    from disagg.pool.instance import PoolConfig

    new = PoolConfig.RENAMED[old]
    value = KV_RENAMES[old]
    with caplog.at_level(logging.WARNING, logger="disagg.config"):
        by_old = PoolConfig.from_dict({**POOL, old: value}, strings=True)
    assert f"{old} is deprecated and goes in the next release: it is now {new}" in caplog.text
    by_new = PoolConfig.from_dict({**POOL, new: value}, strings=True)
    default = PoolConfig.from_dict(POOL, strings=True)
    assert by_old == by_new != default
    name = new.removeprefix("kv.")
    assert getattr(by_new.kv, name) != getattr(default.kv, name)
    if name in ENGINE_FIELDS:  # the engine's KV part is built from the section
        assert getattr(by_new.engine, ENGINE_FIELDS[name]) == getattr(by_new.kv, name)
    with pytest.raises(ConfigError, match=f"{old} and {new} are one key"):  # both at once: refused
        PoolConfig.from_dict({**POOL, old: value, new: value}, strings=True)


def test_every_pool_kv_rename_is_tested() -> None:
    from disagg.pool.instance import PoolConfig

    assert {old for old, new in PoolConfig.RENAMED.items() if new.startswith("kv.")} == set(KV_RENAMES)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"kv.cache_mb": "0"}, "kv.cache_mb: must be positive"),
        ({"kv.cache_mb": "many"}, "kv.cache_mb: must be an integer"),
        ({"kv.block_size": "0"}, "kv.block_size: must be positive"),
        ({"kv.dtype": "int8"}, "kv.dtype: must be one of bfloat16, float16, float32, auto"),
        ({"kv.lease_ttl_s": "0"}, "kv.lease_ttl_s: must be a number of seconds in (0, 3600]"),
        ({"kv.lease_ttl_s": "3601"}, "kv.lease_ttl_s: must be a number of seconds in (0, 3600]"),
        ({"lease_ttl_s": "0"}, "kv.lease_ttl_s: must be a number of seconds in (0, 3600]"),  # old name
        ({"kv.checksum": "maybe"}, "kv.checksum: must be one of"),
        ({"kv.cachemb": "1"}, "kv: unknown key(s) cachemb"),
        ({"kv": "x", "kv.block_size": "8"}, "kv is given whole and by its keys"),
    ],
)
def test_the_kv_section_refuses_its_bad_values_naming_its_key(params: dict[str, str], message: str) -> None:
    from disagg.pool.instance import PoolConfig

    with pytest.raises(ConfigError) as info:
        PoolConfig.from_dict({**POOL, **params}, strings=True)
    assert message in str(info.value)


def test_the_engine_takes_its_kv_part_from_the_section_and_never_a_second_copy() -> None:
    from disagg.engine.engine import EngineConfig
    from disagg.kv.settings import KVSettings
    from disagg.pool.instance import PoolConfig

    kv = KVSettings(cache_mb=64, block_size=32, dtype="bfloat16", prefix_cache=True)
    config = PoolConfig(role="prefill", engine=EngineConfig(model_dir="/m"), kv=kv)
    engine = config.engine
    got = (engine.kv_cache_mb, engine.block_size, engine.kv_dtype, engine.prefix_cache)
    assert got == (64, 32, "bfloat16", True)
    assert PoolConfig(role="prefill", engine=engine, kv=kv) == config  # an engine that agrees is taken
    plain = EngineConfig(model_dir="/m")
    assert PoolConfig(role="prefill", engine=plain).engine == plain  # the section's defaults: the engine's
    # a KV setting given to the engine alone would be dropped unseen: refused, naming the section's key
    with pytest.raises(ValueError, match=r"engine\.block_size: .* give kv\.block_size"):
        PoolConfig(role="prefill", engine=EngineConfig(model_dir="/m", block_size=32))
    with pytest.raises(ConfigError, match=r"^engine\.kv_cache_mb: .* give kv\.cache_mb$"):
        build(PoolConfig, {"role": "prefill", "engine": {"model_dir": "/m", "kv_cache_mb": 64}})
