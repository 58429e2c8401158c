"""gpu-prod's engine group scales 0 -> 2 -> 0 by Ray's own autoscaler, as KubeRay runs it, on a pod
network under gpu-prod's NetworkPolicies.

The pieces are real: the tests' control plane (kube-apiserver, the KubeRay operator; see
tests/support/kube_control_plane.py) holding gpu-prod as rendered, a Ray head started as the
operator's head pod says (``--no-monitor``, no CPUs, autoscaler v2, the pod's ``RAY_*`` environment,
token auth), Ray's ``kuberay-autoscaler`` with the files our manifest's projected volume gives the
``autoscaler`` container (a token of the head pod's service account, TokenRequest, bound to the pod,
as the kubelet asks for it, and the cluster CA), and kube-router's firewall enforcing the policies.

No kubelet runs here; tests/support/pod_runner.py stands in for it on the head pod and on the GPU pods
the operator makes: it starts Ray as the pod's container would (the pod's ``ray start`` resources and
``RAY_*`` environment: the pod's name as the node's cloud instance id) in a pod of
tests/support/pod_network.py, on its pod IP, reports the pod Running and, once the operator deletes
it, stops it and removes it. The autoscaler container runs in the head pod's network namespace, as a
container of that pod; the API server (the ``kubernetes`` Service in a cluster) is relayed onto the
pod's loopback.

What it shows: demand for the engine resource (``llmbatch_engine``) makes the autoscaler patch the
RayCluster's GPU group from 0 to 2 replicas with only that account's rights, and the operator makes
two GPU pods, which join the head by their pod IPs through the head's policy (which refuses the API
pod); the CPU group is left alone; once the demand is gone and the nodes are idle, the autoscaler
takes the group back to 0 and the operator deletes the pods. The same token cannot read the
namespace's Secrets. One knob differs from gpu-prod: the idle timeout (seconds, not minutes).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.kube_control_plane import ControlPlane, KubeApiError, KubeClient
from tests.support.kube_objects import (
    apply_all,
    cluster_pods,
    create_operator_secrets,
    group_replicas,
    publish_root_ca,
    start_command,
    vd,
    worker_groups,
)
from tests.support.kube_router import start_kube_router
from tests.support.pod_checks import NODE, connects, run_plain_pod
from tests.support.pod_network import PodNetwork
from tests.support.pod_runner import LocalPods, ray_env, ray_start_options
from tests.support.private_ray import PrivateRay

pytestmark = [pytest.mark.integration, pytest.mark.deploy]

ENGINE_DEMAND = [{"llmbatch_engine": 1}, {"llmbatch_engine": 1}]
GCS_PORT = 6379
IDLE_TIMEOUT_S = 5  # gpu-prod: 900 s


def _group_pods(kube: KubeClient, namespace: str, name: str, group: str) -> list[dict[str, Any]]:
    return [
        p
        for p in cluster_pods(kube, namespace, name)
        if p["metadata"]["labels"]["ray.io/group"] == group and "deletionTimestamp" not in p["metadata"]
    ]


def _request_resources(ray: PrivateRay, bundles: list[dict[str, Any]]) -> None:
    """A driver in the head pod asks the autoscaler for ``bundles`` (Ray's ``request_resources``;
    ``[]`` withdraws the request), then exits."""
    code = (
        "import sys, json, ray; from ray.autoscaler.sdk import request_resources; "
        "ray.init(address=sys.argv[1], log_to_driver=False); "
        "request_resources(bundles=json.loads(sys.argv[2])); ray.shutdown()"
    )
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": str(ray.auth_token)}
    assert ray.place is not None
    subprocess.run(
        ray.place.command([sys.executable, "-c", code, ray.gcs_address, json.dumps(bundles)]),
        env=env,
        check=True,
        timeout=120,
        capture_output=True,
    )


def test_the_engine_group_scales_from_zero_and_back_by_the_autoscaler_with_the_head_accounts_rights(
    plane: ControlPlane, tmp_path: Path
) -> None:
    kube = plane.client()
    objects = vd.render_overlay("gpu-prod")
    cluster = vd.one(objects, "RayCluster")
    namespace, name = cluster["metadata"]["namespace"], cluster["metadata"]["name"]
    for group in cluster["spec"]["workerGroupSpecs"]:
        group["idleTimeoutSeconds"] = IDLE_TIMEOUT_S
    apply_all(kube, objects, dry_run=False)
    publish_root_ca(kube, namespace, plane.ca_cert)
    create_operator_secrets(kube, namespace)
    expected = 1 + sum(g.get("replicas", 0) for g in worker_groups(cluster["spec"]).values())
    created = plane.wait_for(
        f"the head and worker pods of {name}",
        lambda: found if len(found := cluster_pods(kube, namespace, name)) == expected else None,
    )
    head = next(p for p in created if p["metadata"]["labels"]["ray.io/node-type"] == "head")
    cpu_replicas = worker_groups(cluster["spec"])["cpu"]["replicas"]
    assert group_replicas(kube, namespace, name) == {"gpu": 0, "cpu": cpu_replicas}

    # the head as the operator built it: Ray's monitor is left to the sidecar, the head takes no tasks
    options, flags = ray_start_options(head)
    assert ("--no-monitor" in flags, options["num-cpus"]) == (True, "0"), start_command(head)
    assert ray_env(kube, head)["RAY_enable_autoscaler_v2"] == "true"
    assert start_command(head, "autoscaler").endswith(
        "ray kuberay-autoscaler --cluster-name $(RAY_CLUSTER_NAME) "
        "--cluster-namespace $(RAY_CLUSTER_NAMESPACE)"
    )
    deployments = {d["metadata"]["name"]: d for d in objects if d["kind"] == "Deployment"}
    with PodNetwork() as net, LocalPods(kube, tmp_path, net, node=NODE) as local:
        router = start_kube_router(plane, net, NODE, tmp_path)
        try:
            ray = local.run_head(head)
            head_ip = net.pods[head["metadata"]["name"]].ip
            api = run_plain_pod(kube, net, deployments["llmbatch-api"], "llmbatch-api-test", namespace)
            plane.wait_for(
                f"kube-router enforcing the head's policy (log {router.log})",
                lambda: not connects(net, api, head_ip, GCS_PORT),
                timeout=90,
            )
            # the head pod's autoscaler container: in the head pod's network, beside the GCS
            scaler = local.run_autoscaler(plane.server, head)

            _request_resources(ray, ENGINE_DEMAND)
            plane.wait_for(
                f"the autoscaler scales {name}'s gpu group to 2 (log {scaler.log})",
                lambda: group_replicas(kube, namespace, name)["gpu"] == 2,
                timeout=180,
            )
            gpu_pods = plane.wait_for(
                "two gpu pods",
                lambda: found if len(found := _group_pods(kube, namespace, name, "gpu")) == 2 else None,
            )
            assert group_replicas(kube, namespace, name)["cpu"] == cpu_replicas
            for pod in gpu_pods:  # each joins the head over the pod network, under the policies
                assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
                local.run_worker(pod)
            engines = [
                n
                for n in ray.nodes()
                if n["state"] == "ALIVE" and n["resources_total"].get("llmbatch_engine")
            ]
            assert sorted(n["node_ip"] for n in engines) == sorted(
                net.pods[p["metadata"]["name"]].ip for p in gpu_pods
            )

            _request_resources(ray, [])
            plane.wait_for(
                f"the autoscaler scales {name}'s gpu group back to 0 (log {scaler.log})",
                lambda: group_replicas(kube, namespace, name)["gpu"] == 0,
                timeout=180,
            )
            # the operator deletes the pods; the kubelet stand-in stops their Ray nodes and removes them
            plane.wait_for(
                "the gpu pods deleted",
                lambda: (
                    local.reap(),
                    not [
                        p
                        for p in cluster_pods(kube, namespace, name)
                        if p["metadata"]["labels"]["ray.io/group"] == "gpu"
                    ],
                )[1],
            )
            assert group_replicas(kube, namespace, name)["cpu"] == cpu_replicas
        finally:
            router.stop()
    log = scaler.log.read_text()
    assert "Forbidden" not in log and " 403" not in log, log[-3000:]
    for pod in gpu_pods:  # the autoscaler knew each node for its pod, and removed it for being idle
        pod_name = re.escape(pod["metadata"]["name"])
        assert re.search(
            rf"ALLOCATED->RAY_RUNNING \(id=[^,]+, type=gpu, cloud_instance_id={pod_name},", log
        ), log[-3000:]
    # both removed for being idle: in one round, or one per round when their idle times end apart
    idle_removals = re.findall(r"Removing (\d+) nodes of type gpu \(idle\)\.", log)
    assert sum(map(int, idle_removals)) == 2, log[-3000:]

    # the token the autoscaler used is the head account's, which reads no Secret
    as_head = KubeClient(plane.server, (scaler.volume / "token").read_text(), plane.ca_cert)
    try:
        with pytest.raises(KubeApiError) as refused:
            as_head.list("v1", "Secret", namespace)
        assert refused.value.status == 403
    finally:
        as_head.close()
        kube.close()
