"""The ray-https component's NetworkPolicy change, enforced: the dispatchers leave the dashboard's
plain port for its TLS front, and RayJob submitters keep the plain port.

As tests/integration/test_pod_network_policy.py (the real KubeRay operator and kube-router on the
tests' pod network), with cpu-dev + ray-https as rendered. The head pod's ``dashboard-tls`` sidecar
runs as the component says (``python -m llmbatch.stack.tls_front``, on the pod's 8443, relaying to
the dashboard on the pod's loopback), with a certificate for the head's pod IP from a CA made here.

What it shows, once the policies are enforced: the dispatcher pod is refused on 8265 and reaches the
Jobs API through 8443 over TLS (401 without Ray's token, 200 with it); a RayJob submitter pod reaches
8265; the API pod reaches neither port.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from llmbatch.stack.process import spawn, stop_tree
from llmbatch.stack.tls import make_local_ca
from tests.support.kube_control_plane import ROOT, ControlPlane
from tests.support.kube_objects import vd
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

TLS_PORT = 8443


def test_ray_https_moves_the_dispatcher_to_the_tls_front_and_keeps_submitters_on_the_plain_port(
    plane: ControlPlane, tmp_path: Path
) -> None:
    kube = plane.client()
    objects = vd.render_with_components("cpu-dev", ["ray-https"])
    cluster = vd.one(objects, "RayCluster")
    (sidecar,) = [
        c
        for c in cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
        if c["name"] == "dashboard-tls"
    ]
    assert sidecar["command"][:3] == ["python", "-m", "llmbatch.stack.tls_front"]
    applied = apply_one_worker_cluster(plane, kube, objects)
    namespace, deployments, head_pod = applied.namespace, applied.deployments, applied.head

    with PodNetwork() as net, LocalPods(kube, tmp_path, net, node=NODE) as local:
        head = local.run_head(head_pod)
        assert head.place is not None
        head_ip = head.place.pod.ip
        tls = make_local_ca(tmp_path / "tls", node_ips=(head_ip,))
        # the sidecar's own command, with the certificate files of this test
        argv = [sys.executable if a == "python" else a for a in sidecar["command"]]
        argv = [
            f"--cert={tls.server_cert}"
            if a.startswith("--cert=")
            else f"--key={tls.server_key}"
            if a.startswith("--key=")
            else a
            for a in argv
        ]
        front = spawn(head.place.command(argv), tmp_path / "dashboard-tls.log", cwd=ROOT)
        try:
            api = run_plain_pod(kube, net, deployments["llmbatch-api"], "llmbatch-api-test", namespace)
            dispatcher = run_plain_pod(
                kube, net, deployments["llmbatch-dispatcher"], "llmbatch-dispatcher-test", namespace
            )
            # the submitter pod of the RayJob that reuses the cluster, as its manifest's template says
            (rayjob,) = vd.load_yaml_objects(vd.KUSTOMIZE / "rayjob" / "rayjob-reuse-cluster.yaml")
            template = rayjob["spec"]["submitterPodTemplate"]
            submitter = run_plain_pod(
                kube, net, {"spec": {"template": template}}, "llmbatch-submitter-test", namespace
            )
            plane.wait_for("the TLS front listening", lambda: connects(net, dispatcher, head_ip, TLS_PORT))
            assert connects(net, dispatcher, head_ip, JOBS_PORT)  # no enforcer yet

            router = start_kube_router(plane, net, NODE, tmp_path)
            try:
                plane.wait_for(
                    f"kube-router enforcing the head's policy (log {router.log})",
                    lambda: not connects(net, dispatcher, head_ip, JOBS_PORT),
                    timeout=90,
                )
                rules = router.rules(net)
                assert jobs_api(net, dispatcher, head_ip, None, port=TLS_PORT, ca=tls.ca_cert) == 401
                assert (
                    jobs_api(net, dispatcher, head_ip, head.auth_token, port=TLS_PORT, ca=tls.ca_cert) == 200
                ), rules
                assert jobs_api(net, submitter, head_ip, head.auth_token) == 200, rules
                assert not connects(net, api, head_ip, TLS_PORT), rules
                assert not connects(net, api, head_ip, JOBS_PORT), rules
            finally:
                router.stop()
        finally:
            stop_tree(front)
    kube.close()
