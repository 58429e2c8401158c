#!/usr/bin/env python3
"""Static validation of deploy/ and docker-compose.yml, where no Docker engine or Kubernetes runs.

Used by tests/unit/test_deploy_*.py (imported as a module) and runnable on its own:

    .venv/bin/python scripts/validate_deploy.py            # render + print a short summary

What it brings:

- ``deploycheck``: deploy/tools/deploycheck, a small Go program built from the Go module proxy with
  the libraries the real tools use (sigs.k8s.io/kustomize/api = `kustomize build`,
  compose-spec/compose-go = `docker compose config`: schema validation, interpolation, profiles).
  Cached in ``$LLMBATCH_CACHE/bin`` (default ~/.cache/llmbatch/bin), keyed by its sources.
- the KubeRay CRD schemas and the operator's own rules are scripts/validate_kuberay.py;
- the names of every ``LLMBATCH_*`` setting, read from the settings models themselves;
- the Dockerfile reader and the PromQL/dashboard helpers are scripts/validate_dockerfiles.py and
  scripts/validate_dashboard.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
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
COMPOSE_FILE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
DECKCHECK_SRC = DEPLOY / "tools" / "deploycheck"
KUBERNETES_VERSION = "1.37.0"
KUBERAY_VERSION = "v1.7.0"


_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the CRDs are 2 MB of YAML


def load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_LOADER)  # noqa: S506 - a safe loader


class DeployCheckError(RuntimeError):
    """A tool failed; the message carries its output."""


# --- deploycheck (Go) ---------------------------------------------------------------------------


def deploycheck_binary() -> Path:
    """deploy/tools/deploycheck, built once (Go module proxy) and cached (llmbatch.stack.go_build)."""
    from llmbatch.stack.go_build import go_binaries

    return go_binaries(DECKCHECK_SRC, ["."])["."]


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
                *(kustomization.get("components") or []),
                *(f"../../components/{c}" for c in components),
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
        from llmbatch.dispatcher.settings import DispatcherSettings

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
    from llmbatch.dispatcher.settings import DispatcherSettings

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


# --- CLI ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """``--build``: only build/cache deploycheck (e.g. from a setup step); else render and check all."""
    # run as a script, scripts/ is sys.path[0] (a test that loaded it by path has it in sys.modules)
    import validate_kuberay

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
                errors = [
                    *validate_kuberay.validate_kuberay(obj),
                    *validate_kuberay.kuberay_semantic_errors(obj),
                ]
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
