"""Actuators against in-process fake servers: Triton's model repository API and a Kubernetes API."""

from __future__ import annotations

import json
import re
import stat
import time
from typing import Any

import pytest
from autoscale_factory import FakeClock, config, decode_pool, http_fake, json_body, prefill_pool

from disagg.broker import Broker, BrokerClient, BrokerError
from disagg.control import ModelControl
from disagg_tools.autoscaler.actuator import (
    ActuatorError,
    DrainTimeout,
    KubernetesActuator,
    TritonActuator,
    instance_count,
    with_instance_count,
)
from disagg_tools.autoscaler.config import ActuatorConfig, ConfigError

KEY = "k3y-for-tests-0123456789"
MODEL_CONFIG = {
    "name": "prefill",
    "backend": "python",
    "max_batch_size": 0,
    "instance_group": [{"name": "prefill_0", "kind": "KIND_CPU", "count": 1, "gpus": []}],
    "parameters": {"pool": {"string_value": "prefill"}},
}
POOL = config([prefill_pool()]).pools[0]


def triton_handler(state: dict[str, Any]):
    def handle(method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, str, bytes]:
        if method == "GET" and path == "/v2/models/prefill/config":
            return json_body(state["config"])
        if method == "POST" and path == "/v2/repository/models/prefill/load":
            if headers.get("disagg-admin-key") != KEY:
                return json_body({"error": "This API is restricted"}, 403)
            state["config"] = json.loads(json.loads(body)["parameters"]["config"])
            return 200, "application/json", b""
        return json_body({"error": "not found"}, 404)

    return handle


@pytest.fixture(autouse=True)
def own_state_folder(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model-control lock and journal go to this test's own folder, not the user's state."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


def triton_actuator(
    url: str, inflight: Any = lambda pool: 0.0, control: ModelControl | None = None, **over: Any
) -> tuple[TritonActuator, FakeClock]:
    clock = FakeClock()
    cfg = ActuatorConfig(kind="triton", url=url, drain_timeout_s=10.0, drain_poll_s=1.0, **over)
    return TritonActuator(cfg, clock, inflight, environ={"DISAGG_ADMIN_KEY": KEY}, control=control), clock


def test_triton_actuator_waits_for_model_control_and_gives_up_cleanly_when_it_stays_held(tmp_path) -> None:
    state = {"config": MODEL_CONFIG}
    with http_fake(triton_handler(state)) as (url, records):
        held = ModelControl(url, tmp_path, timeout_s=0.2)
        act, _ = triton_actuator(url, control=ModelControl(url, tmp_path, timeout_s=0.2))
        with held.owner(), pytest.raises(ActuatorError, match="model control busy"):  # a restart under way
            act.apply(POOL, 1, 2)
        assert not [r for r in records if r.method == "POST"], "nothing was loaded while it was held"
        act.apply(POOL, 1, 2)
        assert act.current(POOL) == 2


def test_triton_actuator_posts_the_config_with_the_new_count_and_the_restricted_api_header() -> None:
    state = {"config": MODEL_CONFIG}
    with http_fake(triton_handler(state)) as (url, records):
        act, _ = triton_actuator(url)
        assert act.current(POOL) == 1
        act.apply(POOL, 1, 2)
        assert act.current(POOL) == 2
    post = next(r for r in records if r.method == "POST")
    assert post.path == "/v2/repository/models/prefill/load"
    assert post.headers["disagg-admin-key"] == KEY
    assert post.headers["content-type"] == "application/json"
    sent = json.loads(post.body)
    assert set(sent) == {"parameters"} and set(sent["parameters"]) == {"config"}
    new = json.loads(sent["parameters"]["config"])
    assert new["instance_group"][0]["count"] == 2
    assert {k: v for k, v in new.items() if k != "instance_group"} == {
        k: v for k, v in MODEL_CONFIG.items() if k != "instance_group"
    }
    # The key travels only on the restricted call.
    assert all("disagg-admin-key" not in r.headers for r in records if r.method == "GET")


def test_triton_actuator_errors_are_actuator_errors_without_the_key() -> None:
    state = {"config": MODEL_CONFIG}
    with http_fake(triton_handler(state)) as (url, _):
        clock = FakeClock()
        cfg = ActuatorConfig(kind="triton", url=url)
        act = TritonActuator(cfg, clock, lambda p: 0.0, environ={"DISAGG_ADMIN_KEY": "wrong-key-0123456789"})
        with pytest.raises(ActuatorError) as info:
            act.apply(POOL, 1, 2)
        assert "403" in str(info.value) and "wrong" not in str(info.value)
        other = config([prefill_pool(name="missing")]).pools[0]
        with pytest.raises(ActuatorError):
            act.current(other)
    with pytest.raises(ConfigError):
        TritonActuator(ActuatorConfig(kind="triton"), FakeClock(), lambda p: 0.0, environ={})


def test_without_the_key_the_actuator_asks_the_broker_which_alone_holds_it(tmp_path) -> None:
    """The model-control broker (disagg.broker) of a server: the one holder of its admin key. Callers
    without the key ask it over a 0600 Unix socket; it loads under the server's model-control lock."""
    state = {"config": MODEL_CONFIG}
    with http_fake(triton_handler(state)) as (url, records):
        server = url.split("://")[1]
        control = ModelControl(server, tmp_path, timeout_s=0.2)
        broker = Broker(server, KEY, control).start()
        try:
            assert stat.S_IMODE(broker.path.stat().st_mode) == 0o600
            client = BrokerClient(url, control=control)
            cfg = ActuatorConfig(kind="triton", url=url)
            act = TritonActuator(cfg, FakeClock(), lambda p: 0.0, environ={}, broker=client)
            assert act.current(POOL) == 1
            with control.owner(), pytest.raises(ActuatorError, match="model control busy"):
                act.apply(POOL, 1, 2)  # a restart holds model control: the broker waits, then says so
            assert not [r for r in records if r.method == "POST"]
            act.apply(POOL, 1, 2)
            assert act.current(POOL) == 2
            post = next(r for r in records if r.method == "POST")
            assert post.headers["disagg-admin-key"] == KEY, "the broker added the key"
            kept = json.loads(json.loads(post.body)["parameters"]["config"])
            assert kept["parameters"] == MODEL_CONFIG["parameters"], "the live config, one key replaced"
            with pytest.raises(BrokerError, match="HTTP 404"):
                client.call("config", "missing")
            with pytest.raises(BrokerError, match="op one of"):
                client.call("delete", "prefill")
        finally:
            broker.stop()
        assert not broker.path.exists()
        with pytest.raises(BrokerError, match="no model-control broker"):
            client.call("index")
        with pytest.raises(ConfigError, match="no model-control broker runs"):
            TritonActuator(
                ActuatorConfig(kind="triton", url=url), FakeClock(), lambda p: 0.0, environ={}, broker=client
            )


def test_the_broker_restarts_a_dead_pool_once_with_its_live_config(tmp_path) -> None:
    """A pool watcher's restart through the broker (its own load would hold its stub's GIL for the
    whole load): a model still ready is unloaded, then loaded with its live config, under the lock,
    and recorded; a second watcher that found the same death is told it was restarted since; a model
    that is not ready (being unloaded) is left alone."""
    state = {"config": {**MODEL_CONFIG, "runtime": "model.py"}, "ready": True}
    base = triton_handler(state)

    def handle(method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, str, bytes]:
        if method == "GET" and path == "/v2/models/prefill/ready":
            return (
                (200, "application/json", b"") if state["ready"] else json_body({"error": "not ready"}, 400)
            )
        if method == "POST" and path == "/v2/repository/models/prefill/unload":
            return (
                (200, "application/json", b"") if headers.get("disagg-admin-key") == KEY else (403, "", b"")
            )
        return base(method, path, headers, body)

    with http_fake(handle) as (url, records):
        server = url.split("://")[1]
        control = ModelControl(server, tmp_path, timeout_s=0.2)
        broker = Broker(server, KEY, control).start()
        try:
            client = BrokerClient(url, control=control)
            found_dead_at = time.time()
            assert client.call("restart", "prefill", found_dead_at=found_dead_at) is True
            posts = [r.path.rsplit("/", 1)[1] for r in records if r.method == "POST"]
            assert posts == ["unload", "load"]
            loaded = json.loads(json.loads(records[-1].body)["parameters"]["config"])
            assert "runtime" not in loaded and loaded["instance_group"] == MODEL_CONFIG["instance_group"]
            assert control.last_restart("prefill") >= found_dead_at
            assert client.call("restart", "prefill", found_dead_at=found_dead_at) is False, "restarted since"
            state["ready"] = False
            assert client.call("restart", "prefill", found_dead_at=time.time()) is False, "being unloaded"
            assert [r.method for r in records].count("POST") == 2
            with control.owner(), pytest.raises(BrokerError, match="model control busy"):
                client.call("restart", "prefill", found_dead_at=time.time())
            with pytest.raises(BrokerError, match="found_dead_at must be"):
                client.call("restart", "prefill", found_dead_at=float("nan"))
        finally:
            broker.stop()


WAITING_POOL = config([prefill_pool(drain_max_inflight=0.0)]).pools[0]


def test_scale_in_is_sent_at_once_by_default_the_instance_drains_itself() -> None:
    state = {"config": with_instance_count(MODEL_CONFIG, 3)}
    with http_fake(triton_handler(state)) as (url, records):
        act, clock = triton_actuator(url, inflight=lambda pool: 99.0)
        act.apply(POOL, 3, 2)
    assert clock.waits == []
    assert instance_count(state["config"]) == 2
    assert [r.method for r in records].count("POST") == 1


def test_scale_in_waits_for_the_pool_to_drain_then_reloads() -> None:
    state = {"config": with_instance_count(MODEL_CONFIG, 3)}
    loads = iter([7.0, 2.0, None, 0.0])  # None: the probe could not read the gauge (not drained)
    with http_fake(triton_handler(state)) as (url, records):
        act, clock = triton_actuator(url, inflight=lambda pool: next(loads))
        act.apply(WAITING_POOL, 3, 2)
    assert clock.waits == [1.0, 1.0, 1.0]
    assert instance_count(state["config"]) == 2
    assert [r.method for r in records].count("POST") == 1


def test_scale_in_is_deferred_when_the_pool_does_not_drain() -> None:
    state = {"config": with_instance_count(MODEL_CONFIG, 3)}
    with http_fake(triton_handler(state)) as (url, records):
        act, clock = triton_actuator(url, inflight=lambda pool: 5.0)
        with pytest.raises(DrainTimeout):
            act.apply(WAITING_POOL, 3, 2)
    assert not any(r.method == "POST" for r in records)
    assert instance_count(state["config"]) == 3
    assert sum(clock.waits) >= 10.0


def test_scale_out_does_not_wait_for_drain() -> None:
    state = {"config": MODEL_CONFIG}
    with http_fake(triton_handler(state)) as (url, _):
        act, clock = triton_actuator(url, inflight=lambda pool: 99.0)
        act.apply(WAITING_POOL, 1, 2)
    assert clock.waits == []


def test_instance_groups_several_groups_change_the_last_one() -> None:
    cfg = {"instance_group": [{"count": 2, "gpus": [0]}, {"count": 1, "gpus": [1]}]}
    assert instance_count(cfg) == 3
    assert with_instance_count(cfg, 5)["instance_group"][1]["count"] == 3
    assert cfg["instance_group"][1]["count"] == 1  # the input is not modified
    with pytest.raises(ActuatorError):
        with_instance_count(cfg, 2)
    assert instance_count({}) == 1  # Triton's default


def k8s_handler(state: dict[str, Any]):
    path_re = re.compile(r"^/apis/apps/v1/namespaces/(?P<ns>[^/]+)/deployments/(?P<name>[^/]+)/scale$")

    def scale(ns: str, name: str) -> dict[str, Any]:
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"replicas": state["replicas"][name]},
            "status": {"replicas": state["replicas"][name]},
        }

    def handle(method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, str, bytes]:
        m = path_re.match(path.split("?")[0])
        if not m or m["name"] not in state["replicas"]:
            return json_body({"kind": "Status", "status": "Failure", "code": 404}, 404)
        if method == "PATCH":
            state["replicas"][m["name"]] = json.loads(body)["spec"]["replicas"]
        return json_body(scale(m["ns"], m["name"]))

    return handle


def test_kubernetes_actuator_patches_the_deployment_scale() -> None:
    from kubernetes import client

    state = {"replicas": {"llm-decode": 2}}
    pool = config([decode_pool(deployment="llm-decode")]).pools[0]
    with http_fake(k8s_handler(state)) as (url, records):
        conf = client.Configuration(host=url)
        api = client.AppsV1Api(client.ApiClient(conf))
        act = KubernetesActuator(ActuatorConfig(kind="kubernetes", namespace="serving"), api=api)
        assert act.current(pool) == 2
        act.apply(pool, 2, 3)
        assert act.current(pool) == 3
        with pytest.raises(ActuatorError) as info:
            act.current(config([decode_pool(deployment="absent")]).pools[0])
        assert "404" in str(info.value)
    patch = next(r for r in records if r.method == "PATCH")
    assert patch.path == "/apis/apps/v1/namespaces/serving/deployments/llm-decode/scale"
    assert json.loads(patch.body) == {"spec": {"replicas": 3}}
    assert "patch" in patch.headers["content-type"]  # a merge/strategic patch, not a replace
