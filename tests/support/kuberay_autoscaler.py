"""Ray's own KubeRay autoscaler (what KubeRay runs in the head pod's ``autoscaler`` container:
``ray kuberay-autoscaler --cluster-name ... --cluster-namespace ...``) on this machine, against the
tests' control plane and a local Ray head.

One thing differs from the pod: the files the pod's projected volume holds at ``--mount-path``
(``/var/run/secrets/kubernetes.io/serviceaccount``: token, ca.crt) are read from ``--volume-dir``.
Ray's node provider reads them from fixed paths; this module points those paths into the
directory, and refuses to start when Ray reads them from anywhere but under ``--mount-path``, so a
manifest that mounts the token elsewhere than Ray looks fails here too. The API server's address
comes from ``KUBERNETES_SERVICE_HOST`` and ``KUBERNETES_SERVICE_PORT_HTTPS``, as in a pod.

    python -m tests.support.kuberay_autoscaler --cluster-name N --cluster-namespace NS \\
        --gcs-address 127.0.0.1:PORT --mount-path /var/run/secrets/... --volume-dir DIR
"""

from __future__ import annotations

import argparse
from pathlib import Path, PurePosixPath

from ray.autoscaler._private.kuberay import node_provider
from ray.autoscaler._private.kuberay.run_autoscaler import run_kuberay_autoscaler

# the node provider's module-level paths of a pod's service account files
SERVICE_ACCOUNT_FILES = ("IN_CLUSTER_TOKEN_PATH", "IN_CLUSTER_CA_CERT_PATH")


def remap_service_account_files(mount_path: PurePosixPath, volume_dir: Path) -> dict[str, str]:
    """Point the node provider's service account paths from ``mount_path`` into ``volume_dir``;
    return the new paths. ``ValueError`` if Ray reads one from outside ``mount_path``."""
    moved = {}
    for name in SERVICE_ACCOUNT_FILES:
        in_pod = PurePosixPath(getattr(node_provider, name))
        if not in_pod.is_relative_to(mount_path):
            raise ValueError(
                f"Ray's KubeRay node provider reads {in_pod}, which is not under the mounted {mount_path}"
            )
        moved[name] = str(volume_dir / in_pod.relative_to(mount_path))
        setattr(node_provider, name, moved[name])
    return moved


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster-name", required=True, help="the RayCluster's name")
    parser.add_argument("--cluster-namespace", required=True, help="the RayCluster's namespace")
    parser.add_argument("--gcs-address", required=True, help="the Ray head's GCS, host:port")
    parser.add_argument(
        "--mount-path",
        required=True,
        type=PurePosixPath,
        help="where the pod mounts the service account volume",
    )
    parser.add_argument(
        "--volume-dir",
        required=True,
        type=Path,
        help="the directory holding that volume's files on this machine",
    )
    args = parser.parse_args(argv)
    remap_service_account_files(args.mount_path, args.volume_dir)
    run_kuberay_autoscaler(args.cluster_name, args.cluster_namespace, args.gcs_address)


if __name__ == "__main__":
    main()
