"""A real Kubernetes node for the tests: the kubelet, containerd and runc, running real containers
for pods of the test control plane (:mod:`tests.support.kube_control_plane`).

Everything is built from the Go module proxy once and cached (``deploy/tools/kubelet``,
``deploy/tools/containerd``, ``deploy/tools/runc``, ``deploy/tools/cni-plugins``,
``deploy/tools/coredns``; runc with cgo and seccomp, which needs Debian's ``libseccomp-dev``). The
node's images (:mod:`tests.support.node_images`: busybox and ``pause``, the sandbox image; and a
host-userland image) are imported into containerd, so pods use ``imagePullPolicy: Never``.

What a node does to the machine, and how it is kept to the test:

- The kubelet, containerd, kube-proxy and CoreDNS run in the network namespace of a
  :class:`PodNetwork` node (their iptables chains, such as ``KUBE-FIREWALL`` and kube-proxy's, stay
  there; ``hostNetwork`` pods live there too) and reach the API server through
  :meth:`PodNetwork.forward_from_node`. They share this machine's
  mount namespace, as on a node (the kubelet mounts a pod's volumes; containerd hands them to runc).
- Every file is under the node's folder (kubelet root, containerd root and state, pod logs), but
  ``/var/log/containers``, where the kubelet always links container logs: the node's links go at
  :meth:`KubeletNode.stop`.
- Pods' cgroups are under a cgroup root of the node's own (``/llmbatch-<pid>-<tag>``), removed at
  stop.
- The kubelet sets kernel tunables that are not per namespace (``kernel.panic=10``,
  ``vm.overcommit_memory=1``, ...): their values are read before it starts and written back at stop.
- Teardown is by PID: the kubelet, then every container's processes (the PIDs in the node's
  cgroups), the containerd shims (their ``shim.pid`` files), kube-proxy, CoreDNS, containerd;
  then the node's mounts.

Pods get their network from the reference CNI plugins (bridge, host-local, loopback; built from
``deploy/tools/cni-plugins``): a network namespace of their own, an address of the node's /24 on the
node's bridge, as :class:`PodNetwork`'s own pods have (so kube-router enforces NetworkPolicies between
them, :mod:`tests.support.kube_router`); ``hostNetwork`` pods live in the node's namespace. Their
nameserver is the cluster's DNS, CoreDNS on the node's address (:mod:`tests.support.cluster_dns`),
so Services' names resolve as in a cluster, and kube-proxy (iptables mode, in the node's namespace;
:mod:`tests.support.kube_proxy`) routes Services' ClusterIPs. Pods reach the node either by
``spec.nodeName`` or through kube-scheduler (``start_control_plane(scheduler=True)``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from llmbatch.stack.go_build import go_binaries
from llmbatch.stack.process import StackError, spawn, stop_tree
from tests.support.cluster_dns import (
    CLUSTER_DNS_USER,
    CLUSTER_DOMAIN,
    allow_cluster_dns,
    coredns_binary,
    start_cluster_dns,
)
from tests.support.kube_control_plane import TOOLS, ControlPlane
from tests.support.kube_identities import ClientCert, issue_client_cert, write_cert_kubeconfig
from tests.support.kube_proxy import publish_api_server, start_kube_proxy
from tests.support.node_footprint import (
    CGROUP_FS,
    cgroup_hierarchies,
    kill_all,
    mounts_under,
    read_tunables,
    remove_cgroup,
    write_tunables,
)
from tests.support.node_images import IMAGE, host_userland_image, node_image, pause_program
from tests.support.pod_network import PodNetwork

KUBELET = "k8s.io/kubernetes/cmd/kubelet"
KUBE_PROXY = "k8s.io/kubernetes/cmd/kube-proxy"
CONTAINERD = "github.com/containerd/containerd/v2/cmd/containerd"
SHIM = "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
CTR = "github.com/containerd/containerd/v2/cmd/ctr"
RUNC = "github.com/opencontainers/runc"
# the CNI plugins containerd calls for a pod's network (containernetworking/plugins, the reference ones)
CNI_PLUGINS = tuple(
    f"github.com/containernetworking/plugins/plugins/{p}"
    for p in ("main/bridge", "main/loopback", "ipam/host-local")
)
CONTAINERD_NS = "k8s.io"  # containerd's namespace of the CRI plugin
CONTAINER_LOGS = Path("/var/log/containers")
SHIM_SOCKETS = Path("/run/containerd/s")


@dataclass(frozen=True)
class NodeBinaries:
    kubelet: Path
    kube_proxy: Path
    containerd: Path
    shim: Path
    ctr: Path
    runc: Path
    pause: Path
    cni: Path  # the folder of the CNI plugins
    coredns: Path


def build() -> NodeBinaries:
    """Build (or find cached) the kubelet, containerd, its shim and ``ctr``, runc, the CNI plugins,
    CoreDNS and ``pause``."""
    kube = go_binaries(TOOLS / "kubelet", [KUBELET, KUBE_PROXY])
    containerd = go_binaries(TOOLS / "containerd", [CONTAINERD, SHIM, CTR])
    runc = go_binaries(TOOLS / "runc", [RUNC], cgo=True, tags=["seccomp"])[RUNC]
    cni = go_binaries(TOOLS / "cni-plugins", CNI_PLUGINS)
    return NodeBinaries(
        kubelet=kube[KUBELET],
        kube_proxy=kube[KUBE_PROXY],
        containerd=containerd[CONTAINERD],
        shim=containerd[SHIM],
        ctr=containerd[CTR],
        runc=runc,
        pause=pause_program(),
        cni=cni[CNI_PLUGINS[0]].parent,
        coredns=coredns_binary(),
    )


def cni_config(net: PodNetwork, ipam_dir: Path) -> dict[str, Any]:
    """The node's CNI network, as the bridge plugin's reference set-up: each pod's ``eth0`` on the
    node's bridge (``cbr0``, which has the node's address), an address of the node's /24 from
    host-local (kept in ``ipam_dir``), the node as its default gateway; no NAT."""
    return {
        "cniVersion": "1.0.0",
        "name": "llmbatch-pods",
        "plugins": [
            {
                "type": "bridge",
                "bridge": "cbr0",
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "dataDir": str(ipam_dir),
                    "ranges": [
                        [
                            {
                                "subnet": f"{net.subnet}.0/24",
                                "rangeStart": f"{net.subnet}.100",
                                "rangeEnd": f"{net.subnet}.200",
                                "gateway": net.node_ip,
                            }
                        ]
                    ],
                    "routes": [{"dst": "0.0.0.0/0"}],
                },  # the node routes the rest (Service IPs, say)
            }
        ],
    }


def _containerd_config(folder: Path, binaries: NodeBinaries) -> str:
    cni = folder / "cni"
    return f"""version = 3
root = "{folder / "root"}"
state = "{folder / "state"}"
disabled_plugins = ["io.containerd.nri.v1.nri", "io.containerd.tracing.processor.v1.otlp",
                    "io.containerd.internal.v1.tracing", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]

[grpc]
  address = "{folder / "containerd.sock"}"
[ttrpc]
  address = "{folder / "containerd.sock.ttrpc"}"

[plugins."io.containerd.internal.v1.opt"]
  path = "{folder / "opt"}"
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{IMAGE}"
[plugins."io.containerd.cri.v1.runtime"]
  # this machine drops CAP_SYS_RESOURCE: the sandbox's oom_score_adj -998 would be refused
  restrict_oom_score_adj = true
  # pods' network namespaces under the node's folder, not the machine's /var/run/netns
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{binaries.cni}"]
    conf_dir = "{cni / "net.d"}"
  [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
      BinaryName = "{binaries.runc}"
      Root = "{folder / "runc"}"
      SystemdCgroup = false
[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"""


def kubelet_config(folder: Path, socket: Path, cgroup_root: str, cluster_dns: str) -> dict[str, Any]:
    """The kubelet's KubeletConfiguration: cgroup v1 allowed (this machine boots it), cgroupfs, no
    server of its own (probes and pod status need none), pods' logs under ``folder``, pods' DNS
    from ``cluster_dns``."""
    return {
        "kind": "KubeletConfiguration",
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "enableServer": False,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "containerRuntimeEndpoint": f"unix://{socket}",
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": cgroup_root,
        "failCgroupV1": False,
        "failSwapOn": False,
        "podLogsDir": str(folder / "pods-logs"),
        "resolvConf": "/etc/resolv.conf",
        "staticPodPath": "",
        "clusterDNS": [cluster_dns],
        "clusterDomain": CLUSTER_DOMAIN,
        "nodeStatusUpdateFrequency": "2s",
        "syncFrequency": "5s",
        # a shared test machine's disk may be nearly full: evict nothing for it
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
    }


@dataclass
class KubeletNode:
    """A node named ``name`` of ``plane``: containerd and the kubelet in ``net``'s node namespace."""

    name: str
    folder: Path
    net: PodNetwork
    binaries: NodeBinaries
    cgroup_root: str = field(default_factory=lambda: f"/llmbatch-{os.getpid()}-{secrets.token_hex(3)}")
    pids: dict[str, int] = field(default_factory=dict)
    saved_tunables: dict[str, str] = field(default_factory=dict)

    @property
    def socket(self) -> Path:
        return self.folder / "containerd" / "containerd.sock"

    @property
    def pod_logs(self) -> Path:
        return self.folder / "kubelet" / "pods-logs"

    def ctr(self, *args: str, timeout: float = 120) -> str:
        """``ctr`` against this node's containerd, in its namespace of the CRI; its output."""
        proc = subprocess.run(
            [str(self.binaries.ctr), "--address", str(self.socket), "--namespace", CONTAINERD_NS, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if proc.returncode != 0:
            raise StackError(f"ctr {' '.join(args)} failed", proc.stdout + proc.stderr)
        return proc.stdout

    def start(self, plane: ControlPlane) -> None:
        """Start containerd with the node images, the cluster's DNS, the kubelet registered as node
        ``name``, then kube-proxy (with the ``kubernetes`` Service's endpoint published)."""
        try:
            self._start_containerd()
            server_port = int(plane.server.rsplit(":", 1)[1])
            server = f"https://127.0.0.1:{self.net.forward_from_node(server_port)}"
            kube = plane.client()
            try:
                allow_cluster_dns(kube)
            finally:
                kube.close()
            kubeconfigs = self._component_kubeconfigs(plane, server)
            self.pids["coredns"] = start_cluster_dns(
                self.net, self.binaries.coredns, self.folder / "coredns", kubeconfigs["coredns"]
            )
            self._start_kubelet(plane, kubeconfigs["kubelet"])
            relay = self.net.forward_from_node(server_port, bind=self.net.node_ip)
            kube = plane.client()
            try:
                publish_api_server(kube, self.net.node_ip, relay)
            finally:
                kube.close()
            self.pids["kube-proxy"] = start_kube_proxy(
                self.binaries.kube_proxy,
                self.name,
                self.net,
                self.folder / "kube-proxy",
                kubeconfigs["kube-proxy"],
            )
        except BaseException:
            self.stop()
            raise

    def _component_kubeconfigs(self, plane: ControlPlane, server: str) -> dict[str, Path]:
        """A kubeconfig for each component of the node, each with a client certificate of its own
        identity (see :mod:`tests.support.kube_identities`)."""
        assert plane.client_ca is not None
        identities = {
            "kubelet": (f"system:node:{self.name}", ["system:nodes"]),
            "kube-proxy": ("system:kube-proxy", []),
            "coredns": (CLUSTER_DNS_USER, []),
        }
        kubeconfigs = {}
        for component, (user, groups) in identities.items():
            cert = issue_client_cert(plane.client_ca, self.folder / "pki", user, groups)
            kubeconfigs[component] = self.folder / f"{component}.kubeconfig"
            write_cert_kubeconfig(kubeconfigs[component], server, plane.ca_cert, cert)
        return kubeconfigs

    @property
    def kubelet_identity(self) -> ClientCert:
        """The kubelet's client certificate (user ``system:node:<name>``)."""
        stem = f"system:node:{self.name}".replace(":", "-")
        return ClientCert(self.folder / "pki" / f"{stem}.pem", self.folder / "pki" / f"{stem}.key")

    def _start_containerd(self) -> None:
        folder = self.folder / "containerd"
        for sub in ("cni/net.d", "cni/ipam", "opt"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        (folder / "cni" / "net.d" / "10-llmbatch-pods.conflist").write_text(
            json.dumps(cni_config(self.net, folder / "cni" / "ipam"))
        )
        config = folder / "config.toml"
        config.write_text(_containerd_config(folder, self.binaries))
        log = folder / "containerd.log"
        # the shim is found on PATH; the cgroups of every container go under the node's root
        env = {"PATH": f"{self.binaries.shim.parent}:{os.environ.get('PATH', '')}"}
        self.pids["containerd"] = spawn(
            self.net.command([str(self.binaries.containerd), "--config", str(config)], self.net.node),
            log,
            env=env,
        )
        deadline = time.monotonic() + 60
        while not self.socket.exists() or self._ctr_fails("version"):
            if time.monotonic() > deadline or not psutil.pid_exists(self.pids["containerd"]):
                raise StackError("containerd did not start", log.read_text()[-4000:])
            time.sleep(0.2)
        self.ctr("images", "import", str(node_image(self.binaries.pause, folder)))
        self.ctr("images", "import", str(host_userland_image(folder)))

    def exec_in(self, pod: dict[str, Any], container: str, argv: list[str], timeout: float = 180) -> str:
        """Run ``argv`` in a running container of ``pod`` (as ``kubectl exec``: the container's user,
        environment and namespaces); its output. Fails (StackError) on a non-zero exit."""
        (status,) = [s for s in pod["status"]["containerStatuses"] if s["name"] == container]
        container_id = status["containerID"].removeprefix("containerd://")
        return self.ctr(
            "tasks", "exec", "--exec-id", f"test-{secrets.token_hex(4)}", container_id, *argv, timeout=timeout
        )

    def _ctr_fails(self, *args: str) -> bool:
        try:
            self.ctr(*args, timeout=10)
        except (StackError, subprocess.TimeoutExpired):
            return True
        return False

    def _start_kubelet(self, plane: ControlPlane, kubeconfig: Path) -> None:
        folder = self.folder / "kubelet"
        folder.mkdir(parents=True, exist_ok=True)
        self.pod_logs.mkdir(exist_ok=True)
        for hierarchy in cgroup_hierarchies():  # the kubelet wants its cgroup root to exist in each
            root = hierarchy / self.cgroup_root.strip("/")
            root.mkdir(exist_ok=True)
            if hierarchy.name == "cpuset":  # a v1 cpuset takes no process before it has CPUs
                for key in ("cpuset.cpus", "cpuset.mems"):
                    (root / key).write_text((hierarchy / key).read_text())
        config = folder / "config.json"
        config.write_text(json.dumps(kubelet_config(folder, self.socket, self.cgroup_root, self.net.node_ip)))
        self.saved_tunables = read_tunables()
        self.pids["kubelet"] = spawn(
            self.net.command(
                [
                    str(self.binaries.kubelet),
                    f"--config={config}",
                    f"--kubeconfig={kubeconfig}",
                    f"--root-dir={folder / 'root'}",
                    f"--cert-dir={folder / 'pki'}",
                    f"--hostname-override={self.name}",
                    f"--node-ip={self.net.node_ip}",
                    "--v=2",
                ],
                self.net.node,
            ),
            folder / "kubelet.log",
        )
        client = plane.client()
        try:

            def registered() -> bool:
                if not self.running():
                    raise StackError("the kubelet or containerd exited", self.log()[-4000:])
                node = client.get("v1", "Node", self.name) or {}
                return bool(node.get("status", {}).get("nodeInfo", {}).get("containerRuntimeVersion"))

            plane.wait_for(f"node {self.name} registered by its kubelet", registered, timeout=120)
        finally:
            client.close()

    def running(self) -> bool:
        return all(psutil.pid_exists(pid) for pid in self.pids.values())

    def log(self) -> str:
        return (self.folder / "kubelet" / "kubelet.log").read_text(errors="replace")

    def container_pids(self) -> set[int]:
        """Every process in the node's cgroups (its pods' containers and sandboxes)."""
        pids: set[int] = set()
        for hierarchy in cgroup_hierarchies():
            root = hierarchy / self.cgroup_root.strip("/")
            for procs in root.rglob("cgroup.procs") if root.exists() else []:
                with contextlib.suppress(OSError, ValueError):
                    pids.update(int(line) for line in procs.read_text().split())
        return pids

    def _shims(self) -> dict[int, str]:
        """This node's containerd shims, PID -> the id they serve: from their ``shim.pid`` files,
        and the shims serving this node's containerd socket (one whose task is gone has no file)."""
        tasks = self.folder / "containerd" / "state" / "io.containerd.runtime.v2.task"
        shims = {}
        for pid_file in tasks.glob("*/*/shim.pid") if tasks.exists() else []:
            with contextlib.suppress(OSError, ValueError):
                shims[int(pid_file.read_text().strip())] = pid_file.parent.name
        for proc in psutil.process_iter(["exe", "cmdline"]):
            argv = proc.info["cmdline"] or []
            if proc.info["exe"] == str(self.binaries.shim) and str(self.socket) in argv and "-id" in argv:
                shims[proc.pid] = argv[argv.index("-id") + 1]
        return shims

    def _shim_socket(self, shim_id: str) -> Path:
        """Where a shim of this node listens (containerd's ``shim.SocketAddress``: a hash of the
        containerd socket, namespace and id, in a folder every containerd of the machine shares)."""
        name = hashlib.sha256(f"{self.socket}/{CONTAINERD_NS}/{shim_id}".encode()).hexdigest()
        return SHIM_SOCKETS / name

    def stop(self) -> None:
        """Stop everything of the node by PID and give the machine back what the node changed."""
        if "kubelet" in self.pids:
            stop_tree(self.pids.pop("kubelet"))
        shims = self._shims()
        kill_all(self.container_pids())
        shims.update(self._shims())
        kill_all(set(shims))
        for shim_id in shims.values():  # a killed shim leaves its socket behind
            self._shim_socket(shim_id).unlink(missing_ok=True)
        for name in ("kube-proxy", "coredns", "containerd"):
            if name in self.pids:
                stop_tree(self.pids.pop(name))
        kill_all(self.container_pids())  # a container a shim restarted meanwhile
        for mount in sorted(mounts_under(self.folder), key=len, reverse=True):
            subprocess.run(["umount", "-l", mount], capture_output=True, check=False, timeout=30)
        # runc makes the pods' cgroups in cgroup v2's unified hierarchy too, on a hybrid host
        for hierarchy in [*cgroup_hierarchies(), CGROUP_FS / "unified"]:
            remove_cgroup(hierarchy / self.cgroup_root.strip("/"))
        for link in CONTAINER_LOGS.glob("*.log") if CONTAINER_LOGS.exists() else []:
            with contextlib.suppress(OSError):
                if link.is_symlink() and str(self.folder) in os.readlink(link):
                    link.unlink()
        if self.saved_tunables:
            write_tunables(self.saved_tunables)
        for shared in (SHIM_SOCKETS, SHIM_SOCKETS.parent):
            with contextlib.suppress(OSError):
                shared.rmdir()  # only when empty: another containerd may use them


@contextlib.contextmanager
def kubelet_node(plane: ControlPlane, folder: Path, name: str = "node-1") -> Iterator[KubeletNode]:
    """A started :class:`KubeletNode` of ``plane`` (in a new :class:`PodNetwork`), stopped after."""
    binaries = build()
    with PodNetwork(subnet="10.246.0") as net:
        node = KubeletNode(name=name, folder=folder, net=net, binaries=binaries)
        node.start(plane)
        try:
            yield node
        finally:
            node.stop()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="The tests' kubelet node.")
    parser.add_argument(
        "--build",
        action="store_true",
        required=True,
        help="build the kubelet, containerd, runc, the CNI plugins, CoreDNS and pause\ninto the cache",
    )
    parser.parse_args()
    build()
