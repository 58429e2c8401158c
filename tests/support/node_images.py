"""The images of the tests' kubelet node (tests/support/kube_node.py), written as OCI layouts
(:mod:`tests.support.oci_image`) and imported into its containerd, so pods use
``imagePullPolicy: Never``:

- :data:`IMAGE`: a static busybox (every applet linked in ``/bin``) and ``pause``, compiled with gcc
  from the Kubernetes module's own ``build/pause/linux/pause.c``; the pod sandbox image too.
- :data:`HOST_IMAGE`: no programs of its own; a pod mounts this machine's ``/usr`` into it
  (tests/support/real_ray_pods.py), for a Ray container without a Ray image.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from llmbatch.stack.process import StackError
from llmbatch.stack.state import CACHE_DIR
from tests.support.kube_control_plane import go_module_file
from tests.support.oci_image import ImageFile, image_layout, write_image_tar

# the pause program's source, in the Kubernetes module the kubelet is built from (its go.sum hash)
PAUSE_SOURCE = (
    "k8s.io/kubernetes",
    "v1.37.2",
    "h1:A2VDEiObzkYqFTKhSsn0ZEb0RlLEXpHWj93gi2HqEwE=",
    "build/pause/linux/pause.c",
)
BUSYBOX = Path("/bin/busybox")  # Debian's busybox-static
IMAGE = "llmbatch.test/node:1"  # busybox and pause; the pod sandbox image too
HOST_IMAGE = "llmbatch.test/host-userland:1"


def pause_program() -> Path:
    """``pause`` (the sandbox's PID 1), compiled once and cached under ``$LLMBATCH_CACHE/bin``."""
    source = go_module_file(*PAUSE_SOURCE)
    data = source.read_bytes()
    target = CACHE_DIR / "bin" / f"pause-{hashlib.sha256(data).hexdigest()[:12]}" / "pause"
    if target.exists():
        return target
    gcc = shutil.which("gcc")
    if gcc is None:
        raise StackError("`gcc` is not on PATH: the test node's pause program is compiled with it")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".pause.{os.getpid()}")
    proc = subprocess.run(
        [gcc, "-Os", "-static", "-o", str(tmp), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if proc.returncode != 0:
        raise StackError("compiling pause.c failed", proc.stdout + proc.stderr)
    tmp.rename(target)
    return target


def node_image(pause: Path, folder: Path) -> Path:
    """The node's image as a tar ``ctr images import`` reads: busybox (every applet it has, linked
    in ``/bin``: ``sh``, ``wget``, ``httpd``, ``nslookup``, ...) and ``/pause`` (its entrypoint, as
    the sandbox image's)."""
    if not BUSYBOX.exists():
        raise StackError(f"{BUSYBOX} is missing: install Debian's busybox-static (make setup does)")
    listed = subprocess.run(
        [str(BUSYBOX), "--list"], capture_output=True, text=True, check=True, timeout=30
    ).stdout.split()
    applets = tuple(f"/bin/{a}" for a in listed if a != "busybox")
    layout = image_layout(
        IMAGE,
        [ImageFile("/bin/busybox", BUSYBOX, links=applets), ImageFile("/pause", pause)],
        entrypoint=["/pause"],
    )
    return write_image_tar(folder / "node-image.tar", layout)


def host_userland_image(folder: Path) -> Path:
    """An image of no programs of its own: ``/bin``, ``/lib``, ... link into ``/usr``, which a pod
    mounts from the node (hostPath, read-only); ``/etc/passwd`` knows root, the Ray pods' user 1000
    (group 100) and the dispatcher's 10001 (home ``/home/llmbatch``), as deploy/'s images have them."""
    passwd = (
        b"root:x:0:0:root:/root:/bin/sh\nray:x:1000:100:ray:/tmp:/bin/sh\n"
        b"llmbatch:x:10001:10001::/home/llmbatch:/usr/sbin/nologin\n"
    )
    group = b"root:x:0:\nusers:x:100:\nllmbatch:x:10001:\n"
    files = [ImageFile("/etc/passwd", passwd, mode=0o644), ImageFile("/etc/group", group, mode=0o644)]
    layout = image_layout(
        HOST_IMAGE,
        files,
        entrypoint=["/bin/sh"],
        env={"PATH": "/usr/local/bin:/usr/bin:/bin"},
        empty_dirs=(
            "tmp",
            "etc",
            "proc",
            "sys",
            "dev",
            "usr",
            "root",
            "home",
            "home/llmbatch",
            "run",
            "var/tmp",
        ),
        symlinks={f"/{d}": f"usr/{d}" for d in ("bin", "sbin", "lib", "lib64")},
    )
    return write_image_tar(folder / "host-userland-image.tar", layout)
