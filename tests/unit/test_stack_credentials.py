"""The S3 keys of a local stack's run folder, and the environment its Ray head hands its jobs."""

from __future__ import annotations

import os
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from llmbatch.stack.node_credentials import keep_minio_credentials, minio_credentials, ray_node_credentials

pytestmark = pytest.mark.unit


def test_minio_and_the_ray_head_starting_together_get_one_pair(tmp_path: Path) -> None:
    with ThreadPoolExecutor(8) as pool:
        pairs = set(pool.map(lambda _: minio_credentials(tmp_path), range(32)))
    assert len(pairs) == 1
    path = tmp_path / "minio.credentials.json"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["minio.credentials.json"]  # no temp files left
    assert minio_credentials(tmp_path) == pairs.pop()  # and a restart reads the same


def test_keys_of_another_s3_replace_the_pair(tmp_path: Path) -> None:
    minio_credentials(tmp_path)
    keep_minio_credentials(tmp_path, "ak", "sk")
    assert minio_credentials(tmp_path) == ("ak", "sk")


def test_a_ray_node_gets_the_keys_as_its_jobs_read_them() -> None:
    assert ray_node_credentials("ak", "sk") == {"AWS_ACCESS_KEY_ID": "ak", "AWS_SECRET_ACCESS_KEY": "sk"}
    assert ray_node_credentials("ak", "sk", "pw")["LLMBATCH_REDIS__PASSWORD"] == "pw"
