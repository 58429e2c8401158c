"""The operator's Ray pods as real containers on the tests' kubelet node (tests/support/kube_node.py).

There is no Ray image here (no registry, no Docker), so a RayCluster is changed in one way before it
is applied: its containers (Ray's and the autoscaler's) use the node's host-userland image, with this
machine's ``/usr``, the Python the checkout's venv was made from and the checkout itself (its
``.venv``) mounted read-only at the same paths (hostPath volumes), and ``PATH`` leading to the venv.
Everything else (command, probes, securityContext, environment from Secrets, the projected token
volume) is the pod the operator builds. hostPath volumes are refused under the restricted Pod
Security level, so the test's namespace is labelled ``privileged`` for them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tests.support.kube_control_plane import ROOT
from tests.support.node_images import HOST_IMAGE

PRIVILEGED = {"pod-security.kubernetes.io/enforce": "privileged"}


def host_paths() -> dict[str, str]:
    """Volume name -> a folder of this machine the Ray containers need, mounted where it is."""
    return {
        "host-usr": "/usr",
        "host-python": str(Path(sys.base_prefix).resolve()),
        "host-checkout": str(ROOT),
    }


def _run_on_host(container: dict[str, Any]) -> None:
    container["image"], container["imagePullPolicy"] = HOST_IMAGE, "Never"
    mounts = container.setdefault("volumeMounts", [])
    mounts.extend({"name": name, "mountPath": path, "readOnly": True} for name, path in host_paths().items())
    env = container.setdefault("env", [])
    env.append({"name": "PATH", "value": f"{ROOT / '.venv' / 'bin'}:/usr/local/bin:/usr/bin:/bin"})


def on_host_userland(cluster: dict[str, Any]) -> dict[str, Any]:
    """``cluster`` (a RayCluster) with every container on the host-userland image (see the module
    docstring); changed in place and returned."""
    spec = cluster["spec"]
    groups = [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]
    templates = [group["template"] for group in groups]
    for template in templates:
        for container in template["spec"]["containers"]:
            _run_on_host(container)
        volumes = template["spec"].setdefault("volumes", [])
        volumes.extend(
            {"name": name, "hostPath": {"path": path, "type": "Directory"}}
            for name, path in host_paths().items()
        )
    if "autoscalerOptions" in spec:
        _run_on_host(spec["autoscalerOptions"])
    return cluster


def dispatcher_on_host_userland(deployment: dict[str, Any]) -> dict[str, Any]:
    """``deployment`` (the dispatcher's) on the host-userland image, started as its image starts it
    (deploy/docker/dispatcher.Dockerfile: ENTRYPOINT ``llmbatch``, WORKDIR ``/home/llmbatch``,
    unbuffered output); changed in place and returned."""
    template = deployment["spec"]["template"]
    (container,) = template["spec"]["containers"]
    _run_on_host(container)
    container["command"] = [str(ROOT / ".venv" / "bin" / "llmbatch")]
    container["workingDir"] = "/home/llmbatch"
    container["env"] += [
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
    ]
    volumes = template["spec"].setdefault("volumes", [])
    volumes.extend(
        {"name": name, "hostPath": {"path": path, "type": "Directory"}} for name, path in host_paths().items()
    )
    return deployment
