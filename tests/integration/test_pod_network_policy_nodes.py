"""cpu-dev's Ray pods on two nodes, each node's NetworkPolicies enforced by its own kube-router.

As tests/integration/test_pod_network_policy.py, but the cluster has two nodes (two
:class:`~tests.support.pod_network.PodNetwork`, joined by a :class:`~tests.support.pod_network.NodeLan`
with host-gateway routes, no NAT): the Ray head runs on node ``node-a``, its worker on ``node-b``,
and each node runs kube-router's firewall for the pods bound to it, as a DaemonSet does. So a
policy's peers are pods of the other node (ipsets of remote pod IPs), and each pod's ingress is
enforced only by the node it runs on.

What it shows:

- the API pod on ``node-b`` is refused by the head on ``node-a`` (node-a's enforcer), the dispatcher
  pod on ``node-b`` reaches its Jobs API, where Ray's token decides;
- the worker pod on ``node-b`` joins the head across the nodes under both policies, and a Ray job
  submitted by the dispatcher pod runs its task on that worker (the head's driver, the worker's
  raylet and the object returned crossing the nodes both ways);
- until ``node-b``'s own enforcer runs, a pod of ``node-a`` reaches the worker's dashboard agent
  (node-a's rules do not guard node-b's pods); once it runs, that pod is refused and the cluster
  still works (a second job).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.kube_control_plane import ControlPlane
from tests.support.kube_objects import vd
from tests.support.kube_router import start_kube_router
from tests.support.net_snapshot import path_snapshot
from tests.support.pod_checks import (
    JOBS_PORT,
    NODE,
    apply_one_worker_cluster,
    connects,
    jobs_api,
    run_plain_pod,
)
from tests.support.pod_network import NodeLan, PodNetwork
from tests.support.pod_runner import LocalPods

pytestmark = [pytest.mark.integration, pytest.mark.deploy]

GCS_PORT = 6379
NODE_B = "node-b"
# a task that needs a CPU: the head has none (num-cpus 0), so it can only run on the worker
WHERE_TASK_RAN = (
    "import ray; ray.init(); "
    "f = ray.remote(num_cpus=1)(lambda: ray.util.get_node_ip_address()); "
    "print('task ran on', ray.get(f.remote(), timeout=60))"
)


def run_job(
    net: PodNetwork,
    pod: str,
    head_ip: str,
    token: str,
    entrypoint: str,
    diagnose: Callable[[], str],
    timeout: float = 120.0,
) -> tuple[str, str]:
    """Submit ``entrypoint`` to the head's Jobs API from pod ``pod`` and wait for it to end; its
    status and logs. A connect that times out prints ``diagnose()`` (the path's state) to stderr."""
    base, headers = f"http://{head_ip}:{JOBS_PORT}/api/jobs/", {"Authorization": f"Bearer {token}"}

    def call(method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        def send() -> Any:
            resp = httpx.request(method, base + path, json=body, headers=headers, timeout=10)
            resp.raise_for_status()
            return resp.json()

        try:
            return net.in_pod(pod, send)
        except httpx.ConnectTimeout:  # the path is allowed: say where it broke
            print(f"{method} {base + path} from pod {pod}: connect timed out\n" + diagnose(), file=sys.stderr)
            raise

    job = call("POST", "", {"entrypoint": f'{sys.executable} -c "{entrypoint}"'})["submission_id"]
    deadline = time.monotonic() + timeout
    while (status := call("GET", job)["status"]) not in ("SUCCEEDED", "FAILED", "STOPPED"):
        assert time.monotonic() < deadline, f"job {job} still {status} after {timeout} s"
        time.sleep(1)
    return status, str(call("GET", f"{job}/logs")["logs"])


def test_cpu_dev_on_two_nodes_each_node_enforcing_its_own_pods_policies(
    plane: ControlPlane, tmp_path: Path
) -> None:
    kube = plane.client()
    objects = vd.render_overlay("cpu-dev")
    applied = apply_one_worker_cluster(plane, kube, objects)
    namespace, deployments = applied.namespace, applied.deployments
    head_pod, worker_pod = applied.head, applied.worker

    with (
        PodNetwork("10.244.0") as net_a,
        PodNetwork("10.244.1") as net_b,
        NodeLan([net_a, net_b]),
        LocalPods(kube, tmp_path, net_a, node=NODE) as local,
    ):
        local.add_node(NODE_B, net_b)
        head = local.run_head(head_pod)
        assert head.auth_token is not None
        head_ip = net_a.pods[head_pod["metadata"]["name"]].ip
        api = run_plain_pod(kube, net_b, deployments["llmbatch-api"], "llmbatch-api-b", namespace, NODE_B)
        dispatcher = run_plain_pod(
            kube, net_b, deployments["llmbatch-dispatcher"], "llmbatch-dispatcher-b", namespace, NODE_B
        )
        api_a = run_plain_pod(kube, net_a, deployments["llmbatch-api"], "llmbatch-api-a", namespace)

        def diagnose() -> str:
            return path_snapshot(net_b, dispatcher, net_a, head_pod["metadata"]["name"], JOBS_PORT)

        # no enforcer yet: across the nodes, every pod reaches the head
        assert connects(net_b, api, head_ip, JOBS_PORT)

        router_a = start_kube_router(plane, net_a, NODE, tmp_path)
        try:
            plane.wait_for(
                f"node-a's kube-router enforcing the head's policy (log {router_a.log})",
                lambda: not connects(net_b, api, head_ip, JOBS_PORT),
                timeout=90,
            )
            rules_a = router_a.rules(net_a)
            assert not connects(net_b, api, head_ip, GCS_PORT), rules_a
            assert jobs_api(net_b, dispatcher, head_ip, None) == 401, rules_a
            assert jobs_api(net_b, dispatcher, head_ip, head.auth_token) == 200, rules_a

            # the worker on the other node joins the head through node-a's enforcer
            worker = local.run_worker(worker_pod, node=NODE_B)
            worker_ip = net_b.pods[worker_pod["metadata"]["name"]].ip
            assert worker_ip.startswith("10.244.1.")
            (node,) = [n for n in head.nodes() if n["node_id"] == worker.node_id]
            assert (node["state"], node["node_ip"]) == ("ALIVE", worker_ip)
            assert worker.agent_port is not None
            status, logs = run_job(net_b, dispatcher, head_ip, head.auth_token, WHERE_TASK_RAN, diagnose)
            assert (status, f"task ran on {worker_ip}") == ("SUCCEEDED", logs.strip().splitlines()[-1]), logs
            # node-a's rules guard node-a's pods only: the worker is still open to node-a's API pod
            assert connects(net_a, api_a, worker_ip, worker.agent_port), rules_a

            router_b = start_kube_router(plane, net_b, NODE_B, tmp_path)
            try:
                plane.wait_for(
                    f"node-b's kube-router enforcing the workers' policy (log {router_b.log})",
                    lambda: not connects(net_a, api_a, worker_ip, worker.agent_port),
                    timeout=90,
                )
                rules_b = router_b.rules(net_b)
                assert connects(net_b, worker_pod["metadata"]["name"], head_ip, GCS_PORT), rules_a
                status, logs = run_job(net_b, dispatcher, head_ip, head.auth_token, WHERE_TASK_RAN, diagnose)
                assert (status, f"task ran on {worker_ip}") == ("SUCCEEDED", logs.strip().splitlines()[-1]), (
                    logs,
                    rules_b,
                )
                assert not connects(net_b, api, worker_ip, worker.agent_port), rules_b
            finally:
                router_b.stop()
        finally:
            router_a.stop()
    kube.close()
