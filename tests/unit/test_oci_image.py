"""tests/support/oci_image.py: the test node's image layout, its digests and its layer."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from tests.support.oci_image import ImageFile, image_layout, layer_tar, write_image_tar

pytestmark = pytest.mark.unit


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture
def tool(tmp_path: Path) -> Path:
    path = tmp_path / "tool"
    path.write_bytes(b"\x7fELF not really")
    return path


def test_every_descriptor_names_a_blob_by_its_content_and_the_config_its_layer(tool: Path) -> None:
    layout = image_layout("llmbatch.test/x:2", [ImageFile("/bin/tool", tool)], entrypoint=["/bin/tool"])
    assert json.loads(layout["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    (entry,) = json.loads(layout["index.json"])["manifests"]
    assert entry["annotations"]["io.containerd.image.name"] == "llmbatch.test/x:2"
    assert entry["platform"] == {"architecture": "amd64", "os": "linux"}

    def blob(descriptor: dict[str, object]) -> bytes:
        data = layout[f"blobs/sha256/{str(descriptor['digest']).removeprefix('sha256:')}"]
        assert _sha(data) == descriptor["digest"] and len(data) == descriptor["size"]
        return data

    manifest = json.loads(blob(entry))
    config = json.loads(blob(manifest["config"]))
    (layer_descriptor,) = manifest["layers"]
    layer = blob(layer_descriptor)
    assert config["rootfs"]["diff_ids"] == [_sha(layer)]  # an uncompressed layer: the same digest
    assert config["config"]["Entrypoint"] == ["/bin/tool"]
    assert config["config"]["Env"] == ["PATH=/bin"]


def test_the_layer_holds_the_files_links_and_folders_and_is_the_same_every_time(tool: Path) -> None:
    files = [ImageFile("/bin/tool", tool, links=("/bin/sh", "/usr/bin/other"))]
    data = layer_tar(files)
    assert layer_tar(files) == data  # no time or owner of this machine in it
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert members["bin/tool"].mode == 0o755
        extracted = tar.extractfile("bin/tool")
        assert extracted is not None and extracted.read() == tool.read_bytes()
        assert members["bin/sh"].issym() and members["bin/sh"].linkname == "/bin/tool"
        assert members["usr"].isdir() and members["usr/bin"].isdir()
        assert members["tmp"].mode == 0o1777 and members["proc"].isdir()
        assert {m.uid for m in members.values()} == {0}


def test_the_tar_holds_the_layout_as_given(tool: Path, tmp_path: Path) -> None:
    layout = image_layout("llmbatch.test/x:2", [ImageFile("/bin/tool", tool)], entrypoint=["/bin/tool"])
    path = write_image_tar(tmp_path / "image.tar", layout)
    with tarfile.open(path) as tar:
        got = {m.name: (tar.extractfile(m) or io.BytesIO()).read() for m in tar.getmembers()}
    assert got == layout


def test_files_given_as_bytes_and_folder_links_are_in_the_layer(tool: Path) -> None:
    data = layer_tar(
        [ImageFile("/etc/passwd", b"root:x:0:0::/root:/bin/sh\n", mode=0o644)],
        empty_dirs=("root",),
        symlinks={"/bin": "usr/bin", "/lib/x": "../usr/lib/x"},
    )
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = {m.name: m for m in tar.getmembers()}
        passwd = tar.extractfile("etc/passwd")
        assert passwd is not None and passwd.read() == b"root:x:0:0::/root:/bin/sh\n"
        assert members["etc/passwd"].mode == 0o644
        assert members["bin"].issym() and members["bin"].linkname == "usr/bin"
        assert members["lib"].isdir() and members["lib/x"].linkname == "../usr/lib/x"
        assert members["root"].isdir() and "tmp" not in members
