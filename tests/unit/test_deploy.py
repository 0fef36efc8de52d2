"""deploy/: every file parses, Kubernetes objects pass the API schemas (kubernetes-validate, strict),
PromQL parses (promql-parser), and every `disagg_*` name used anywhere is in the metric contract."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from disagg_tools.autoscaler.config import AutoscalerConfig, build_config
from disagg_tools.autoscaler.contract import AUTOSCALER_METRIC_NAMES, METRIC_NAMES, family_of
from disagg_tools.autoscaler.controller import READS

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
NAME_RE = re.compile(r"\bdisagg_[a-z0-9_]+")
GRAFANA_VARS = {"$__rate_interval": "5m", "$model": ".*"}
KNOWN = set(METRIC_NAMES) | set(AUTOSCALER_METRIC_NAMES)


def files(*suffixes: str) -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in suffixes)


def yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def k8s_objects() -> list[dict[str, Any]]:
    found = [d for p in files(".yaml", ".yml") if "kubernetes" in p.parts for d in yaml_docs(p)]
    return [d for d in found if "apiVersion" in d]  # the multi-host spec there is not one


def dashboard() -> dict[str, Any]:
    return json.loads((DEPLOY / "grafana" / "disagg-dashboard.json").read_text())


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]


def keda_queries() -> list[str]:
    return [
        t["metadata"]["query"]
        for o in k8s_objects()
        if o["kind"] == "ScaledObject"
        for t in o["spec"]["triggers"]
        if t["type"] == "prometheus"
    ]


def autoscaler_configs() -> list[AutoscalerConfig]:
    found = [build_config(yaml.safe_load((DEPLOY / "autoscaler" / "autoscale.yaml").read_text()))]
    for o in k8s_objects():
        if o["kind"] == "ConfigMap" and "autoscale.yaml" in o.get("data", {}):
            found.append(build_config(yaml.safe_load(o["data"]["autoscale.yaml"])))
    return found


def unknown_names(texts: list[str]) -> set[str]:
    return {family_of(n) for t in texts for n in NAME_RE.findall(t)} - KNOWN


def test_every_file_parses() -> None:
    seen = files(".yaml", ".yml", ".json")
    assert {p.parent.name for p in seen} >= {"prometheus", "grafana", "kubernetes", "autoscaler"}
    for path in seen:
        if path.suffix == ".json":
            json.loads(path.read_text())
        else:
            assert yaml_docs(path), path


def test_kubernetes_objects_pass_the_api_schemas() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    checked = 0
    for obj in k8s_objects():
        assert obj.get("apiVersion") and obj.get("kind") and obj["metadata"].get("name")
        if obj["apiVersion"].startswith("keda.sh/"):
            continue  # a CRD: no schema in kubernetes-validate; checked structurally below
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
        checked += 1
    assert checked >= 8


def test_scaled_objects_target_the_pool_deployments_and_fail_static() -> None:
    objects = k8s_objects()
    deployments = {o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"}
    scaled = [o for o in objects if o["kind"] == "ScaledObject"]
    assert {o["spec"]["scaleTargetRef"]["name"] for o in scaled} == {"triton-prefill", "triton-decode"}
    for o in scaled:
        spec = o["spec"]
        assert spec["scaleTargetRef"]["name"] in deployments
        assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]  # never to zero
        assert "fallback" not in spec  # a fixed fallback count is not fail-static
        for trigger in spec["triggers"]:
            assert trigger["type"] == "prometheus"
            meta = trigger["metadata"]
            assert meta["ignoreNullValues"] == "false"  # empty answer = error, not zero
            float(meta["threshold"])
            assert trigger.get("metricType", "AverageValue") in ("AverageValue", "Value")


def test_promql_parses() -> None:
    promql_parser = pytest.importorskip("promql_parser")
    exprs = dashboard_exprs() + keda_queries()
    assert len(exprs) > 20
    for expr in exprs:
        for var, value in GRAFANA_VARS.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, expr
        promql_parser.parse(expr)


def test_every_metric_name_used_is_in_the_contract() -> None:
    assert unknown_names(dashboard_exprs()) == set()
    assert unknown_names(keda_queries()) == set()
    assert set(READS) <= set(METRIC_NAMES)
    for text in (p.read_text() for p in files(".yaml", ".yml", ".json")):
        assert unknown_names([text]) == set()


def test_dashboard_shows_every_contract_family_and_the_autoscaler() -> None:
    used = {family_of(n) for e in dashboard_exprs() for n in NAME_RE.findall(e)}
    assert set(METRIC_NAMES) <= used, set(METRIC_NAMES) - used
    assert set(AUTOSCALER_METRIC_NAMES) <= used, set(AUTOSCALER_METRIC_NAMES) - used
    panels = dashboard()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}"
    # Percentiles come from rate() over buckets, never from lifetime totals.
    for expr in dashboard_exprs():
        if "histogram_quantile" in expr:
            assert "rate(" in expr and "_bucket" in expr


def test_prometheus_scrapes_triton_and_the_autoscaler() -> None:
    (config,) = yaml_docs(DEPLOY / "prometheus" / "prometheus.yml")
    targets = [
        t for job in config["scrape_configs"] for s in job.get("static_configs", []) for t in s["targets"]
    ]
    ports = {int(t.rsplit(":", 1)[1]) for t in targets}
    default_port = AutoscalerConfig.__dataclass_fields__["metrics_port"].default
    assert {8002, default_port} <= ports
    assert any(job.get("kubernetes_sd_configs") for job in config["scrape_configs"])


def test_autoscaler_configs_validate_and_match_the_manifests() -> None:
    objects = k8s_objects()
    deployments = {o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"}
    (role,) = [o for o in objects if o["kind"] == "Role"]
    allowed = {n for rule in role["rules"] for n in rule.get("resourceNames", [])}
    for cfg in autoscaler_configs():
        assert {p.role for p in cfg.pools} == {"prefill", "decode"}
        for pool in cfg.pools:
            assert pool.min_size >= 1
            assert (pool.deployment or pool.name) in deployments
            if cfg.actuator.kind == "kubernetes":
                assert (pool.deployment or pool.name) in allowed


def test_the_multihost_manifests_are_rendered_from_their_spec() -> None:
    from disagg_tools.manifests import render
    from disagg_tools.spec import load_spec

    spec_path = DEPLOY / "kubernetes" / "spec.yaml"
    rendered = render(load_spec(spec_path), spec_path.read_text())
    assert rendered == (DEPLOY / "kubernetes" / "triton-pools.yaml").read_text(), (
        "run: disagg manifests --spec deploy/kubernetes/spec.yaml --out deploy/kubernetes/triton-pools.yaml"
    )


def test_the_role_deployments_run_the_topology_the_multihost_test_runs() -> None:
    """One `disagg serve --spec ... --role` per Deployment, as tests/integration/test_multihost.py starts
    them; the spec they serve (the ConfigMap) is deploy/kubernetes/spec.yaml, whose remote pools are DNS
    names of headless Services selecting the pool pods; every pod takes the deployment secret from the
    Secret, never from its command line."""
    from disagg.serving.endpoints import parse_spec
    from disagg_tools.spec import load_spec
    from disagg_tools.spec import parse_spec as parse_deployment_spec

    objects = k8s_objects()
    deployments = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment" and
                   o["metadata"]["name"].startswith("triton-")}  # fmt: skip
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    (config_map,) = [
        o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "triton-disagg-spec"
    ]
    spec = load_spec(DEPLOY / "kubernetes" / "spec.yaml")
    assert parse_deployment_spec(yaml.safe_load(config_map["data"]["spec.yaml"])) == spec
    roles = {}
    for name, deployment in deployments.items():
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        args = container["args"]
        role = args[args.index("--role") + 1]
        assert container["command"] == ["disagg"] and args[:3] == ["serve", "--spec", "/etc/disagg/spec.yaml"]
        assert {"--address", "0.0.0.0", "--openai-port", "0"} <= set(args)
        spec.layout(role)  # the spec has this role
        roles[role] = name
        env = {e["name"]: e for e in container["env"]}
        assert env["DISAGG_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "triton-disagg-secrets"
        assert not any("secret" in a.lower() or "key=" in a for a in args)
        # a pool role keeps HTTP on loopback: its probes run in the container, the frontend's over HTTP
        for probe in (container["readinessProbe"], container["livenessProbe"]):
            if role == "frontend":
                assert probe["httpGet"]["port"] == "http", probe
            else:
                assert "http://127.0.0.1:8000/v2/health/" in " ".join(probe["exec"]["command"]), probe
    assert set(roles) == {"frontend", "prefill", "decode"}
    assert spec.remote is not None
    for pool in ("prefill", "decode"):
        (entry,) = parse_spec(getattr(spec.remote, pool))
        service_name, namespace = entry.host.split(".")[:2]
        service = services[service_name]
        assert entry.dns and namespace == service["metadata"]["namespace"]
        assert service["spec"]["clusterIP"] == "None"  # headless: one address per ready pod
        assert {"name": "grpc", "port": entry.port, "targetPort": "grpc"} in service["spec"]["ports"]
        pods = deployments[roles[pool]]["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= pods.items()


MOUNT_BASE = "/etc/disagg"  # where the pods mount the spec


def test_with_the_specs_tls_every_pod_mounts_the_tls_secret_where_the_spec_names_it() -> None:
    """The shipped multi-host spec runs the pools' gRPC links over mutual TLS (`remote.tls: tls`): every
    pod mounts the Secret triton-disagg-tls at /etc/disagg/tls, beside the spec, where `disagg serve`
    looks for ca.pem, cert.pem and key.pem; a spec without TLS mounts none."""
    import dataclasses

    from disagg_tools.manifests import render
    from disagg_tools.spec import load_spec

    spec = load_spec(DEPLOY / "kubernetes" / "spec.yaml")
    assert spec.remote is not None and spec.remote.tls == "tls"
    assert spec.tls_folder(Path(MOUNT_BASE)) == f"{MOUNT_BASE}/tls"
    deployments = [
        o for o in k8s_objects() if o["kind"] == "Deployment" and o["metadata"]["name"].startswith("triton-")
    ]
    assert len(deployments) == 3
    for deployment in deployments:
        pod = deployment["spec"]["template"]["spec"]
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "tls"]
        assert mount == {"name": "tls", "mountPath": f"{MOUNT_BASE}/tls", "readOnly": True}
        (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
        assert volume["secret"]["secretName"] == "triton-disagg-tls"
    plain = dataclasses.replace(spec, remote=dataclasses.replace(spec.remote, tls=""))
    assert "secretName: triton-disagg-tls" not in render(plain, "")
