"""Container images for the tests' kubelet node, made here without Docker or a registry.

An image is an OCI image layout (``oci-layout``, ``index.json``, ``blobs/sha256/...``) packed as one
tar, which ``ctr images import`` loads into containerd. Its single layer holds the files given
(a static busybox and the pause program, say); the config names the entrypoint and ``PATH``.
Digests are computed here from the bytes, as a registry would check them.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
CONFIG = "application/vnd.oci.image.config.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
INDEX = "application/vnd.oci.image.index.v1+json"
# the fixed time of every file in a layer: the same inputs make the same image
EPOCH = 0


@dataclass(frozen=True)
class ImageFile:
    """One file of a layer: its content is ``source`` (bytes, or a file of this machine to read);
    ``links``: the symlinks to it (``/bin/sh`` -> ``/bin/busybox``)."""

    path: str
    source: Path | bytes
    mode: int = 0o755
    links: tuple[str, ...] = ()


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _dirs_of(path: str) -> list[str]:
    parts = path.strip("/").split("/")[:-1]
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


DEFAULT_DIRS = ("tmp", "etc", "proc", "sys", "dev")


def layer_tar(
    files: Sequence[ImageFile],
    empty_dirs: Sequence[str] = DEFAULT_DIRS,
    symlinks: Mapping[str, str] | None = None,
) -> bytes:
    """An uncompressed layer: ``files``, their links, their parent folders, ``empty_dirs`` and
    ``symlinks`` (path -> target: ``/bin`` -> ``usr/bin``), owned by root, with time
    :data:`EPOCH` (the same inputs give the same bytes)."""
    symlinks = symlinks or {}
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs = sorted(
            {d for f in files for p in (f.path, *f.links) for d in _dirs_of(p)}
            | {d for p in symlinks for d in _dirs_of(p)}
            | {d.strip("/") for d in empty_dirs}
        )
        for name in dirs:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o1777 if name == "tmp" else 0o755, EPOCH
            tar.addfile(info)
        for path, target in sorted(symlinks.items()):
            sym = tarfile.TarInfo(path.strip("/"))
            sym.type, sym.linkname, sym.mode, sym.mtime = tarfile.SYMTYPE, target, 0o777, EPOCH
            tar.addfile(sym)
        for f in files:
            data = f.source if isinstance(f.source, bytes) else f.source.read_bytes()
            info = tarfile.TarInfo(f.path.strip("/"))
            info.size, info.mode, info.mtime = len(data), f.mode, EPOCH
            tar.addfile(info, io.BytesIO(data))
            for link in f.links:
                sym = tarfile.TarInfo(link.strip("/"))
                sym.type, sym.linkname, sym.mode, sym.mtime = tarfile.SYMTYPE, f.path, 0o777, EPOCH
                tar.addfile(sym)
    return out.getvalue()


def image_layout(
    name: str,
    files: Sequence[ImageFile],
    entrypoint: Sequence[str],
    env: Mapping[str, str] | None = None,
    *,
    empty_dirs: Sequence[str] = DEFAULT_DIRS,
    symlinks: Mapping[str, str] | None = None,
) -> dict[str, bytes]:
    """The files of an OCI image layout (path -> bytes) for an image called ``name``
    (``registry/repository:tag``) with one layer (:func:`layer_tar`)."""
    layer = layer_tar(files, empty_dirs, symlinks)
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {
                "Entrypoint": list(entrypoint),
                "Env": [f"{k}={v}" for k, v in (env or {"PATH": "/bin"}).items()],
            },
            "rootfs": {"type": "layers", "diff_ids": [_digest(layer)]},
        },
        sort_keys=True,
    ).encode()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST,
            "config": {"mediaType": CONFIG, "digest": _digest(config), "size": len(config)},
            "layers": [{"mediaType": LAYER_TAR, "digest": _digest(layer), "size": len(layer)}],
        },
        sort_keys=True,
    ).encode()
    index: dict[str, Any] = {
        "schemaVersion": 2,
        "mediaType": INDEX,
        "manifests": [
            {
                "mediaType": MANIFEST,
                "digest": _digest(manifest),
                "size": len(manifest),
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {
                    "io.containerd.image.name": name,
                    "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1],
                },
            }
        ],
    }
    blobs = {f"blobs/sha256/{_digest(b).removeprefix('sha256:')}": b for b in (layer, config, manifest)}
    return {
        "oci-layout": b'{"imageLayoutVersion":"1.0.0"}',
        "index.json": json.dumps(index).encode(),
        **blobs,
    }


def write_image_tar(path: Path, layout: Mapping[str, bytes]) -> Path:
    """Pack an image layout into the tar ``ctr images import`` reads; return ``path``."""
    with tarfile.open(path, "w") as tar:
        for name, data in sorted(layout.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, EPOCH
            tar.addfile(info, io.BytesIO(data))
    return path
