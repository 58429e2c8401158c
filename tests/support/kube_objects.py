"""What the deploy tests do with the objects on the tests' control plane
(:mod:`tests.support.kube_control_plane`): apply a rendered overlay, list the pods and events the
KubeRay operator made, read those pods' start commands, and give a pod's container the environment
and volume files a kubelet would."""

from __future__ import annotations

import base64
import secrets
from pathlib import Path
from typing import Any

from tests.support.kube_control_plane import (
    SERVICEMONITOR_CRD,
    KindNotServed,
    KubeApiError,
    KubeClient,
    go_module_file,
)
from tests.support.scripts import load_script

RAY = "ray.io/v1"
RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}

vd = load_script("validate_deploy")
kuberay = load_script("validate_kuberay")


def crds() -> list[dict[str, Any]]:
    """Every CRD a rendered overlay needs: KubeRay's v1.7.0 (../shared/kuberay-crds) and
    prometheus-operator's ServiceMonitor."""
    found = [kuberay.crd_document(kind) for kind in ("RayCluster", "RayJob", "RayService")]
    found.append(vd.load_yaml(go_module_file(*SERVICEMONITOR_CRD).read_text()))
    return found


def ensure_namespace(kube: KubeClient, name: str, labels: dict[str, str] | None = None) -> None:
    """The namespace (restricted Pod Security unless ``labels`` say otherwise) and its `default`
    ServiceAccount (kube-controller-manager's job; none runs here, and the ServiceAccount admission
    plugin refuses pods without it)."""
    kube.apply(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or RESTRICTED}}
    )
    kube.apply(
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": name}}
    )


def apply_all(kube: KubeClient, objects: list[dict[str, Any]], *, dry_run: bool) -> set[tuple[str, str]]:
    """Apply ``objects`` (namespaces for real first); return the kinds no API group serves."""
    for obj in objects:
        if obj["kind"] == "Namespace":
            ensure_namespace(kube, obj["metadata"]["name"], obj["metadata"].get("labels"))
    skipped: set[tuple[str, str]] = set()
    errors = []
    for obj in objects:
        if obj["kind"] == "Namespace":
            continue
        try:
            kube.apply(obj, dry_run=dry_run)
        except KindNotServed:
            skipped.add((obj["apiVersion"], obj["kind"]))
        except (KubeApiError, ValueError) as exc:  # ValueError: a namespaced object without namespace
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {exc}")
    assert not errors, "the API server refused:\n" + "\n".join(errors)
    return skipped


def object_events(kube: KubeClient, namespace: str, name: str) -> list[dict[str, Any]]:
    return [e for e in kube.list("v1", "Event", namespace) if e["involvedObject"]["name"] == name]


def cluster_pods(kube: KubeClient, namespace: str, cluster: str) -> list[dict[str, Any]]:
    return kube.list("v1", "Pod", namespace, selector=f"ray.io/cluster={cluster}")


def ray_container(pod: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = pod["spec"]["containers"][0]  # KubeRay's rule: Ray runs in the first
    return found


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(c for c in pod["spec"]["containers"] if c["name"] == name)
    return found


def start_command(pod: dict[str, Any], name: str | None = None) -> str:
    """The shell command line of the pod's Ray container (or of container ``name``)."""
    found = container(pod, name) if name else ray_container(pod)
    return " ".join([*found.get("command", []), *found.get("args", [])])


def worker_groups(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {g["groupName"]: g for g in spec.get("workerGroupSpecs") or []}


# what a kubelet would do for a pod it runs (none runs here): the container's environment, the
# files of a projected volume


def _field(pod: dict[str, Any], path: str) -> str:
    meta = pod["metadata"]
    if path in ("metadata.name", "metadata.namespace", "metadata.uid"):
        return str(meta[path.removeprefix("metadata.")])
    if path.startswith("metadata.labels['") and path.endswith("']"):
        return str(meta["labels"][path[len("metadata.labels['") : -2]])
    raise NotImplementedError(f"fieldRef {path!r}: add it to kube_objects._field")


def _key_of(kube: KubeClient, kind: str, namespace: str, ref: dict[str, Any]) -> str:
    obj = kube.get("v1", kind, ref["name"], namespace)
    assert obj is not None, f"{kind} {namespace}/{ref['name']} does not exist"
    if kind == "Secret":
        return base64.b64decode(obj["data"][ref["key"]]).decode()
    return str(obj["data"][ref["key"]])


def container_env(kube: KubeClient, pod: dict[str, Any], name: str) -> dict[str, str]:
    """Container ``name``'s environment as the kubelet would give it: literal values, fieldRefs of
    the pod's metadata, Secret and ConfigMap keys read from the API server."""
    namespace = pod["metadata"]["namespace"]
    env: dict[str, str] = {}
    for var in container(pod, name).get("env") or []:
        source = var.get("valueFrom")
        if source is None:
            env[var["name"]] = var.get("value", "")
        elif "fieldRef" in source:
            env[var["name"]] = _field(pod, source["fieldRef"]["fieldPath"])
        elif "secretKeyRef" in source:
            env[var["name"]] = _key_of(kube, "Secret", namespace, source["secretKeyRef"])
        elif "configMapKeyRef" in source:
            env[var["name"]] = _key_of(kube, "ConfigMap", namespace, source["configMapKeyRef"])
        else:
            raise NotImplementedError(f"env {var['name']}: {source}")
    return env


def project_volume(kube: KubeClient, pod: dict[str, Any], volume: str, dest: Path) -> None:
    """Write the files of the pod's projected volume ``volume`` into ``dest`` as the kubelet would:
    a service account token asked for through the TokenRequest API and bound to the pod,
    ConfigMap keys, downward API fields."""
    found = next(v for v in pod["spec"]["volumes"] if v["name"] == volume)
    namespace = pod["metadata"]["namespace"]
    dest.mkdir(parents=True, exist_ok=True)
    for source in found["projected"]["sources"]:
        if "serviceAccountToken" in source:
            wanted = source["serviceAccountToken"]
            token = kube.request_token(
                namespace,
                pod["spec"]["serviceAccountName"],
                bound_pod=pod,
                expiration_seconds=wanted.get("expirationSeconds", 3600),
                audiences=[wanted["audience"]] if "audience" in wanted else (),
            )
            (dest / wanted["path"]).write_text(token)
        elif "configMap" in source:
            for item in source["configMap"]["items"]:
                (dest / item["path"]).write_text(
                    _key_of(
                        kube,
                        "ConfigMap",
                        namespace,
                        {"name": source["configMap"]["name"], "key": item["key"]},
                    )
                )
        elif "downwardAPI" in source:
            for item in source["downwardAPI"]["items"]:
                (dest / item["path"]).write_text(_field(pod, item["fieldRef"]["fieldPath"]))
        else:
            raise NotImplementedError(f"projected source {sorted(source)} of volume {volume}")


def publish_root_ca(kube: KubeClient, namespace: str, ca_cert: Path) -> None:
    """kube-root-ca.crt, which kube-controller-manager (not run here) publishes in every namespace."""
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "kube-root-ca.crt", "namespace": namespace},
            "data": {"ca.crt": ca_cert.read_text()},
        }
    )


def create_operator_secrets(kube: KubeClient, namespace: str) -> dict[str, dict[str, str]]:
    """The Secrets gpu-prod's kustomization.yaml has the operator create before the first apply,
    with random values; returns them by name."""
    wanted = {
        "llmbatch-credentials": (
            "s3-access-key",
            "s3-secret-key",
            "redis-password",
            "replay-key",
            "runner-token",
        ),
        "llmbatch-ray-auth": ("auth_token",),
    }
    made = {name: {key: secrets.token_hex(32) for key in keys} for name, keys in wanted.items()}
    for name, data in made.items():
        kube.apply(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": name, "namespace": namespace},
                "stringData": data,
            }
        )
    return made


def group_replicas(kube: KubeClient, namespace: str, cluster: str) -> dict[str, int]:
    """``replicas`` of each worker group of a RayCluster as the API server has it now."""
    found = kube.get(RAY, "RayCluster", cluster, namespace)
    assert found is not None, f"RayCluster {namespace}/{cluster} does not exist"
    return {g: spec.get("replicas", 0) for g, spec in worker_groups(found["spec"]).items()}


def rayservice_cluster(kube: KubeClient, namespace: str, service: str) -> dict[str, Any] | None:
    """The RayCluster the operator made for RayService ``service`` (its owner), if any yet."""
    for cluster in kube.list(RAY, "RayCluster", namespace):
        if any(
            ref["kind"] == "RayService" and ref["name"] == service
            for ref in cluster["metadata"].get("ownerReferences", [])
        ):
            return cluster
    return None
