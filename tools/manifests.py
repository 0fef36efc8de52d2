"""Render the Kubernetes objects of a multi-host deployment spec (one with a ``remote`` section).

    disagg manifests --spec deploy/kubernetes/spec.yaml --out deploy/kubernetes/triton-pools.yaml

Three Deployments, each pod one ``disagg serve --spec /etc/disagg/spec.yaml --role R``: the frontend
(entry points and orchestrators), the prefill pool and the decode pool; the spec itself in a ConfigMap
mounted at ``/etc/disagg``; a Service for the clients (the frontend's HTTP and gRPC) and, for each pool,
the headless Service its ``remote`` entry names (``dns:SERVICE.NAMESPACE.svc...:PORT``: DNS lists one
address per ready pod, which the frontend looks up again every few seconds); the model's volume claim.
The deployment secret and the admin key come from the Secret ``triton-disagg-secrets``, never from a
command line. The same roles and arguments run in ``tests/integration/test_multihost.py``.

The pods pin their pools to the spec's core numbers, so each pool pod needs a node (or a cpuset) where
those cores are its own: one pool pod per node, or a spec per node shape. Never applied to a cluster.
"""

from __future__ import annotations

import argparse
import posixpath
import sys
from pathlib import Path
from typing import Any

import yaml

from disagg.serving.endpoints import parse_spec as parse_servers
from disagg_tools.spec import Spec, load_spec

SECRETS = "triton-disagg-secrets"
TLS_SECRET = "triton-disagg-tls"  # ca.pem, cert.pem, key.pem: mounted where the spec's remote.tls names
SPEC_MOUNT = "/etc/disagg"
MODELS_MOUNT = "/models"
LABEL = "app.kubernetes.io/name"
COMPONENT = "app.kubernetes.io/component"
PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
GRACE_S = {"frontend": 120, "prefill": 60, "decode": 120}  # decode streams are long: time to finish
EXIT_TIMEOUT_S = {"frontend": 100, "prefill": 45, "decode": 100}  # under each grace period
HEADER = """\
# Rendered by `disagg manifests --spec deploy/kubernetes/spec.yaml`; edit the spec or the renderer
# (tools/manifests.py), not this file. A test keeps the two equal.
#
# A three-role deployment across hosts: frontend, prefill and decode Deployments, each pod one
# `disagg serve --spec ... --role ...`; the frontend reaches the pool pods over gRPC through headless
# Services (DNS lists every ready pod; scaling a pool adds capacity without restarting the frontend);
# the KV moves pod to pod over NIXL / UCX, so the pods must reach each other on UCX's ports too.
# NO CLUSTER WAS AVAILABLE: these objects are schema-checked, never applied. The image (this project
# on Triton 2.51) is not published. The Secret is made once, never committed:
#   kubectl -n NAMESPACE create secret generic triton-disagg-secrets \\
#     --from-literal=deployment-secret=$(openssl rand -hex 32) \\
#     --from-literal=admin-key=$(openssl rand -hex 24)
# With the spec's remote.tls (mutual TLS on the pools' gRPC links), so is the TLS Secret, mounted at
# /etc/disagg/<remote.tls>: one CA, and a certificate whose names cover the frontend's and the pools'
# Service names (e.g. *.triton-prefill.llm.svc.cluster.local), shared by every pod:
#   kubectl -n NAMESPACE create secret generic triton-disagg-tls \\
#     --from-file=ca.pem --from-file=cert.pem --from-file=key.pem
# The KV itself (NIXL over UCX) is not encrypted: keep the pods on a network you trust.
# Scale with ONE of keda-scaledobjects.yaml or autoscaler.yaml (both would fight over spec.replicas).
# A removed pod gets SIGTERM: Triton refuses new requests and waits up to --exit-timeout for the
# ones in flight; terminationGracePeriodSeconds is longer, so the kubelet never cuts a stream.
"""


def _pool_service(spec: Spec, pool: str) -> tuple[str, str, int]:
    """(service, namespace, port) of the pool's ``remote`` entry; ValueError unless it is one
    ``dns:SERVICE.NAMESPACE.svc...:PORT``."""
    if spec.remote is None:
        raise ValueError("the spec has no remote section: nothing to place on other hosts")
    entries = parse_servers(getattr(spec.remote, pool))
    if len(entries) != 1 or not entries[0].dns or ".svc" not in entries[0].host:
        raise ValueError(f"remote.{pool}: Kubernetes needs one dns:SERVICE.NAMESPACE.svc...:PORT entry")
    service, namespace = entries[0].host.split(".")[:2]
    return service, namespace, entries[0].port


def _labels(component: str) -> dict[str, str]:
    return {LABEL: "triton-disagg", COMPONENT: component}


def _cores(spec: Spec, role: str) -> int:
    if role == "frontend":
        return len(spec.entry_points.cores)
    return len(getattr(spec.pools, role).cores)


def _probe(role: str, state: str) -> dict[str, Any]:
    """A probe of Triton's /v2/health/<state>. A pool role keeps its HTTP endpoint on loopback (only
    gRPC, the pools' link, is exposed), so its probe runs inside the container against 127.0.0.1."""
    path = f"/v2/health/{state}"
    if role == "frontend":
        return {"httpGet": {"path": path, "port": "http"}}
    url = f"http://127.0.0.1:{PORTS['http']}{path}"
    check = f"import urllib.request; urllib.request.urlopen('{url}', timeout=2)"
    return {"exec": {"command": ["python3", "-c", check]}, "timeoutSeconds": 3}


def _deployment(spec: Spec, role: str, name: str, namespace: str, image: str) -> dict[str, Any]:
    args = ["serve", "--spec", f"{SPEC_MOUNT}/spec.yaml", "--role", role, "--address", "0.0.0.0"]
    args += ["--openai-port", "0", "--exit-timeout", str(EXIT_TIMEOUT_S[role])]
    cpus = str(max(1, _cores(spec, role)))
    container = {
        "name": "tritonserver",
        "image": image,
        "command": ["disagg"],
        "args": args,
        "env": [
            {
                "name": "DISAGG_SECRET",
                "valueFrom": {"secretKeyRef": {"name": SECRETS, "key": "deployment-secret"}},
            },
            {
                "name": "DISAGG_ADMIN_KEY",
                "valueFrom": {"secretKeyRef": {"name": SECRETS, "key": "admin-key"}},
            },
            {"name": "MODEL_DIR", "value": f"{MODELS_MOUNT}/checkpoint"},
            {"name": "UCX_TLS", "value": "tcp"},  # drop it on an RDMA fabric: UCX picks rc
        ],
        "ports": [{"name": port, "containerPort": number} for port, number in PORTS.items()],
        "readinessProbe": {**_probe(role, "ready"), "periodSeconds": 5},
        "livenessProbe": {**_probe(role, "live"), "periodSeconds": 10, "failureThreshold": 6},
        "resources": {"requests": {"cpu": cpus}, "limits": {"cpu": cpus}},
        "volumeMounts": [
            {"name": "spec", "mountPath": SPEC_MOUNT, "readOnly": True},
            {"name": "model", "mountPath": MODELS_MOUNT, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
    volumes: list[dict[str, Any]] = [
        {"name": "spec", "configMap": {"name": "triton-disagg-spec"}},
        {"name": "model", "persistentVolumeClaim": {"claimName": "triton-disagg-models", "readOnly": True}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
    ]
    if spec.remote is not None and spec.remote.tls:  # where tls_folder() finds it, beside the spec
        mount = posixpath.normpath(posixpath.join(SPEC_MOUNT, spec.remote.tls))
        container["volumeMounts"].append({"name": "tls", "mountPath": mount, "readOnly": True})
        volumes.append({"name": "tls", "secret": {"secretName": TLS_SECRET, "defaultMode": 0o400}})
    labels = _labels(role)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "replicas": 1 if role == "frontend" else getattr(spec.pools, role).autoscale.min_size,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(PORTS["metrics"]),
                    },
                },
                "spec": {
                    "terminationGracePeriodSeconds": GRACE_S[role],
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }


def _service(name: str, namespace: str, component: str, headless: bool, grpc_port: int) -> dict[str, Any]:
    ports = dict(PORTS, grpc=grpc_port)
    body: dict[str, Any] = {"clusterIP": "None"} if headless else {}
    body["selector"] = _labels(component)
    body["ports"] = [{"name": port, "port": number, "targetPort": port} for port, number in ports.items()]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": _labels(component)},
        "spec": body,
    }


def render(spec: Spec, spec_text: str, image: str = "triton-disagg:2.51") -> str:
    """The manifests' YAML text for ``spec`` (parsed from ``spec_text``, which the ConfigMap carries);
    ValueError for a spec without remote pools or with remote entries Kubernetes cannot serve."""
    prefill, namespace, prefill_port = _pool_service(spec, "prefill")
    decode, decode_namespace, decode_port = _pool_service(spec, "decode")
    if decode_namespace != namespace:
        raise ValueError("remote: the prefill and decode services must be in one namespace")
    docs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "triton-disagg-spec", "namespace": namespace},
            "data": {"spec.yaml": spec_text},
        },
        _deployment(spec, "frontend", "triton-frontend", namespace, image),
        _deployment(spec, "prefill", prefill, namespace, image),
        _deployment(spec, "decode", decode, namespace, image),
        _service("triton-frontend", namespace, "frontend", False, PORTS["grpc"]),
        _service(prefill, namespace, "prefill", True, prefill_port),
        _service(decode, namespace, "decode", True, decode_port),
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "triton-disagg-models", "namespace": namespace},
            "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "50Gi"}}},
        },
    ]
    body = "---\n".join(yaml.safe_dump(doc, sort_keys=False, width=110) for doc in docs)
    return HEADER + body


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="disagg manifests", description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", type=Path, required=True, help="a deployment spec with a remote section")
    parser.add_argument(
        "--image", default="triton-disagg:2.51", help="the image: this project on Triton 2.51"
    )
    parser.add_argument("--out", type=Path, default=None, help="write here (default: standard output)")
    args = parser.parse_args(argv)
    try:
        text = render(load_spec(args.spec), args.spec.read_text(), args.image)
    except ValueError as exc:
        print(f"disagg manifests: {exc}", file=sys.stderr)
        return 2
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
