"""A real Kubernetes control plane on 127.0.0.1 for the deploy tests: etcd, kube-apiserver and the
KubeRay operator, each built from the Go module proxy (deploy/tools/kubeapi,
deploy/tools/kuberay-operator) once and cached under ``~/.cache/llmbatch/bin``.

The plane itself runs no node: pods are created, admitted and stored, but run only where a test
adds one (tests/support/kube_node.py: a real kubelet, containerd and runc; or
tests/support/pod_runner.py's stand-in, which runs a Ray pod as local processes). What is real: the
API server's validation (native objects, the KubeRay CRDs' schemas and CEL rules, admission),
server-side apply, and the KubeRay operator's own checks and the pods and services it builds from
our RayCluster and RayService.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import ssl
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from llmbatch.stack.go_build import go_binaries
from llmbatch.stack.ports import free_port
from llmbatch.stack.process import StackError, spawn, stop_tree, wait_until
from tests.support.kube_identities import ClientCa, make_client_ca

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "deploy" / "tools"
KUBE_APISERVER = "k8s.io/kubernetes/cmd/kube-apiserver"
KUBE_CONTROLLER_MANAGER = "k8s.io/kubernetes/cmd/kube-controller-manager"
KUBE_SCHEDULER = "k8s.io/kubernetes/cmd/kube-scheduler"
# the controllers of kube-controller-manager a test can ask for: the Services' EndpointSlices, the
# garbage collector (what a deleted owner owned goes too: a deleted RayCluster's pods), the node
# lifecycle (it lifts the not-ready taint a kubelet registers its node with, once the node is Ready),
# and Deployments' pods (their ReplicaSets)
CONTROLLERS = ("endpointslice", "garbagecollector", "nodelifecycle", "deployment", "replicaset")
ETCD = "go.etcd.io/etcd/server/v3"
KUBERAY_OPERATOR = "github.com/ray-project/kuberay/ray-operator"
KUBE_ROUTER = "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router"  # tests/support/kube_router.py
FIELD_MANAGER = "llmbatch-tests"
# prometheus-operator's ServiceMonitor CRD (gpu-prod's ServiceMonitor), from the Go module proxy:
# module, version, its go.sum hash (checked), the file inside
SERVICEMONITOR_CRD = (
    "github.com/prometheus-operator/prometheus-operator",
    "v0.85.0",
    "h1:M5xLCLEoaW2IJfnuCwFzzpL+jSVQu3KGT84Pye+fW8s=",
    "example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml",
)


class KubeApiError(RuntimeError):
    """The API server refused a request; ``status`` and ``reason`` are its answer's."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message


class KindNotServed(LookupError):
    """No API group on the server serves this apiVersion and kind (its CRD is not installed)."""


def _tls(ca_cert: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca_cert))


def go_module_file(module: str, version: str, h1: str, path: str) -> Path:
    """``path`` inside Go module ``module@version``, downloaded through the Go module proxy (verified
    by the checksum database, and against ``h1``) into Go's module cache."""
    go = shutil.which("go")
    if go is None:
        raise StackError(f"`go` is not on PATH: the deploy tests download {module} with it")
    with tempfile.TemporaryDirectory(prefix="llmbatch-gomod-") as outside_any_module:
        proc = subprocess.run(
            [go, "mod", "download", "-json", f"{module}@{version}"],
            cwd=outside_any_module,
            env={**os.environ, "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=mod"},
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    if proc.returncode != 0:
        raise StackError(f"go mod download {module}@{version} failed", proc.stdout + proc.stderr)
    found = json.loads(proc.stdout)
    if found.get("Sum") != h1:
        raise StackError(f"{module}@{version} is {found.get('Sum')}, not the pinned {h1}")
    return Path(found["Dir"]) / path


def _group_path(api_version: str) -> str:
    """The REST path of an API group version: the core group is ``/api/v1``, others ``/apis/<g>/<v>``."""
    return "/api/v1" if api_version == "v1" else f"/apis/{api_version}"


class KubeClient:
    """The few REST calls the tests need: discovery, server-side apply, get, list, delete, and
    service account tokens."""

    def __init__(self, server: str, token: str, ca_cert: Path) -> None:
        self._http = httpx.Client(
            base_url=server, verify=_tls(ca_cert), timeout=30.0, headers={"Authorization": f"Bearer {token}"}
        )
        self._resources: dict[str, dict[str, tuple[str, bool]]] = {}

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, url: str, **kwargs: Any) -> Any:
        resp = self._http.request(method, url, **kwargs)
        if resp.status_code >= 300:
            try:
                body = resp.json()
            except ValueError:
                body = {"reason": "", "message": resp.text}
            raise KubeApiError(resp.status_code, body.get("reason", ""), body.get("message", ""))
        return resp.json()

    def _resource(self, api_version: str, kind: str) -> tuple[str, bool]:
        if api_version not in self._resources:
            try:
                listing = self._request("GET", _group_path(api_version))["resources"]
            except KubeApiError as exc:
                if exc.status == 404:
                    raise KindNotServed(f"{api_version} is not served") from exc
                raise
            self._resources[api_version] = {
                r["kind"]: (r["name"], r["namespaced"]) for r in listing if "/" not in r["name"]
            }
        try:
            return self._resources[api_version][kind]
        except KeyError:
            raise KindNotServed(f"{api_version} {kind} is not served") from None

    def path(self, api_version: str, kind: str, namespace: str | None = None, name: str | None = None) -> str:
        plural, namespaced = self._resource(api_version, kind)
        if namespaced and name and not namespace:
            raise ValueError(f"{kind} {name!r} is namespaced: give its metadata.namespace")
        where = f"/namespaces/{namespace}" if namespaced and namespace else ""
        return f"{_group_path(api_version)}{where}/{plural}" + (f"/{name}" if name else "")

    def apply(self, obj: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        """Server-side apply, as ``kubectl apply --server-side --force-conflicts``."""
        meta = obj["metadata"]
        url = self.path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        params = {"fieldManager": FIELD_MANAGER, "force": "true", "fieldValidation": "Strict"}
        if dry_run:
            params["dryRun"] = "All"
        result: dict[str, Any] = self._request(
            "PATCH",
            url,
            params=params,
            content=json.dumps(obj),
            headers={"Content-Type": "application/apply-patch+yaml"},
        )
        return result

    def get(
        self, api_version: str, kind: str, name: str, namespace: str | None = None
    ) -> dict[str, Any] | None:
        try:
            obj: dict[str, Any] = self._request("GET", self.path(api_version, kind, namespace, name))
        except KubeApiError as exc:
            if exc.status == 404:
                return None
            raise
        return obj

    def list(
        self, api_version: str, kind: str, namespace: str | None = None, selector: str | None = None
    ) -> list[dict[str, Any]]:
        params = {"labelSelector": selector} if selector else {}
        items: list[dict[str, Any]] = self._request(
            "GET", self.path(api_version, kind, namespace), params=params
        )["items"]
        return items

    def request_token(
        self,
        namespace: str,
        service_account: str,
        *,
        expiration_seconds: int,
        audiences: Sequence[str] = (),
        bound_pod: dict[str, Any] | None = None,
    ) -> str:
        """A token of ``service_account``, asked for as the kubelet asks for the one in a pod's
        projected ``serviceAccountToken`` volume (TokenRequest API, bound to ``bound_pod``)."""
        spec: dict[str, Any] = {"expirationSeconds": expiration_seconds}
        if audiences:
            spec["audiences"] = list(audiences)
        if bound_pod is not None:
            meta = bound_pod["metadata"]
            spec["boundObjectRef"] = {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": meta["name"],
                "uid": meta["uid"],
            }
        url = self.path("v1", "ServiceAccount", namespace, service_account) + "/token"
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
        token: str = self._request("POST", url, json=body)["status"]["token"]
        return token

    def review_token(self, token: str, audiences: Sequence[str] = ()) -> dict[str, Any]:
        """The API server's TokenReview of ``token`` for ``audiences``: its ``status`` (whether it
        authenticates, and as whom)."""
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, **({"audiences": list(audiences)} if audiences else {})},
        }
        status: dict[str, Any] = self._request(
            "POST", "/apis/authentication.k8s.io/v1/tokenreviews", json=body
        )["status"]
        return status

    def patch_status(
        self, api_version: str, kind: str, name: str, namespace: str | None, status: dict[str, Any]
    ) -> dict[str, Any]:
        """Merge ``status`` into the object's status subresource (what a kubelet does for a pod)."""
        result: dict[str, Any] = self._request(
            "PATCH",
            self.path(api_version, kind, namespace, name) + "/status",
            content=json.dumps({"status": status}),
            headers={"Content-Type": "application/merge-patch+json"},
        )
        return result

    def delete(
        self,
        api_version: str,
        kind: str,
        name: str,
        namespace: str | None = None,
        *,
        grace_period_seconds: int | None = None,
    ) -> None:
        params = {} if grace_period_seconds is None else {"gracePeriodSeconds": grace_period_seconds}
        with contextlib.suppress(KubeApiError):
            self._request("DELETE", self.path(api_version, kind, namespace, name), params=params)

    def bind(self, namespace: str, pod: str, node: str) -> None:
        """Bind ``pod`` to ``node`` (what kube-scheduler does; none runs here)."""
        self._request(
            "POST",
            self.path("v1", "Pod", namespace, pod) + "/binding",
            content=json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Binding",
                    "metadata": {"name": pod, "namespace": namespace},
                    "target": {"apiVersion": "v1", "kind": "Node", "name": node},
                }
            ),
            headers={"Content-Type": "application/json"},
        )


@dataclass
class ControlPlane:
    """etcd, kube-apiserver and the KubeRay operator, started and stopped by PID."""

    workdir: Path
    server: str = ""
    token: str = ""
    ca_cert: Path = Path()
    operator_log: Path = Path()
    client_ca: ClientCa | None = None  # signs the certificates of the plane's components
    pids: list[int] = field(default_factory=list)

    def client(self) -> KubeClient:
        return KubeClient(self.server, self.token, self.ca_cert)

    def stop(self) -> None:
        for pid in reversed(self.pids):  # operator, then API server, then etcd
            stop_tree(pid)
        self.pids.clear()

    def wait_for(self, what: str, check: Any, timeout: float = 60.0) -> Any:
        """Poll ``check()`` until it returns something truthy; fail naming ``what``."""
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout:.0f}s (operator log {self.operator_log})")
            time.sleep(0.5)


def _service_account_keys(workdir: Path) -> tuple[Path, Path]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private, public = workdir / "sa.key", workdir / "sa.pub"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    private.chmod(0o600)
    return private, public


def write_kubeconfig(path: Path, server: str, token: str, ca_cert: Path) -> None:
    """A kubeconfig (mode 0600) for ``server`` with bearer ``token``, trusting ``ca_cert``."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "local",
        "clusters": [{"name": "local", "cluster": {"server": server, "certificate-authority": str(ca_cert)}}],
        "users": [{"name": "admin", "user": {"token": token}}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": "admin"}}],
    }
    path.write_text(json.dumps(config))  # JSON is YAML
    path.chmod(0o600)


def start_control_plane(
    workdir: Path,
    crds: Sequence[dict[str, Any]],
    operator_env: Mapping[str, str] | None = None,
    controllers: Sequence[str] = (),
    *,
    operator: bool = True,
    scheduler: bool = False,
) -> ControlPlane:
    """Start etcd, kube-apiserver (tokens for the tests, client certificates of
    :attr:`ControlPlane.client_ca` for the components; Node and RBAC authorization; the default
    admission plugins and NodeRestriction) with the
    CustomResourceDefinitions ``crds`` installed, and the KubeRay operator watching every
    namespace (with ``operator_env`` added to its environment; not ``operator``: the caller starts
    it, :func:`start_operator`). ``controllers``: those of kube-controller-manager to run as well (of
    :data:`CONTROLLERS`); none: it does not run. ``scheduler``: kube-scheduler runs too (binding pods to
    the nodes they fit: a test with a real node, :mod:`tests.support.kube_node`)."""
    assert set(controllers) <= set(CONTROLLERS), controllers
    kube = go_binaries(TOOLS / "kubeapi", [KUBE_APISERVER, ETCD, KUBE_CONTROLLER_MANAGER, KUBE_SCHEDULER])
    workdir.mkdir(parents=True, exist_ok=True)
    plane = ControlPlane(workdir=workdir, token=secrets.token_hex(16))
    try:
        _start(plane, kube, crds)
        if operator:
            start_operator(plane, operator_env or {})
        if controllers:
            _start_controller_manager(plane, kube[KUBE_CONTROLLER_MANAGER], controllers)
        if scheduler:
            _start_scheduler(plane, kube[KUBE_SCHEDULER])
    except BaseException:
        plane.stop()
        raise
    return plane


def _start(plane: ControlPlane, kube: dict[str, Path], crds: Sequence[dict[str, Any]]) -> None:
    work = plane.workdir
    client_port, peer_port = free_port(), free_port()
    etcd_log = work / "etcd.log"
    pid = spawn(
        [
            str(kube[ETCD]),
            "--name",
            "t",
            "--data-dir",
            str(work / "etcd"),
            "--listen-client-urls",
            f"http://127.0.0.1:{client_port}",
            "--advertise-client-urls",
            f"http://127.0.0.1:{client_port}",
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer_port}",
            "--initial-cluster",
            f"t=http://127.0.0.1:{peer_port}",
            "--unsafe-no-fsync",
            "--log-level",
            "warn",
        ],
        etcd_log,
    )
    plane.pids.append(pid)
    wait_until(
        lambda: httpx.get(f"http://127.0.0.1:{client_port}/health").json()["health"] == "true",
        60,
        pid,
        "etcd",
        etcd_log,
    )

    private, public = _service_account_keys(work)
    tokens = work / "tokens.csv"
    tokens.write_text(f'{plane.token},llmbatch-test-admin,llmbatch-test-admin,"system:masters"\n')
    tokens.chmod(0o600)
    plane.client_ca = make_client_ca(work / "client-ca")
    port = free_port()
    certs = work / "certs"
    api_log = work / "kube-apiserver.log"
    pid = spawn(
        [
            str(kube[KUBE_APISERVER]),
            f"--etcd-servers=http://127.0.0.1:{client_port}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={certs}",
            f"--token-auth-file={tokens}",
            f"--client-ca-file={plane.client_ca.cert}",
            # a node's kubelet reads only what its pods use, and writes only its Node and pods
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            "--service-cluster-ip-range=10.96.0.0/16",
            # the `kubernetes` Service's endpoint would be 127.0.0.1, which it refuses
            "--endpoint-reconciler-type=none",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={public}",
            f"--service-account-signing-key-file={private}",
        ],
        api_log,
    )
    plane.pids.append(pid)
    plane.server = f"https://127.0.0.1:{port}"
    plane.ca_cert = certs / "apiserver.crt"
    headers = {"Authorization": f"Bearer {plane.token}"}
    wait_until(
        lambda: (
            httpx.get(f"{plane.server}/readyz", headers=headers, verify=_tls(plane.ca_cert)).status_code
            == 200
        ),
        180,
        pid,
        "kube-apiserver",
        api_log,
        interval=0.5,
    )

    client = plane.client()
    try:
        for crd in crds:
            client.apply(crd)

        def established(name: str) -> bool:
            found = client.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", name) or {}
            conditions = (found.get("status") or {}).get("conditions") or []
            return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

        plane.wait_for(
            "the CRDs established", lambda: all(established(crd["metadata"]["name"]) for crd in crds)
        )
    finally:
        client.close()

    write_kubeconfig(work / "kubeconfig", plane.server, plane.token, plane.ca_cert)


def start_operator(
    plane: ControlPlane,
    env: Mapping[str, str],
    *,
    server: str | None = None,
    wrap: Callable[[list[str]], list[str]] | None = None,
    call: Callable[[Callable[[], bool]], bool] | None = None,
) -> int:
    """Start the KubeRay operator watching every namespace, with ``env`` added to its environment;
    return its PID (stopped with the plane, before the API server). For an operator in a pod:
    ``server`` the API server's address as the pod reaches it, ``wrap`` its command line (into the
    pod's namespace), ``call`` runs its readiness check where the operator listens."""
    operator = go_binaries(TOOLS / "kuberay-operator", [KUBERAY_OPERATOR])[KUBERAY_OPERATOR]
    kubeconfig = plane.workdir / "kuberay-operator.kubeconfig"
    write_kubeconfig(kubeconfig, server or plane.server, plane.token, plane.ca_cert)
    probe = free_port()
    plane.operator_log = plane.workdir / "kuberay-operator.log"
    argv = [
        str(operator),
        f"--metrics-addr=127.0.0.1:{free_port()}",
        f"--health-probe-bind-address=127.0.0.1:{probe}",
        "--enable-leader-election=false",
        "--log-stdout-encoder=console",
    ]
    pid = spawn(wrap(argv) if wrap else argv, plane.operator_log, env={**env, "KUBECONFIG": str(kubeconfig)})
    plane.pids.insert(2, pid)  # stopped before the API server (and etcd)

    def ready() -> bool:
        return httpx.get(f"http://127.0.0.1:{probe}/readyz").status_code == 200

    wait_until(lambda: call(ready) if call else ready(), 120, pid, "kuberay-operator", plane.operator_log)
    return pid


def _start_controller_manager(plane: ControlPlane, binary: Path, controllers: Sequence[str]) -> None:
    port = free_port()
    log = plane.workdir / "kube-controller-manager.log"
    pid = spawn(
        [
            str(binary),
            f"--kubeconfig={plane.workdir / 'kubeconfig'}",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={plane.workdir / 'kcm-certs'}",
            "--leader-elect=false",
            f"--controllers={','.join(controllers)}",
        ],
        log,
    )
    plane.pids.insert(2, pid)  # stopped after the operator, before the API server
    wait_until(
        lambda: (
            httpx.get(
                f"https://127.0.0.1:{port}/healthz",  # anyone may; its own cert
                verify=False,
            ).status_code
            == 200
        ),
        120,
        pid,
        "kube-controller-manager",
        log,
    )


def _start_scheduler(plane: ControlPlane, binary: Path) -> None:
    port = free_port()
    log = plane.workdir / "kube-scheduler.log"
    pid = spawn(
        [
            str(binary),
            f"--kubeconfig={plane.workdir / 'kubeconfig'}",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={plane.workdir / 'scheduler-certs'}",
            "--leader-elect=false",
        ],
        log,
    )
    plane.pids.insert(2, pid)  # stopped after the operator, before the API server
    wait_until(
        lambda: (
            httpx.get(
                f"https://127.0.0.1:{port}/healthz",  # anyone may; its own cert
                verify=False,
            ).status_code
            == 200
        ),
        120,
        pid,
        "kube-scheduler",
        log,
    )


def build() -> None:
    """Build (or find cached) every binary :func:`start_control_plane` runs."""
    go_binaries(TOOLS / "kubeapi", [KUBE_APISERVER, ETCD, KUBE_CONTROLLER_MANAGER, KUBE_SCHEDULER])
    go_binaries(TOOLS / "kuberay-operator", [KUBERAY_OPERATOR])
    go_binaries(TOOLS / "kube-router", [KUBE_ROUTER])
    go_module_file(*SERVICEMONITOR_CRD)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="The tests' Kubernetes control plane.")
    parser.add_argument(
        "--build",
        action="store_true",
        required=True,
        help="build etcd, kube-apiserver, kube-controller-manager, kube-scheduler, the "
        "KubeRay operator and kube-router into the cache, and download the "
        "ServiceMonitor CRD",
    )
    parser.parse_args()
    build()
