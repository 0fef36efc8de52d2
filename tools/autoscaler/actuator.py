"""Actuators: read a pool's current size and apply a decided one.

- `log`: dry run. Keeps a simulated size per pool (starting at min_size); the runner prints every
  decision as a JSON line.
- `triton`: one machine. Reads the model's live config (`GET /v2/models/<name>/config`), changes the
  `instance_group` count and posts it back through the model repository API
  (`POST /v2/repository/models/<name>/load` with `{"parameters": {"config": "<json>"}}`), which needs
  `--model-control-mode=explicit` and, where the server restricts the `model-repository` API, the
  configured header. The key is read from an environment variable, never a flag. Each load is made
  as the server's model-control owner (`disagg.control`), so it never lands in the middle of a pool
  restart by an entry point's watcher, and a restart keeps the count it set.
- `kubernetes`: patches a Deployment's `scale` subresource with the official client.

Scale-in safety (RELIABILITY F3). Triton 2.51's model management guide says: a load whose config
differs from the loaded one only in the instance groups *updates* the model in place (instances are
added or removed, the model is not reloaded); a failed reload leaves the loaded model untouched. It does
not promise what happens to work still held by an instance that an update removes (decoupled Python
models, whose streams outlive `execute()`, are not covered). The pool instances make it safe
themselves: Triton stops routing to the removed instance, then finalizes it, and its finalize drains
(the jobs it was handed finish, its exported KV leases are pulled or expire; bounded at 10 s) before
its memory goes; it zeroes its gauges (its series stay on /metrics). Measured under a steady load
(`tests/integration/test_autoscale.py`): prefill 2 -> 1 with no failed request, the removed instance's
KV region gone within seconds.
So by default a scale-in is sent at once. A pool may also ask to wait first (`drain_max_inflight`):
until the pool's in-flight gauge (prefill: pending tokens + queued requests; decode: active sequences)
is at most that, polling for up to `drain_timeout_s`; if it does not drain, the scale-in is not sent
and the decision is reported as deferred (a pool under steady load then never scales in). On
Kubernetes the pod's own shutdown drains: Triton stops accepting work on SIGTERM and waits up to
`--exit-timeout-secs` for in-flight requests, which must fit in `terminationGracePeriodSeconds`
(see deploy/).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol

from disagg.broker import BrokerClient, BrokerError, TritonRepository
from disagg.control import ModelControl, loadable_config
from disagg_tools.autoscaler.clock import Clock
from disagg_tools.autoscaler.config import ActuatorConfig, ConfigError, ScaledPool


class ActuatorError(RuntimeError):
    """The size could not be read or changed; the message is safe to log (no keys, no bodies)."""


class DrainTimeout(ActuatorError):
    """Scale-in not sent: the pool still held work when the drain deadline passed."""


class Actuator(Protocol):
    def current(self, pool: ScaledPool) -> int: ...

    def apply(self, pool: ScaledPool, current: int, desired: int) -> None: ...


class LogActuator:
    """Dry run: simulated sizes, nothing is changed anywhere."""

    def __init__(self) -> None:
        self._sizes: dict[str, int] = {}

    def current(self, pool: ScaledPool) -> int:
        return self._sizes.setdefault(pool.name, pool.min_size)

    def apply(self, pool: ScaledPool, current: int, desired: int) -> None:
        self._sizes[pool.name] = desired


def instance_count(model_config: Any) -> int:
    """Total instances in a model config's `instance_group` list (Triton's default is one group of 1)."""
    if not isinstance(model_config, dict):
        raise ActuatorError("model config is not an object")
    groups = model_config.get("instance_group") or [{"count": 1}]
    try:
        return sum(int(g.get("count", 1)) for g in groups)
    except (AttributeError, TypeError, ValueError):
        raise ActuatorError("model config has a malformed instance_group") from None


def with_instance_count(model_config: dict[str, Any], desired: int) -> dict[str, Any]:
    """A copy of `model_config` with `desired` instances in total, ready to post as a load's config
    override (`disagg.control.loadable_config`); the change goes to the last group (a config with
    several groups, e.g. one per GPU, grows and shrinks its last one, never below 1)."""
    groups = [dict(g) for g in (model_config.get("instance_group") or [{"count": 1}])]
    others = sum(int(g.get("count", 1)) for g in groups[:-1])
    if desired - others < 1:
        raise ActuatorError("cannot reach that size by changing the last instance group")
    groups[-1]["count"] = desired - others
    return loadable_config({**model_config, "instance_group": groups})


class TritonActuator:
    """Changes a pool's instance count on one Triton server through its model repository API."""

    def __init__(
        self,
        config: ActuatorConfig,
        clock: Clock,
        inflight: Callable[[ScaledPool], float | None],
        environ: dict[str, str] | None = None,
        control: ModelControl | None = None,
        broker: BrokerClient | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        key = env.get(config.admin_key_env, "")
        # the model-repository calls: to Triton with the key, or without it through the server's
        # model-control broker, the key's one holder (which takes the model-control lock itself)
        self._broker: BrokerClient | None = None
        self._calls: TritonRepository | BrokerClient
        if key:
            self._calls = TritonRepository(config.url, key, config.timeout_s, config.admin_header)
        else:
            broker = broker if broker is not None else BrokerClient(config.url, config.timeout_s)
            if not broker.available():
                raise ConfigError(
                    f"actuator.admin_key_env: environment variable {config.admin_key_env} is not set, "
                    f"and no model-control broker runs for {config.url} (disagg serve starts one)"
                )
            self._calls = self._broker = broker
        self._config = config
        self._clock = clock
        self._inflight = inflight
        # the server's model-control owner, shared with its pool watchers' restarts (same host)
        self._control = control if control is not None else ModelControl(config.url)

    def _ask(self, op: str, model: str, config: dict[str, Any] | None = None) -> Any:
        try:
            return self._calls.call(op, model, config)
        except BrokerError as exc:
            raise ActuatorError(str(exc)) from None

    def _model_config(self, pool: ScaledPool) -> dict[str, Any]:
        found = self._ask("config", pool.name)
        if not isinstance(found, dict):
            raise ActuatorError("model config is not an object")
        return found

    def current(self, pool: ScaledPool) -> int:
        return instance_count(self._model_config(pool))

    def _drain(self, pool: ScaledPool) -> None:
        if pool.drain_max_inflight is None:
            return  # the removed instance drains itself
        deadline = self._clock.monotonic() + self._config.drain_timeout_s
        while True:
            load = self._inflight(pool)
            if load is not None and load <= pool.drain_max_inflight:
                return
            if self._clock.monotonic() >= deadline:
                raise DrainTimeout(f"{pool.name} did not drain within {self._config.drain_timeout_s:g} s")
            if self._clock.wait(self._config.drain_poll_s):
                raise DrainTimeout(f"{pool.name}: stopping while waiting for drain")

    def apply(self, pool: ScaledPool, current: int, desired: int) -> None:
        if desired < current:
            self._drain(pool)
        if self._broker is not None:  # it re-reads the live config and loads under the lock
            groups = with_instance_count(self._model_config(pool), desired)["instance_group"]
            self._ask("update", pool.name, {"instance_group": groups})
            return
        try:
            with self._control.owner():
                # Re-read right before the load: the config may have changed since current() was read.
                updated = with_instance_count(self._model_config(pool), desired)
                self._ask("load", pool.name, updated)
        except TimeoutError as exc:  # a restart or another actuator held model control
            raise ActuatorError(str(exc)) from None


class KubernetesActuator:
    """Sets `spec.replicas` of the pool's Deployment through `AppsV1Api` (scale subresource)."""

    def __init__(self, config: ActuatorConfig, api: Any | None = None) -> None:
        self._namespace = config.namespace
        if api is None:
            try:
                from kubernetes import client
                from kubernetes import config as kube_config
            except ImportError:
                raise ConfigError("actuator.kind kubernetes: install the 'k8s' extra (kubernetes)") from None
            if config.in_cluster:
                kube_config.load_incluster_config()
            else:
                kube_config.load_kube_config(config_file=config.kubeconfig)
            api = client.AppsV1Api()
        self._api = api

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:  # the client raises ApiException, urllib3 and socket errors alike
            status = getattr(exc, "status", None)
            raise ActuatorError(f"Kubernetes {what} failed ({status or type(exc).__name__})") from None

    def current(self, pool: ScaledPool) -> int:
        name = pool.deployment or pool.name
        scale = self._call(
            "read scale", lambda: self._api.read_namespaced_deployment_scale(name, self._namespace)
        )
        replicas = getattr(getattr(scale, "spec", None), "replicas", None)
        if not isinstance(replicas, int):
            raise ActuatorError("Deployment scale has no replicas")
        return replicas

    def apply(self, pool: ScaledPool, current: int, desired: int) -> None:
        name = pool.deployment or pool.name
        body = {"spec": {"replicas": desired}}
        self._call(
            "patch scale",
            lambda: self._api.patch_namespaced_deployment_scale(name, self._namespace, body),
        )
