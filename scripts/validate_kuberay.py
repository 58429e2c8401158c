#!/usr/bin/env python3
"""KubeRay objects as the deploy tests check them without a cluster: the real KubeRay v1.7.0 CRD
schemas (``../shared/kuberay-crds``), made strict like ``kubectl apply --validate=strict``, and the
rules the operator checks before it acts (a subset of ray-operator's ``validation.go``; the RayService
ones and the Serve config's placement in scripts/validate_rayservice.py). Loaded by path (scripts/ is
no package) by scripts/validate_deploy.py and the deploy tests;
tests/integration/test_kuberay_operator.py checks these rules against the real operator."""

from __future__ import annotations

import copy
import functools
import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the CRDs are 2 MB of YAML


def load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_LOADER)  # noqa: S506 - a safe loader


def kuberay_crd_dir() -> Path:
    configured = os.environ.get("LLMBATCH_KUBERAY_CRDS")
    candidates = [Path(configured)] if configured else []
    candidates += [ROOT.parent / "shared" / "kuberay-crds", Path("/work/shared/kuberay-crds")]
    for candidate in candidates:
        if (candidate / "ray.io_rayclusters.yaml").exists():
            return candidate
    raise FileNotFoundError("KubeRay CRDs not found in ../shared/kuberay-crds (or LLMBATCH_KUBERAY_CRDS)")


@functools.cache
def crd_document(kind: str) -> dict[str, Any]:
    """The KubeRay CustomResourceDefinition of ``kind`` (RayCluster, RayJob, RayService), as shipped."""
    crd: dict[str, Any] = load_yaml((kuberay_crd_dir() / f"ray.io_{kind.lower()}s.yaml").read_text())
    return crd


@functools.cache
def crd_schema(kind: str, version: str = "v1", strict: bool = True) -> dict[str, Any]:
    """The openAPIV3Schema of a KubeRay CRD (RayCluster, RayJob, RayService), strict: unknown fields fail."""
    crd = crd_document(kind)
    assert crd["spec"]["names"]["kind"] == kind, crd["spec"]["names"]
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            schema: dict[str, Any] = copy.deepcopy(v["schema"]["openAPIV3Schema"])
            return strict_schema(schema) if strict else schema
    raise KeyError(f"{kind} has no version {version}")


def strict_schema(node: Any) -> Any:
    """What the API server does with a structural schema on a strict apply: an object with listed
    ``properties`` accepts no other field, unless it says ``x-kubernetes-preserve-unknown-fields``."""
    if isinstance(node, dict):
        for value in node.values():
            strict_schema(value)
        if (
            "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
    elif isinstance(node, list):
        for item in node:
            strict_schema(item)
    return node


@functools.cache
def _crd_validator(kind: str, version: str) -> Any:
    import jsonschema

    return jsonschema.Draft7Validator(crd_schema(kind, version))


def validate_kuberay(obj: dict[str, Any]) -> list[str]:
    """jsonschema errors of a RayCluster/RayJob/RayService against the real CRD (empty = valid)."""
    group, _, version = obj["apiVersion"].partition("/")
    if group != "ray.io":
        raise ValueError(f"not a KubeRay object: {obj['apiVersion']}")
    validator = _crd_validator(obj["kind"], version)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


def rayservice_checks() -> Any:
    """scripts/validate_rayservice.py (RayService + Ray resource checks), loaded by path: scripts/ is
    no package, and this module may itself have been loaded by path (the tests) or run as a script."""
    name = "validate_rayservice"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def kuberay_semantic_errors(obj: dict[str, Any]) -> list[str]:
    """The checks the KubeRay operator makes before it acts (a subset of ray-operator's
    utils/validation.go: ValidateRayClusterSpec / ValidateRayJobSpec / ValidateRayServiceSpec), which no
    CRD schema carries, plus what a RayService's Serve config needs of its cluster."""
    errors: list[str] = []
    name = obj["metadata"]["name"]
    kind, spec = obj["kind"], obj["spec"]
    if not _DNS1035.match(name) or len(name) > 63:
        errors.append(f"{kind} name {name!r} must be a DNS-1035 label")
    if kind == "RayCluster":
        errors += _raycluster_errors(spec, kind)
    elif kind == "RayService":
        errors += rayservice_checks().rayservice_errors(obj, _raycluster_errors)
    elif kind == "RayJob":
        if len(name) > 47:
            errors.append("RayJob names are limited to 47 characters")
        selector = spec.get("clusterSelector") or {}
        shutdown = bool(spec.get("shutdownAfterJobFinishes"))
        if not spec.get("rayClusterSpec") and not selector:
            errors.append("one of rayClusterSpec or clusterSelector must be set")
        if spec.get("rayClusterSpec") and selector:
            errors.append(
                "rayClusterSpec and clusterSelector together: the selector wins, the spec is ignored"
            )
        if selector and not selector.get("ray.io/cluster"):
            errors.append("clusterSelector needs the key ray.io/cluster")
        if selector and spec.get("submissionMode") == "SidecarMode":
            errors.append("clusterSelector is not supported in SidecarMode")
        if not shutdown and spec.get("ttlSecondsAfterFinished", 0) > 0:
            errors.append("ttlSecondsAfterFinished needs shutdownAfterJobFinishes: true")
        if spec.get("suspend") and not shutdown:
            errors.append("suspend needs shutdownAfterJobFinishes: true")
        if spec.get("activeDeadlineSeconds") is not None and spec["activeDeadlineSeconds"] <= 0:
            errors.append("activeDeadlineSeconds must be positive")
        if spec.get("submissionMode", "K8sJobMode") not in {
            "K8sJobMode",
            "HTTPMode",
            "InteractiveMode",
            "SidecarMode",
        }:
            errors.append(f"unknown submissionMode {spec['submissionMode']!r}")
        try:
            yaml.safe_load(spec.get("runtimeEnvYAML") or "{}")
        except yaml.YAMLError as exc:
            errors.append(f"runtimeEnvYAML is not YAML: {exc}")
        if spec.get("rayClusterSpec"):
            errors += _raycluster_errors(spec["rayClusterSpec"], "RayJob.rayClusterSpec")
    return errors


def _raycluster_errors(spec: dict[str, Any], where: str) -> list[str]:
    errors: list[str] = []
    groups = [
        ("head", spec["headGroupSpec"]),
        *((g["groupName"], g) for g in spec.get("workerGroupSpecs") or []),
    ]
    autoscaling = bool(spec.get("enableInTreeAutoscaling"))
    v2 = autoscaling and (spec.get("autoscalerOptions") or {}).get("version") == "v2"
    for group_name, group in groups:
        pod = group["template"]["spec"]
        if not pod.get("containers"):
            errors.append(f"{where} {group_name}: at least one container")
        params = group.get("rayStartParams") or {}
        if any(params.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources")) and group.get(
            "resources"
        ):
            errors.append(f"{where} {group_name}: resources in both rayStartParams and resources")
        if "labels" in params:
            errors.append(f"{where} {group_name}: rayStartParams['labels'] is not supported")
        errors += rayservice_checks().group_resource_errors(f"{where} {group_name}", group)
        if v2 and pod.get("restartPolicy") not in (None, "Never"):
            errors.append(f"{where} {group_name}: autoscaler v2 needs restartPolicy Never or unset")
        if group_name != "head":
            lo, hi = group.get("minReplicas", 0), group.get("maxReplicas", 2**31 - 1)
            if lo > hi:
                errors.append(f"{where} {group_name}: minReplicas > maxReplicas")
            if "replicas" in group and not lo <= group["replicas"] <= hi:
                errors.append(f"{where} {group_name}: replicas outside [minReplicas, maxReplicas]")
            if autoscaling and group.get("suspend"):
                errors.append(f"{where} {group_name}: cannot be suspended with the autoscaler on")
    token = (spec.get("authOptions") or {}).get("mode") == "token" or any(
        e.get("name") == "RAY_AUTH_MODE" and e.get("value") == "token"
        for c in spec["headGroupSpec"]["template"]["spec"]["containers"]
        for e in c.get("env") or []
    )
    if token:
        version = tuple(int(x) for x in re.findall(r"\d+", spec.get("rayVersion", ""))[:3])
        if version < (2, 52, 0):
            errors.append(f"{where}: token auth needs rayVersion >= 2.52.0, got {spec.get('rayVersion')!r}")
    return errors
