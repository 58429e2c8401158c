"""cpu-dev's Ray pods on a pod network, with its NetworkPolicies enforced by a real enforcer.

The pieces are real: the tests' control plane (kube-apiserver and the KubeRay operator) holding
cpu-dev as rendered; kube-router's network policy controller (the one k3s ships) enforcing the
NetworkPolicies of deploy/kubernetes/base/ray/networkpolicy.yaml on the node; Ray's token auth.
No kubelet and no CNI plugin run here: tests/support/pod_network.py gives each pod a network
namespace of its own on a node bridge (what the bridge CNI plugin does), and
tests/support/pod_runner.py starts the operator's Ray pods in them as their containers would, on
their pod IPs and the ports of their pod spec. The dispatcher and API pods run nothing; the test
connects from inside them, so the packets come from their pod IPs.

What it shows:

- before the enforcer runs, the API pod reaches the Ray head's Jobs API (so what follows is the
  policies' doing, not the network's);
- once it runs, the API pod (which has no business with Ray) reaches neither the head's Jobs API
  and GCS nor the worker, while the dispatcher pod still reaches the Jobs API; there Ray's token
  decides: without the token 401, with it 200;
- a worker pod started under the policies joins the head over the pod network with the token from
  the cluster's Secret (the head lists it ALIVE at its pod IP), and the head's metrics port answers
  a pod of namespace ``monitoring`` but not the API pod; the KubeRay operator's pod (namespace
  ``kuberay-system``) reaches the Jobs API but not the GCS, and another pod of its namespace neither.
"""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from tests.support.kube_control_plane import ControlPlane
from tests.support.kube_objects import ensure_namespace, vd
from tests.support.kube_router import start_kube_router
from tests.support.pod_checks import (
    JOBS_PORT,
    NODE,
    apply_one_worker_cluster,
    connects,
    jobs_api,
    run_plain_pod,
)
from tests.support.pod_network import PodNetwork
from tests.support.pod_runner import LocalPods

pytestmark = [pytest.mark.integration, pytest.mark.deploy]

GCS_PORT, METRICS_PORT = 6379, 8080


def test_cpu_dev_ray_pods_under_their_network_policies_enforced_by_kube_router(
    plane: ControlPlane, tmp_path: Path
) -> None:
    kube = plane.client()
    objects = vd.render_overlay("cpu-dev")
    assert {p["metadata"]["name"] for p in objects if p["kind"] == "NetworkPolicy"} == {
        "llmbatch-ray-head",
        "llmbatch-ray-workers",
    }
    token = next(
        s for s in objects if s["kind"] == "Secret" and s["metadata"]["name"].startswith("llmbatch-ray-auth")
    )
    applied = apply_one_worker_cluster(plane, kube, objects)
    namespace, deployments = applied.namespace, applied.deployments
    head_pod, worker_pod = applied.head, applied.worker

    with PodNetwork() as net, LocalPods(kube, tmp_path, net, node=NODE) as local:
        head = local.run_head(head_pod)
        head_ip = net.pods[head_pod["metadata"]["name"]].ip
        # the token is the Secret's, as the kubelet gives it to the pod
        assert head.auth_token == base64.b64decode(token["data"]["auth_token"]).decode()
        api = run_plain_pod(kube, net, deployments["llmbatch-api"], "llmbatch-api-test", namespace)
        dispatcher = run_plain_pod(
            kube, net, deployments["llmbatch-dispatcher"], "llmbatch-dispatcher-test", namespace
        )
        ensure_namespace(kube, "monitoring", {"kubernetes.io/metadata.name": "monitoring"})
        prometheus = run_plain_pod(
            kube,
            net,
            {
                "spec": {
                    "template": {
                        "metadata": {"labels": {"app.kubernetes.io/name": "prometheus"}},
                        "spec": {"containers": [{"name": "prometheus", "image": "prometheus"}]},
                    }
                }
            },
            "prometheus-test",
            "monitoring",
        )
        # the KubeRay operator's pod (its Helm chart's labels) and another pod of its namespace
        ensure_namespace(kube, "kuberay-system", {"kubernetes.io/metadata.name": "kuberay-system"})
        operator, webhook = (
            run_plain_pod(
                kube,
                net,
                {
                    "spec": {
                        "template": {
                            "metadata": {
                                "labels": {
                                    "app.kubernetes.io/name": "kuberay-operator",
                                    "app.kubernetes.io/component": component,
                                }
                            },
                            "spec": {"containers": [{"name": component, "image": "kuberay"}]},
                        }
                    }
                },
                f"{component}-test",
                "kuberay-system",
            )
            for component in ("kuberay-operator", "webhook")
        )

        # no enforcer yet: the pod network lets every pod reach the head
        assert connects(net, api, head_ip, JOBS_PORT)
        assert connects(net, api, head_ip, METRICS_PORT)

        router = start_kube_router(plane, net, NODE, tmp_path)
        try:
            plane.wait_for(
                f"kube-router enforcing the head's policy (log {router.log})",
                lambda: not connects(net, api, head_ip, JOBS_PORT),
                timeout=90,
            )
            rules = router.rules(net)
            assert connects(net, dispatcher, head_ip, JOBS_PORT), rules
            assert jobs_api(net, dispatcher, head_ip, None) == 401
            assert jobs_api(net, dispatcher, head_ip, head.auth_token) == 200
            assert not connects(net, api, head_ip, GCS_PORT), rules
            assert connects(net, prometheus, head_ip, METRICS_PORT), rules
            assert not connects(net, api, head_ip, METRICS_PORT), rules
            # the operator polls the dashboard (RayJob status, Serve applications), nothing else
            assert jobs_api(net, operator, head_ip, head.auth_token) == 200, rules
            assert not connects(net, operator, head_ip, GCS_PORT), rules
            assert not connects(net, webhook, head_ip, JOBS_PORT), rules

            # a worker pod started under the policies joins over the pod network with the token
            worker = local.run_worker(worker_pod)
            worker_ip = net.pods[worker_pod["metadata"]["name"]].ip
            (node,) = [n for n in head.nodes() if n["node_id"] == worker.node_id]
            assert (node["state"], node["node_ip"]) == ("ALIVE", worker_ip)
            assert worker.agent_port is not None
            assert connects(net, worker_pod["metadata"]["name"], head_ip, GCS_PORT)
            assert not connects(net, api, worker_ip, worker.agent_port), router.rules(net)
        finally:
            router.stop()
    kube.close()
