"""deploy/kubernetes: every manifest valid against the Kubernetes schemas (rendered the
way `kubectl apply -k` renders the kustomizations), and in agreement with the server:
ports, probes, flags and a grace period that covers the drain."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate (the dev extra) is not installed"
)

ROOT = Path(__file__).resolve().parents[1]
KUBE = ROOT / "deploy" / "kubernetes"
VERSION = "1.33.0"  # a current Kubernetes release (native gRPC probes, preStop sleep)
KUSTOMIZE_KEYS = {"apiVersion", "kind", "labels", "resources", "images", "patches"}


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]


def _json_patch(doc: dict, ops: list[dict]) -> None:
    """RFC 6902 add, replace and remove: what the overlays use."""
    for op in ops:
        *parents, last = _pointer(op["path"])
        node = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if op["op"] in ("add", "replace"):
            if isinstance(node, list):
                node.insert(len(node) if last == "-" else int(last), copy.deepcopy(op["value"]))
            else:
                assert op["op"] == "add" or last in node, f"replace of a missing {op['path']}"
                node[last] = copy.deepcopy(op["value"])
        elif op["op"] == "remove":
            del node[int(last) if isinstance(node, list) else last]
        else:
            raise AssertionError(f"unsupported patch op {op['op']}")


def render(folder: Path) -> list[dict]:
    """The kustomization in `folder`, rendered: resources, labels, images, JSON patches
    (the features these manifests use; anything else fails here, not silently)."""
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert set(k) <= KUSTOMIZE_KEYS, (
        f"{folder}: kustomize features not rendered here: {set(k) - KUSTOMIZE_KEYS}"
    )
    docs: list[dict] = []
    for resource in k.get("resources", []):
        path = folder / resource
        docs += render(path) if path.is_dir() else list(yaml.safe_load_all(path.read_text()))
    for label in k.get("labels", []):
        for doc in docs:
            doc.setdefault("metadata", {}).setdefault("labels", {}).update(label["pairs"])
    for image in k.get("images", []):
        for doc in docs:
            spec = doc.get("spec", {}).get("template", {}).get("spec", {})
            for container in spec.get("containers", []):
                if container["image"].split(":")[0] == image["name"]:
                    name = image.get("newName", image["name"])
                    container["image"] = f"{name}:{image['newTag']}"
    for patch in k.get("patches", []):
        target = patch["target"]
        hits = [
            d
            for d in docs
            if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]
        ]
        assert len(hits) == 1, f"patch target {target} matches {len(hits)} resources"
        _json_patch(hits[0], yaml.safe_load(patch["patch"]))
    return docs


KUSTOMIZATIONS = [
    pytest.param(KUBE, id="kubernetes"),  # `kubectl apply -k deploy/kubernetes`: the base
    pytest.param(KUBE / "base", id="base"),
    pytest.param(KUBE / "overlays" / "gpu", id="gpu"),
]


@pytest.mark.parametrize("folder", KUSTOMIZATIONS)
def test_every_rendered_manifest_is_valid(folder: Path) -> None:
    docs = render(folder)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["Deployment", "HorizontalPodAutoscaler", "PersistentVolumeClaim",
                     "PodDisruptionBudget", "Service", "Service"]  # fmt: skip
    for doc in docs:
        kubernetes_validate.validate(doc, VERSION, strict=True)


@pytest.mark.parametrize("folder", KUSTOMIZATIONS)
def test_kubectl_renders_what_is_validated_here(folder: Path) -> None:
    """kubectl's own kustomize (what `kubectl apply -k` runs, no cluster needed) gives the
    manifests validated above: the renderer here cannot drift from the real one."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    out = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True,
                         timeout=60, check=True)  # fmt: skip

    def by_name(doc: dict) -> tuple[str, str]:
        return doc["kind"], doc["metadata"]["name"]

    assert sorted(yaml.safe_load_all(out.stdout), key=by_name) == sorted(
        render(folder), key=by_name
    )


def test_a_broken_manifest_fails_validation() -> None:
    (deployment,) = [d for d in render(KUBE / "base") if d["kind"] == "Deployment"]
    deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "x"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSION, strict=True)


def _deployment(folder: Path) -> tuple[dict, dict]:
    (deployment,) = [d for d in render(folder) if d["kind"] == "Deployment"]
    return deployment, deployment["spec"]["template"]["spec"]


def test_the_deployment_agrees_with_the_server_and_the_image() -> None:
    from echoic.cli.main import build_parser
    from echoic.server.process.app import END_SECONDS, SERVICE_NAME

    _, pod = _deployment(KUBE / "base")
    (container,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    entrypoint = re.search(r'ENTRYPOINT \[(.*?)\]\n', (ROOT / "Dockerfile").read_text().split(
        "AS serve")[1]).group(1)  # fmt: skip
    flags = [a.strip().strip('"') for a in entrypoint.split(",")][2:]  # after "echoic", "serve"
    args = build_parser().parse_args(["serve", *flags, *container["args"]])
    assert ports == {"grpc": args.port, "http": args.http_port, "metrics": args.metrics_port}
    assert ports == {"grpc": 50051, "http": 8000, "metrics": 9090}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["grpc"]["port"] == args.port
    assert container["readinessProbe"]["grpc"]["service"] == SERVICE_NAME
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = pre_stop + args.grace_seconds + END_SECONDS
    assert pod["terminationGracePeriodSeconds"] >= drain, (
        pod["terminationGracePeriodSeconds"],
        drain,
    )
    env = {e["name"]: e["value"] for e in container["env"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert env["ECHOIC_MODEL_REPO"] == mounts["models"]  # the default repository, on the volume
    assert pod["securityContext"]["runAsUser"] == 10001  # the image's user


def test_services_name_the_container_ports_and_the_gpu_overlay_asks_for_a_gpu() -> None:
    docs = render(KUBE / "base")
    _, pod = _deployment(KUBE / "base")
    named = {p["name"] for p in pod["containers"][0]["ports"]}
    for service in (d for d in docs if d["kind"] == "Service"):
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= named
    headless = next(d for d in docs if d["metadata"]["name"] == "echoic-headless")
    assert headless["spec"]["clusterIP"] == "None"
    _, gpu = _deployment(KUBE / "overlays" / "gpu")
    (container,) = gpu["containers"]
    assert (
        container["image"] == "echoic:gpu"
        and container["resources"]["limits"]["nvidia.com/gpu"] == 1
    )
    assert pod["containers"][0]["image"] == "echoic:latest"


def test_the_service_monitor_scrapes_the_metrics_port() -> None:
    monitor = yaml.safe_load((KUBE / "monitoring" / "servicemonitor.yaml").read_text())
    service = next(
        d
        for d in render(KUBE / "base")
        if d["kind"] == "Service" and d["metadata"]["name"] == "echoic"
    )
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {
        p["name"] for p in service["spec"]["ports"]
    }


def test_the_envoy_config_health_checks_what_the_server_serves() -> None:
    """deploy/envoy (not run here: no Envoy): it reads as YAML, dials the headless
    Service's port and health-checks the service name the server reports."""
    from echoic.server.process.app import SERVICE_NAME

    envoy = yaml.safe_load((ROOT / "deploy" / "envoy" / "envoy.yaml").read_text())
    (cluster,) = envoy["static_resources"]["clusters"]
    (check,) = cluster["health_checks"]
    assert check["grpc_health_check"]["service_name"] == SERVICE_NAME
    (endpoint,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    address = endpoint["endpoint"]["address"]["socket_address"]
    headless = next(d for d in render(KUBE / "base") if d["metadata"]["name"] == "echoic-headless")
    assert address["address"].startswith("echoic-headless.")
    assert address["port_value"] == headless["spec"]["ports"][0]["port"]
